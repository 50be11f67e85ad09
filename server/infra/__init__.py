"""What the process runs on: Prometheus metrics (metrics), the CPUs it may use (cpus), OpenMP's
wait policy and the one-pool rule (openmp). How the native engine's steps use the CPUs under
contention is the engine's own (server/engines/native/core/execution.py)."""
