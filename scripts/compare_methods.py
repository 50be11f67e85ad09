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
retrieved row (what a registration does); "mix" a gradient-free mix of stored rows (LoraHub's idea,
training.mix_search); "arrow" zero-shot routing from the skills' own weights, per token (training.arrow);
"majority" always the examples' most frequent answer; "routing", "mu", "full"
as in training.adapt; "demos" the examples that fit the demonstration budget in the bare backbone's
prompt, "demos+routing" those and a routing row trained with them in context, "auto" the form
cross-validation chooses among them (training.auto, made as the server's registration makes it:
its record also holds the estimate, `cv_exact`, and the chosen form). Each
record holds the bytes a server stores for the task (the k examples' text for "icl"). Writes
results incrementally as JSON (one record per task x vocabulary x seed x method).

    .venv/bin/python -m scripts.compare_methods --store /tmp/default_store --tasks 4 --seeds 0,1,2 \
        --k 16 --n-test 16 --methods mu0,routing,mu,full --out /tmp/compare.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--label", default="", help="name of the inventory in the output (e.g. mhr, poly)")
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--tasks", type=int, default=16,
                    help="N tasks of --task-set, evenly spaced in its order (pairs first, then triples)")
    ap.add_argument("--task-set", choices=["heldout", "far", "bigbench", "real"], default="heldout",
                    help="heldout: build_suite's 16 held-out tasks; far: training/far_heldout.py's FAR_HELDOUT; "
                         "bigbench: the BIG-bench suite's held-out (BIG-Bench Hard) tasks (training/bigbench.py); "
                         "real: the hand-written small real tasks (training/real_tasks.py)")
    ap.add_argument("--demonstration-tokens", type=int, default=None,
                    help="demos, demos+routing, auto: the demonstration budget (default: the server's)")
    ap.add_argument("--folds", type=int, default=None, help="auto: cross-validation folds (default: training.auto's)")
    ap.add_argument("--max-length", type=int, default=None,
                    help="prompt + answer tokens in adaptation and evaluation "
                         "(default: training.batching.FEW_SHOT_MAX_LENGTH)")
    ap.add_argument("--task-ids", default="",
                    help="comma-separated task names to run instead of --tasks evenly spaced ones")
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
    ap.add_argument("--batch-size", type=int, default=None,
                    help="default: the method's (training.adapt_config.DEFAULTS)")
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="padded tokens a training batch may hold (0: no cap; default: the method's)")
    ap.add_argument("--screen-tokens", type=int, default=None,
                    help="retrieval: padded tokens of the screen's examples (0: no cap; default: SCREEN_TOKENS)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--select", choices=["loss", "exact"], default=None,
                    help="what early stopping keeps: the held-out loss or exact match (default: AdaptConfig's)")
    ap.add_argument("--holdout", type=float, default=None,
                    help="share of the k examples held out of training for early stopping (0: train on all; "
                         "default: AdaptConfig's, none from LONG_FROM examples on)")
    ap.add_argument("--trained-share", type=float, default=1.0,
                    help="routing methods: the top share of the adapted linears whose routing is trained")
    ap.add_argument("--arrow-top-k", type=int, default=4, help="arrow: skills kept per token and head")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--autocast", choices=["auto", "bf16", "none"], default="auto",
                    help="bf16 autocast of retrieval and adaptation (training.precision; auto: CUDA and AMX CPUs)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from adapters_store.backbone.load import load_backbone
    from adapters_store.lora.inject import RoutedModel
    from adapters_store.store.directory import DirectoryStore
    from adapters_store.store.materialize import mu_weights, task_layers
    from training.adapt import Adaptation, adapt
    from training.adapt_config import AdaptConfig
    from training.arrow import arrow_score_rows
    from training.auto import DEFAULT_FOLDS, AutoAdaptation
    from training.batching import FEW_SHOT_MAX_LENGTH
    from training.bigbench import load_cache
    from training.data import Example
    from training.demos import DEFAULT_DEMONSTRATION_TOKENS, demonstration_text, select_demonstrations
    from training.evaluate import score_rows
    from training.far_heldout import far_tasks
    from training.icl import icl_context, icl_max_length
    from training.mix_search import gradient_free_mix
    from training.real_tasks import REAL_TASKS, real_task_examples
    from training.retrieve import Retrieval, RetrievedAdaptation
    from training.suite import build_suite, examples
    from training.vocab import VOCABS

    bb = load_backbone(args.backbone)
    store = DirectoryStore(args.store)
    info, skills = store.load_inventory(bb.fingerprint)
    rm = RoutedModel(bb.model, info.spec)
    rm.load_skills(skills)
    store_itemsize = next(iter(skills.values())).element_size()
    skills = {k: v.float() for k, v in skills.items()}
    max_length = args.max_length or FEW_SHOT_MAX_LENGTH
    if args.task_set == "bigbench":
        held_bb = {t.id: t for t in load_cache() if t.heldout}
        names = sorted(held_bb)
        args.vocabs = "task"  # real tasks bring their own words
    elif args.task_set == "real":
        names = list(REAL_TASKS)
        args.vocabs = "task"
    else:
        by_name = {t.name: t for t in (build_suite(0).heldout_tasks if args.task_set == "heldout" else far_tasks())}
        names = list(by_name)
    if args.task_set == "real" and not args.task_ids:
        args.task_ids = ",".join(names)  # every one of them: the set is small
    if args.task_ids:
        unknown = sorted(set(args.task_ids.split(",")) - set(names))
        if unknown:
            ap.error(f"--task-ids: not held-out tasks of this set: {unknown}")
        names = args.task_ids.split(",")
    else:
        names = [names[(i * len(names)) // args.tasks] for i in range(min(args.tasks, len(names)))]

    def case(name: str, vocab: str, seed: int) -> tuple[list[Example], list[dict]]:
        """The k examples a user gives (seeded) and the fixed test rows."""
        if args.task_set == "bigbench":
            t = held_bb[name]
            pool = t.examples("train") + t.examples("valid")
            few = random.Random(f"{name}/{seed}").sample(pool, min(args.k, len(pool)))
            return few, t.split_rows("test")[: args.n_test]
        if args.task_set == "real":
            few, test_examples = real_task_examples(name, args.k, seed)
            return few, [ex.to_dict() for ex in test_examples[: args.n_test]]
        task = by_name[name]
        few = examples(task, args.k, seed=1000 + seed, split="train" if vocab == "legacy" else "valid", vocab=vocab)
        test = [ex.to_dict() for ex in examples(task, args.n_test, seed=0, split="test", vocab=vocab)]
        return few, test

    out = Path(args.out)
    records = json.loads(out.read_text()) if out.exists() else []
    done = {(r["inventory"], r["task"], r.get("vocab", "legacy"), r["seed"], r["method"]) for r in records}
    vocabs = args.vocabs.split(",")
    if args.task_set not in ("bigbench", "real") and not set(vocabs) <= set(VOCABS):
        ap.error(f"--vocabs: each of {VOCABS}")
    label = args.label or info.made_by.get("method", "?")
    candidates = {r.id: store.load_routing(r.id) for r in store.list_tasks()
                  if r.kind == "routing" and r.status == "ready"}
    screen = {} if args.screen_tokens is None else {"screen_tokens": args.screen_tokens}
    recipe = {"lr": args.lr, "max_steps": args.max_steps, "batch_size": args.batch_size,
              "step_tokens": args.step_tokens, "eval_every": args.eval_every, "patience": args.patience,
              **({} if args.select is None else {"select": args.select}),
              "autocast": args.autocast, "holdout_fraction": args.holdout, "max_length": max_length}
    budget = args.demonstration_tokens if args.demonstration_tokens is not None else DEFAULT_DEMONSTRATION_TOKENS

    def registration(method: str, few: list, others: dict, seed: int):
        """demos / demos+routing / auto as the server's registration runs them (server/jobs/adaptation.py)."""
        def trained(form: str, examples: list, demos: list):
            config = AdaptConfig(method="full" if form == "full" else "routing", steps=args.steps, seed=seed,
                                 autocast=args.autocast, max_length=max_length)
            if form == "routing" and others:
                retrieval = Retrieval(rm, info, others, examples, bb.tokenizer, seed=seed, autocast=args.autocast,
                                      max_length=max_length, **screen)
                return RetrievedAdaptation(retrieval, lambda row, known: Adaptation(
                    rm, info, skills, examples, bb.tokenizer, config, init_row=row, init_eval=known))
            return Adaptation(rm, info, skills, examples, bb.tokenizer, config, demonstrations=demos or None)

        if method == "demos+routing":
            run = trained("demos+routing", few, select_demonstrations(few, bb.tokenizer, budget))
        else:
            run = AutoAdaptation(rm, info, skills, few, bb.tokenizer, trained, demonstration_tokens=budget, seed=seed,
                                 folds=args.folds or DEFAULT_FOLDS, steps=args.steps, autocast=args.autocast,
                                 forms=("demos",) if method == "demos" else None)
        while run.step():
            pass
        return run.result()

    for name, vocab in [(n, v) for n in names for v in vocabs]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            few, test = case(name, vocab, seed)
            for method in args.methods.split(","):
                key = (label, name, vocab, seed, method)
                if key in done or (method in ("mu0", "zero", "arrow") and seed != int(args.seeds.split(",")[0])):
                    continue
                started = time.perf_counter()
                context, stored, answer = "", 0, None
                if method == "majority":  # always the examples' most frequent answer
                    layers, params, metrics = None, 0, {}
                    answer = Counter(ex.output for ex in few).most_common(1)[0][0]
                    stored = len(answer.encode())
                elif method == "mu0":
                    layers, params, metrics = mu_weights(info), 0, {}
                elif method in ("zero", "icl", "arrow"):
                    layers, params, metrics = None, 0, {}
                    if method == "icl":
                        context = icl_context(few)
                        stored = len(context.encode())
                elif method in ("demos", "demos+routing", "auto"):
                    others = {n: r for n, r in candidates.items() if n != name}
                    res = registration(method, few, others, seed)
                    layers = None if res.kind == "demos" else task_layers(info, skills, res.kind, res.tensors)
                    params, metrics = res.params, res.metrics
                    demos = [Example(name, d["input"], d["output"]) for d in res.demonstrations]
                    context = demonstration_text(demos)
                    stored = len(context.encode()) + sum(t.numel() * 4 for t in res.tensors.values())
                else:
                    if method == "mix":
                        res = gradient_free_mix(rm, info, {n: r for n, r in candidates.items() if n != name}, few,
                                                bb.tokenizer, seed=seed, autocast=args.autocast, max_length=max_length)
                    if method in ("retrieve", "routing-r"):
                        retrieval = Retrieval(rm, info, {n: r for n, r in candidates.items() if n != name}, few,
                                              bb.tokenizer, seed=seed, autocast=args.autocast, max_length=max_length,
                                              **screen)
                        while retrieval.step():
                            pass
                        res = retrieval.result()
                    if method == "routing-r":  # as a registration: from the retrieved row and its known loss
                        config = AdaptConfig(method="routing", steps=args.steps, seed=seed,
                                             trained_share=args.trained_share, **recipe)
                        res = adapt(rm, info, skills, few, bb.tokenizer, config, init_row=res.tensors["logits"],
                                    init_eval=retrieval.known_eval())
                    elif method not in ("retrieve", "mix"):
                        share = {"trained_share": args.trained_share} if method == "routing" else {}
                        config = AdaptConfig(method=method, steps=args.steps, seed=seed, **share, **recipe)
                        res = adapt(rm, info, skills, few, bb.tokenizer, config)
                    layers, params, metrics = task_layers(info, skills, res.kind, res.tensors), res.params, res.metrics
                    # as a server stores it: a routing row in float32, a LoRA in the skills' dtype
                    stored = sum(t.numel() * (4 if res.kind == "routing" else store_itemsize)
                                 for t in res.tensors.values())
                adapt_s = time.perf_counter() - started
                if answer is not None:
                    hits = sum(answer.strip() in [a.strip() for a in r.get("targets") or [r["output"]]] for r in test)
                    scores = {"exact_match": hits / len(test)}
                    if any(r.get("choices") for r in test):
                        scores["ll_acc"] = scores["exact_match"]
                elif method == "arrow":
                    scores = arrow_score_rows(rm, bb.tokenizer, test, top_k=args.arrow_top_k, max_length=max_length)
                else:
                    # after in-context examples an answer ends at its first newline, as the server's
                    # stop string ends it after a task's demonstrations (training/demos.py)
                    scores = score_rows(rm, layers, bb.tokenizer, test, context=context,
                                        max_length=icl_max_length(bb.model) if context else max_length,
                                        first_line=bool(context))
                rec = {"inventory": label, "task": name, "vocab": vocab, "seed": seed, "method": method,
                       "k": args.k, "n_test": len(test), **scores, "params": params, "stored_bytes": stored,
                       "adapt_seconds": round(adapt_s, 2),
                       **{f: metrics[f] for f in ("chosen", "cv_exact", "cv_exact_n", "majority_exact", "estimate",
                                                  "demonstrations") if f in metrics},
                       "steps_run": metrics.get("steps_run"), "best_step": metrics.get("best_step"),
                       "steps": args.steps, "trained_share": args.trained_share, **screen, **recipe}
                records.append(rec)
                out.write_text(json.dumps(records, indent=1))
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
