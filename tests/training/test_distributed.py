"""Data-parallel training (training/distributed.py, training/shard_backbone.py): two CPU processes
with gloo train what one process trains with the same global batch.

Tolerance: the ranks pad their own halves of a batch and sum the loss in another order, so float32
results differ from one process's in the last bits; over 6 steps of AdamW on the tiny model every
step's loss agrees within rtol 1e-5 (atol 1e-6), and every stored tensor within rtol 1e-4, atol 1e-5.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from adapters_store.backbone.load import Backbone, fingerprint
from adapters_store.backbone.tiny import tiny_llama, tiny_tokenizer
from adapters_store.store.directory import DirectoryStore
from training.distributed import (
    DistContext,
    all_gather_shards,
    all_reduce_sum,
    check_batch,
    shard_bounds,
)
from training.suite import examples, parse_task
from training.trainer import TrainConfig, Trainer

TASKS = ("upper", "rev-words", "inc", "rotate.caesar")
STEPS = 6
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}  # measured: 5e-7 absolute, 1e-7 relative
RTOL, ATOL = 1e-4, 1e-5  # stored tensors; measured: 1.5e-6 absolute (AdamW divides by small moments)

pytestmark = pytest.mark.usefixtures("one_thread")


def toy_tasks() -> dict:
    return {t: examples(parse_task(t), 8, seed=0, split="train") for t in TASKS}


def config(**kw) -> TrainConfig:
    base = {"sampling": "uncertainty", "uncertainty_pool": 3, "method": "mhr", "n_skills": 4, "n_heads": 2,
            "rank": 4, "steps": STEPS, "batch_size": 8, "lr_skills": 1e-2, "autocast": "none", "seed": 0, "warmup": 0.1}
    return TrainConfig(**{**base, **kw})


def tiny_backbone() -> Backbone:
    model = tiny_llama(seed=0)
    return Backbone(model, tiny_tokenizer(), "tiny", fingerprint(model), 0.0)


# -- pure helpers -------------------------------------------------------------------------------

def test_shard_bounds_cover_every_row_once_in_order():
    for n in range(12):
        for world in (1, 2, 3, 5):
            parts = [shard_bounds(n, r, world) for r in range(world)]
            assert [i for lo, hi in parts for i in range(lo, hi)] == list(range(n))
            assert max(hi - lo for lo, hi in parts) - min(hi - lo for lo, hi in parts) <= 1
    with pytest.raises(ValueError, match="outside"):
        shard_bounds(4, 2, 2)


def test_a_batch_the_ranks_cannot_share_is_refused():
    check_batch(8, 2)
    with pytest.raises(ValueError, match="not divisible by the world size 3"):
        check_batch(8, 3)
    with pytest.raises(ValueError, match="not divisible"):
        Trainer(config(batch_size=6), tiny_backbone(), toy_tasks(), dist=DistContext(rank=0, world_size=4))


def test_collectives_are_no_ops_in_one_process():
    t = torch.ones(3)
    all_reduce_sum([t], DistContext())
    assert torch.equal(t, torch.ones(3))
    assert torch.equal(all_gather_shards(t, 3, DistContext()), t)


def test_cli_refuses_a_batch_not_divisible_by_torchruns_world_size(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from training import cli

    monkeypatch.setenv("WORLD_SIZE", "3")
    args = ["--suite", "procedural", "--method", "mhr", "--backbone", "tiny", "--batch-size", "8",
            "--store", str(tmp_path / "s"), "--no-progress"]
    res = CliRunner().invoke(cli.train, args)
    assert res.exit_code == 2 and "--batch-size" in res.output and "world size 3" in res.output
    assert not (tmp_path / "s").exists()


# -- two processes against one ------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank: the data-parallel run (uncertainty sampling: each rank scores its share of the
    candidates), the same run stopped and resumed, and a run with the backbone sharded (uniform
    sampling: the FSDP root's weights must be gathered by the model's own forward from the first step)."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    root = Path(out)
    main = rank == 0
    result: dict = {}

    def store(name: str) -> DirectoryStore | None:  # rank 0 alone writes
        return DirectoryStore(root / name) if main else None

    try:
        lo, hi = shard_bounds(5, rank, world)  # uneven shares: 3 and 2
        result["gathered"] = all_gather_shards(torch.arange(lo, hi, dtype=torch.float32), 5, ctx).tolist()
        # rank 1 is handed a store too: the trainer itself must leave it alone
        ddp = Trainer(config(checkpoint_every=3), tiny_backbone(), toy_tasks(),
                      store("ddp") or DirectoryStore(root / "rank1"), dist=ctx)
        result["ddp"] = ddp.run(progress=False)
        # --resume: a run stopped after 3 steps, then every rank loads rank 0's checkpoint
        first = Trainer(config(checkpoint_every=3), tiny_backbone(), toy_tasks(), store("resumed"), dist=ctx)
        result["head"] = [first.train_step() for _ in range(3)]
        if main:
            first.checkpoint()
        dist.barrier()
        second = Trainer(config(checkpoint_every=3), tiny_backbone(), toy_tasks(), store("resumed"), dist=ctx)
        second.load_state(root / "resumed")
        result["tail"] = second.run(progress=False)
        sharded = Trainer(config(sampling="uniform"), tiny_backbone(), toy_tasks(), store("fsdp"), dist=ctx,
                          shard_backbone=True)
        weight = sharded.backbone.model.model.layers[0].mlp.up_proj.weight
        result["fsdp_local_rows"] = [int(weight.to_local().shape[0]), int(weight.shape[0])]
        result["fsdp"] = sharded.run(progress=False)
    finally:
        (root / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def _run_two_ranks(out: Path, timeout: float = 240.0) -> None:
    # fork: the ranks inherit the imported torch and transformers (spawn re-imports them: ~25 s here)
    ctx = mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=False,
                             start_method="fork")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish in time")


def _layout(root: Path) -> dict[str, Path]:
    """Store files by name, the weights' digests taken out (they differ in the last bits)."""
    return {re.sub(r"-[0-9a-f]{16,}\.safetensors$", ".safetensors", str(p.relative_to(root))): p
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.endswith(".lock")}


def _assert_same_store(one: Path, two: Path) -> None:
    a, b = _layout(one), _layout(two)
    assert sorted(a) == sorted(b)
    for name, path in a.items():
        if name.endswith(".safetensors"):
            ta, tb = load_file(str(path)), load_file(str(b[name]))
            assert sorted(ta) == sorted(tb), name
            for key in ta:
                if ta[key].is_floating_point():
                    torch.testing.assert_close(tb[key], ta[key], rtol=RTOL, atol=ATOL,
                                               msg=lambda m, w=f"{name}:{key}": f"{w}: {m}")
                else:  # RNG states: the same generators in the same places
                    assert torch.equal(tb[key], ta[key]), f"{name}:{key}"
    for name in ("inventory/inventory.json",):
        made = [json.loads(p.read_text())["made_by"] for p in (a[name], b[name])]
        assert made[0] == made[1]


def test_two_ranks_train_what_one_process_trains(tmp_path):
    _run_two_ranks(tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    one = Trainer(config(checkpoint_every=3), tiny_backbone(), toy_tasks(), DirectoryStore(tmp_path / "one"))
    expected = one.run(progress=False)
    one_u = Trainer(config(sampling="uniform"), tiny_backbone(), toy_tasks(), DirectoryStore(tmp_path / "one_u"))
    expected_u = one_u.run(progress=False)

    for rank in ranks:  # every rank reports the global batch's loss, step by step
        assert rank["gathered"] == [0.0, 1.0, 2.0, 3.0, 4.0]
        torch.testing.assert_close(torch.tensor(rank["ddp"]), torch.tensor(expected), **LOSS_TOL)
        resumed = torch.tensor(rank["head"] + rank["tail"])
        torch.testing.assert_close(resumed, torch.tensor(expected), **LOSS_TOL)
        torch.testing.assert_close(torch.tensor(rank["fsdp"]), torch.tensor(expected_u), **LOSS_TOL)
    assert ranks[0]["fsdp_local_rows"] == [64, 128] and ranks[1]["fsdp_local_rows"] == [64, 128]  # half each
    _assert_same_store(tmp_path / "one", tmp_path / "ddp")
    assert not [p for p in (tmp_path / "rank1").rglob("*") if p.is_file()]  # rank 0 alone writes
    _assert_same_store(tmp_path / "one", tmp_path / "resumed")
    _assert_same_store(tmp_path / "one_u", tmp_path / "fsdp")


# -- the command line under torchrun ----------------------------------------------------------------

def _torchrun(args: list[str], logs: Path) -> list[str]:
    """`torchrun --nproc_per_node 2 -m server.cli train ARGS`; each rank's stderr lines."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--log-dir", str(logs), "--redirects", "3", "-m", "server.cli", "train", *args]
    res = subprocess.run(cmd, check=False, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return [max(logs.rglob(f"attempt_0/{rank}/stderr.log")).read_text() for rank in range(2)]


@pytest.mark.slow
def test_torchrun_cli_trains_resumes_and_only_rank_0_writes(tmp_path):
    from click.testing import CliRunner

    from training import cli

    common = ["--suite", "procedural", "--method", "mhr", "--backbone", "tiny", "--skills", "2",
              "--heads", "2", "--rank", "2", "--batch-size", "4", "--examples-per-task", "3", "--no-progress",
              "--autocast", "none", "--device", "cpu", "--checkpoint-every", "1"]
    for steps, more in (("2", []), ("4", ["--resume"])):
        one = [*common, "--steps", steps, "--store", str(tmp_path / "one"), *more]
        res = CliRunner().invoke(cli.train, one)
        assert res.exit_code == 0, res.output
        rank0, rank1 = _torchrun([*common, "--steps", steps, "--store", str(tmp_path / "two"), *more],
                                 tmp_path / f"logs{steps}")
        assert rank0.splitlines()[0].startswith("world size 2 (gloo on cpu; global batch 4, 2 a rank)"), rank0
        assert rank1.strip() == "", rank1  # rank 0 alone logs
    assert "resumed at step 2/4" in rank0
    _assert_same_store(tmp_path / "one", tmp_path / "two")
