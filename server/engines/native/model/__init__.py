"""What runs one flat step: the model runners (the Llama runner, the Hugging Face one), their
attention over the slot cache, the per-slot LoRA tables, and static decode."""
