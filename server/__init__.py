"""polyserve's server: many routed-LoRA tasks over one frozen backbone.

    api/              the HTTP layer: app.py (create_app, the lifespan that builds the Runtime),
                      routes/ (one module per resource), wire schemas, OpenAI formats, errors,
                      auth (deps.py), middleware, and generation.py, the request path every
                      generating route shares
    runtime.py        backbone + store + RoutedModel + adapter cache + task registry + engine
    settings.py       Settings (POLYSERVE_* env)
    engines/          the data plane behind the API: native/ (continuous batching in its own
                      thread: engine, scheduler, step, slots, slot_lora, model_runner, sampling,
                      detok) or vllm/ (vLLM's engine, its LoRA directories, the resolver plugin)
    adapter_cache/    adapter cache tiers: L1 LRU (bytes), L2 Redis (sealed safetensors), L3 compute
    jobs/             registration jobs: service (enqueue, cancel, recover), runner (the slices)
    worker/           `polyserve worker`: runs leased jobs from the store's queue, serves nothing
    tasks.py          the task registry (store-backed), ownership.py, tenants.py, usage.py, mixes.py
    replicas.py       agreement between processes sharing a store (pub/sub hints, re-scans)
    metrics.py        Prometheus metrics (own registry per app)
    openmp.py         OpenMP spin defaults, set here, before torch loads, and the one-pool rule
                      (in_fresh_thread, one_thread; see its docstring)
"""

from server import openmp

openmp.apply()
