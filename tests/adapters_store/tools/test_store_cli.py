"""`polyserve import-peft-poly` and `polyserve export` through the real CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from torch.testing import assert_close

from server.cli import main

peft = pytest.importorskip("peft", reason="PEFT writes the checkpoint to import")


def test_import_then_export_round_trip(tiny_base, tmp_path):
    config = peft.PolyConfig(task_type="CAUSAL_LM", r=2, n_tasks=2, n_skills=3, n_splits=2,
                             target_modules=["q_proj", "v_proj"], init_weights=False)
    torch.manual_seed(0)
    pm = peft.get_peft_model(copy.deepcopy(tiny_base), config).eval()
    pm.save_pretrained(tmp_path / "poly")
    (tmp_path / "names.json").write_text(json.dumps(["summarise", "translate.fr"]))
    runner = CliRunner()
    store = str(tmp_path / "store")
    result = runner.invoke(main, ["import-peft-poly", str(tmp_path / "poly"), "--store", store,
                                  "--backbone", "tiny", "--names", str(tmp_path / "names.json")])
    assert result.exit_code == 0, result.output
    assert "2 tasks" in result.output
    again = runner.invoke(main, ["import-peft-poly", str(tmp_path / "poly"), "--store", store, "--backbone", "tiny"])
    assert again.exit_code != 0 and "already has an inventory" in again.output

    result = runner.invoke(main, ["export", "--task", "translate.fr", "--out", str(tmp_path / "lora"),
                                  "--store", store])
    assert result.exit_code == 0, result.output
    lora = peft.PeftModel.from_pretrained(copy.deepcopy(tiny_base), tmp_path / "lora").eval()
    ids = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(lora(input_ids=ids).logits, pm(input_ids=ids, task_ids=torch.tensor([1])).logits,
                     rtol=1e-5, atol=1e-5)

    bad = runner.invoke(main, ["export", "--task", "../etc", "--out", str(tmp_path / "x"), "--store", store])
    assert bad.exit_code != 0 and "must match" in bad.output
    missing = runner.invoke(main, ["export", "--task", "nope", "--out", str(tmp_path / "x"), "--store", store])
    assert missing.exit_code != 0 and "not found" in missing.output


def test_export_names_the_base_model_vllm_serves(tmp_path, monkeypatch):
    """vLLM's LoRA resolvers load an adapter only if base_model_name_or_path is the served model's
    name, which is the --model directory `polyserve backbone-path` prints (default backbone)."""
    from adapters_store.backbone.load import DEFAULT_NAME
    from tests.support.server_fixtures import build_store

    monkeypatch.setenv("POLYSERVE_HOME", str(tmp_path / "home"))
    store = build_store(tmp_path / "store")
    runner = CliRunner()
    out = tmp_path / "lora"
    assert runner.invoke(main, ["export", "--task", "alpha", "--out", str(out),
                                "--store", str(store.root)]).exit_code == 0
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
    named = runner.invoke(main, ["export", "--task", "alpha", "--out", str(out), "--store", str(store.root),
                                 "--base-model", "my-served-name"])
    assert named.exit_code == 0, named.output
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "my-served-name"
    # a store built on the default backbone: the directory vLLM is given as --model
    info = json.loads((store.root / "inventory" / "inventory.json").read_text())
    info["backbone_name"] = DEFAULT_NAME
    (store.root / "inventory" / "inventory.json").write_text(json.dumps(info))
    assert runner.invoke(main, ["export", "--task", "alpha", "--out", str(out),
                                "--store", str(store.root)]).exit_code == 0
    expected = tmp_path / "home" / "backbones" / "smollm2-135m-instruct-q4_1"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(expected)


def test_backbone_path_prints_a_loadable_directory_or_refuses(tmp_path):
    runner = CliRunner()
    tiny = runner.invoke(main, ["backbone-path", "--backbone", "tiny"])
    assert tiny.exit_code != 0 and "no directory" in tiny.output
    empty = runner.invoke(main, ["backbone-path", "--backbone", str(tmp_path)])
    assert empty.exit_code != 0 and "no config.json" in empty.output
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    ok = runner.invoke(main, ["backbone-path", "--backbone", str(tmp_path / "model")])
    assert ok.exit_code == 0 and ok.output.strip() == str((tmp_path / "model").resolve())


def test_backbone_path_of_the_default_is_the_cached_hf_directory():
    from adapters_store.backbone.load import default_gguf_path

    try:
        default_gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    result = CliRunner().invoke(main, ["backbone-path"])
    assert result.exit_code == 0, result.output
    from pathlib import Path

    path = Path(result.stdout.strip())  # stdout only: a first run dequantises with progress bars on stderr
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert list(path.glob("*.safetensors"))
