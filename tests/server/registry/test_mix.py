"""Per-request task mixes (`mix:ID=W,...`): parsing, the combine math, the cache tiers, and the
OpenAI routes (official client) against an offline combine of the mixed routing rows."""

from __future__ import annotations

import httpx
import pytest
import torch

from adapters_store.lora.combine import materialize
from adapters_store.lora.mix import MAX_MIX_PARTS, MixError, is_mix, mix_weights, parse_mix
from adapters_store.store.materialize import layers_from_weights, task_weights
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

openai = pytest.importorskip("openai")


# -- parsing -----------------------------------------------------------------------------------
def test_parse_normalises_sorts_and_is_canonical():
    mix = parse_mix("mix:beta=3,alpha=7")
    assert mix.tasks == ("alpha", "beta")
    assert mix.weights == pytest.approx((0.7, 0.3))
    assert sum(mix.weights) == pytest.approx(1.0)
    assert parse_mix(mix.canonical) == mix
    assert parse_mix("mix:alpha=0.5").weights == (1.0,)
    assert parse_mix("mix:a=1e-3,b=.5").weights == pytest.approx((0.001 / 0.501, 0.5 / 0.501))
    assert is_mix("mix:a=1") and not is_mix("alpha")


BAD = [
    ("alpha=1", "starts with"),
    ("mix:", "ID=WEIGHT"),
    ("mix:alpha", "ID=WEIGHT"),
    ("mix:alpha=0", "> 0"),
    ("mix:alpha=-1", "decimal number"),
    ("mix:alpha=nan", "decimal number"),
    ("mix:alpha=inf", "decimal number"),
    ("mix:alpha=1e999", "decimal number"),
    ("mix:alpha=1,alpha=2", "twice"),
    ("mix:Alpha=1", "must match"),
    ("mix:../x=1", "must match"),
    ("mix:base=1", "not a routed task"),
    ("mix:" + ",".join(f"t{i}=1" for i in range(MAX_MIX_PARTS + 1)), f"at most {MAX_MIX_PARTS} parts"),
    ("mix:" + "a" * 2000 + "=1", "characters"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[m for _, m in BAD])
def test_parse_refuses(text, message):
    with pytest.raises(MixError, match=message) as info:
        parse_mix(text)
    assert len(str(info.value)) < 200  # never echoes the whole input


# -- the math ----------------------------------------------------------------------------------
def test_mix_weights_is_the_convex_combination_and_exact_for_one_task():
    gen = torch.Generator().manual_seed(0)
    w = task_weights_like(torch.randn(3, 5, 2, 4, generator=gen))  # 3 tasks, L=5, h=2, S=4
    one = mix_weights(w[:1], torch.tensor([1.0]))
    assert torch.equal(one, w[0])  # exactly the task, bit for bit
    lam = torch.tensor([0.5, 0.3, 0.2])
    mixed = mix_weights(w, lam)
    torch.testing.assert_close(mixed, 0.5 * w[0] + 0.3 * w[1] + 0.2 * w[2])
    torch.testing.assert_close(mixed.sum(-1), torch.ones(5, 2))  # each head still sums to 1
    with pytest.raises(ValueError, match="shape"):
        mix_weights(w, torch.tensor([1.0]))


def task_weights_like(logits: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits)
    return p / p.sum(-1, keepdim=True)


def test_the_mixed_adapter_is_the_weighted_sum_of_the_adapters():
    """A_mix = sum λ_i A_i and B_mix = sum λ_i B_i (the combine is linear in w), which is not
    the weighted sum of the deltas A_i B_i."""
    gen = torch.Generator().manual_seed(1)
    h, S, d_in, d_out, r = 2, 4, 8, 6, 3
    A, B = torch.randn(h, S, d_in // h, r, generator=gen), torch.randn(h, S, r, d_out // h, generator=gen)
    w = task_weights_like(torch.randn(2, 1, h, S, generator=gen))
    lam = torch.tensor([0.7, 0.3])
    A_m, B_m = materialize(A, B, mix_weights(w, lam)[0])
    (A_0, B_0), (A_1, B_1) = materialize(A, B, w[0, 0]), materialize(A, B, w[1, 0])
    torch.testing.assert_close(A_m, 0.7 * A_0 + 0.3 * A_1)
    torch.testing.assert_close(B_m, 0.7 * B_0 + 0.3 * B_1)
    assert not torch.allclose(A_m @ B_m, 0.7 * A_0 @ B_0 + 0.3 * A_1 @ B_1)


# -- the cache tiers ---------------------------------------------------------------------------
def make_cache(store, routing_layers: bool):
    from server.adapter_cache.cache import AdapterCache
    from server.adapter_cache.l1 import L1Cache

    info, skills = store.load_inventory()
    return AdapterCache(store, info, skills, fingerprint="fp", device=torch.device("cpu"), dtype=torch.float32,
                        l1=L1Cache(1 << 26), routing_layers=routing_layers)


@pytest.mark.parametrize("routing_layers", [False, True], ids=["native", "vllm"])
def test_cache_keys_a_mix_by_its_members_versions(tmp_path, routing_layers):
    from tests.support.server_fixtures import put_task

    store = build_store(tmp_path / "store")
    cache = make_cache(store, routing_layers)
    info, skills = store.load_inventory()
    mix = parse_mix("mix:alpha=0.7,beta=0.3")
    records = [store.get_task("alpha"), store.get_task("beta")]
    adapter = cache.get_mix(mix, records)
    want = 0.7 * task_weights(info, store.load_routing("alpha")) + 0.3 * task_weights(info, store.load_routing("beta"))
    torch.testing.assert_close(adapter.weights, want)
    assert adapter.task == mix.canonical
    if routing_layers:  # one materialised LoRA per distinct mix (what the vLLM engine loads)
        for (a, b), (a_ref, b_ref) in zip(adapter.layers, layers_from_weights(info, skills, want), strict=True):
            torch.testing.assert_close(a, a_ref)
            torch.testing.assert_close(b, b_ref)
    else:
        assert adapter.layers == []
    assert cache.get_mix(parse_mix("mix:beta=3,alpha=7"), records) is adapter  # L1 hit, same key
    put_task(store, "beta", seed=99)  # a member changes: a new key, a new adapter
    changed = cache.get_mix(mix, [store.get_task("alpha"), store.get_task("beta")])
    assert changed.key != adapter.key
    assert not torch.allclose(changed.weights, adapter.weights)


# -- the routes, through the official client ---------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Tasks alpha, beta, ...; `offline-mix` is the plain LoRA combined offline from 0.7 alpha +
    0.3 beta (materialised by adapters_store.lora.combine from the mixed routing weights); `plain` is
    another plain LoRA, which cannot be mixed."""
    root = tmp_path_factory.mktemp("mix")
    store = build_store(root / "store")
    info, skills = store.load_inventory()
    w = 0.7 * task_weights(info, store.load_routing("alpha")) + 0.3 * task_weights(info, store.load_routing("beta"))
    lora = {}
    for name, (a, b) in zip(info.layer_names, layers_from_weights(info, skills, w), strict=True):
        lora[f"{name}.A"], lora[f"{name}.B"] = a, b
    store.put_lora("offline-mix", lora, method="offline-combine")
    store.put_lora("plain", lora, method="mu")
    with live_server(settings_for(root, max_new_tokens=32), tiny_backbone()) as srv:
        yield srv


@pytest.fixture(scope="module")
def oc(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def answer(oc, model: str, prompt: str = "Input: abc\nOutput:") -> tuple[str, list[float]]:
    c = oc.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=1)
    return c.choices[0].text, list(c.choices[0].logprobs.token_logprobs)


def test_a_mix_of_one_task_is_that_task_exactly(oc):
    for prompt in ("Input: abc\nOutput:", "hello"):
        assert answer(oc, "mix:alpha=1.0", prompt) == answer(oc, "alpha", prompt)
        assert answer(oc, "mix:beta=0.25", prompt) == answer(oc, "beta", prompt)


def test_a_mix_of_two_equals_the_offline_combine_and_differs_from_both(oc):
    mixed_text, mixed_lp = answer(oc, "mix:alpha=0.7,beta=0.3")
    offline_text, offline_lp = answer(oc, "offline-mix")
    assert mixed_text == offline_text
    assert mixed_lp == pytest.approx(offline_lp, abs=1e-4)
    assert answer(oc, "mix:beta=3,alpha=7") == (mixed_text, mixed_lp)  # the same mix, spelled otherwise
    for task in ("alpha", "beta"):
        text, lp = answer(oc, task)
        assert text != mixed_text or lp != pytest.approx(mixed_lp, abs=1e-4), task


def test_a_mix_on_chat_streaming_and_generate(oc, server):
    msgs = [{"role": "user", "content": "abc"}]
    chat = oc.chat.completions.create(model="mix:alpha=0.7,beta=0.3", messages=msgs, max_tokens=12, temperature=0)
    offline = oc.chat.completions.create(model="offline-mix", messages=msgs, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == offline.choices[0].message.content
    assert chat.model == "mix:alpha=0.7,beta=0.3"
    streamed = oc.chat.completions.create(model="mix:alpha=0.7,beta=0.3", messages=msgs, max_tokens=12,
                                          temperature=0, stream=True)
    assert ("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
            == offline.choices[0].message.content)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        gen = http.post("/v1/generate", json={"task": "mix:alpha=0.7,beta=0.3", "prompt": "abc", "max_new_tokens": 12})
        ref = http.post("/v1/generate", json={"task": "offline-mix", "prompt": "abc", "max_new_tokens": 12})
        assert gen.status_code == 200 and gen.json()["text"] == ref.json()["text"]


REFUSED = [
    ("mix:alpha=0.5,nope=0.5", 404, "'nope' not found"),
    ("mix:alpha=0.5,plain=0.5", 422, "plain LoRA"),
    ("mix:alpha=1,alpha=2", 422, "twice"),
    ("mix:alpha=1,base=1", 422, "not a routed task"),
    ("mix:alpha=0", 422, "pattern"),  # the schema's pattern: a weight > 0, at most 8 parts
    ("mix:" + ",".join(f"t{i}=1" for i in range(MAX_MIX_PARTS + 1)), 422, "pattern"),
    ("mix:alpha=1;", 422, "pattern"),
]


@pytest.mark.parametrize(("model", "status", "message"), REFUSED, ids=[m for _, _, m in REFUSED])
def test_bad_mixes_are_4xx_naming_the_field(server, model, status, message):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2})
        assert r.status_code == (400 if status == 422 else status), r.text  # OpenAI's routes: 400
        err = r.json()["error"]
        assert message in err["message"] and err.get("param") == "model", err
        g = http.post("/v1/generate", json={"task": model, "prompt": "x", "max_new_tokens": 2})
        assert g.status_code == status, g.text
        assert g.json()["error"].get("param") in ("task", "model")
