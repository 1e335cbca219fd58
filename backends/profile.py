"""Per-node timing of graph runs: where a Session's time goes, in the form of ggml's perf
output (time, calls, share, and GB/s or GFLOPS per op kind).

A `Profile` is handed to `Session.run(graph, inputs, profile=p)`, or attached to a runner for
a stretch of runs (`with p.attach(session): engine.eval(...)`): each bound call is timed and
recorded under the nodes it computes (a fused call computes several and is recorded once,
under the joined op names). Bytes are what a node reads from its sources plus what it writes;
FLOPs are counted for the products (mul_mat, mul_mat_id, flash_attn_ext), so those rows show
GFLOPS and the memory-bound rest GB/s.

Timing adds one clock read per call (~0.1 us) and a device synchronize per call where the
backend queues work (CUDA), so profiled figures are for finding the heavy ops, not for
benchmarks.
"""
from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from ggraph.ir.opkind import OpKind
from ggraph.ops import fa_flops, mm_flops
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import row_size

# a layer number: `-12` at the end of a name, or `_l12` inside one (`cache_k_l12 (view)`)
_LAYER_NUMBER = re.compile(r"(?:[-.]\d+$)|(?<=_l)\d+\b")


def node_flops(node: Tensor) -> int:
    """Multiply-adds x 2 of a product node (the ops' own counts); 0 for the other ops."""
    if node.op in (OpKind.MUL_MAT, OpKind.MUL_MAT_ID):
        return int(mm_flops(node))
    if node.op == OpKind.FLASH_ATTN_EXT:
        return int(fa_flops(node))
    return 0


def node_bytes(node: Tensor, inside: frozenset[Tensor] = frozenset()) -> int:
    """Bytes `node` reads (sources not in `inside`, the rest of a fused group) and writes.
    Row gathers and scatters count the rows they touch, not the whole table."""
    src = [s for s in node.src if s is not None and s not in inside]
    if node.op == OpKind.GET_ROWS:
        a = node.src[0]
        read = node.nrows * row_size(a.type, a.ne[0]) if a not in inside else 0
        return read + sum(s.nbytes for s in src[1:]) + node.nbytes
    if node.op == OpKind.SET_ROWS:
        dst, rows = node.src[0], node.src[1]
        written = rows.nrows * row_size(dst.type, dst.ne[0])
        return sum(s.nbytes for s in src if s is not dst) + written
    return sum(s.nbytes for s in src) + node.nbytes


def pattern(node: Tensor) -> str:
    """A node's name with its layer number cut (`ffn_up-12` -> `ffn_up`), else its op."""
    name = _LAYER_NUMBER.sub("", node.name) if node.name else ""
    return name or str(node.op)


@dataclass
class OpStat:
    """Totals for one row of the table."""
    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0
    flops: int = 0

    def add(self, seconds: float, nbytes: int, flops: int) -> None:
        self.calls += 1
        self.seconds += seconds
        self.bytes += nbytes
        self.flops += flops


@dataclass(frozen=True)
class CallInfo:
    """What one bound call computes, worked out once per binding."""
    op: str               # the op kind, or `A+B` for a fused call
    pattern: str          # the node name pattern(s) of the call
    bytes: int
    flops: int

    @staticmethod
    def of(nodes: Sequence[Tensor]) -> "CallInfo":
        inside = frozenset(nodes) if len(nodes) > 1 else frozenset()
        return CallInfo(op="+".join(str(n.op) for n in nodes),
                        pattern="+".join(dict.fromkeys(pattern(n) for n in nodes)),
                        bytes=sum(node_bytes(n, inside) for n in nodes),
                        flops=sum(node_flops(n) for n in nodes))


@dataclass
class Profile:
    """Accumulated per-call timings over any number of runs (see the module docstring)."""
    by_op: dict[str, OpStat] = field(default_factory=dict)
    by_pattern: dict[str, OpStat] = field(default_factory=dict)
    runs: int = 0
    run_seconds: float = 0.0     # wall time of the profiled runs' kernel loops, overhead too
    _info: dict[tuple[Tensor, ...], CallInfo] = field(default_factory=dict, repr=False)

    def record(self, info: CallInfo, seconds: float) -> None:
        for table, key in ((self.by_op, info.op), (self.by_pattern, info.pattern)):
            st = table.get(key)
            if st is None:
                st = table[key] = OpStat()
            st.add(seconds, info.bytes, info.flops)

    def info(self, nodes: tuple[Tensor, ...]) -> CallInfo:
        """What a call computing `nodes` costs (worked out once per group of nodes)."""
        got = self._info.get(nodes)
        if got is None:
            got = self._info[nodes] = CallInfo.of(nodes)
        return got

    def time_calls(self, calls: Sequence[Any], groups: Sequence[tuple[Tensor, ...]],
                   sync: Any = None) -> None:
        """Run `calls` in order, timing each (`sync()` after each when the backend queues);
        groups[i] are the nodes calls[i] computes."""
        if len(calls) != len(groups):
            raise ValueError(f"{len(calls)} calls but {len(groups)} node groups to time")
        infos = [self.info(g) for g in groups]
        clock = time.perf_counter
        start = clock()
        for call, info in zip(calls, infos):
            t0 = clock()
            call()
            if sync is not None:
                sync()
            self.record(info, clock() - t0)
        self.run_seconds += clock() - start
        self.runs += 1

    def reset(self) -> None:
        self.by_op.clear()
        self.by_pattern.clear()
        self.runs, self.run_seconds = 0, 0.0
        self._info.clear()

    @contextlib.contextmanager
    def attach(self, runner: Any) -> Iterator["Profile"]:
        """Every `runner.run` inside the block records into this profile (a runner without
        profiling support raises TypeError naming it)."""
        if not hasattr(runner, "profile"):
            raise TypeError(f"{type(runner).__name__} cannot be profiled (no `profile` slot)")
        was, runner.profile = runner.profile, self
        try:
            yield self
        finally:
            runner.profile = was

    # -- reports ----------------------------------------------------------------------------
    @property
    def kernel_seconds(self) -> float:
        return sum(s.seconds for s in self.by_op.values())

    def rows(self, by: str = "op") -> list[tuple[str, OpStat]]:
        """(key, totals) by op kind (`op`) or node name pattern (`name`), slowest first."""
        if by not in ("op", "name"):
            raise ValueError(f"profile rows are by 'op' or 'name', not {by!r}")
        table = self.by_op if by == "op" else self.by_pattern
        return sorted(table.items(), key=lambda kv: -kv[1].seconds)

    def table(self, by: str = "op", top: int | None = None) -> list[str]:
        """ggml-perf-like lines: key, calls, ms per run, us per call, share, GB/s or GFLOPS;
        a last line with the kernels' total and the loop's overhead beside it."""
        total = self.kernel_seconds or 1e-30
        runs = max(self.runs, 1)
        head = "op" if by == "op" else "node"
        lines = [f"{head:<28}{'calls':>8}{'ms/run':>10}{'us/call':>10}{'share':>8}"
                 f"{'GB/s':>9}{'GFLOPS':>9}"]
        rows = self.rows(by)
        for key, st in rows[:top] if top else rows:
            s = st.seconds or 1e-30
            gbs = f"{st.bytes / s / 1e9:9.2f}"
            gfl = f"{st.flops / s / 1e9:9.2f}" if st.flops else f"{'':>9}"
            lines.append(f"{key[:27]:<28}{st.calls:>8}{st.seconds * 1e3 / runs:10.3f}"
                         f"{st.seconds * 1e6 / max(st.calls, 1):10.2f}"
                         f"{100 * st.seconds / total:7.1f}%{gbs}{gfl}")
        over = self.run_seconds - self.kernel_seconds
        lines.append(f"{'total':<28}{sum(s.calls for s in self.by_op.values()):>8}"
                     f"{self.kernel_seconds * 1e3 / runs:10.3f} ms/run in kernels over "
                     f"{self.runs} runs; loop overhead {max(over, 0.0) * 1e3 / runs:.3f} "
                     f"ms/run")
        return lines

    def to_json(self) -> dict[str, Any]:
        """The totals as plain data (seconds, bytes, flops per op and per name pattern)."""
        def rows(by: str) -> list[dict[str, Any]]:
            return [dict(key=k, calls=s.calls, seconds=s.seconds, bytes=s.bytes, flops=s.flops)
                    for k, s in self.rows(by)]
        return dict(runs=self.runs, run_seconds=self.run_seconds,
                    kernel_seconds=self.kernel_seconds, by_op=rows("op"),
                    by_name=rows("name"))
