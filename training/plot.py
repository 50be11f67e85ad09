"""Routing plot: a task x skill heatmap ordered by a task dendrogram (matplotlib Agg, scipy).

    Z_plot[t, s] = mean over layers and heads of sigmoid(logits[t, l, k, s])   (hyper: raw values)
    dendrogram   = average-linkage clustering of the tasks' full routing vectors (L*h*S, cosine)
"""

from __future__ import annotations

from pathlib import Path

import torch


def plot_matrix(logits: torch.Tensor, routing: str = "sigmoid") -> torch.Tensor:
    """(T, L, h, S) -> (T, S) averaged allocation."""
    z = logits.double() if routing == "hyper" else torch.sigmoid(logits.double())
    return z.mean(dim=(1, 2))


def routing_plot(logits: torch.Tensor, task_names: list[str], out: str | Path, routing: str = "sigmoid",
                 title: str = "") -> Path:
    """Write one PNG: dendrogram of tasks (left) + heatmap of tasks x skills (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy.cluster.hierarchy import dendrogram, linkage

    T = logits.shape[0]
    if T != len(task_names):
        raise ValueError(f"{T} routing rows but {len(task_names)} task names")
    Z = plot_matrix(logits, routing).numpy()
    vectors = (logits.double() if routing == "hyper" else torch.sigmoid(logits.double())).reshape(T, -1).numpy()
    height = max(3.0, 0.22 * T + 1.0)
    fig, (ax_d, ax_h) = plt.subplots(1, 2, figsize=(10, height), gridspec_kw={"width_ratios": [1, 2.2]})
    if T >= 2:
        centred = vectors - vectors.mean(axis=0, keepdims=True)
        metric = "cosine" if (abs(centred).sum(axis=1) > 0).all() else "euclidean"
        tree = linkage(centred, method="average", metric=metric)
        d = dendrogram(tree, orientation="left", no_labels=True, ax=ax_d, color_threshold=0)
        order = d["leaves"]
    else:
        order = list(range(T))
    ax_d.axis("off")
    # dendrogram leaves go bottom to top; draw the heatmap rows in the same order
    img = ax_h.imshow(Z[order][::-1], aspect="auto", cmap="viridis", interpolation="nearest",
                      vmin=None if routing == "hyper" else 0.0, vmax=None if routing == "hyper" else 1.0)
    ax_h.set_yticks(range(T))
    ax_h.set_yticklabels([task_names[i] for i in order][::-1], fontsize=6)
    ax_h.set_xticks(range(Z.shape[1]))
    ax_h.set_xlabel("skill")
    fig.colorbar(img, ax=ax_h, fraction=0.04, label="mean routing probability" if routing != "hyper" else "embedding")
    fig.suptitle(title or "task x skill routing (mean over layers and heads)")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def nearest_tasks(weights: torch.Tensor, task_names: list[str], k: int = 5) -> dict[str, list[dict]]:
    """weights (T, L, h, S) inference weights -> {task: [{"id", "score"}, ...]}: each task's k
    nearest others by exact routing-row score (adapters_store.lora.similar), best first."""
    from adapters_store.lora.similar import rank_exact

    return {name: [{"id": task_names[j], "score": round(score, 6)}
                   for j, score in rank_exact(weights[i], weights, k, exclude=i)]
            for i, name in enumerate(task_names)}


def write_nearest(info, logits: torch.Tensor, task_names: list[str], plot_path: str | Path, k: int = 5) -> Path:
    """The routing plot's nearest-task data, as JSON beside it (FILE.similar.json)."""
    from adapters_store.store.atomic import atomic_write_json
    from adapters_store.store.materialize import task_weights

    weights = task_weights(info, logits.float())
    out = Path(plot_path).with_suffix(".similar.json")
    atomic_write_json(out, nearest_tasks(weights, task_names, k))
    return out
