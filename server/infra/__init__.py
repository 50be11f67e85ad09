"""What the process runs on: Prometheus metrics (metrics), the CPUs it may use (cpus), OpenMP's
wait policy and the one-pool rule (openmp), and the thread governor under contention
(contention)."""
