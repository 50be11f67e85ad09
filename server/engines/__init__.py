"""Engines: the data plane behind polyserve's API. `factory.build_engine` picks one from the
settings; `base.Engine` is what every engine offers the API.

    native   server/engines/native: continuous batching over the in-process routed backbone
    vllm     server/engines/vllm:   vLLM's async engine with tasks materialised as LoRAs
"""
