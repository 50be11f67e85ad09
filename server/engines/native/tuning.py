"""The native engine's internal switches: one value, read from the environment in one place and
carried whole from the settings to the model runner (docs/tuning.md lists them).

Every user wants their defaults (`auto`: the machine decides; adaptive_threads: true); a fixed
choice is for measuring and for working around a machine where `auto` chooses wrong. They are not user
settings (server/wiring/settings.py); each keeps its POLYSERVE_* environment variable.

    adaptive_threads    each step as one OpenMP team, or, while other processes hold the CPUs,
                        on one thread (core/execution.py)
    contended_helper    on one thread, the weight kernel's linears share their panels with a
                        helper thread (kernels/panel_helper.h)
    packed_weights      the Llama runner's linears packed once for oneDNN
    native_executor     llama = the engine's own fused forward, hf = the model's forward on flat steps
    static_decode       decode steps padded to fixed shapes and replayed as CUDA graphs
    lora_kernel, attention_kernel, weight_kernel, elementwise_kernel
                        a path of the runner in a C++ kernel built on first use (kernels/:
                        lora_kernel.py, attention_kernel.py, quant_linear.py, elementwise_kernel.py)

A new kernel adds its switch here and calls `resolve_switch` where its path is chosen. A switch
whose path was removed stays in RETIRED, so a deployment that still sets it is told, not ignored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from pydantic import TypeAdapter

Switch = Literal["auto", "on", "off"]
SWITCH = ("auto", "on", "off")
EXECUTORS = ("auto", "llama", "hf")
PREFIX = "POLYSERVE_"
log = logging.getLogger("polyserve")
# switches whose path is gone: what replaced it (a start-up warning where one is still set)
RETIRED = {"contended_lanes": "a contended step runs on one thread, with the panel helper where the linears "
                              "have it (docs/tuning.md)"}


def switch(value: str) -> bool | None:
    """An auto/on/off switch as None (decide by the machine) / True / False."""
    return {"auto": None, "on": True, "off": False}[value]


def env_name(field: str) -> str:
    return f"{PREFIX}{field.upper()}"


@dataclass(frozen=True)
class Tuning:
    adaptive_threads: bool = True
    contended_helper: Switch = "auto"
    packed_weights: Switch = "auto"
    native_executor: Literal["auto", "llama", "hf"] = "auto"
    static_decode: Switch = "auto"
    lora_kernel: Switch = "auto"
    attention_kernel: Switch = "auto"
    weight_kernel: Switch = "auto"
    elementwise_kernel: Switch = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "adaptive_threads":
                if not isinstance(value, bool):
                    raise ValueError(f"adaptive_threads ({env_name(f.name)}) must be a boolean, got {value!r}")
                continue
            allowed = EXECUTORS if f.name == "native_executor" else SWITCH
            if value not in allowed:
                raise ValueError(f"{f.name} ({env_name(f.name)}) must be one of {', '.join(allowed)}, "
                                 f"got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Tuning:
        """The switches set in the environment (POLYSERVE_<NAME>, any case, as the settings read
        theirs); the rest at their defaults."""
        env = {key.upper(): value for key, value in (os.environ if environ is None else environ).items()}
        for name, instead in RETIRED.items():
            if env_name(name) in env:
                log.warning("%s has no effect: %s", env_name(name), instead)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(env_name(f.name))
            if raw is None:
                continue
            if f.name == "adaptive_threads":
                try:  # the booleans a setting takes: true/false, on/off, yes/no, 1/0
                    values[f.name] = TypeAdapter(bool).validate_python(raw)
                except ValueError:
                    raise ValueError(f"adaptive_threads ({env_name(f.name)}) must be a boolean, "
                                     f"got {raw!r}") from None
            else:
                values[f.name] = raw
        return cls(**values)

    @classmethod
    def env_names(cls) -> list[str]:
        return [env_name(f.name) for f in fields(cls)]


DEFAULT = Tuning()  # every switch at its default


def resolve_switch(name: str, setting: str, why_not: Callable[[], str | None]) -> bool:
    """Whether the path behind switch `name` runs: off never; auto and on where why_not() (what
    the machine or the model lacks, or why the kernel does not build) is None. It is asked only
    where the setting is not off, so it may build a kernel. on, where it cannot run: ValueError
    naming the reason."""
    if setting not in SWITCH:
        raise ValueError(f"{name} must be auto, on or off; got {setting!r}")
    if setting == "off":
        return False
    why = why_not()
    if why is not None and setting == "on":
        raise ValueError(f"{env_name(name)}=on: {why}")
    return why is None
