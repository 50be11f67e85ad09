"""Per-slot LoRA tables: each row's adapter, written once into its KV slot's tables.

The runner fuses linears that read the same input (q/k/v -> "qkv", gate/up -> "gate_up"), and
the routed LoRA is fused the same way. For group g of layer l, slot s holds

    A[l][g][s]  (d_in, m*r)       the members' A_t side by side
    B[l][g][s]  (m*r, d_out)      member j's B_t * scale in rows j*r.. and its own output columns
                                  (block diagonal: the other columns stay zero)

so for a row in slot s:   out += x @ A[l][g][s] @ B[l][g][s]   =   each member's x @ A_t @ B_t * scale.

A row's tables are written when it takes its slot, and read by every forward the row is in: the
decode group as one bmm pair over slots [:n] (a view while slots are dense), each prompt chunk as
two GEMMs against its slot's tables; with the native kernel (lora_kernel.py), the decode rows and
every chunk's tokens in one call per group. So a step costs the same whatever the number of distinct
tasks among its rows, and no per-step plan is built. Rows without an adapter (`base`) have zero
A; a step where no row has an adapter skips the LoRA work entirely.

Writing a row's tables:
    write_routing(slot, w)  a routed task from its mixing weights w (L, h, S) and the skills: the
                            combine (adapters_store.lora.combine.materialize_stacked) of every layer at
                            once, per group member, straight into the slot (no materialised
                            adapter anywhere: the adapter cache keeps only routing rows)
    write(slot, layers)     a plain LoRA (per linear (A_t, B_t)), e.g. a task trained with "mu"
A group kind laid out the same way in every layer (the Llama runner's) is one buffer
(L, slots, ...), so a write, copy or clear of a slot is a few ops whatever the number of layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from adapters_store.lora.combine import materialize_stacked
from server.engines.native.core.step import StepBatch
from server.engines.native.kernels import lora_kernel
from server.engines.native.tuning import resolve_switch


@dataclass(frozen=True)
class Member:
    """One adapted linear inside a fused group."""

    index: int  # its position in the adapter's layers (the inventory's layer order)
    start: int  # first output column in the fused linear
    width: int  # its d_out
    order: torch.Tensor | None = None  # the fused linear's order of this member's outputs (None: as is)

    def shape_key(self) -> tuple:
        return (self.start, self.width, None if self.order is None else tuple(self.order.tolist()))


@dataclass(frozen=True)
class Group:
    d_in: int
    d_out: int  # the fused linear's output width
    members: tuple[Member, ...]

    def shape_key(self) -> tuple:
        return (self.d_in, self.d_out, tuple(m.shape_key() for m in self.members))

    def members_columns(self) -> list[tuple[int, int]]:
        """(first output column, width) of each member, in the tables' order."""
        return [(m.start, m.width) for m in self.members]


@dataclass
class _Skills:
    """The skills of member j of a group, stacked over the layers of its buffers A, B (L, slots, ...)."""

    A: torch.Tensor
    B: torch.Tensor
    j: int
    member: Member
    index: torch.Tensor  # (L,) the member's adapted-linear index in each layer
    A_sk: torch.Tensor  # (L, h, S, d_in/h, r)
    B_sk: torch.Tensor  # (L, h, S, r, d_out/h)


class SlotLoRA:
    def __init__(self, groups: list[list[Group | None]], *, slots: int, rank: int, scale: float,
                 dtype: torch.dtype, device: torch.device | str = "cpu", kernel: str = "auto") -> None:
        """groups[l][g]: group g of decoder layer l (None: nothing adapted there). kernel: the
        decode group's LoRA in the native CPU kernel (lora_kernel.py): auto | on | off."""
        self.groups, self.slots, self.rank, self.scale = groups, slots, rank, scale
        self.dtype, self.device = dtype, torch.device(device)
        n_layers = len(groups)
        width = max((len(row) for row in groups), default=0)
        self.A: list[list[torch.Tensor | None]] = [[None] * len(row) for row in groups]
        self.B: list[list[torch.Tensor | None]] = [[None] * len(row) for row in groups]
        self._stacks: list[tuple[int, Group, torch.Tensor, torch.Tensor]] = []  # (column g, its group, A, B)
        for g in range(width):
            column = [row[g] if g < len(row) else None for row in groups]
            present = [c for c in column if c is not None]
            if not present:
                continue
            if len(present) == n_layers and len({c.shape_key() for c in present}) == 1:
                first = present[0]
                A = self._zeros(n_layers, slots, first.d_in, len(first.members) * rank)
                B = self._zeros(n_layers, slots, len(first.members) * rank, first.d_out)
                self._stacks.append((g, first, A, B))
                for layer in range(n_layers):
                    self.A[layer][g], self.B[layer][g] = A[layer], B[layer]
                continue
            for layer, c in enumerate(column):
                if c is not None:
                    self.A[layer][g] = self._zeros(slots, c.d_in, len(c.members) * rank)
                    self.B[layer][g] = self._zeros(slots, len(c.members) * rank, c.d_out)
        self.adapted = [False] * slots
        # the kernel's constant arguments per (layer, group): tables and member columns
        runs = resolve_switch("lora_kernel", kernel, lambda: lora_kernel.why_not(self.device, dtype, rank))
        self.kernel = lora_kernel.load() if runs else None
        self.kernel_args: list[list[lora_kernel.TableArgs | None]] = [
            [None if g is None else lora_kernel.TableArgs(  # a, b: set wherever g is
                cast(torch.Tensor, a), cast(torch.Tensor, b), g.members_columns(), rank, g.d_in, g.d_out)
             for g, a, b in zip(layer, a_row, b_row, strict=True)]
            for layer, a_row, b_row in zip(groups, self.A, self.B, strict=True)] if self.kernel else []
        self.n_linears = sum(len(g.members) for layer in groups for g in layer if g is not None)
        self._skills: list[_Skills] | None = None

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for rows in (*self.A, *self.B) for t in rows if t is not None)

    def _tables(self):
        """(group, A (slots, ...), B (slots, ...)) of every adapted group of every layer."""
        for layer, a_row, b_row in zip(self.groups, self.A, self.B, strict=True):
            for g, a, b in zip(layer, a_row, b_row, strict=True):
                if g is not None:
                    yield g, a, b

    def _unstacked(self):
        stacked = {g for g, _, _, _ in self._stacks}
        for layer, a_row, b_row in zip(self.groups, self.A, self.B, strict=True):
            for col, (g, a, b) in enumerate(zip(layer, a_row, b_row, strict=True)):
                if g is not None and col not in stacked:
                    yield g, a, b

    # -- writing a slot ------------------------------------------------------------------------
    def clear(self, slot: int) -> None:
        """The slot's row runs without an adapter."""
        if self.adapted[slot]:
            for _, _, A, _ in self._stacks:
                A[:, slot].zero_()
            for _, a, _ in self._unstacked():
                a[slot].zero_()
        self.adapted[slot] = False

    def write(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """layers[i] = (A_t (d_in, r), B_t (r, d_out)) of adapted linear i (inventory order)."""
        if len(layers) != self.n_linears:
            raise ValueError(f"the adapter has {len(layers)} layers, the inventory {self.n_linears}")
        r = self.rank
        for g, _, _ in self._tables():
            for m in g.members:
                a_t, b_t = layers[m.index]
                if a_t.shape != (g.d_in, r) or b_t.shape != (r, m.width):
                    raise ValueError(f"adapter layer {m.index}: shapes {tuple(a_t.shape)}, {tuple(b_t.shape)} "
                                     f"!= ({g.d_in}, {r}), ({r}, {m.width})")
        with torch.no_grad():
            for col, first, A, B in self._stacks:
                for j, m in enumerate(first.members):
                    index = [row[col].members[j].index for row in self.groups]  # type: ignore[union-attr]
                    a_t = torch.stack([layers[i][0] for i in index])  # (L, d_in, r)
                    b_t = torch.stack([layers[i][1] for i in index])  # (L, r, width)
                    self._put(A, B, slot, j, m, a_t, b_t)
            for g, a, b in self._unstacked():
                for j, m in enumerate(g.members):
                    a_t, b_t = layers[m.index]
                    self._put(a.unsqueeze(0), b.unsqueeze(0), slot, j, m, a_t[None], b_t[None])
        self.adapted[slot] = True

    def _put(self, A: torch.Tensor, B: torch.Tensor, slot: int, j: int, m: Member,
             a_t: torch.Tensor, b_t: torch.Tensor) -> None:
        """Member j's tables (L, d_in, r), (L, r, width) into slot `slot` of (L, slots, ...) buffers."""
        r = self.rank
        if m.order is not None:
            b_t = b_t[:, :, m.order]
        A[:, slot, :, j * r : (j + 1) * r] = a_t
        B[:, slot, j * r : (j + 1) * r, m.start : m.start + m.width] = b_t * self.scale

    def set_skills(self, skills: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The inventory's skills, per adapted linear (A (h, S, d_in/h, r), B (h, S, r, d_out/h)),
        for write_routing; kept stacked per group member (over the layers of a stacked buffer)
        in the combine's dtype (_combine_dtype)."""
        if len(skills) != self.n_linears:
            raise ValueError(f"{len(skills)} skill pairs for {self.n_linears} adapted linears")
        # (A, B buffers (L, slots, ...), the group, its column in every layer's row; None: one table)
        targets: list[tuple[torch.Tensor, torch.Tensor, Group, int | None]] = [
            (A, B, first, col) for col, first, A, B in self._stacks]
        targets += [(a.unsqueeze(0), b.unsqueeze(0), g, None) for g, a, b in self._unstacked()]
        entries = []
        with torch.no_grad():
            for A, B, group, col in targets:
                for j, m in enumerate(group.members):
                    index = [m.index] if col is None else [row[col].members[j].index for row in self.groups]  # type: ignore[union-attr]
                    A_sk = torch.stack([skills[i][0] for i in index]).to(self.device, self._combine_dtype)
                    B_sk = torch.stack([skills[i][1] for i in index]).to(self.device, self._combine_dtype)
                    entries.append(_Skills(A, B, j, m, torch.tensor(index, device=self.device), A_sk, B_sk))
        self._skills = entries

    @property
    def _combine_dtype(self) -> torch.dtype:
        """A routed row's tables are combined in float32 on a CPU, then rounded once into the
        tables' dtype: a CPU's bfloat16 einsum is slower than its float32 one (the 64 rows of
        serve_bench's workload took 0.22 s to write against 0.12 s, bench/step_split.py) and rounds
        every partial sum."""
        return torch.float32 if self.device.type == "cpu" else self.dtype

    @property
    def routes(self) -> bool:
        """write_routing can be used (set_skills was called)."""
        return self._skills is not None

    def write_routing(self, slot: int, weights: torch.Tensor) -> None:
        """weights (n_linears, h, S): a routed task's mixing weights; its tables are combined from
        the skills straight into the slot."""
        if self._skills is None:
            raise RuntimeError("write_routing needs the skills (set_skills)")
        if weights.dim() != 3 or weights.shape[0] != self.n_linears:
            raise ValueError(f"routing weights of shape {tuple(weights.shape)} for {self.n_linears} linears")
        w = weights.to(self.device, self._combine_dtype)
        with torch.no_grad():
            for e in self._skills:
                if e.A_sk.shape[1:3] != w.shape[1:]:
                    raise ValueError(f"routing weights {tuple(w.shape[1:])} do not match the skills' "
                                     f"{tuple(e.A_sk.shape[1:3])}")
                a_t, b_t = materialize_stacked(e.A_sk, e.B_sk, w.index_select(0, e.index))
                self._put(e.A, e.B, slot, e.j, e.member, a_t, b_t)
        self.adapted[slot] = True

    def copy(self, src: int, dst: int) -> None:
        if src == dst:
            return
        if not self.adapted[src]:
            self.clear(dst)
            return
        for _, _, A, B in self._stacks:
            A[:, dst].copy_(A[:, src])
            B[:, dst].copy_(B[:, src])
        for _, a, b in self._unstacked():
            a[dst].copy_(a[src])
            b[dst].copy_(b[src])
        self.adapted[dst] = True

    # -- reading -------------------------------------------------------------------------------
    def step(self, batch: StepBatch) -> SlotLoRAStep | None:
        """The LoRA work of one forward, or None when none of its rows has an adapter."""
        decode_on = any(self.adapted[s] for s in batch.decode_slots)
        chunks = [(c.offset, len(c.item.tokens), c.item.slot) for c in batch.chunks if self.adapted[c.item.slot]]
        if not decode_on and not chunks:
            return None
        n = batch.n_decode if decode_on else 0
        gather = None if batch.decode_contiguous else batch.decode_slots_t
        if self.kernel is None:
            return SlotLoRAStep(self, n, gather, chunks)
        # the kernel takes the decode rows and every chunk's tokens in one call per group (a chunk's
        # tables stay in cache across its tokens): cheaper than two GEMMs a chunk for long chunks too
        # (bench/lora_step.py --chunk 45|128; docs/history/lora-kernel.md)
        if not chunks:
            return SlotLoRAStep(self, n, gather, [])
        rows = list(range(n)) + [t for offset, length, _ in chunks for t in range(offset, offset + length)]
        slots = batch.decode_slots[:n] + [s for _, length, s in chunks for _ in range(length)]
        step = SlotLoRAStep(self, len(rows), torch.tensor(slots, dtype=torch.int64), [])
        step.rows, step.row_end = torch.tensor(rows, dtype=torch.int64), max(rows) + 1
        return step


def write_adapter(lora: SlotLoRA | None, slot: int, adapter) -> None:
    """The row in `slot` runs with `adapter` (server.adapter_cache.types.Adapter; None = base): a routed
    task from its routing weights, a plain LoRA from its layers."""
    if adapter is None:
        if lora is not None:
            lora.clear(slot)
        return
    if lora is None:
        raise RuntimeError("adapters requested but the backbone has no skill inventory")
    if adapter.weights is not None and adapter.kind == "routing" and lora.routes:
        lora.write_routing(slot, adapter.weights)
    elif adapter.layers:
        lora.write(slot, adapter.layers)
    else:
        raise ValueError(f"adapter of task {adapter.task!r} holds neither routing weights nor LoRA layers")


class SlotLoRAStep:
    """Adds the rows' LoRA outputs to a fused linear's output, in place."""

    def __init__(self, lora: SlotLoRA, n_decode: int, gather: torch.Tensor | None,
                 chunks: list[tuple[int, int, int]]) -> None:
        """n_decode rows [0, n) in slots gather (None: slot = row); chunks (offset, length, slot).
        With the kernel, `rows` may list the rows it takes (then n counts them, gather their slots)."""
        self.lora, self.n, self.gather, self.chunks = lora, n_decode, gather, chunks
        self.rows: torch.Tensor | None = None
        self.row_end: int | None = None

    def apply(self, layer: int, group: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """x (T, d_in), out (T, d_out) of group `group` of `layer`:  out[t] += x[t] @ A[slot(t)] @ B[slot(t)]."""
        A, B = self.lora.A[layer][group], self.lora.B[layer][group]
        if A is None or B is None:
            return
        dtype = self.lora.dtype
        n = self.n
        if n and self.lora.kernel is not None:
            args = self.lora.kernel_args[layer][group]
            assert args is not None
            args.rows(self.lora.kernel, x, out, n, self.gather, self.rows, self.row_end)
        elif n:
            a, b = ((A[:n], B[:n]) if self.gather is None
                    else (A.index_select(0, self.gather), B.index_select(0, self.gather)))
            u = torch.bmm(x[:n].unsqueeze(1).to(dtype), a)  # (n, 1, m*r)
            if out.dtype == dtype:
                out[:n].unsqueeze(1).baddbmm_(u, b)
            else:  # in-place add casts to out's dtype: no separate conversion op
                out[:n].add_(torch.bmm(u, b).squeeze(1))
        for offset, length, slot in self.chunks:
            xs = x[offset : offset + length].to(dtype)
            if out.dtype == dtype:
                out[offset : offset + length].addmm_(xs @ A[slot], B[slot])
            else:
                out[offset : offset + length].add_((xs @ A[slot]) @ B[slot])
