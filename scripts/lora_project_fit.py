"""The fit table of `import-lora --project`: how well a routing row approximates a LoRA, and what
the task's exact match is before (the LoRA) and after (the fitted row), default backbone, shipped
inventory, held-out procedural examples.

Per shipped task, two LoRAs are imported (adapters_store.interop.lora_import) and projected
(adapters_store.interop.lora_project.fit_routing):
    export     the routed task exported as PEFT (`polyserve export`): the round trip, whose import
               must match the routed task exactly; its projection can recover the row
    rank-4     the same update truncated to rank 4 by SVD: a LoRA the inventory did not make
Columns: fit error (relative Frobenius error of the updates) at μ and at the fit, exact match of
the routed task, of the imported LoRA (before) and of the fitted row (after), and of μ.

    .venv/bin/python -m scripts.lora_project_fit --tasks caesar,double,dedupe.sum --n 16 --steps 300
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
import torch

from adapters_store.interop.lora_import import backbone_aliases, convert, read_dir
from adapters_store.interop.lora_project import fit_routing
from adapters_store.interop.peft_io import export_peft_lora
from adapters_store.store.materialize import mu_weights, task_layers, task_weights
from training.cli import _open_store, _routed
from training.evaluate import evaluate_task
from training.suite import examples, parse_task


def truncate(lora: dict[str, torch.Tensor], names: list[str], rank: int) -> dict[str, torch.Tensor]:
    """Each linear's update A B truncated to `rank` by SVD, as factors padded to the same width."""
    out = {}
    for name in names:
        A, B = lora[f"{name}.A"], lora[f"{name}.B"]
        U, S, Vh = torch.linalg.svd(A @ B, full_matrices=False)
        A2, B2 = torch.zeros_like(A), torch.zeros_like(B)
        A2[:, :rank] = U[:, :rank] * S[:rank]
        B2[:rank] = Vh[:rank]
        out[f"{name}.A"], out[f"{name}.B"] = A2, B2
    return out


def layers_of(info, lora: dict[str, torch.Tensor]) -> list:
    return [(lora[f"{n}.A"], lora[f"{n}.B"]) for n in info.layer_names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="caesar,double,dedupe.sum")
    ap.add_argument("--n", type=int, default=16, help="held-out examples per task")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    store = _open_store(str(Path(tempfile.mkdtemp(prefix="polyserve-fit-")) / "store"), install_default=True)
    bb, rm, info, skills = _routed(store, "default")
    tmp = Path(tempfile.mkdtemp(prefix="polyserve-fit-peft-"))
    rows = []
    for task in args.tasks.split(","):
        exs = examples(parse_task(task), args.n, seed=0, split="test")
        record = store.get_task(task)
        routed_w = task_weights(info, store.load_weights(record)["logits"].float())
        em_routed = evaluate_task(rm, routed_w, bb.tokenizer, exs)["exact_match"]
        em_mu = evaluate_task(rm, mu_weights(info), bb.tokenizer, exs)["exact_match"]
        export_peft_lora(store, task, tmp / task, base_model=info.backbone_name)
        config, tensors = read_dir(tmp / task)
        exported = convert(config, tensors, info, backbone_aliases(info))
        ref = task_layers(info, skills, "routing", store.load_weights(record))
        same = all(torch.allclose(a.float(), c.float(), atol=1e-5) and torch.allclose(b.float(), d.float(), atol=1e-5)
                   for (a, b), (c, d) in zip(ref, layers_of(info, exported), strict=True))
        for variant, lora in (("export", exported), ("rank-4", truncate(exported, list(info.layer_names), 4))):
            em_before = evaluate_task(rm, layers_of(info, lora), bb.tokenizer, exs)["exact_match"]
            started = time.perf_counter()
            logits, fit = fit_routing(info, skills, lora, steps=args.steps)
            seconds = time.perf_counter() - started
            em_after = evaluate_task(rm, task_weights(info, logits), bb.tokenizer, exs)["exact_match"]
            rows.append((task, variant, fit["error_mu"], fit["error"], seconds, em_routed, em_before, em_after, em_mu,
                         same if variant == "export" else None))
            print(rows[-1], flush=True)
    print(f"\ndefault backbone, shipped inventory, {args.n} held-out examples per task, {args.steps} Adam steps, "
          f"{args.threads} threads")
    print("| task | LoRA | fit error at μ | fit error | fit s | EM routed task | EM LoRA (before) "
          "| EM fitted row (after) | EM μ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for task, variant, e_mu, e, s, em_r, em_b, em_a, em_mu, same in rows:
        note = " (import = routed task exactly)" if same else ""
        print(f"| {task} | {variant}{note} | {e_mu:.3f} | {e:.3f} | {s:.1f} | {em_r:.3f} | {em_b:.3f} | {em_a:.3f} "
              f"| {em_mu:.3f} |")


if __name__ == "__main__":
    main()
