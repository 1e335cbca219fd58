"""Compiling the kernels a graph is missing in helper processes, beside this one.

numba compiles one function at a time under the GIL, and a model's first run spends most of
its time there: Qwen2.5 1.5B's first token took 42.5 s on the 2-core Zen 4, 35 s of it
compiling 17 kernels one after the other, three of them 11-13 s each (the packed Q4_K and
Q6_K products and the flash-attention decode). Before a bound graph's calls are made direct
(compile.direct compiles each one it has no machine code for), `prepare` finds the kernels
neither in memory nor in numba's on-disk cache, splits them between this process and up to
`cpu_count - 1` helpers by their size (the pickled function: what numba compiles, its bound
helpers included), starts the helpers on their shares, compiles its own, and waits. Each
helper unpickles its dispatchers, turns their disk cache on and compiles them, so their
machine code lands where this process's `compile` then loads it. A helper that fails, or a
kernel it could not compile, costs nothing but the time: `compile` compiles it here as before.

Nothing runs in a helper but numba's compiler on functions this process pickled. A share is
handed to a helper only when it is worth a process's start (~0.8 s of imports) and there is
more than one kernel to compile; where numba's disk cache is off, a helper's work would not
reach this process, so nothing is handed. Whether the disk cache holds a kernel is read from
numba's own cache index (its internals: any surprise there reads as "unknown", and the kernel
compiles here). GGRAPH_COMPILE_AHEAD=0 turns it off.

A kernel loaded from the cache must compute what the same kernel compiled here computes: numba
runs a parallel kernel's body optimized once where it compiled it and twice where it loaded it,
so a sum LLVM may reassociate differed between the two (the decode attention, until it summed
in a fixed order: tests/backends/cpu/test_fixed_order.py), and with kernels from both origins
a first run's greedy text differed from a warm run's.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import numba
from numba.core.dispatcher import Dispatcher

from ggraph import config
from ..compiles import note_elsewhere
from . import native_loop
from .compile import DIRECT, arg_type, dispatcher_calls

ENABLED = config.compile_ahead()
# a helper's share must pickle to at least this many bytes (~2-5 s of compiling: the packed
# products pickle to ~50 KB and compile in 12-13 s, a norm chain to 9 KB and 1.9 s) to pay for
# its start; smaller work stays here
MIN_SHARE = 12_000
# the most helpers, whatever the cores (each is a Python process with numba loaded, ~150 MB)
MAX_HELPERS = 3
# a helper still compiling after this long is stopped (its kernels then compile here)
WAIT_S = 600.0


@dataclass
class Job:
    """One kernel to compile: a dispatcher, the argument types of its call, its pickle."""
    f: Dispatcher
    sig: tuple
    blob: bytes


@dataclass
class Ahead:
    """What one `prepare` did: kernels compiled here and by helpers, the helpers' failures."""
    here: int = 0
    helped: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0


def dispatch_pairs(calls: Iterable[Any]) -> list[tuple[Dispatcher, tuple]]:
    """(dispatcher, argument types) of each of compile.dispatcher_calls(calls), each pair
    once."""
    out: dict[tuple[int, tuple], tuple[Dispatcher, tuple]] = {}
    for call in dispatcher_calls(calls):
        f = call.func
        try:
            sig = tuple(arg_type(f, a) for a in call.args)
        except Exception:   # noqa: BLE001 - untypable: its call reports it when it runs
            continue
        out.setdefault((id(f), sig), (f, sig))
    return list(out.values())


def on_disk(f: Dispatcher, sig: tuple) -> bool | None:
    """Whether numba's disk cache holds f's machine code for `sig` (None: f caches nothing,
    or the cache cannot be read)."""
    cache = getattr(f, "_cache", None)
    try:
        if cache is None or not getattr(cache, "_enabled", False):
            return None
        key = cache._index_key(sig, f.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:   # noqa: BLE001 - numba's cache internals: unknown means "not ahead"
        return None


def missing(calls: Iterable[Any]) -> list[Job]:
    """The kernels of `calls` to compile: in no overload of their dispatcher, absent from a
    disk cache that is on, and picklable (largest first)."""
    jobs = []
    for f, sig in dispatch_pairs(calls):
        if f.overloads.get(sig) is not None or on_disk(f, sig) is not False:
            continue
        try:
            blob = pickle.dumps((f, sig))
        except Exception:   # noqa: BLE001 - what cannot be pickled compiles here
            continue
        jobs.append(Job(f, sig, blob))
    return sorted(jobs, key=lambda j: -len(j.blob))


def split(jobs: list[Job], helpers: int) -> list[list[Job]]:
    """`jobs` in helpers + 1 shares of about equal size (largest first, each to the smallest
    share), share 0 this process's; a helper's share under MIN_SHARE goes back to share 0."""
    shares: list[list[Job]] = [[] for _ in range(helpers + 1)]
    load = [0] * (helpers + 1)
    for j in jobs:
        k = load.index(min(load))
        shares[k].append(j)
        load[k] += len(j.blob)
    for k in range(1, helpers + 1):
        if load[k] < MIN_SHARE:
            shares[0].extend(shares[k])
            shares[k] = []
    return shares


def prepare(calls: Iterable[Any]) -> Ahead:
    """Compile the kernels `calls` (a bound graph's) are missing, here and in helpers (see
    the module docstring); afterwards compile.direct finds each in memory or on disk."""
    done = Ahead()
    # the kernels of the team forms too, where the native runs will have teams (their
    # second run lays them out, and a team's kernels compiled then are seconds of a start)
    teams = native_loop.ENABLED and native_loop.TEAM and numba.get_num_threads() > 1
    calls = dispatcher_calls(calls, teams) if ENABLED and DIRECT and cores() > 1 else []
    # typing every argument costs ~6 ms a graph (Qwen2.5 0.5B's decode graph, bound again
    # each 256 cells): done only where a kernel has never compiled, as on a first run; a new
    # signature of a compiled kernel compiles here, as it always did
    if all(c.func.overloads for c in calls):
        return done
    jobs = missing(calls)
    helpers = min(MAX_HELPERS, cores() - 1, len(jobs) - 1)
    if helpers < 1:
        return done
    shares = split(jobs, helpers)
    procs = [(_start(share), share) for share in shares[1:] if share]
    if not procs:
        return done
    t0 = time.perf_counter()
    for j in shares[0]:
        try:
            j.f.compile(j.sig)
            done.here += 1
        except Exception:   # noqa: BLE001 - as compile.direct: the call reports it when it runs
            pass
    for proc, share in procs:
        for j, (ok, secs, why) in zip(share, _finish(proc, len(share))):
            if ok:
                done.helped += 1
                note_elsewhere(getattr(j.f.py_func, "__qualname__", "?"), secs)
            else:
                done.failed.append(f"{getattr(j.f.py_func, '__qualname__', '?')}: {why}")
    done.seconds = time.perf_counter() - t0
    return done


def cores() -> int:
    """The cores this process may run on (its affinity where Linux says, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _start(share: list[Job]) -> subprocess.Popen | None:
    """A helper process compiling `share`, fed through its standard input."""
    try:
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    except OSError:
        return None
    try:
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps([j.blob for j in share]))
        proc.stdin.close()
    except OSError:
        pass    # it died already: _finish reports each of its jobs failed
    return proc


def _finish(proc: subprocess.Popen | None, n: int) -> list[tuple[bool, float, str]]:
    """(compiled, seconds, why not) for each of a helper's n jobs, once it has exited."""
    if proc is None:
        return [(False, 0.0, "no helper process")] * n
    try:   # a line a job: far less than a pipe holds, so waiting first cannot block it
        proc.wait(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.stdout.close()
    got: dict[int, tuple[bool, float, str]] = {}
    for line in out.decode("utf-8", "replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] in ("ok", "err") and parts[1].isdigit():
            try:
                secs = float(parts[2])
            except ValueError:
                continue
            got[int(parts[1])] = (parts[0] == "ok", secs, parts[3] if len(parts) > 3 else "")
    return [got.get(i, (False, 0.0, f"helper exited {proc.returncode}")) for i in range(n)]


def _helper() -> int:
    """A helper's loop: the pickled (dispatcher, types) jobs on standard input, each compiled
    into numba's disk cache, one line each on standard output: ok|err INDEX SECONDS [why]."""
    blobs = pickle.loads(sys.stdin.buffer.read())
    for i, blob in enumerate(blobs):
        t0 = time.perf_counter()
        try:
            f, sig = pickle.loads(blob)
            f.enable_caching()
            f.compile(sig)
            line = f"ok {i} {time.perf_counter() - t0:.3f}"
        except Exception as e:   # noqa: BLE001 - reported; the parent compiles it itself
            why = (str(e).splitlines() or [""])[0][:200]
            line = f"err {i} {time.perf_counter() - t0:.3f} {type(e).__name__}: {why}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_helper())
