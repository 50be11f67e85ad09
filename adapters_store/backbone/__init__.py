"""The one frozen backbone (load: the embedded default, a local HF directory, or the tiny test
model), the one prompt format (prompt), what the CPU can do for bf16 (hardware) and where polyserve
keeps its files on this machine (home)."""
