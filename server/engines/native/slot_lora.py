"""Per-slot LoRA tables: each row's adapter, written once into its KV slot's tables.

The executor fuses linears that read the same input (q/k/v -> "qkv", gate/up -> "gate_up"), and
the routed LoRA is fused the same way. For group g of layer l, slot s holds

    A[l][g][s]  (d_in, m*r)       the members' A_t side by side
    B[l][g][s]  (m*r, d_out)      member j's B_t * scale in rows j*r.. and its own output columns
                                  (block diagonal: the other columns stay zero)

so for a row in slot s:   out += x @ A[l][g][s] @ B[l][g][s]   =   each member's x @ A_t @ B_t * scale.

A row's tables are written when it takes its slot (`write`: from the adapter's materialised
layers, or straight from its routing weights and the skills, `write_routing`), copied with the
slot (`copy`), and read by every forward the row is in: the decode group as one bmm pair over
slots [:n] (a view while slots are dense), each prompt chunk as two GEMMs against its slot's
tables. So a step costs the same whatever the number of distinct tasks among its rows, and no
per-step plan is built. Rows without an adapter (`base`) have zero A; a step where no row has an
adapter skips the LoRA work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engines.native.step import StepBatch


@dataclass(frozen=True)
class Member:
    """One adapted linear inside a fused group."""

    index: int  # its position in the adapter's layers (the inventory's layer order)
    start: int  # first output column in the fused linear
    width: int  # its d_out
    order: torch.Tensor | None = None  # the fused linear's order of this member's outputs (None: as is)


@dataclass(frozen=True)
class Group:
    d_in: int
    d_out: int  # the fused linear's output width
    members: tuple[Member, ...]


class SlotLoRA:
    def __init__(self, groups: list[list[Group | None]], *, slots: int, rank: int, scale: float,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        """groups[l][g]: group g of decoder layer l (None: nothing adapted there)."""
        self.groups, self.slots, self.rank, self.scale = groups, slots, rank, scale
        self.dtype, self.device = dtype, torch.device(device)
        self.A: list[list[torch.Tensor | None]] = []
        self.B: list[list[torch.Tensor | None]] = []
        for layer in groups:
            self.A.append([None if g is None else torch.zeros(slots, g.d_in, len(g.members) * rank, dtype=dtype,
                                                               device=self.device) for g in layer])
            self.B.append([None if g is None else torch.zeros(slots, len(g.members) * rank, g.d_out, dtype=dtype,
                                                               device=self.device) for g in layer])
        self.adapted = [False] * slots
        self.n_linears = sum(len(g.members) for layer in groups for g in layer if g is not None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for rows in (*self.A, *self.B) for t in rows if t is not None)

    def _tables(self):
        for layer, a_row, b_row in zip(self.groups, self.A, self.B, strict=True):
            for g, a, b in zip(layer, a_row, b_row, strict=True):
                if g is not None:
                    yield g, a, b

    def clear(self, slot: int) -> None:
        """The slot's row runs without an adapter."""
        if self.adapted[slot]:
            for _, a, _ in self._tables():
                a[slot].zero_()
        self.adapted[slot] = False

    def write(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """layers[i] = (A_t (d_in, r), B_t (r, d_out)) of adapted linear i (inventory order)."""
        if len(layers) != self.n_linears:
            raise ValueError(f"the adapter has {len(layers)} layers, the inventory {self.n_linears}")
        r = self.rank
        with torch.no_grad():
            for g, a, b in self._tables():
                for j, m in enumerate(g.members):
                    a_t, b_t = layers[m.index]
                    if a_t.shape != (g.d_in, r) or b_t.shape != (r, m.width):
                        raise ValueError(f"adapter layer {m.index}: shapes {tuple(a_t.shape)}, {tuple(b_t.shape)} "
                                         f"!= ({g.d_in}, {r}), ({r}, {m.width})")
                    if m.order is not None:
                        b_t = b_t[:, m.order]
                    a[slot, :, j * r : (j + 1) * r].copy_(a_t)
                    b[slot, j * r : (j + 1) * r, m.start : m.start + m.width].copy_(b_t).mul_(self.scale)
        self.adapted[slot] = True

    def copy(self, src: int, dst: int) -> None:
        if src == dst:
            return
        if self.adapted[src]:
            for _, a, b in self._tables():
                a[dst].copy_(a[src])
                b[dst].copy_(b[src])
            self.adapted[dst] = True
        else:
            self.clear(dst)

    def step(self, batch: StepBatch) -> SlotLoRAStep | None:
        """The LoRA work of one forward, or None when none of its rows has an adapter."""
        decode_on = any(self.adapted[s] for s in batch.decode_slots)
        chunks = [(c.offset, len(c.item.tokens), c.item.slot) for c in batch.chunks if self.adapted[c.item.slot]]
        if not decode_on and not chunks:
            return None
        return SlotLoRAStep(self, batch.n_decode if decode_on else 0,
                            None if batch.decode_contiguous else batch.decode_slots_t, chunks)


class SlotLoRAStep:
    """Adds the rows' LoRA outputs to a fused linear's output, in place."""

    def __init__(self, lora: SlotLoRA, n_decode: int, gather: torch.Tensor | None,
                 chunks: list[tuple[int, int, int]]) -> None:
        self.lora, self.n, self.gather, self.chunks = lora, n_decode, gather, chunks

    def apply(self, layer: int, group: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """x (T, d_in), out (T, d_out) of group `group` of `layer`:  out[t] += x[t] @ A[slot(t)] @ B[slot(t)]."""
        A, B = self.lora.A[layer][group], self.lora.B[layer][group]
        if A is None or B is None:
            return
        dtype = self.lora.dtype
        n = self.n
        if n:
            a, b = (A[:n], B[:n]) if self.gather is None else (A.index_select(0, self.gather), B.index_select(0, self.gather))
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
