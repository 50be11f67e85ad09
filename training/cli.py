"""`polyserve train | adapt | eval | routing-plot`: offline commands on a store.

Heavy imports (torch, transformers, matplotlib) stay inside the command functions so that
`polyserve --help` starts fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from adapters_store.backbone import home

STORE_HELP = "store directory (default: $POLYSERVE_STORE or $POLYSERVE_HOME/store)"


def default_store() -> Path:
    return Path(home.default_store()).expanduser()


def _threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


def _open_store(path: str | None, *, install_default: bool = False):  # -> DirectoryStore
    from adapters_store.store.directory import DirectoryStore

    store = DirectoryStore(Path(path).expanduser() if path else default_store())
    if install_default and not store.has_inventory():
        from training.shipped_inventory import install_default_inventory

        install_default_inventory(store)
    return store


@click.command()
@click.option("--suite", required=True,
              help="procedural (open vocabulary) | procedural24 (the first 24 words) | bigbench (its training "
                   "tasks, built by scripts/bigbench_suite.py) | PATH.jsonl ({task, input, output} per line)")
@click.option("--method", required=True, type=click.Choice(["mhr", "poly", "shared", "private", "random-mu", "hyper"]))
@click.option("--skills", default=8, show_default=True, help="S, skills in the inventory")
@click.option("--heads", default=8, show_default=True, help="h, routing heads (mhr, random-mu, hyper)")
@click.option("--rank", default=8, show_default=True)
@click.option("--steps", default=1000, show_default=True)
@click.option("--store", "store_dir", default=None, help=STORE_HELP)
@click.option("--backbone", default="default", show_default=True, help="default | tiny | PATH")
@click.option("--batch-size", default=8, show_default=True)
@click.option("--lr-routing", default=0.1, show_default=True)
@click.option("--lr-skills", default=1e-3, show_default=True)
@click.option("--weight-decay", default=0.01, show_default=True, help="on skills only")
@click.option("--warmup", default=0.06, show_default=True, help="fraction of steps")
@click.option("--temperature", default=1.0, show_default=True, help="Gumbel-sigmoid temperature")
@click.option("--no-gumbel", is_flag=True, help="train with plain sigmoid routing (no noise)")
@click.option("--sampling", default="uniform", show_default=True,
              type=click.Choice(["uniform", "proportional", "uncertainty"]))
@click.option("--uncertainty-pool", default=1, show_default=True, help="candidates per task (uncertainty)")
@click.option("--checkpoint-every", default=0, show_default=True, help="steps; 0 = only at the end")
@click.option("--resume", is_flag=True, help="continue from the store's trainer state")
@click.option("--init-from", "init_from", default=None, type=click.Path(exists=True, file_okay=False),
              help="start from this store's skills and the routing rows of the tasks it shares with this run; "
                   "this run may have more --skills and more --targets (the inventory grows)")
@click.option("--seed", default=0, show_default=True)
@click.option("--examples-per-task", default=500, show_default=True)
@click.option("--targets", default=None, help="comma-separated linear names to adapt [default: the backbone "
              "architecture's attention projections, e.g. q_proj,k_proj,v_proj,o_proj; Phi-3 qkv_proj,o_proj]")
@click.option("--max-length", default=128, show_default=True)
@click.option("--autocast", default="auto", show_default=True, type=click.Choice(["auto", "bf16", "none"]),
              help="auto = bf16 only where the CPU has fast bf16 kernels (AVX-512/AMX); fp32 on AVX2")
@click.option("--save-dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]))
@click.option("--threads", default=None, type=int, help="torch CPU threads")
@click.option("--no-progress", is_flag=True)
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
              help="auto = this rank's GPU where CUDA is available, else the CPU")
@click.option("--shard-backbone", is_flag=True,
              help="under torchrun: shard the frozen backbone across the ranks (FSDP), for one too big for a device")
def train(suite, method, skills, heads, rank, steps, store_dir, backbone, batch_size, lr_routing, lr_skills,
          weight_decay, warmup, temperature, no_gumbel, sampling, uncertainty_pool, checkpoint_every, resume,
          init_from, seed, examples_per_task, targets, max_length, autocast, save_dtype, threads, no_progress,
          device, shard_backbone) -> None:
    """Pre-train a skill inventory and the training tasks' routing rows (multi-task).

    Under `torchrun --nproc_per_node N` it trains data-parallel: --batch-size is the global batch,
    split evenly across the N ranks (it must be a multiple of N); rank 0 alone logs and writes."""
    if resume and init_from:
        raise click.UsageError("--resume and --init-from exclude each other")
    from training.distributed import check_batch, env_world_size, launched_by_torchrun

    try:
        check_batch(batch_size, env_world_size())
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--batch-size") from None
    if shard_backbone and not launched_by_torchrun():
        raise click.UsageError("--shard-backbone shards the backbone across torchrun's ranks: start it with torchrun")
    _threads(threads)
    from training import distributed

    with distributed.session(device) as ctx:
        from adapters_store.backbone.load import load_backbone
        from training import checkpoint as ckpt
        from training.trainer import TrainConfig, Trainer, suite_tasks

        def say(message: str) -> None:  # rank 0 alone logs
            if ctx.is_main:
                click.echo(message, err=True)

        say(f"world size {ctx.world_size} ({ctx.backend or 'one process'} on {ctx.device}"
            f"{', backbone sharded' if shard_backbone else ''}; global batch {batch_size}, "
            f"{batch_size // ctx.world_size} a rank)")

        cfg = TrainConfig(  # no --targets: () = the backbone architecture's default (adapters_store.lora.targets)
            method=method, n_skills=skills, n_heads=heads, rank=rank, steps=steps,
            targets=tuple(t for t in (targets or "").split(",") if t),
            batch_size=batch_size, lr_routing=lr_routing, lr_skills=lr_skills, weight_decay=weight_decay,
            warmup=warmup, temperature=temperature, gumbel=not no_gumbel, sampling=sampling,
            uncertainty_pool=uncertainty_pool, max_length=max_length, autocast=autocast, seed=seed,
            checkpoint_every=checkpoint_every, save_dtype=save_dtype, suite=suite,
        )
        store = _open_store(store_dir) if ctx.is_main else None  # the other ranks write nothing
        root = store.root if store is not None else (Path(store_dir).expanduser() if store_dir else default_store())
        bb = load_backbone(backbone, device=str(ctx.device))
        tasks = suite_tasks(suite, examples_per_task, seed)
        say(f"backbone {bb.name} ({bb.fingerprint}); {len(tasks)} tasks; store {root}")
        try:
            trainer = Trainer(cfg, bb, tasks, store, dist=ctx, shard_backbone=shard_backbone)
        except ValueError as err:
            raise click.UsageError(str(err)) from None
        if init_from:
            from adapters_store.store.directory import DirectoryStore
            from adapters_store.store.errors import StoreError

            try:
                carried = trainer.warm_start(DirectoryStore(init_from))
            except (StoreError, ValueError) as err:
                raise click.BadParameter(str(err), param_hint="--init-from") from err
            say(f"started from {init_from}: its skills and {len(carried)} of {len(tasks)} tasks' routing rows")
        if resume:  # every rank reads the same checkpoint
            if not ckpt.has_state(root):
                raise click.UsageError(f"--resume: no trainer state in {root / ckpt.STATE_DIR}")
            trainer.load_state(root)
            say(f"resumed at step {trainer.step}/{cfg.steps}")
        trainer.run(progress=not no_progress)
        if not ctx.is_main:
            return
        click.echo(json.dumps({"steps": trainer.step, "last_loss": trainer.last_loss,
                               "seconds": round(trainer.elapsed, 1),
                               "tokens_per_s": round(trainer.tokens / max(trainer.elapsed, 1e-9), 1),
                               "store": str(root), "world_size": ctx.world_size}))


def _routed(store, backbone: str):  # -> (bb, rm, info, skills)
    from adapters_store.backbone.load import load_backbone
    from adapters_store.lora.inject import RoutedModel

    bb = load_backbone(backbone)
    info, skills = store.load_inventory(expected_fingerprint=bb.fingerprint)
    rm = RoutedModel(bb.model, info.spec)
    rm.load_skills(skills)
    return bb, rm, info, skills


@click.command()
@click.option("--task", required=True, help="id of the new task")
@click.option("--examples", "examples_file", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--method", default="routing", show_default=True,
              type=click.Choice(["routing", "retrieve", "mu", "full"]),
              help="retrieve: the best-fitting mixture of the store's tasks' routing rows, no training")
@click.option("--init", "init", default="retrieve", show_default=True, type=click.Choice(["retrieve", "mu"]),
              help="routing: start from the retrieved row or from μ")
@click.option("--steps", default=None, type=int, help="optimisation steps (default: per method)")
@click.option("--lr", default=None, type=float)
@click.option("--batch-size", default=None, type=int, help="examples per step (default: per method)")
@click.option("--seed", default=0, show_default=True)
@click.option("--store", "store_dir", default=None, help=STORE_HELP)
@click.option("--backbone", default="default", show_default=True)
@click.option("--threads", default=None, type=int)
def adapt(task, examples_file, method, init, steps, lr, batch_size, seed, store_dir, backbone, threads) -> None:
    """Few-shot adaptation of a new task from a JSONL file of examples; stores it."""
    _threads(threads)
    from adapters_store.store.ids import validate_new_task_id
    from training.adapt import Adaptation
    from training.adapt_config import AdaptConfig
    from training.data import DataError, load_jsonl
    from training.retrieve import MAX_CANDIDATES, Retrieval, RetrievedAdaptation

    try:
        validate_new_task_id(task)
        examples = load_jsonl(examples_file, task=task)
    except (DataError, ValueError) as err:
        raise click.UsageError(str(err)) from None
    store = _open_store(store_dir, install_default=True)
    bb, rm, info, skills = _routed(store, backbone)
    from tqdm import tqdm

    bar = tqdm(desc=f"adapt {task} ({method})", unit="step")

    def progress(p: dict) -> None:
        bar.total = p["steps"]
        bar.n = p["step"]
        fmt = {k: "-" if p[k] is None else f"{p[k]:.3f}" for k in ("loss", "eval_loss")}
        bar.set_postfix(loss=fmt["loss"], eval=fmt["eval_loss"], refresh=False)
        bar.refresh()

    def adaptation(init_row=None, init_eval=None):
        config = AdaptConfig(method=method, steps=steps, seed=seed, batch_size=batch_size, lr=lr)
        return Adaptation(rm, info, skills, examples, bb.tokenizer, config, progress=progress, init_row=init_row,
                          init_eval=init_eval)

    candidates = store.routing_rows(limit=MAX_CANDIDATES, exclude=task) \
        if method == "retrieve" or (method == "routing" and init == "retrieve") else {}
    job: Retrieval | RetrievedAdaptation | Adaptation
    if method == "retrieve":
        job = Retrieval(rm, info, candidates, examples, bb.tokenizer, seed=seed)
    elif candidates:
        job = RetrievedAdaptation(Retrieval(rm, info, candidates, examples, bb.tokenizer, seed=seed), adaptation)
    else:
        job = adaptation()
    while job.step():
        pass
    bar.close()
    res = job.result()
    source = {"kind": "adapt", "examples": len(examples), "file": Path(examples_file).name, "seed": seed}
    if res.kind == "routing":
        rec = store.put_routing(task, res.tensors["logits"], method=method, source=source, metrics=res.metrics)
    else:
        rec = store.put_lora(task, res.tensors, method=method, source=source, metrics=res.metrics)
    click.echo(json.dumps({"task": rec.id, "version": rec.version, "kind": rec.kind, "params": res.params,
                           "metrics": res.metrics}))


@click.command("eval")
@click.option("--store", "store_dir", default=None, help=STORE_HELP)
@click.option("--tasks", default=None, help="comma-separated task ids (default: every task in the store)")
@click.option("--split", default="test", show_default=True, type=click.Choice(["train", "valid", "test"]))
@click.option("--n", default=32, show_default=True, help="examples per task")
@click.option("--seed", default=0, show_default=True)
@click.option("--examples", "examples_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="JSONL with examples for tasks that are not procedural compositions")
@click.option("--mu", is_flag=True, help="also evaluate zero-shot μ (the skills' average) on each task")
@click.option("--vocabs", default="train,heldout,madeup", show_default=True,
              help="procedural tasks: the words of the test inputs, side by side (training.vocab: train, "
                   "heldout, madeup, legacy; sentences, for word-level tasks only); the first one a task has fills "
                   "its top-level figures")
@click.option("--backbone", default="default", show_default=True)
@click.option("--threads", default=None, type=int)
@click.option("--json-out", default=None, type=click.Path(dir_okay=False))
def eval_cmd(store_dir, tasks, split, n, seed, examples_file, mu, vocabs, backbone, threads, json_out) -> None:
    """Per-task exact match (greedy) and loss, on training words and held-out words side by side;
    Z statistics of the stored routing rows."""
    _threads(threads)
    import torch

    from adapters_store.store.materialize import mu_weights, task_layers
    from training.data import group_by_task, load_jsonl
    from training.evaluate import evaluate_task
    from training.suite import examples as suite_examples
    from training.suite import parse_task, takes_sentences
    from training.vocab import EVAL_VOCABS, SENTENCES
    from training.zstats import z_stats

    vocab_list = vocabs.split(",")
    if not vocab_list or not set(vocab_list) <= set(EVAL_VOCABS):
        raise click.BadParameter(f"each of {', '.join(EVAL_VOCABS)}", param_hint="--vocabs")

    store = _open_store(store_dir, install_default=True)
    bb, rm, info, skills = _routed(store, backbone)
    records = {r.id: r for r in store.list_tasks() if r.status == "ready"}
    names = tasks.split(",") if tasks else sorted(records)
    given = group_by_task(load_jsonl(examples_file)) if examples_file else {}
    rows: dict[str, dict] = {}
    for name in names:
        if name not in records:
            raise click.UsageError(f"task {name!r} is not in the store")
        if name in given:
            sets = {"given": given[name][:n]}
        else:
            try:
                spec = parse_task(name)
            except ValueError:
                click.echo(f"skip {name}: not a procedural task and not in --examples", err=True)
                continue
            # a sentence is an input only to a task of word-level primitives (no number task's)
            sets = {v: suite_examples(spec, n, seed=seed, split=split, vocab=v) for v in vocab_list
                    if v != SENTENCES or takes_sentences(spec)}
            if not sets:
                click.echo(f"skip {name}: no word-level task, so no sentence inputs", err=True)
                continue
        rec = records[name]
        layers = task_layers(info, skills, str(rec.kind), store.load_weights(rec))
        by_vocab = {v: evaluate_task(rm, layers, bb.tokenizer, exs) for v, exs in sets.items()}
        row = {"method": rec.method, **next(iter(by_vocab.values())), "by_vocab": by_vocab}
        if mu:
            row["mu"] = {v: evaluate_task(rm, mu_weights(info), bb.tokenizer, exs) for v, exs in sets.items()}
        rows[name] = row
        cells = " ".join(f"{v}={r['exact_match']:.3f}" for v, r in by_vocab.items())
        click.echo(f"{name:32s} {rec.method:10s} exact_match {cells} loss={row['loss']:.3f}", err=True)
    routing = [r for r in records.values() if r.kind == "routing"]
    summary: dict = {"tasks": rows, "n": n, "split": split}
    if rows:
        summary["mean_exact_match"] = sum(r["exact_match"] for r in rows.values()) / len(rows)
        summary["mean_exact_match_by_vocab"] = {
            v: sum(r["by_vocab"][v]["exact_match"] for r in rows.values() if v in r["by_vocab"])
            / max(1, sum(v in r["by_vocab"] for r in rows.values()))
            for v in dict.fromkeys(v for r in rows.values() for v in r["by_vocab"])}
    if routing and info.spec.routing != "hyper" and info.spec.n_skills > 1:  # S = 1: nothing is chosen
        summary["z_stats"] = z_stats(torch.stack([store.load_routing(r.id).float() for r in routing]))
    text = json.dumps(summary, indent=2)
    if json_out:
        Path(json_out).write_text(text + "\n")
    click.echo(text)


@click.command("routing-plot")
@click.option("--store", "store_dir", default=None, help=STORE_HELP)
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@click.option("--tasks", default=None, help="comma-separated task ids (default: every routing task)")
def routing_plot(store_dir, out, tasks) -> None:
    """Task x skill heatmap with a task dendrogram, as a PNG; beside it FILE.similar.json, each
    task's 5 nearest tasks by routing row (as GET /v1/tasks/{task}/similar ranks them)."""
    import torch

    from training.plot import routing_plot as draw

    store = _open_store(store_dir, install_default=True)
    info = store.inventory_info()
    records = [r for r in store.list_tasks() if r.kind == "routing" and r.status == "ready"]
    if tasks:
        wanted = tasks.split(",")
        records = [r for r in records if r.id in wanted]
    if not records:
        raise click.UsageError(f"no routing rows in {store.root}")
    logits = torch.stack([store.load_routing(r.id).float() for r in records])
    path = draw(logits, [r.id for r in records], out, routing=info.spec.routing,
                title=f"{info.backbone_name}: S={info.spec.n_skills}, h={info.spec.n_heads}, r={info.spec.rank}")
    click.echo(str(path))
    from training.plot import write_nearest

    click.echo(str(write_nearest(info, logits, [r.id for r in records], path)))
eval = eval_cmd  # server.cli mounts `training.cli.eval`
