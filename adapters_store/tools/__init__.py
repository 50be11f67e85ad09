"""The store-side commands of `polyserve` (cli.py): export, import-peft-poly, import-lora,
warm-cache, backbone-path, db upgrade, store copy."""
