"""How a server process is put together: settings (POLYSERVE_* env), runtime (backbone + store +
routed model + adapter cache + task registry + engine), startup (what the lifespan runs),
exposure (refusing an unauthenticated public bind) and serve_cli (`polyserve serve`)."""
