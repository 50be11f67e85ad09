"""polyserve's server: many routed-LoRA tasks over one frozen backbone.

    cli.py            `polyserve`: every package's commands in one console script
    api/              the HTTP layer: app.py (create_app, the lifespan that builds the Runtime),
                      routes/ (one module per resource), openai/ (the OpenAI-compatible routes,
                      their schemas and formats), wire schemas, errors (every error -> its
                      status, in one place), auth (deps.py), middleware, and generation.py, the
                      request path every generating route shares
    wiring/           settings (POLYSERVE_* env), runtime (backbone + store + RoutedModel +
                      adapter cache + task registry + engine), startup, `polyserve serve`
    engines/          the data plane behind the API: native/ (continuous batching in its own
                      thread: engine, scheduler, step, slots, slot_lora, model_runner, sampling,
                      detok) or vllm/ (vLLM's engine, its LoRA directories, the resolver plugin)
    adapter_cache/    adapter cache tiers: L1 LRU (bytes), L2 Redis (sealed safetensors), L3 compute
    registry/         the task registry (store-backed), mixes, routing search, ownership, and
                      the domain errors the API maps
    jobs/             registration jobs: service (enqueue, cancel, recover), runner (the slices),
                      journal (the job writes, on one I/O thread), leases, cancels (the poll
                      thread), recovery (start-up), state (their shared memory), contract
    tenancy/          tenants (keys, weights, admins) and usage
    fleet/            replicas (agreement between processes sharing a store) and worker/
                      (`polyserve worker`: runs leased jobs from the store's queue)
    infra/            Prometheus metrics, the CPU budget, OpenMP's spin defaults (set here,
                      before torch loads) and the one-pool rule
"""

from server.infra import openmp

openmp.apply()
