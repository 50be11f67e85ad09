"""PEFT in and out: a task exported as a standard LoRA and a PEFT Poly/MHR checkpoint imported as
an inventory (peft_io), a PEFT LoRA brought as a task (lora_import), a LoRA projected onto the
inventory's routing (lora_project)."""
