"""A fixture that runs a test once per build of a native kernel module (its `BUILDS`: the build for
this CPU and the one a lesser CPU gets), with the module's KERNEL swapped for that build."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest


def builds_fixture(module: ModuleType) -> Any:
    @pytest.fixture(params=sorted(module.BUILDS))
    def build(request, monkeypatch):
        """Kernels called in the test run this build."""
        kernel = module.BUILDS[request.param]
        if kernel.load() is None:
            pytest.fail(f"the {request.param} build of {module.__name__} did not load: {kernel.error()}")
        monkeypatch.setattr(module, "KERNEL", kernel)
        return request.param

    return build
