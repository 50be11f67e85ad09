"""Shared fixtures: a tiny random Llama built in-process (no files, no network)."""

from __future__ import annotations

import copy

import pytest
import torch

from adapters_store.backbone.tiny import tiny_llama, tiny_tokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_base() -> torch.nn.Module:
    return tiny_llama(seed=0)


@pytest.fixture
def tiny_model(tiny_base: torch.nn.Module) -> torch.nn.Module:
    """A fresh copy per test (adapters are attached in place)."""
    return copy.deepcopy(tiny_base)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def one_thread():
    """The tiny model gains nothing from threads, and 2 OpenMP threads on a busy 2-core machine stall."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
