import pytest
import torch

from training.precision import bf16_is_fast, resolve_autocast


def test_explicit_choices_win_over_detection():
    assert resolve_autocast("bf16") is True and resolve_autocast(True) is True
    assert resolve_autocast("none") is False and resolve_autocast(False) is False


def test_auto_follows_the_cpu_capability():
    assert resolve_autocast("auto", "cpu") is bf16_is_fast("cpu")
    assert resolve_autocast(None, torch.device("cpu")) is bf16_is_fast("cpu")


def test_auto_is_off_where_bf16_kernels_are_missing():
    # AVX2-only CPUs emulate bf16 matmuls ~20x slower than fp32; "auto" must not pick it there.
    assert bf16_is_fast("cpu") is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert bf16_is_fast("meta") is False


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="auto\\|bf16\\|none"):
        resolve_autocast("fp16")
