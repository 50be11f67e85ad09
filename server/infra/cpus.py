"""The CPUs this process may really use: affinity, cpuset and CFS quota (cgroup v2 and v1).

torch and libgomp size their thread teams from the machine's cores (or the affinity mask); neither
reads a cgroup's CPU quota. A container limited to 1 CPU on a 2-core host would then run two
intra-op threads that take turns inside one CPU's quota, and every barrier of every parallel op
waits for the thread that the quota has just parked. So the engine's default thread count is

    threads = max(1, min(affinity, cpuset, ceil(quota)))

where each limit that is absent is ignored:

    affinity   os.sched_getaffinity(0)
    cpuset     cgroup v2 `cpuset.cpus.effective`, v1 `cpuset.effective_cpus` (or `cpuset.cpus`)
    quota      cgroup v2 `cpu.max` ("max 100000" = none), v1 `cpu.cfs_quota_us / cpu.cfs_period_us`
               (-1 = none); the smallest over the process's cgroup and its ancestors, since a
               parent's limit binds its children too

`POLYSERVE_THREADS` still wins (server/wiring/settings.py). Everything is read from files under `root`,
so tests point it at a temp dir holding a fake /proc and /sys.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class CpuBudget:
    online: int  # os.cpu_count()
    affinity: int | None = None  # CPUs in the scheduler's affinity mask
    cpuset: int | None = None  # CPUs in the cgroup's cpuset
    quota: float | None = None  # CPUs' worth of time per period (cpu.max / CFS); None = unlimited
    sources: tuple[str, ...] = field(default_factory=tuple)  # the files each limit came from

    @property
    def usable(self) -> float:
        """CPUs' worth of time this process can get: the smallest of the limits found."""
        limits = [float(x) for x in (self.online, self.affinity, self.cpuset, self.quota) if x is not None]
        return min(limits)

    @property
    def threads(self) -> int:
        """Intra-op threads: one per usable CPU, a fractional quota rounded up, at least 1."""
        return max(1, math.ceil(self.usable - 1e-9))

    @property
    def limited(self) -> bool:
        """A quota below the CPUs the threads may run on: threads are parked when it runs out, so a
        thread spinning in a barrier spends the quota its partner needs (server/infra/openmp.py)."""
        cpus = min(x for x in (self.online, self.affinity, self.cpuset) if x is not None)
        return self.quota is not None and self.quota < cpus

    def describe(self) -> str:
        found = [f"{self.online} online"]
        if self.affinity is not None:
            found.append(f"affinity {self.affinity}")
        if self.cpuset is not None:
            found.append(f"cpuset {self.cpuset}")
        found.append(f"quota {self.quota:g} CPUs" if self.quota is not None else "no CPU quota")
        where = f" ({', '.join(self.sources)})" if self.sources else ""
        return f"{', '.join(found)}{where} -> {self.threads} threads"


def parse_cpu_list(text: str) -> int:
    """Count the CPUs of a list like "0-3,8,10-11" (cpuset files, /sys/.../online)."""
    count = 0
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        count += int(hi) - int(lo) + 1 if hi else 1
    return count


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # absent (no such controller), unreadable: no limit from this file
        return None


def _cgroup_dirs(root: Path) -> tuple[list[Path], dict[str, list[Path]]]:
    """The process's cgroup directories: the v2 one, and each v1 controller's, innermost first,
    each followed by its ancestors up to the mount point."""
    mounts_v2: list[tuple[str, Path]] = []
    mounts_v1: dict[str, tuple[str, Path]] = {}
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        mount_root, mount_point, fstype = fields[3], fields[4], tail[0]
        if fstype == "cgroup2":
            mounts_v2.append((mount_root, Path(mount_point)))
        elif fstype == "cgroup":
            for opt in tail[2].split(","):
                mounts_v1.setdefault(opt, (mount_root, Path(mount_point)))

    def chain(mount: tuple[str, Path], cg_path: str) -> list[Path]:
        mount_root, mount_point = mount
        rel = os.path.relpath(cg_path, mount_root) if cg_path.startswith(mount_root) else "."
        here = root / str(mount_point).lstrip("/") / ("" if rel == "." else rel)
        top = root / str(mount_point).lstrip("/")
        dirs = [here]
        while here != top and top in here.parents:
            here = here.parent
            dirs.append(here)
        return dirs

    v2: list[Path] = []
    v1: dict[str, list[Path]] = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, cg_path = parts
        if controllers == "":
            for mount in mounts_v2:
                v2 += chain(mount, cg_path)
        else:
            for ctrl in controllers.split(","):
                if ctrl in mounts_v1:
                    v1[ctrl] = chain(mounts_v1[ctrl], cg_path)
    return v2, v1


def _quota(v2: list[Path], v1: dict[str, list[Path]], root: Path) -> tuple[float | None, list[str]]:
    best: float | None = None
    sources: list[str] = []

    def take(value: float, path: Path) -> None:
        nonlocal best
        if best is None or value < best:
            best = value
            sources[:] = ["/" + str(path.relative_to(root))]

    for d in v2:
        text = _read(d / "cpu.max")
        if text:
            limit, _, period = text.partition(" ")
            if limit != "max" and period:
                take(int(limit) / int(period), d / "cpu.max")
    for d in v1.get("cpu", []):
        cfs_quota, cfs_period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if cfs_quota and cfs_period and int(cfs_quota) > 0 and int(cfs_period) > 0:
            take(int(cfs_quota) / int(cfs_period), d / "cpu.cfs_quota_us")
    return best, sources


def _cpuset(v2: list[Path], v1: dict[str, list[Path]], root: Path) -> tuple[int | None, list[str]]:
    candidates = [d / "cpuset.cpus.effective" for d in v2[:1]]
    candidates += [d / name for d in v1.get("cpuset", [])[:1] for name in ("cpuset.effective_cpus", "cpuset.cpus")]
    for path in candidates:
        text = _read(path)
        if text:
            return parse_cpu_list(text), ["/" + str(path.relative_to(root))]
    return None, []


def read_budget(root: Path = Path("/"), affinity: int | None = None) -> CpuBudget:
    """What this process may use, read from `root` (the real / by default). affinity: the mask's
    size (default: os.sched_getaffinity, only where root is the real /)."""
    if affinity is None and root == Path("/") and hasattr(os, "sched_getaffinity"):
        affinity = len(os.sched_getaffinity(0))
    online_text = _read(root / "sys/devices/system/cpu/online")
    online = parse_cpu_list(online_text) if online_text else (os.cpu_count() or 1)
    v2, v1 = _cgroup_dirs(root)
    quota, quota_src = _quota(v2, v1, root)
    cpuset, cpuset_src = _cpuset(v2, v1, root)
    return CpuBudget(online=online, affinity=affinity, cpuset=cpuset, quota=quota,
                     sources=tuple(cpuset_src + quota_src))


_budget: CpuBudget | None = None


def budget() -> CpuBudget:
    """This process's budget, read once (limits are set when a container starts)."""
    global _budget
    if _budget is None:
        _budget = read_budget()
    return _budget


def default_threads(override: int | None = None) -> int:
    """The engine's intra-op threads: the override (POLYSERVE_THREADS) where given, else one per
    usable CPU."""
    return override if override else budget().threads
