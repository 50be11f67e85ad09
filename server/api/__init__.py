"""The HTTP layer: the FastAPI app, its routes, wire schemas, OpenAI formats, errors, auth and middleware."""
