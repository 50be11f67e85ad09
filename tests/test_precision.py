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
