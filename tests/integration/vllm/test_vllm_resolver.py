"""The vLLM LoRA resolver plugin (server/engines/vllm/resolver.py).

StoreResolver (what the plugin does, without vLLM): tiny model saved as a real Hugging Face
directory, real store, real Redis. Then, where a vLLM environment exists (`make vllm-env`), vLLM's
own OpenAI server with the plugin, the default backbone and the shipped inventory."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from adapters_store.backbone.load import fingerprint, fingerprint_hf_dir
from adapters_store.backbone.tiny import tiny_llama
from adapters_store.interop.peft_io import PREFIX
from adapters_store.lora.combine import from_peft_lora
from adapters_store.store.materialize import task_layers
from server.engines.vllm.lora_dirs import dir_name, lora_int_id
from server.engines.vllm.resolver import StoreResolver
from tests.support.server_fixtures import (
    build_store,
    free_port,
    put_task,
    redis_up,
    require_vllm_and_backbone,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory) -> Path:
    """The tiny backbone as vLLM would be given it: a Hugging Face directory with safetensors."""
    path = tmp_path_factory.mktemp("tiny-hf")
    tiny_llama(seed=0).save_pretrained(path, safe_serialization=True)
    return path


def test_fingerprint_of_a_directory_equals_the_loaded_models(served_dir, tmp_path):
    assert fingerprint_hf_dir(served_dir) == fingerprint(tiny_llama(seed=0))
    other = tmp_path / "other"
    tiny_llama(seed=1).save_pretrained(other, safe_serialization=True)
    assert fingerprint_hf_dir(other) != fingerprint_hf_dir(served_dir)


def test_a_ready_task_becomes_a_peft_directory_equal_to_the_served_adapter(served_dir, tmp_path):
    store = build_store(tmp_path / "store")
    resolver = StoreResolver(store.root, tmp_path / "loras")
    found = resolver.resolve(str(served_dir), "alpha")
    assert not isinstance(found, str), found
    path, lora_id = found
    record = store.get_task("alpha")
    key = (f"polyserve:v1:{store.inventory_info().backbone_fingerprint}:{store.inventory_info().version}:"
           f"alpha:{record.cache_version}")
    assert path.name == dir_name("alpha", key) and lora_id == lora_int_id(path.name)
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == str(served_dir)
    info, skills = store.load_inventory()
    expected = task_layers(info, skills, "routing", store.load_weights(record))
    tensors = load_file(str(path / "adapter_model.safetensors"))
    for name, (ea, eb) in zip(info.layer_names, expected, strict=True):
        a, b = from_peft_lora(tensors[f"{PREFIX}{name}.lora_A.weight"], tensors[f"{PREFIX}{name}.lora_B.weight"])
        torch.testing.assert_close(a @ b, ea.float() @ eb.float(), rtol=1e-5, atol=1e-6)
    # the same task again: same directory, no rewrite
    stamp = (path / "adapter_model.safetensors").stat().st_mtime_ns
    assert resolver.resolve(str(served_dir), "alpha") == (path, lora_id)
    assert (path / "adapter_model.safetensors").stat().st_mtime_ns == stamp
    # re-registered: a new version is a new directory and a new id (vLLM never serves the old one)
    put_task(store, "alpha", seed=99)
    new_path, new_id = resolver.resolve(str(served_dir), "alpha")
    assert new_path != path and new_id != lora_id


def test_refusals_say_why(served_dir, tmp_path):
    store = build_store(tmp_path / "store")
    from adapters_store.store.records import TaskRecord

    store.put_record(TaskRecord(id="busy", method="routing", status="training", version=0, created_at=0, updated_at=0))
    resolver = StoreResolver(store.root, tmp_path / "loras")
    assert "no task" in resolver.resolve(str(served_dir), "nope")
    assert "no task" in resolver.resolve(str(served_dir), "../etc")
    assert "not ready" in resolver.resolve(str(served_dir), "busy")
    assert "cannot be verified" in resolver.resolve("some-alias", "alpha")
    other = tmp_path / "other-model"
    tiny_llama(seed=3).save_pretrained(other, safe_serialization=True)
    refused = resolver.resolve(str(other), "alpha")
    assert isinstance(refused, str) and "built for backbone" in refused
    assert not list((tmp_path / "loras").iterdir())


@pytest.mark.redis
def test_adapters_come_through_redis_with_the_servers_keys(served_dir, tmp_path):
    if not redis_up():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    import redis

    prefix = f"test-resolver-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        store = build_store(tmp_path / "store")
        first = StoreResolver(store.root, tmp_path / "a", "redis://127.0.0.1:6379/0", prefix)
        path_a, _ = first.resolve(str(served_dir), "beta")
        keys = [k.decode() for k in client.keys(f"{prefix}:*")]
        record = store.get_task("beta")
        assert keys == [(f"{prefix}:v1:{store.inventory_info().backbone_fingerprint}:"
                        f"{store.inventory_info().version}:beta:{record.cache_version}")]
        # a second process (fresh directory) reads Redis: corrupt the entry and it recomputes
        client.set(keys[0], b"garbage")
        second = StoreResolver(store.root, tmp_path / "b", "redis://127.0.0.1:6379/0", prefix)
        path_b, _ = second.resolve(str(served_dir), "beta")
        a, b = (load_file(str(p / "adapter_model.safetensors")) for p in (path_a, path_b))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert client.get(keys[0]) != b"garbage"
    finally:
        for key in client.keys(f"{prefix}:*"):
            client.delete(key)


# -- real vLLM ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.vllm
def test_vllms_own_server_answers_a_store_task_through_the_plugin(tmp_path):
    python = require_vllm_and_backbone()
    from adapters_store.backbone.load import hf_dir
    from adapters_store.store.directory import DirectoryStore
    from training.shipped_inventory import install_default_inventory

    store = DirectoryStore(tmp_path / "store")
    install_default_inventory(store)
    port = free_port()
    env = {**os.environ, "POLYSERVE_HOME": str(tmp_path / "home"), "POLYSERVE_STORE": str(store.root),
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("POLYSERVE_REDIS_URL", None)
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir()), "--enable-lora",
           "--max-lora-rank", "8", "--port", str(port), "--dtype", "float32", "--max-model-len", "512"]
    log = open(tmp_path / "vllm.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 400
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("vLLM did not start in 400 s")
        # a word-order task: the shipped inventory holds those on any words (spelling ones it does not)
        body = {"model": "rev-words", "prompt": "Input: cat dog 3\nOutput:", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].strip() == "3 dog cat"
        missing = httpx.post(f"{url}/v1/completions", json={**body, "model": "no-such-task"}, timeout=60)
        assert missing.status_code == 404
        assert ("Resolved and loaded LoRA adapter 'rev-words' using PolyserveResolver"
                in (tmp_path / "vllm.log").read_text())
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
