"""EngineConfig: the native engine's settings in one validated value, mapped from POLYSERVE_*."""

from __future__ import annotations

import pytest
import torch

from server.engines.native.config import EngineConfig
from server.engines.native.tuning import Tuning
from server.wiring.settings import Settings


def test_from_settings_carries_every_budget_and_runner_choice():
    tuning = Tuning(native_executor="hf", packed_weights="off", static_decode="on", lora_kernel="off")
    settings = Settings(max_batch_rows=8, max_batch_tokens=4096, max_prefill_rows=3, max_queue=17,
                        max_step_tokens=64, background_share=0.5, dtype="float32", tuning=tuning,
                        api_keys=["alice:k1:3", "bob:k2"], tenant_max_rows=5, tenant_kv_share=0.25)
    cfg = EngineConfig.from_settings(settings, threads=3)
    assert (cfg.max_batch_rows, cfg.max_batch_tokens, cfg.max_prefill_rows, cfg.max_queue,
            cfg.max_step_tokens, cfg.background_share) == (8, 4096, 3, 17, 64, 0.5)
    assert (cfg.dtype, cfg.tuning, cfg.threads) == (torch.float32, tuning, 3)
    assert cfg.caps.weights == {"alice": 3.0, "bob": 1.0}
    assert (cfg.caps.max_rows, cfg.caps.kv_share) == (5, 0.25)


@pytest.mark.parametrize(("fields", "named"), [
    ({"background_share": 0.0}, "background_share"),
    ({"background_share": 1.5}, "background_share"),
    ({"max_batch_rows": 0}, "max_batch_rows"),
    ({"max_queue": 0}, "max_queue"),
    ({"max_batch_rows": 64, "max_step_tokens": 64}, "max_step_tokens"),
])
def test_a_config_that_cannot_run_is_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(**fields)


def test_settings_refuse_the_queue_the_engine_refuses():
    """max_queue 0 never served (the native engine refused it at start, vLLM's queue was always
    full): one rule, at least 1, in the settings as in EngineConfig."""
    with pytest.raises(ValueError, match="max_queue"):
        Settings(max_queue=0)
    assert EngineConfig.from_settings(Settings(max_queue=1)).max_queue == 1
