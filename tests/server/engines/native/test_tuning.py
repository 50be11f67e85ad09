"""The native engine's internal switches: read from their own POLYSERVE_* variables into one
Tuning, validated there, carried whole; one auto/on/off rule for every kernel."""

from __future__ import annotations

import pytest

from server.engines.native.config import EngineConfig
from server.engines.native.tuning import Tuning, resolve_switch
from server.wiring.settings import Settings


def test_each_switch_is_read_from_its_own_variable(monkeypatch):
    monkeypatch.setenv("POLYSERVE_LORA_KERNEL", "off")
    monkeypatch.setenv("POLYSERVE_NATIVE_EXECUTOR", "hf")
    monkeypatch.setenv("polyserve_adaptive_threads", "no")  # any case, the booleans a setting takes
    tuning = Settings().tuning
    assert tuning == Tuning(lora_kernel="off", native_executor="hf", adaptive_threads=False)
    assert EngineConfig.from_settings(Settings()).tuning == tuning
    assert Tuning.from_env({}) == Tuning()


@pytest.mark.parametrize(("name", "value"), [("POLYSERVE_WEIGHT_KERNEL", "yes"),
                                             ("POLYSERVE_NATIVE_EXECUTOR", "on"),
                                             ("POLYSERVE_ADAPTIVE_THREADS", "maybe")])
def test_a_bad_switch_is_refused_naming_it(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name.removeprefix("POLYSERVE_").lower()):
        Settings()


def test_the_switches_are_not_one_variable(monkeypatch):
    """POLYSERVE_TUNING would be a second way to set them: refused."""
    monkeypatch.setenv("POLYSERVE_TUNING", '{"lora_kernel": "off"}')
    with pytest.raises(ValueError, match="POLYSERVE_TUNING"):
        Settings()


def test_resolve_switch_is_the_one_auto_on_off_rule():
    asked: list[str] = []

    def why(reason: str | None):
        def ask() -> str | None:
            asked.append("asked")
            return reason
        return ask

    assert resolve_switch("lora_kernel", "off", why(None)) is False and asked == []  # off builds nothing
    assert resolve_switch("lora_kernel", "auto", why(None)) is True
    assert resolve_switch("lora_kernel", "on", why(None)) is True
    assert resolve_switch("lora_kernel", "auto", why("it runs on CPUs only")) is False
    with pytest.raises(ValueError, match="POLYSERVE_LORA_KERNEL=on: it runs on CPUs only"):
        resolve_switch("lora_kernel", "on", why("it runs on CPUs only"))
    with pytest.raises(ValueError, match="auto, on or off"):
        resolve_switch("lora_kernel", "yes", why(None))
