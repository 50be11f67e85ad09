"""The OpenAI-compatible surface: /v1/completions and /v1/chat/completions (routes, completions,
chat), their wire shapes (schemas) and answers (format), response_format (structured outputs),
and vLLM's /tokenize and /detokenize (tokenize_routes, tokenize_schemas)."""
