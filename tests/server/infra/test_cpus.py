"""The engine's thread count follows the CPUs the process may use (server/infra/cpus.py): cgroup v2
`cpu.max` and cpuset, cgroup v1 CFS quota, read from a fake /proc and /sys in a temp dir; and
POLYSERVE_THREADS wins over all of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.infra import cpus

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
V1_MOUNTS = ("31 23 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
             "32 23 0:28 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n")


def fake_root(tmp: Path, *, online: str = "0-1", mountinfo: str = V2_MOUNT, cgroup: str = "0::/kubepods/pod1/c1\n",
              files: dict[str, str] | None = None) -> Path:
    (tmp / "proc/self").mkdir(parents=True)
    (tmp / "proc/self/mountinfo").write_text(mountinfo)
    (tmp / "proc/self/cgroup").write_text(cgroup)
    (tmp / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp / "sys/devices/system/cpu/online").write_text(online + "\n")
    for rel, text in (files or {}).items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return tmp


@pytest.mark.parametrize(("cpu_max", "threads", "quota"), [
    ("100000 100000", 1, 1.0),    # 1 CPU of 2: one thread, not two taking turns in one quota
    ("150000 100000", 2, 1.5),    # a fractional quota rounds up
    ("50000 100000", 1, 0.5),     # at least one
    ("max 100000", 2, None),      # no quota: the cores
])
def test_v2_cpu_max_sizes_the_threads(tmp_path, cpu_max, threads, quota):
    root = fake_root(tmp_path, files={"sys/fs/cgroup/kubepods/pod1/c1/cpu.max": cpu_max})
    got = cpus.read_budget(root, affinity=2)
    assert (got.threads, got.quota) == (threads, quota)
    assert got.limited is (quota is not None and quota < 2)


def test_a_parents_quota_binds_its_child(tmp_path):
    root = fake_root(tmp_path, online="0-7", files={
        "sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "max 100000",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "300000 100000",   # the pod's limit: 3 CPUs
        "sys/fs/cgroup/kubepods/cpu.max": "600000 100000",
    })
    got = cpus.read_budget(root, affinity=8)
    assert got.threads == 3
    assert "/sys/fs/cgroup/kubepods/pod1/cpu.max" in got.sources
    assert "quota 3 CPUs" in got.describe()


def test_v2_cpuset_and_affinity_bound_the_threads(tmp_path):
    root = fake_root(tmp_path, online="0-15", files={"sys/fs/cgroup/kubepods/pod1/c1/cpuset.cpus.effective": "2-3,8"})
    assert cpus.read_budget(root, affinity=16).threads == 3
    assert cpus.read_budget(root, affinity=2).threads == 2   # taskset narrower than the cpuset


def test_v1_cfs_quota_in_a_hybrid_hierarchy(tmp_path):
    """This project's hosts: v1 controllers, an empty v2 mount beside them."""
    root = fake_root(tmp_path, mountinfo=V1_MOUNTS + V2_MOUNT.replace("/sys/fs/cgroup ", "/sys/fs/cgroup/unified "),
                     cgroup="4:cpu,cpuacct:/bench\n3:cpuset:/\n0::/\n", files={
                         "sys/fs/cgroup/cpu,cpuacct/bench/cpu.cfs_quota_us": "100000",
                         "sys/fs/cgroup/cpu,cpuacct/bench/cpu.cfs_period_us": "100000",
                         "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1",       # the root: unlimited
                         "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
                         "sys/fs/cgroup/cpuset/cpuset.effective_cpus": "0-1",
                     })
    got = cpus.read_budget(root, affinity=2)
    assert (got.quota, got.cpuset, got.threads) == (1.0, 2, 1)


def test_no_cgroup_files_at_all_leaves_the_cores(tmp_path):
    root = fake_root(tmp_path, online="0-3", mountinfo="", cgroup="")
    got = cpus.read_budget(root, affinity=None)
    assert (got.threads, got.quota, got.cpuset) == (4, None, None)


def test_parse_cpu_list():
    assert cpus.parse_cpu_list("0-3,8,10-11") == 7
    assert cpus.parse_cpu_list("5") == 1


def test_the_override_wins_over_the_quota(tmp_path, monkeypatch):
    from server.wiring.settings import Settings

    root = fake_root(tmp_path, files={"sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "100000 100000"})
    monkeypatch.setattr(cpus, "_budget", cpus.read_budget(root, affinity=2))
    monkeypatch.delenv("POLYSERVE_THREADS", raising=False)
    assert cpus.default_threads(Settings().threads) == 1
    monkeypatch.setenv("POLYSERVE_THREADS", "2")
    assert cpus.default_threads(Settings().threads) == 2


def test_the_runtime_gives_the_engine_the_quotas_thread_count(tmp_path, monkeypatch):
    """End to end: the engine built by the server runs on ceil(quota) threads, or on
    POLYSERVE_THREADS where it is set."""
    from server.infra.metrics import Metrics
    from server.wiring.runtime import Runtime
    from tests.support.server_fixtures import build_store, settings_for, tiny_backbone

    root = fake_root(tmp_path / "root", files={"sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "100000 100000"})
    monkeypatch.setattr(cpus, "_budget", cpus.read_budget(root, affinity=2))
    build_store(tmp_path / "store")
    for threads, want in ((None, 1), (2, 2)):
        rt = Runtime.build(settings_for(tmp_path, warmup=False, threads=threads), Metrics(), backbone=tiny_backbone())
        try:
            assert rt.engine.threads == want
        finally:
            rt.close()
