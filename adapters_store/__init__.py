"""The bottom of polyserve: the routed-LoRA math and the store that keeps inventories and tasks.
Imports neither server nor training. Four rooms and the store's commands:

    lora/       the math, pure functions over tensors: routing (Poly/MHR/mu weights), combine (a
                task's LoRA from the skills), batched (rows of different tasks in one forward),
                layer + inject (the routed linear in a backbone), mix, similar, spec, targets
    store/      the store contract (contract.py: AdapterStore) written once over two backends,
                one file each (directory.py: DirectoryStore; postgres.py: PostgresStore), and
                what they share: records, ids, errors, atomic writes, the job queue, the task
                snapshot, materialize (a stored task -> its LoRA), copy and refine
    backbone/   the one frozen model: load (embedded default, HF directory, tiny test model),
                prompt (the one prompt format), hardware (bf16 facts), home ($POLYSERVE_HOME)
    interop/    PEFT in and out: peft_io (export a task as a LoRA, import a Poly checkpoint),
                lora_import (bring your own LoRA), lora_project (a LoRA onto the inventory)
    tools/      `polyserve export | import-* | warm-cache | backbone-path | db | store copy`
"""
