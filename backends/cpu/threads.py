"""How the CPU backend's numba threads wait, and how many of them a graph run uses.

Waiting. numba's `omp` threading layer runs each parallel kernel as an OpenMP region; between
regions libgomp's threads spin for GOMP_SPINCOUNT iterations (300,000 by default, ~9 ms on
the EPYC measured) before they sleep. Decode runs ~270 regions per token, so the threads stay
hot while a token is computed whatever the bound, but a long bound burns a core after every
run and, on a busy machine, makes a thread that waits for a descheduled partner spin away its
time slice. `configure_openmp` bounds the spin to ~1 ms (GOMP_SPINCOUNT=30000; KMP_BLOCKTIME=1
for LLVM/Intel OpenMP) unless the environment chooses; it must run before the OpenMP runtime
is loaded (the CPU backend calls it on import), since the runtime reads its environment once.

How many. Every region waits for all its threads at its end, so on a machine whose cores are
busy with other work a parallel run waits for the slowest thread's next time slice, ~270
times a token: SmolLM2 decode fell from 49 to 12 tok/s with one competing process per core,
while a single thread fell from 32 to 20. `ThreadGovernor` picks, per repeatedly run graph,
the thread count whose recent runs were fastest among the most (`-t`), half of them and one,
trying another count now and then (every 4 runs; while trials lose, the gap doubles to 16
for more threads, to 64 for fewer or for a trial more than 2x slower), and trying more threads
at once when Linux reports cores free (/proc/loadavg), so the backend uses every thread on a
quiet machine, falls back to fewer when the cores are shared, and comes back when they free. Thread
counts change no result: every kernel splits whole rows between threads.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable, MutableMapping

# libgomp: spins before sleeping (~1 ms here); LLVM/Intel OpenMP: ms before sleeping
OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "30000", "KMP_BLOCKTIME": "1"}


def configure_openmp(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the bounded-spin defaults the environment leaves unset (none at all when it sets
    OMP_WAIT_POLICY: that choice wins). Returns what was set."""
    if "OMP_WAIT_POLICY" in env:
        return {}
    added = {k: v for k, v in OPENMP_DEFAULTS.items() if k not in env}
    env.update(added)
    return added


def free_cores() -> int | None:
    """Cores with nothing runnable on them right now besides the caller, from Linux's
    /proc/loadavg (running tasks, the caller included); None where it cannot be read."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) - (running - 1)


def arms(n_threads: int) -> tuple[int, ...]:
    """The thread counts a governor chooses between: all, half, one (most first)."""
    return tuple(sorted({n_threads, max(1, n_threads // 2), 1}, reverse=True))


@dataclass
class _Track:
    """One graph's recent run times per thread count."""
    times: dict[int, list[float]] = field(default_factory=dict)
    runs: int = 0
    gap: int = 0              # runs until the next trial of another count
    interval: int = 0         # the gap set after each trial
    trial: int | None = None  # the count being tried by the current run
    next_arm: int = 0         # round robin over the counts that are not the best

    def estimate(self, n: int) -> float | None:
        t = self.times.get(n)
        return sum(t) / len(t) if t else None


@dataclass
class ThreadGovernor:
    """Chooses the thread count of each run of a graph (see the module docstring)."""
    n_threads: int
    keep: int = 2              # recent runs averaged per thread count
    first_gap: int = 4         # runs between trials while trials win
    near_gap: int = 16         # ... doubling up to this while they lose by less than 2x
    max_gap: int = 64          # ... or up to this while they lose by more (a costly trial)
    max_graphs: int = 16
    # cores free right now (None: unknown); more threads are tried as soon as they fit
    room: Callable[[], int | None] = free_cores
    _tracks: "OrderedDict[Hashable, _Track]" = field(default_factory=OrderedDict)

    def choose(self, key: Hashable) -> int:
        """Threads for the next run of graph `key`."""
        counts = arms(self.n_threads)
        if len(counts) == 1:
            return counts[0]
        tr = self._tracks.get(key)
        if tr is None:
            tr = self._tracks[key] = _Track(gap=self.first_gap, interval=self.first_gap)
            while len(self._tracks) > self.max_graphs:
                self._tracks.popitem(last=False)
        self._tracks.move_to_end(key)
        tr.trial = None
        untried = [n for n in counts if n not in tr.times]
        if tr.runs == 0:
            return counts[0]          # the first run compiles and binds: not a measurement
        if untried:
            tr.trial = untried[0]
            return tr.trial
        best = self.best(key)
        tr.gap -= 1
        more = [n for n in counts if n > best]
        if more and tr.gap > 0 and tr.interval - tr.gap >= self.first_gap:
            free = self.room()
            if free is not None and free >= more[-1] - best:
                tr.trial = more[-1]   # the cores look free: try the next larger count now
                tr.gap = 0
                return tr.trial
        if tr.gap <= 0:
            others = [n for n in counts if n != best]
            tr.trial = others[tr.next_arm % len(others)]
            tr.next_arm += 1
            return tr.trial
        return best

    def best(self, key: Hashable) -> int:
        """The count whose recent runs of `key` were fastest (the most threads if none ran)."""
        tr = self._tracks.get(key)
        counts = arms(self.n_threads)
        if tr is None:
            return counts[0]
        known = [(tr.estimate(n), -n) for n in counts if tr.estimate(n) is not None]
        return -min(known)[1] if known else counts[0]

    def record(self, key: Hashable, n: int, seconds: float) -> None:
        """The run of `key` that `choose` gave n threads took `seconds`."""
        tr = self._tracks.get(key)
        if tr is None:
            return
        tr.runs += 1
        if tr.runs == 1:
            return                    # compile and bind time
        t = tr.times.setdefault(n, [])
        if tr.trial is None:
            t.append(seconds)
            del t[:-self.keep]
            return
        # a trial: a count beating the best's recent runs takes over at once (the machine got
        # quieter or busier); one that loses waits twice as long for its next trial
        best = self.best(key)
        mine = tr.estimate(best)
        won = n != best and mine is not None and seconds < mine
        if won or not t:
            t[:] = [seconds]
        else:
            t.append(seconds)
            del t[:-self.keep]
        if tr.gap <= 0:
            # fewer threads need few trials: a busier machine slows the best count's own runs
            # until the stale figure of fewer wins; more threads are tried sooner to recover
            costly = n < best or (mine is not None and seconds > 2 * mine)
            cap = self.max_gap if costly else self.near_gap
            tr.interval = self.first_gap if won else min(cap, 2 * tr.interval)
            tr.gap = tr.interval
