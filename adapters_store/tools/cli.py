"""Store-side commands: export a task as a PEFT LoRA, import a PEFT Poly checkpoint, warm caches,
print the backbone's directory for other engines (vLLM)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from adapters_store.backbone.home import default_store, polyserve_home

store_option = click.option(
    "--store", "store_dir", default=default_store, show_default="$POLYSERVE_STORE",
    help="Store: a directory, or postgresql://USER@HOST:PORT/DB.",
)
backbone_option = click.option(
    "--backbone", default=lambda: os.environ.get("POLYSERVE_BACKBONE", "default"), show_default=True,
    help="'default' (embedded SmolLM2-135M-Instruct), 'tiny' (tests) or a local HF model directory.",
)


@click.command()
@click.option("--task", required=True, help="Task id to export.")
@click.option("--format", "fmt", type=click.Choice(["peft-lora"]), default="peft-lora", show_default=True)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--base-model", default=None,
              help="base_model_name_or_path written into adapter_config.json; vLLM's resolvers load an adapter "
                   "only when it equals the served model's name. Default: for the default backbone, the "
                   "directory `polyserve backbone-path` prints (what `--model` is given); else the backbone's name.")
@store_option
def export(task: str, fmt: str, out: str, base_model: str | None, store_dir: str) -> None:
    """Write a task as a standard PEFT LoRA (adapter_config.json + adapter_model.safetensors)."""
    from adapters_store.backbone.load import DEFAULT_NAME, default_hf_dir
    from adapters_store.interop.peft_io import export_peft_lora
    from adapters_store.store.directory import DirectoryStore
    from adapters_store.store.errors import StoreError
    from adapters_store.store.ids import validate_task_id

    try:
        store = DirectoryStore(store_dir)
        if base_model is None:
            name = store.inventory_info().backbone_name
            base_model = str(default_hf_dir()) if name == DEFAULT_NAME else name
        path = export_peft_lora(store, validate_task_id(task), out, base_model=base_model)
    except (StoreError, ValueError) as err:
        raise click.ClickException(str(err)) from err
    click.echo(f"wrote {fmt} adapter for {task!r} to {path}")


@click.command("import-peft-poly")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.option("--names", type=click.Path(exists=True, dir_okay=False),
              help="JSON list (or index->name map) of task ids.")
@click.option("--replace", is_flag=True, help="Overwrite the store's existing inventory.")
@store_option
@backbone_option
def import_peft_poly(src: str, names: str | None, replace: bool, store_dir: str, backbone: str) -> None:
    """Import a PEFT Poly/MHR checkpoint: its skills become the inventory, its n_tasks rows tasks."""
    import json

    from adapters_store.backbone.load import load_backbone
    from adapters_store.interop.peft_io import import_peft_poly as do_import
    from adapters_store.lora.inject import find_target_linears
    from adapters_store.store.directory import DirectoryStore
    from adapters_store.store.errors import StoreError

    config = json.loads((Path(src) / "adapter_config.json").read_text())
    bb = load_backbone(backbone)
    try:
        order = find_target_linears(bb.model, tuple(config.get("target_modules") or ()))
        info, tasks = do_import(
            src, DirectoryStore(store_dir), layer_order=order, backbone_fingerprint=bb.fingerprint,
            backbone_name=bb.name, mapping=names, replace=replace,
        )
    except (StoreError, ValueError, KeyError) as err:
        raise click.ClickException(str(err)) from err
    click.echo(f"imported inventory {info.version} (S={info.spec.n_skills}, h={info.spec.n_heads}, "
               f"r={info.spec.rank}) and {len(tasks)} tasks into {store_dir}")


@click.group()
def db() -> None:
    """The PostgreSQL store's schema."""


@db.command("upgrade")
@click.option("--store", "dsn", default=default_store, show_default="$POLYSERVE_STORE",
              help="postgresql://USER@HOST:PORT/DB")
def db_upgrade(dsn: str) -> None:
    """Create or migrate the schema. Idempotent; safe when several processes run it at once."""
    import psycopg

    from adapters_store.store.location import is_dsn
    from adapters_store.store.postgres import redact
    from adapters_store.store.postgres_schema import SCHEMA_VERSION, upgrade

    if not is_dsn(dsn):
        raise click.UsageError(f"--store must be a postgresql:// DSN (a directory store has no schema), got {dsn!r}")
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            applied = upgrade(conn)
    except (psycopg.Error, RuntimeError) as err:
        raise click.ClickException(f"{redact(dsn)}: {err}") from err
    done = f"applied migration(s) {', '.join(map(str, applied))}" if applied else "already up to date"
    click.echo(f"{redact(dsn)}: schema version {SCHEMA_VERSION} ({done})")


@click.group("store")
def store_group() -> None:
    """Whole-store operations."""


@store_group.command("copy")
@click.option("--from", "src", required=True, help="Source store: a directory or a postgresql:// DSN.")
@click.option("--to", "dst", required=True, help="Destination store: a directory or a postgresql:// DSN.")
def store_copy(src: str, dst: str) -> None:
    """Copy a store (inventory, tasks with every record as it is, finished jobs) and verify it."""
    import json

    from tqdm import tqdm

    from adapters_store.store import open_store
    from adapters_store.store.copy import copy_store
    from adapters_store.store.errors import StoreError

    if src == dst:
        raise click.UsageError("--from and --to name the same store")
    try:
        source = open_store(src, cache_dir=polyserve_home() / "inventories")
        target = open_store(dst, cache_dir=polyserve_home() / "inventories")
        with tqdm(total=len(source.task_stamps()), unit="task", desc="copying", disable=None) as bar:
            report = copy_store(source, target, progress=bar.update)
    except StoreError as err:
        raise click.ClickException(str(err)) from err
    click.echo(json.dumps({"from": source.location, "to": target.location, "verified": True, **report.to_json()}))


@click.command("import-lora")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.option("--task", required=True, help="The new task's id.")
@click.option("--project", is_flag=True, help="Also fit the routing row whose combined adapter best approximates "
              "the LoRA (least squares in weight space) and report the fit; the task stays the plain LoRA, the "
              "fitted row becomes the task ID-routed.")
@store_option
@click.option("--url", default=None, help="Import over HTTP into the server at URL (POST /v1/tasks, method lora; "
              "admin keys) instead of into --store.")
@click.option("--api-key", envvar="POLYSERVE_API_KEY", default=None, help="With --url: bearer key "
              "(env POLYSERVE_API_KEY).")
@click.option("--shared", is_flag=True, help="With --url: the task is usable by every tenant (admin keys).")
@click.pass_context
def import_lora(ctx: click.Context, src: str, task: str, project: bool, store_dir: str, url: str | None,
                api_key: str | None, shared: bool) -> None:
    """Register a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) as a
    plain-LoRA task: into a store (a running server on it serves it at once), or with --url into a
    running server over HTTP."""
    import json

    if url is None:
        if shared:
            raise click.UsageError("--shared is for --url (a store import has no caller to share from)")
    else:
        if ctx.get_parameter_source("store_dir") is not click.core.ParameterSource.DEFAULT:
            raise click.UsageError("--store and --url exclude each other: import into a store, or over HTTP")
        from client.cli import import_lora_over_http

        import_lora_over_http(url, api_key, src, task, project=project, shared=shared)
        return
    from adapters_store.interop.lora_import import ImportRefused, read_dir
    from adapters_store.interop.lora_import import import_lora as do_import
    from adapters_store.store import open_store
    from adapters_store.store.errors import StoreError

    try:
        store = open_store(store_dir, cache_dir=polyserve_home() / "inventories")
        config, tensors = read_dir(src)
        record = do_import(store, task, config, tensors, source={"imported_from": str(Path(src).resolve())})
        report = {"task": record.id, "kind": record.kind, "version": record.version, "params": record.params}
        if project:
            from adapters_store.interop.lora_project import project_task

            report["project"] = project_task(store, record.id)
    except (ImportRefused, StoreError, ValueError) as err:
        raise click.ClickException(str(err)) from err
    click.echo(json.dumps(report, indent=2))


@click.command("warm-cache")
def warm_cache() -> None:
    """Dequantise the embedded default backbone once into $POLYSERVE_HOME (used by the Docker build)."""
    from adapters_store.backbone.load import warm_default_cache

    click.echo(f"default backbone cached at {warm_default_cache()}")


@click.command("backbone-path")
@backbone_option
def backbone_path(backbone: str) -> None:
    """Print the backbone's local Hugging Face directory (dequantising the default first if
    needed), for engines that load it themselves: vllm ... --model "$(polyserve backbone-path)"."""
    from adapters_store.backbone.load import hf_dir

    try:
        click.echo(hf_dir(backbone))
    except (FileNotFoundError, ValueError) as err:
        raise click.ClickException(str(err)) from err
