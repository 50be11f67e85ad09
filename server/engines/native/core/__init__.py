"""The engine loop and what it keeps between steps: the scheduler's admission and step plan, the
KV slots, the flat step, the prefix cache, the final-event ledger, fault isolation, and how each step
runs on the CPUs (execution)."""
