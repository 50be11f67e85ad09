"""polyserve's HTTP server: many routed-LoRA tasks over one frozen backbone.

    app.py            create_app(settings): thin FastAPI shell, lifespan builds the Runtime
    runtime.py        backbone + store + RoutedModel + adapter cache + task registry + engine
    settings.py       Settings (POLYSERVE_* env)
    routes/           one module per resource: generate, openai, tasks, health, metrics
    generation.py     the request path shared by every generating endpoint
    engines/          the data plane behind the API: native/ (continuous batching in its own thread:
                      engine, step, slots, slot_lora, llama / hf_executor, sampling, detok) or vllm/
    adapters/         adapter cache tiers: L1 LRU (bytes), L2 Redis (safetensors), L3 compute
    tasks.py          the task registry (store-backed; issue #5 adds create/delete/jobs)
    metrics.py        Prometheus metrics (own registry per app)
    openmp.py         OpenMP spin defaults, set here, before torch loads, and the one-pool rule
                      (in_fresh_thread, one_thread; see its docstring)
"""

from server import openmp

openmp.apply()
