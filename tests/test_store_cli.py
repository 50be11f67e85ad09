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

    result = runner.invoke(main, ["export", "--task", "translate.fr", "--out", str(tmp_path / "lora"), "--store", store])
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
