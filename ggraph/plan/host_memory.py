"""How much memory this process may still allocate on the host, and the check a planned host
buffer passes before it is allocated.

A buffer larger than the memory left fails inside numpy as `_ArrayMemoryError` (or, under a
memory limit, as the kernel's refusal at first touch); planned buffers are known before
anything is allocated, so they are compared with the memory available first and refused with
one line in llama.cpp's manner: the buffer, its size and what is available.

What is available is the smallest of:
- `MemAvailable + SwapFree` of /proc/meminfo (psutil's figures where there is no /proc);
- the address space left under RLIMIT_AS (`ulimit -v`), its limit less the process's VmSize;
- the memory left in the process's cgroup (v2 `memory.max` less `memory.current`).
Where none of them can be read, nothing is refused.
"""
from __future__ import annotations

import os
from typing import Sequence

from ggraph.ir.types import MIB


class HostMemoryError(MemoryError, ValueError):
    """A planned buffer does not fit in the memory available (a ValueError too, so command
    lines print it as the one-line error it is)."""


def _meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _system_available() -> int | None:
    info = _meminfo()
    if "MemAvailable" in info:
        return info["MemAvailable"] + info.get("SwapFree", 0)
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available + psutil.swap_memory().free)


def _rlimit_left() -> int | None:
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = _meminfo("/proc/self/status").get("VmSize")
    return max(soft - used, 0) if used is not None else soft


def _cgroup_left() -> int | None:
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.split(":", 2)[2].strip() for line in f
                        if line.startswith("0::")), None)
        if rel is None:
            return None
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            current = int(f.read().strip())
        return max(int(limit) - current, 0)
    except (OSError, ValueError):
        return None


def available() -> tuple[int | None, str]:
    """(bytes this process may still allocate, what limits it); (None, "") when unknown."""
    found = [(v, what) for v, what in ((_system_available(), "MemAvailable + SwapFree"),
                                       (_rlimit_left(), "RLIMIT_AS"),
                                       (_cgroup_left(), "the cgroup's memory.max"))
             if v is not None]
    return min(found) if found else (None, "")


def check_buffers(buffers: Sequence[tuple[str, int]], device: str = "CPU") -> None:
    """Refuse (HostMemoryError) the first of `buffers` ((name, bytes), in the order they
    will be allocated) that does not fit in what is available after the ones before it."""
    if not any(n > 0 for _, n in buffers):
        return
    avail, why = available()
    if avail is None:
        return
    before = 0
    for name, n in buffers:
        if before + n > avail:
            after = f" after {before / MIB:.2f} MiB of other buffers" if before else ""
            what = f"{device} {name}" if name else device
            raise HostMemoryError(
                f"failed to allocate the {what} buffer of {n / MIB:.2f} MiB: "
                f"{avail / MIB:.2f} MiB of memory are available ({why}){after}")
        before += n
