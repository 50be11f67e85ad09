"""`polyserve` — the one console script. Each package contributes its own commands:

    serve                                   server.wiring.serve_cli      (runs the HTTP server)
    worker                                  server.fleet.worker.cli     (runs registration jobs)
    train, adapt, eval, routing-plot        training.cli          (offline, on the store)
    export, import-peft-poly, import-lora,  adapters_store.tools.cli    (interop, caches, other engines,
    warm-cache, backbone-path, db upgrade,                         the PostgreSQL schema, copies)
    store copy
    generate, register, tasks, jobs,        client.cli            (talk HTTP to a server)
    models, usage

Modules imported here keep torch/transformers imports inside the command functions, so
`polyserve --help` and the client commands start fast.
"""

from __future__ import annotations

import importlib

import click

COMMANDS = {
    "server.wiring.serve_cli": ["serve"],
    "server.fleet.worker.cli": ["worker"],
    "training.cli": ["train", "adapt", "eval", "routing_plot"],
    "adapters_store.tools.cli": ["export", "import_peft_poly", "import_lora", "warm_cache", "backbone_path", "db",
                           "store_group"],
    "client.cli": ["generate", "register", "tasks", "jobs", "models", "usage"],
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="polyserve")
def main() -> None:
    """polyserve: serve many tasks over one frozen LM as routed combinations of LoRA skills."""


for module_name, names in COMMANDS.items():
    module = importlib.import_module(module_name)
    for attr in names:
        main.add_command(getattr(module, attr))


if __name__ == "__main__":
    main()
