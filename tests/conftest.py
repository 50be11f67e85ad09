"""Shared fixtures: a tiny random Llama built in-process (no files, no network)."""

from __future__ import annotations

import copy

import pytest
import torch

from adapters_store.tiny import tiny_llama, tiny_tokenizer

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
