"""Bring your own LoRA: the conversion, the refusals, the PEFT round trip (export a routed task,
import it as a plain LoRA, it answers the same), the projection onto a routing row, the CLI and
POST /v1/tasks with method lora."""

from __future__ import annotations

import base64
import json
import math

import httpx
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save, save_file

from adapters_store.interop.lora_import import ImportRefused, convert, import_lora, read_dir
from adapters_store.interop.lora_project import fit_routing, project_task
from adapters_store.interop.peft_io import PREFIX, export_peft_lora
from adapters_store.store.materialize import task_layers
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

openai = pytest.importorskip("openai")


def peft_lora(info, r: int, alpha: float, layers=None, seed: int = 0, **config):
    """A PEFT LoRA (config, tensors) for `layers` (default: every inventory linear)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (d_in, d_out) in zip(info.layer_names, info.layer_dims, strict=True):
        if layers is None or name in layers:
            tensors[f"{PREFIX}{name}.lora_A.weight"] = torch.randn(r, d_in, generator=gen)
            tensors[f"{PREFIX}{name}.lora_B.weight"] = torch.randn(d_out, r, generator=gen)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "base_model_name_or_path": info.backbone_name,
           "target_modules": list(info.spec.target_modules), "bias": "none", **config}
    return cfg, tensors


@pytest.fixture
def store(tmp_path):
    return build_store(tmp_path / "store")


@pytest.mark.parametrize("rslora", [False, True])
def test_convert_keeps_the_update_at_a_lower_rank(store, rslora):
    info = store.inventory_info()
    R = info.spec.rank
    cfg, tensors = peft_lora(info, r=2, alpha=4, layers=info.layer_names[:3], use_rslora=rslora)
    out = convert(cfg, tensors, info)
    s = 4 / (math.sqrt(2) if rslora else 2)
    for name in info.layer_names:
        A_t, B_t = out[f"{name}.A"], out[f"{name}.B"]
        assert A_t.shape[1] == R and B_t.shape[0] == R
        if name in info.layer_names[:3]:
            a, b = tensors[f"{PREFIX}{name}.lora_A.weight"], tensors[f"{PREFIX}{name}.lora_B.weight"]
            torch.testing.assert_close(A_t @ B_t / R, a.T @ b.T * s)
        else:  # not adapted by the LoRA: no update
            assert not A_t.any() and not B_t.any()


def refused_cases(info):
    base = peft_lora(info, r=2, alpha=2)
    name = info.layer_names[0]
    d_in, _ = info.layer_dims[0]
    bad_target = dict(base[1])
    bad_target[f"{PREFIX}model.layers.0.mlp.gate_proj.lora_A.weight"] = torch.zeros(2, d_in)
    bad_shape = dict(base[1])
    bad_shape[f"{PREFIX}{name}.lora_A.weight"] = torch.zeros(2, d_in + 1)
    no_b = {k: v for k, v in base[1].items() if k != f"{PREFIX}{name}.lora_B.weight"}
    return [
        ("wrong base model", {**base[0], "base_model_name_or_path": "meta-llama/Llama-3-8B"}, base[1]),
        ("wrong base model", {**base[0], "base_model_name_or_path": None}, base[1]),
        ("unsupported target", base[0], bad_target),
        ("rank 16 is above the limit", peft_lora(info, r=16, alpha=16)[0], peft_lora(info, r=16, alpha=16)[1]),
        ("modules_to_save", {**base[0], "modules_to_save": ["lm_head"]}, base[1]),
        ("DoRA", {**base[0], "use_dora": True}, base[1]),
        ("not LORA", {**base[0], "peft_type": "POLY"}, base[1]),
        ("rank_pattern", {**base[0], "rank_pattern": {"q_proj": 4}}, base[1]),
        ("shapes", base[0], bad_shape),
        ("must both be present", base[0], no_b),
    ]


def test_refusals_say_why(store):
    info = store.inventory_info()
    for message, cfg, tensors in refused_cases(info):
        with pytest.raises(ImportRefused, match=message):
            convert(cfg, tensors, info)
    assert not store.has_task("x")


def test_round_trip_export_then_import_is_the_same_adapter(store, tmp_path):
    info, skills = store.load_inventory()
    export_peft_lora(store, "alpha", tmp_path / "peft", base_model=info.backbone_name)
    config, tensors = read_dir(tmp_path / "peft")
    record = import_lora(store, "alpha-lora", config, tensors)
    assert record.kind == "lora" and record.method == "lora-import"
    routed = task_layers(info, skills, "routing", store.load_weights(store.get_task("alpha")))
    plain = task_layers(info, skills, "lora", store.load_weights(record))
    for (a, b), (a2, b2) in zip(routed, plain, strict=True):
        torch.testing.assert_close(a, a2)
        torch.testing.assert_close(b, b2)
    from adapters_store.store.errors import TaskExists

    with pytest.raises(TaskExists):
        import_lora(store, "alpha-lora", config, tensors)


def test_projection_recovers_a_routed_update_in_another_basis(store):
    """A routed task's LoRA with its factors mixed by an invertible R (A R, R^-1 B: the same
    update, another basis) is fitted back to a routing row far closer than μ."""
    info, skills = store.load_inventory()
    layers = task_layers(info, skills, "routing", store.load_weights(store.get_task("beta")))
    gen = torch.Generator().manual_seed(3)
    R = torch.randn(info.spec.rank, info.spec.rank, generator=gen) + 3 * torch.eye(info.spec.rank)
    target = {}
    for name, (a, b) in zip(info.layer_names, layers, strict=True):
        target[f"{name}.A"], target[f"{name}.B"] = a @ R, torch.linalg.solve(R, b)
    _, report = fit_routing(info, skills, target, steps=300)
    assert report["error"] < 0.2 < report["error_mu"], report
    store.put_lora("beta-lora", target, method="lora-import")
    out = project_task(store, "beta-lora", steps=50)
    record = store.get_task("beta-lora")
    assert record.kind == "routing" and record.method == "lora-projected" and out["version"] == 2
    assert out["params_after"] < out["params_before"]


def test_cli_import_lora(store, tmp_path):
    from adapters_store.tools import cli

    info = store.inventory_info()
    cfg, tensors = peft_lora(info, r=2, alpha=2)
    src = tmp_path / "mine"
    src.mkdir()
    save_file(tensors, str(src / "adapter_model.safetensors"))
    (src / "adapter_config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(cli.import_lora, [str(src), "--task", "mine", "--store", str(store.root)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["kind"] == "lora" and store.get_task("mine").kind == "lora"
    (src / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    res = CliRunner().invoke(cli.import_lora, [str(src), "--task", "mine2", "--store", str(store.root)])
    assert res.exit_code != 0 and "DoRA" in res.output and not store.has_task("mine2")
    (src / "adapter_config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(cli.import_lora, [str(src), "--task", "mine3", "--project", "--store", str(store.root)])
    assert res.exit_code == 0, res.output
    assert "error" in json.loads(res.output)["project"] and store.get_task("mine3").kind == "routing"


# -- over HTTP: the round trip answers the same; admin only; refusals --------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    build_store(root / "store")
    settings = settings_for(root, api_keys=["ukey"], admin_keys=["akey"], max_new_tokens=32)
    with live_server(settings, tiny_backbone()) as srv:
        yield srv


def upload(info, cfg, tensors, task, project=False):
    return {"task": task, "method": "lora", "adapter": base64.b64encode(save(tensors)).decode(),
            "adapter_config": cfg, "project": project}


def test_post_lora_round_trip_answers_the_same(server, tmp_path):
    store = server.runtime.registry.store
    info = store.inventory_info()
    export_peft_lora(store, "gamma", tmp_path / "peft", base_model=info.backbone_name)
    config, tensors = read_dir(tmp_path / "peft")
    admin = {"Authorization": "Bearer akey"}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = upload(info, config, tensors, "gamma-lora")
        assert http.post("/v1/tasks", json=body, headers={"Authorization": "Bearer ukey"}).status_code in (401, 403)
        r = http.post("/v1/tasks", json=body, headers=admin)
        assert r.status_code == 201, r.text
        assert r.json()["task"]["kind"] == "lora" and r.json()["task"]["status"] == "ready"
        assert http.post("/v1/tasks", json=body, headers=admin).status_code == 409
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="ukey", max_retries=0)
    for prompt in ("Input: abc\nOutput:", "hello"):
        a = oc.completions.create(model="gamma", prompt=prompt, max_tokens=16, temperature=0, logprobs=1)
        b = oc.completions.create(model="gamma-lora", prompt=prompt, max_tokens=16, temperature=0, logprobs=1)
        assert a.choices[0].text == b.choices[0].text
        assert a.choices[0].logprobs.token_logprobs == pytest.approx(b.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_post_lora_refusals_are_4xx_naming_the_field(server):
    info = server.runtime.registry.store.inventory_info()
    admin = {"Authorization": "Bearer akey"}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for i, (message, cfg, tensors) in enumerate(refused_cases(info)):
            r = http.post("/v1/tasks", json=upload(info, cfg, tensors, f"bad-{i}"), headers=admin)
            assert r.status_code == 422, r.text
            err = r.json()["error"]
            assert err["param"] == "adapter_config" and message.split()[0] in err["message"], err
        cfg, tensors = peft_lora(info, r=2, alpha=2)
        for patch, param in (({"adapter": "%%%"}, "adapter"),
                             ({"adapter": base64.b64encode(b"junk").decode()}, "adapter"),
                             ({"adapter_config": None}, "adapter_config"), ({"task": "base"}, "task")):
            r = http.post("/v1/tasks", json={**upload(info, cfg, tensors, "bad-x"), **patch}, headers=admin)
            assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text
        r = http.post("/v1/tasks", json=upload(info, cfg, tensors, "proj", project=True), headers=admin)
        assert r.status_code == 201 and r.json()["task"]["kind"] == "routing", r.text
        assert r.json()["import"]["project"]["error"] <= r.json()["import"]["project"]["error_mu"]
