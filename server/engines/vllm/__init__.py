"""The vLLM engine: polyserve's API, task registry and jobs in front of vLLM's async engine."""
