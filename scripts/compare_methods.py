"""Few-shot comparison on held-out tasks of the procedural suite (docs/RESULTS.md).

For each held-out task, vocabulary and seed: k examples (seeded), adaptation with each method,
then greedy exact match and loss on a fixed test set (split "test", seed 0) that no method ever
sees during adaptation. The vocabularies (training.vocab): "train" (words inventories are trained
on), "heldout" (English words never trained on), "madeup" (made-up strings never trained on) draw
their k examples from split "valid"; "legacy" (the first suite's 24 words) from split "train", as
every figure before the open vocabulary was measured.

Methods: "zero" the bare backbone; "icl" the bare backbone with the k examples in its prompt
(training.icl); "plain-lora" a LoRA of the inventory's rank on the same linears trained on the k
examples (training.adapt); "mu0" zero-shot μ; "retrieve" the routing row retrieved from the
store's tasks (training.retrieve, no gradient step); "routing-r" a routing row trained from that
retrieved row (what a registration does); "routing", "mu", "full" as in training.adapt. Each
record holds the bytes a server stores for the task (the k examples' text for "icl"). Writes
results incrementally as JSON (one record per task x vocabulary x seed x method).

    .venv/bin/python -m scripts.compare_methods --store /tmp/default_store --tasks 4 --seeds 0,1,2 \
        --k 16 --n-test 16 --methods mu0,routing,mu,full --out /tmp/compare.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--label", default="", help="name of the inventory in the output (e.g. mhr, poly)")
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--tasks", type=int, default=16,
                    help="N tasks of --task-set, evenly spaced in its order (pairs first, then triples)")
    ap.add_argument("--task-set", choices=["heldout", "far"], default="heldout",
                    help="heldout: build_suite's 16 held-out tasks; far: training/far_heldout.py's FAR_HELDOUT")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--n-test", type=int, default=16)
    ap.add_argument("--methods", default="mu0,routing,mu,full")
    ap.add_argument("--vocabs", default="legacy",
                    help="comma-separated of train,heldout,madeup,legacy: the words of the examples and tests")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--max-steps", type=int, default=None,
                    help="go on past --steps while the held-out loss still falls, up to this many (routing)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--batch-size", type=int, default=None, help="default: the method's (training.adapt.DEFAULTS)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--holdout", type=float, default=0.25,
                    help="share of the k examples held out of training for early stopping (0: train on all)")
    ap.add_argument("--trained-share", type=float, default=1.0,
                    help="routing methods: the top share of the adapted linears whose routing is trained")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--autocast", choices=["auto", "bf16", "none"], default="auto",
                    help="bf16 autocast of retrieval and adaptation (training.precision; auto: CUDA and AMX CPUs)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from adapters_store.backbone import load_backbone
    from adapters_store.inject import RoutedModel
    from adapters_store.materialize import mu_weights, task_layers
    from adapters_store.store import Store
    from training.adapt import adapt
    from training.batching import DEFAULT_MAX_LENGTH
    from training.evaluate import evaluate_task
    from training.far_heldout import far_tasks
    from training.icl import ICL_MAX_LENGTH, icl_context
    from training.retrieve import retrieve
    from training.suite import build_suite, examples
    from training.vocab import VOCABS

    bb = load_backbone(args.backbone)
    store = Store(args.store)
    info, skills = store.load_inventory(bb.fingerprint)
    rm = RoutedModel(bb.model, info.spec)
    rm.load_skills(skills)
    store_itemsize = next(iter(skills.values())).element_size()
    skills = {k: v.float() for k, v in skills.items()}
    held = build_suite(0).heldout_tasks if args.task_set == "heldout" else far_tasks()
    tasks = [held[(i * len(held)) // args.tasks] for i in range(min(args.tasks, len(held)))]
    out = Path(args.out)
    records = json.loads(out.read_text()) if out.exists() else []
    done = {(r["inventory"], r["task"], r.get("vocab", "legacy"), r["seed"], r["method"]) for r in records}
    vocabs = args.vocabs.split(",")
    if not set(vocabs) <= set(VOCABS):
        ap.error(f"--vocabs: each of {VOCABS}")
    label = args.label or info.made_by.get("method", "?")
    candidates = {r.id: store.load_routing(r.id) for r in store.list_tasks() if r.kind == "routing" and r.status == "ready"}
    recipe = {"lr": args.lr, "max_steps": args.max_steps, "batch_size": args.batch_size,
              "eval_every": args.eval_every, "patience": args.patience,
              "autocast": args.autocast, "holdout_fraction": args.holdout}
    for task, vocab in [(t, v) for t in tasks for v in vocabs]:
        test = examples(task, args.n_test, seed=0, split="test", vocab=vocab)
        for seed in [int(s) for s in args.seeds.split(",")]:
            few = examples(task, args.k, seed=1000 + seed, split="train" if vocab == "legacy" else "valid",
                           vocab=vocab)
            for method in args.methods.split(","):
                key = (label, task.name, vocab, seed, method)
                if key in done or (method in ("mu0", "zero") and seed != int(args.seeds.split(",")[0])):
                    continue
                started = time.perf_counter()
                context, stored = "", 0
                if method == "mu0":
                    layers, params, metrics = mu_weights(info), 0, {}
                elif method in ("zero", "icl"):
                    layers, params, metrics = None, 0, {}
                    if method == "icl":
                        context = icl_context(few)
                        stored = len(context.encode())
                else:
                    if method in ("retrieve", "routing-r"):
                        res = retrieve(rm, info, {n: r for n, r in candidates.items() if n != task.name}, few,
                                       bb.tokenizer, seed=seed, autocast=args.autocast)
                    if method == "routing-r":
                        res = adapt(rm, info, skills, few, bb.tokenizer, method="routing", steps=args.steps,
                                    seed=seed, init_row=res.tensors["logits"], trained_share=args.trained_share,
                                    **recipe)
                    elif method != "retrieve":
                        share = {"trained_share": args.trained_share} if method == "routing" else {}
                        res = adapt(rm, info, skills, few, bb.tokenizer, method=method, steps=args.steps, seed=seed,
                                    **share, **recipe)
                    layers, params, metrics = task_layers(info, skills, res.kind, res.tensors), res.params, res.metrics
                    # as a server stores it: a routing row in float32, a LoRA in the skills' dtype
                    stored = sum(t.numel() * (4 if res.kind == "routing" else store_itemsize)
                                 for t in res.tensors.values())
                adapt_s = time.perf_counter() - started
                scores = evaluate_task(rm, layers, bb.tokenizer, test, context=context,
                                       max_length=ICL_MAX_LENGTH if context else DEFAULT_MAX_LENGTH)
                rec = {"inventory": label, "task": task.name, "vocab": vocab, "seed": seed, "method": method,
                       "k": args.k, "n_test": args.n_test, **scores, "params": params, "stored_bytes": stored,
                       "adapt_seconds": round(adapt_s, 2),
                       "steps_run": metrics.get("steps_run"), "best_step": metrics.get("best_step"),
                       "steps": args.steps, "trained_share": args.trained_share, **recipe}
                records.append(rec)
                out.write_text(json.dumps(records, indent=1))
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
