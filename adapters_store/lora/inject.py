"""Wrap a backbone's target linears with RoutedLoRALinear and address them by name."""

from __future__ import annotations

import torch
from torch import nn

from adapters_store.lora.combine import materialize_many, materialize_stacked
from adapters_store.lora.layer import AdapterBatch, GatheredPlan, RoutedLoRALinear, SkillSpacePlan
from adapters_store.lora.spec import InventorySpec


def find_target_linears(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Qualified names of the nn.Linear modules whose last name component is in targets, in
    model order. Raises if a target matches nothing (a typo would otherwise adapt nothing)."""
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]
    found = {n.rsplit(".", 1)[-1] for n in names}
    missing = [t for t in targets if t not in found]
    if missing:
        raise ValueError(f"target modules {missing} match no nn.Linear in {type(model).__name__}")
    return names


class RoutedModel:
    """A frozen backbone whose target linears carry the inventory's skills.

    layers[l] is the l-th adapted linear; every per-layer tensor (routing logits (L, h, S),
    plans) is indexed in this order, which `names` records.
    """

    def __init__(self, model: nn.Module, spec: InventorySpec) -> None:
        self.model = model
        self.spec = spec
        self.batch = AdapterBatch()
        self.names = find_target_linears(model, spec.target_modules)
        self.layers: list[RoutedLoRALinear] = []
        for param in model.parameters():
            param.requires_grad_(False)
        for index, name in enumerate(self.names):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = RoutedLoRALinear(getattr(parent, attr), index, spec, self.batch)
            setattr(parent, attr, layer)
            self.layers.append(layer)
        # layers whose skills have one shape are combined together for one task (set_materialized)
        by_shape: dict[tuple, list[int]] = {}
        for index, layer in enumerate(self.layers):
            by_shape.setdefault((tuple(layer.lora_A.shape), tuple(layer.lora_B.shape)), []).append(index)
        self._shape_groups = list(by_shape.values())
        self._stacked: tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    # -- skills -------------------------------------------------------------------------------
    def skill_tensors(self) -> dict[str, torch.Tensor]:
        """{"<name>.A": (h, S, d_in/h, r), "<name>.B": (h, S, r, d_out/h)} for every layer."""
        out: dict[str, torch.Tensor] = {}
        for name, layer in zip(self.names, self.layers, strict=True):
            out[f"{name}.A"] = layer.lora_A.detach()
            out[f"{name}.B"] = layer.lora_B.detach()
        return out

    def load_skills(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, layer in zip(self.names, self.layers, strict=True):
            for key, param in ((f"{name}.A", layer.lora_A), (f"{name}.B", layer.lora_B)):
                if key not in tensors:
                    raise KeyError(f"inventory has no tensor {key!r}")
                if tuple(tensors[key].shape) != tuple(param.shape):
                    raise ValueError(f"{key}: shape {tuple(tensors[key].shape)} != {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensors[key])

    def reset_skills(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        for layer in self.layers:
            layer.reset_skills(gen)

    def skill_parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in (layer.lora_A, layer.lora_B)]

    def set_skills_trainable(self, trainable: bool) -> None:
        for p in self.skill_parameters():
            p.requires_grad_(trainable)

    def layer_dims(self) -> list[tuple[int, int]]:
        return [(layer.in_features, layer.out_features) for layer in self.layers]

    # -- per-forward assignment ----------------------------------------------------------------
    def set_weights(self, weights: torch.Tensor | None) -> None:
        """weights: (L, N, h, S) per-row mixing weights (skill-space path), None = no adapters."""
        self.batch.set(None if weights is None else SkillSpacePlan(weights))

    def set_gathered(self, A_tables: list[torch.Tensor], B_tables: list[torch.Tensor], index: torch.Tensor) -> None:
        """Materialised path: per layer (G, d_in, r) / (G, r, d_out) tables and a (N,) row index."""
        if len(A_tables) != len(self.layers) or len(B_tables) != len(self.layers):
            raise ValueError(f"need one table per adapted layer ({len(self.layers)})")
        self.batch.set(GatheredPlan(A_tables, B_tables, index))

    def set_materialized(self, weights: torch.Tensor, index: torch.Tensor | None = None, rows: int = 1,
                         frozen_layers: int = 0) -> None:
        """Few tasks, many rows (training, evaluation, retrieval): materialise each task's LoRA
        once per layer and gather it per row. weights: (G, L, h, S) or one task's (L, h, S);
        index: (N,) row -> task (default: `rows` rows of task 0). Differentiable in `weights`
        (and the skills): a routing row trains through the O(S*r*(d_in+d_out)) combine, not
        through per-token skill-space products (~4x fewer FLOPs in the adapters for one task).
        The first `frozen_layers` layers read detached weights: with the skills frozen too, nothing
        below the first differentiable layer joins the autograd graph, so a backward pass stops there.
        One task with no frozen layers (every routing step) takes `_materialize_one`: one combine per
        group of same-shape layers; otherwise each layer is combined on its own."""
        if weights.dim() == 3:
            weights = weights.unsqueeze(0)
        if weights.shape[1] != len(self.layers):
            raise ValueError(f"weights cover {weights.shape[1]} layers, the model has {len(self.layers)}")
        if index is None:
            index = torch.zeros(rows, dtype=torch.long, device=weights.device)
        if not 0 <= frozen_layers <= len(self.layers):
            raise ValueError(f"frozen_layers must be in [0, {len(self.layers)}], got {frozen_layers}")
        device = self.layers[0].lora_A.device
        if weights.shape[0] == 1 and frozen_layers == 0:  # one task: one combine per group of same-shape layers
            self.set_gathered(*self._materialize_one(weights[0].to(device)), index.to(device))
            return
        tables = [materialize_many(layer.lora_A, layer.lora_B,
                                   (weights[:, i].detach() if i < frozen_layers else weights[:, i])
                                   .to(layer.lora_A.device))
                  for i, layer in enumerate(self.layers)]
        self.set_gathered([a for a, _ in tables], [b for _, b in tables], index.to(device))

    def _materialize_one(self, w: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One task's tables (1, d_in, r) / (1, r, d_out) for every layer from w (L, h, S): one
        materialize_stacked per shape group instead of two einsums per layer (a routing step of
        the default inventory: 4 einsums instead of 240, forward and backward; bit-equal)."""
        A_tables: list[torch.Tensor] = [w] * len(self.layers)  # placeholders, all replaced
        B_tables: list[torch.Tensor] = [w] * len(self.layers)
        for layers, (A_sk, B_sk) in zip(self._shape_groups, self._stacked_skills(), strict=True):
            rows = torch.tensor(layers, device=w.device)
            A_t, B_t = materialize_stacked(A_sk, B_sk, w.index_select(0, rows))
            for j, layer in enumerate(layers):
                A_tables[layer], B_tables[layer] = A_t[j : j + 1], B_t[j : j + 1]
        return A_tables, B_tables

    def _stacked_skills(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per shape group: the skills stacked, A (Lg, h, S, d_in/h, r) and B (Lg, h, S, r, d_out/h).
        Stacked differentiably on every call while skills train; while they are frozen, stacked
        once and reused until a skill tensor changes (its storage or its in-place version)."""
        params = self.skill_parameters()
        if any(p.requires_grad for p in params):
            return [self._stack(layers) for layers in self._shape_groups]
        key = tuple((p.data_ptr(), p._version) for p in params)
        if self._stacked is None or self._stacked[0] != key:
            with torch.no_grad():
                self._stacked = (key, [self._stack(layers) for layers in self._shape_groups])
        return self._stacked[1]

    def _stack(self, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.stack([self.layers[i].lora_A for i in layers]),
                torch.stack([self.layers[i].lora_B for i in layers]))
