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


@pytest.mark.parametrize("amx", [True, False])
def test_auto_on_a_cpu_is_bf16_exactly_where_amx_is(monkeypatch, amx):
    # AVX512_BF16 without AMX (this project's CPU): a whole step at most ~1.2x faster in bf16 and a
    # micro-probe's choice flipped between processes; AVX2: bf16 emulated, ~20x slower
    monkeypatch.setattr(precision.torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert bf16_is_fast("cpu") is amx
    assert resolve_autocast("auto", "cpu") is amx


def test_auto_is_the_same_every_time_in_a_process():
    # the old timing probe could answer differently in two processes of one machine
    first = resolve_autocast("auto", "cpu")
    assert all(resolve_autocast("auto", "cpu") is first for _ in range(20))
    assert first is bool(torch.cpu._is_amx_tile_supported())


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="auto\\|bf16\\|none"):
        resolve_autocast("fp16")
