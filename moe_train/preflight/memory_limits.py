"""How much memory one training process may allocate here, and which limit says so.

On a GPU that is the device's free memory. On the CPU a run is bounded by the least of: this
machine's available RAM (`MemAvailable`), the headroom of its memory cgroup and every ancestor
cgroup (how Slurm enforces `--mem`, and how containers are limited; both hierarchies, v1 and v2),
and the process's own address-space and data limits (`ulimit -v`, `ulimit -d`). The first two are
shared by the processes of this machine, the last is each process's own. The start-up memory check
(`moe_train.plan.start_up_memory_problems`) compares its estimate with this, so a run that cannot fit
stops before it allocates instead of dying by the OOM killer or a MemoryError minutes later.
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 2**30
UNLIMITED = 2**62  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


@dataclass(frozen=True)
class MemoryLimit:
    gib: float  # what one process may still allocate
    source: str  # the binding limit, as a user would look it up


def available_memory(device: torch.device, processes_here: int, cgroup_root: Path = Path("/sys/fs/cgroup"),
                     proc_self: Path = Path("/proc/self")) -> MemoryLimit:
    """The tightest limit on what one of the `processes_here` processes on this machine may allocate."""
    if device.type == "cuda":
        return MemoryLimit(torch.cuda.mem_get_info(device)[0] / GIB, "free GPU memory")
    shared = [(ram_available_bytes(), "available RAM")]
    cgroup = cgroup_headroom_bytes(cgroup_root, (proc_self / "cgroup").read_text() if (proc_self / "cgroup").exists()
                                   else "")
    if cgroup is not None:
        shared.append((cgroup, "the memory cgroup's limit (a Slurm job's --mem, a container's limit)"))
    limits = [(size / max(1, processes_here), source) for size, source in shared]
    limits += rlimit_headroom_bytes(proc_self / "status")
    size, source = min(limits, key=lambda item: item[0])
    return MemoryLimit(max(0, size) / GIB, source)


def ram_available_bytes() -> int:
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cgroup_headroom_bytes(root: Path, proc_cgroup: str) -> int | None:
    """Least (limit - usage) over this process's memory cgroup and its ancestors that have a limit,
    reclaimable page cache (inactive file pages) not counted as used; None when none has a limit.
    `proc_cgroup` is the text of /proc/self/cgroup; `root` is where the hierarchies are mounted."""
    headrooms = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: the unified hierarchy
            mount, limit_file, usage_file, cache_key = root, "memory.max", "memory.current", "inactive_file"
            if (root / "unified" / "cgroup.controllers").exists() and not (root / "cgroup.controllers").exists():
                mount = root / "unified"  # hybrid mode: v2 mounted beside the v1 controllers
        elif "memory" in controllers.split(","):
            mount, limit_file, usage_file, cache_key = (root / "memory", "memory.limit_in_bytes",
                                                        "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for group in _own_and_ancestor_groups(mount, path):
            headroom = _headroom(group, limit_file, usage_file, cache_key)
            if headroom is not None:
                headrooms.append(headroom)
    return min(headrooms) if headrooms else None


def _own_and_ancestor_groups(mount: Path, path: str) -> list[Path]:
    """The folders of the cgroup at `path` and of its ancestors under `mount`. In a cgroup namespace
    (containers) the mount is the process's own group and `path` may not exist below it."""
    parts = [p for p in path.strip("/").split("/") if p]
    groups = [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [g for g in groups if g.is_dir()]


def _headroom(group: Path, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    try:
        limit_text = (group / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= UNLIMITED:
            return None
        usage = int((group / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    reclaimable = 0
    try:
        for line in (group / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == cache_key:
                reclaimable = int(value)
    except (OSError, ValueError):
        pass
    return int(limit_text) - max(0, usage - reclaimable)


def rlimit_headroom_bytes(status: Path) -> list[tuple[int, str]]:
    """What this process's address-space and data limits leave: (limit - VmSize) and (limit - VmData)."""
    try:
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
    except OSError:
        return []
    headrooms = []
    for kind, field, source in ((resource.RLIMIT_AS, "VmSize", "the address-space limit (ulimit -v)"),
                                (resource.RLIMIT_DATA, "VmData", "the data-segment limit (ulimit -d)")):
        limit = resource.getrlimit(kind)[0]
        if limit != resource.RLIM_INFINITY and field in fields:
            headrooms.append((limit - int(fields[field].split()[0]) * 1024, source))
    return headrooms
