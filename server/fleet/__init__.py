"""Several processes over one store: agreement between replicas (replicas: pub/sub hints,
re-scans) and `polyserve worker` (worker/: runs leased registration jobs, serves nothing)."""
