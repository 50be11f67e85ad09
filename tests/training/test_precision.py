import pytest
import torch

from training import precision
from training.precision import bf16_is_fast, resolve_autocast


def test_explicit_choices_win_over_detection():
    assert resolve_autocast("bf16") is True and resolve_autocast(True) is True
    assert resolve_autocast("none") is False and resolve_autocast(False) is False


def test_auto_follows_the_cpu_capability():
    assert resolve_autocast("auto", "cpu") is bf16_is_fast("cpu")
    assert resolve_autocast(None, torch.device("cpu")) is bf16_is_fast("cpu")
    assert bf16_is_fast("meta") is False


@pytest.mark.parametrize("amx,avx512_bf16,speedup,want", [
    (True, True, None, True),  # AMX: bf16, no probe
    (False, False, None, False),  # AVX2 only: bf16 is emulated, no probe
    (False, True, 2.4, True),  # AVX512_BF16, the EPYC's probe (2.31-2.48)
    (False, True, 1.79, False),  # just under the bar
    (False, True, 1.2, False),  # the first AVX512_BF16 machine's whole steps
])
def test_auto_on_a_cpu(monkeypatch, amx, avx512_bf16, speedup, want):
    def no_probe():
        raise AssertionError("the probe ran where the CPU's flags decide")

    monkeypatch.setattr(precision, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(precision, "cpu_has_avx512_bf16", lambda: avx512_bf16)
    monkeypatch.setattr(precision, "cpu_bf16_train_speedup", no_probe if speedup is None else lambda: speedup)
    assert bf16_is_fast("cpu") is want
    assert resolve_autocast("auto", "cpu") is want
    assert resolve_autocast("none", "cpu") is False and resolve_autocast("bf16", "cpu") is True


def test_auto_is_the_same_every_time_in_a_process():
    # the probe runs once per process: the answer cannot flip between two adaptations
    first = resolve_autocast("auto", "cpu")
    assert all(resolve_autocast("auto", "cpu") is first for _ in range(20))


def test_the_probe_measures_a_ratio():
    ratio = precision.cpu_bf16_train_speedup.__wrapped__(d_in=64, d_out=128, rows=4, rounds=3, calls=2)
    assert 0 < ratio < 100


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="auto\\|bf16\\|none"):
        resolve_autocast("fp16")


def test_the_server_decides_registration_autocast_at_start_not_at_the_first_registration(monkeypatch, tmp_path):
    """A server probes while nothing is served: at its first registration, serving load would
    skew a timing probe (on the EPYC: 1.72x under load, 1.88-2.82x idle, around the 1.8x bar)."""
    from server.infra.metrics import Metrics
    from server.wiring.runtime import Runtime
    from tests.support.server_fixtures import build_store, settings_for, tiny_backbone

    calls = []
    monkeypatch.setattr(precision, "bf16_is_fast", lambda device="cpu": calls.append(str(device)) or False)
    build_store(tmp_path / "store")
    rt = Runtime.build(settings_for(tmp_path, warmup=False), Metrics(), backbone=tiny_backbone())
    try:
        assert calls == ["cpu"], "the autocast decision was not taken while the runtime was built"
    finally:
        rt.close()
