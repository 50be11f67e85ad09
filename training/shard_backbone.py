"""Shard the frozen backbone across the ranks (FSDP2) for backbones that do not fit one device.

    for block in decoder.layers: fully_shard(block, ignored_params=skills)    # one all-gather unit each
    fully_shard(model, ignored_params=skills)                                 # embeddings, final norm, head

Each rank then stores 1/N of every frozen weight; a block's weights are all-gathered for its forward
(and again for its backward, which needs them to pass gradients down) and freed after. The skills
(the LoRA tensors) stay out of FSDP: they are small, whole on every rank, and their gradients are
summed by training/distributed.py exactly as without sharding, so checkpoints, the store and
--resume do not change. The routing table never enters the backbone. The data-parallel recipe is
the unsharded one: each rank runs its own rows through the (gathered) layers.

The sharded model must be called as a whole (`model(input_ids=...)`): FSDP gathers the root's
own weights (embeddings, head) in the root's forward, so the decoder and the head cannot be called
apart as `training.loss.target_logits` does for an unsharded model (`whole_model=True` there).
"""

from __future__ import annotations

from torch import nn

from training.distributed import DistContext


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM (model.model.layers and kin)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    blocks = getattr(decoder, "layers", None) if decoder is not None else None
    if not isinstance(blocks, nn.ModuleList) or not len(blocks):
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__} to shard")
    return list(blocks)


def shard_frozen_backbone(model: nn.Module, keep_whole: list[nn.Parameter], ctx: DistContext) -> None:
    """fully_shard every decoder block, then the root, leaving `keep_whole` (the skills) unsharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not ctx.backend:
        raise ValueError("sharding the backbone needs a process group: start the run with torchrun")
    trainable = {id(p) for p in keep_whole}
    stray = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in trainable]
    if stray:
        raise ValueError(f"only frozen weights may be sharded; trainable: {stray[:3]}")
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    ignored = set(keep_whole)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
