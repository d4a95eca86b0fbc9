"""The cgroup limits on this process, read from the files Linux keeps them in: the CPU
quota and the memory room of every cgroup on this process's path, v1 and v2 alike.

Part of the platform layer (``paged_engine.platform`` turns these into core counts and
available memory). Each is read every time it is asked (a container's limits can change
while the process runs); a file that is missing or unreadable counts as no limit. The
paths are module globals, so a test points them at a tree of its own.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "CGROUP_ROOT",
    "PROC_SELF_CGROUP",
    "cgroup_dirs",
    "cpu_quotas",
    "memory_room",
    "read_int",
    "read_text",
]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")

_MEMORY_FILES = (
    ("memory.max", "memory.current"),
    ("memory.limit_in_bytes", "memory.usage_in_bytes"),
)
"""A cgroup's memory limit and use: v2's, then v1's."""


def read_text(path: Path) -> str | None:
    """The file's text, stripped; None where it cannot be read."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def read_int(path: Path) -> int | None:
    """The file's integer; None where it cannot be read or holds none (v2's "max")."""
    text = read_text(path)
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def cgroup_dirs(controller: str) -> list[Path]:
    """The cgroup directories whose ``controller`` limits apply to this process, from
    /proc/self/cgroup: its own and each one above it, up to the hierarchy's root. v2 (the
    "0::" line, under ``CGROUP_ROOT``) and v1 (the line naming ``controller``, under
    ``CGROUP_ROOT / <its controllers>``) alike; the roots alone where the file is missing,
    and no deeper where a path leaves the mount (one outside this cgroup namespace)."""
    v1_root = CGROUP_ROOT / controller
    found: dict[Path, list[str]] = {CGROUP_ROOT: [], v1_root: []}
    for line in (read_text(PROC_SELF_CGROUP) or "").splitlines():
        _, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        if names == "":
            root = CGROUP_ROOT
        elif controller in names.split(","):
            root = CGROUP_ROOT / names if (CGROUP_ROOT / names).is_dir() else v1_root
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        found[root] = [] if ".." in parts else parts
    return [
        root.joinpath(*parts[:depth])
        for root, parts in found.items()
        for depth in range(len(parts) + 1)
    ]


def cpu_quotas() -> list[tuple[int, int]]:
    """Every CPU quota on this process's path as ``(quota, period)``: v2's ``cpu.max``
    ("quota period"; "max" is none) and v1's ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us`` (a quota of -1 is none, left for the caller to skip)."""
    quotas: list[tuple[int, int]] = []
    for d in cgroup_dirs("cpu"):
        fields = (read_text(d / "cpu.max") or "").split()
        if len(fields) >= 2 and fields[0].isdigit() and fields[1].isdigit():
            quotas.append((int(fields[0]), int(fields[1])))
        quota, period = read_int(d / "cpu.cfs_quota_us"), read_int(d / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            quotas.append((quota, period))
    return quotas


def memory_room() -> int | None:
    """The least memory any cgroup on this process's path leaves under its limit
    (``_MEMORY_FILES``: limit minus use, at least 0); None where none sets a limit."""
    rooms = []
    for d in cgroup_dirs("memory"):
        for limit_name, used_name in _MEMORY_FILES:
            limit, used = read_int(d / limit_name), read_int(d / used_name)
            if limit is not None and used is not None:
                rooms.append(max(0, limit - used))
    return min(rooms) if rooms else None
