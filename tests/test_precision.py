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


def test_auto_is_off_where_bf16_kernels_are_missing():
    # AVX2-only CPUs emulate bf16 matmuls ~20x slower than fp32; "auto" must not pick it there.
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert bf16_is_fast("cpu") is False
    assert bf16_is_fast("meta") is False


@pytest.mark.parametrize(("fp32", "bf16", "expected"), [(1.0, 2.0, False), (1.0, 0.9, False), (1.0, 0.5, True)])
def test_auto_follows_the_measurement_not_the_claim(monkeypatch, fp32, bf16, expected):
    # this machine claims bf16 kernels (AVX512_BF16) yet runs bf16 autocast ~20x slower: only a
    # measurement tells; bf16 must be clearly faster to be picked
    monkeypatch.setattr(precision.torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(precision, "_probe_seconds", lambda bf16_on: bf16 if bf16_on else fp32)
    precision.cpu_bf16_speedup.cache_clear()
    try:
        assert bf16_is_fast("cpu") is expected
        assert resolve_autocast("auto", "cpu") is expected
    finally:
        precision.cpu_bf16_speedup.cache_clear()


def test_probe_measures_both_precisions():
    assert precision._probe_seconds(False) > 0 and precision._probe_seconds(True) > 0


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="auto\\|bf16\\|none"):
        resolve_autocast("fp16")
