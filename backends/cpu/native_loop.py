"""The CPU's native loop: a bound graph's kernel calls made one after the other from machine
code, with their arguments laid out once, rather than by Python calling each kernel's
compiled wrapper, which unboxes every argument at every call.

- `Loop(calls, fallback)`: what a Session runs for a bound call list (the executor's `loop`).
  Its first run goes through `fallback`, the Python loop (a prompt's graph often runs once);
  the second lays the calls out (`lay_out`) and runs them so, and so does every later run
  (a list it fails to lay out goes on through `fallback`, with a RuntimeWarning).
- `lay_out(calls)`: composites opened (compile.steps: a fusion group's calls, an index check
  and its kernel), then consecutive kernel calls whose every argument numba's data model
  describes here (arrays, numbers, booleans, tuples of arrays or of 64-bit numbers) go into
  one `Native` run; any other call stays a Python call between runs. A result landed by
  np.copyto (a buffer of the same shape and type) is a copy kernel here.
- `Native`: a table of (trampoline, kernel, arguments) rows and one driver that calls each
  row's trampoline. A trampoline is compiled once per argument signature: it loads the
  arguments from their words and calls the kernel's machine code as numba's own wrapper
  would. An array's words are numba's array struct (no meminfo: the kernel borrows the
  array, as from its wrapper; `Native` keeps every array alive). A step that fails (a
  kernel's exception, an index check that finds a bad index) is run again through Python,
  which raises its error as the Python loop would.
- A run whose parallel kernels all have a team form (a decode step's packed products and
  attention) is made by one team of threads in one parallel region (backends/cpu/team.py),
  not a fork and join of numba's threads a kernel: `lay_out(calls, team=True)`, as `Loop`
  does where TEAM was on when the list was bound. Without a team a run is the same driver's
  thread 0 alone.

A decode step of Qwen2.5 1.5B at 2 threads (Zen 4) is ~460 kernel calls; SmolLM2's ~490.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.callconv import RETCODE_NONE, RETCODE_OK
from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import cpu_target

from ggraph import config
from . import team as T
from .compile import SERIAL, overload, steps

# the native loop instead of Python's for every graph run more than once
# (GGRAPH_CPU_NATIVE_LOOP; tests and benchmarks/ab_decode.py switch it off for the graphs
# bound meanwhile)
ENABLED = config.native_loop()
# a native run whose parallel kernels a team can make runs as one team's region
# (backends/cpu/team.py; GGRAPH_CPU_TEAM; benchmarks/ab_decode.py --without team)
TEAM = config.cpu_team()

_MASK = (1 << 64) - 1
_I8P = ir.IntType(8).as_pointer()
_I32, _I64 = ir.IntType(32), ir.IntType(64)
_TRAMPOLINE = ir.FunctionType(_I32, [_I8P, _I8P])


def _copy(d, s):
    # written out: `d[...] = s` took ~3 s to compile (numba's broadcasting setitem), these
    # loops well under one
    for i0 in range(d.shape[0]):
        for i1 in range(d.shape[1]):
            for i2 in range(d.shape[2]):
                for i3 in range(d.shape[3]):
                    d[i0, i1, i2, i3] = s[i0, i1, i2, i3]


# compiled once per dtype for 4-D arrays of any layout (numba's 'A': the same words as 'C'),
# whatever each landed result's layout: one kernel from the disk cache, not one per layout
_COPY = SERIAL(_copy)


def _copy_kernel(dtype: np.dtype):
    ty = types.Array(numba.from_dtype(dtype), 4, "A")
    sig = (ty, ty)
    if sig not in _COPY.overloads:
        _COPY.compile(sig)
    return _COPY.overloads[sig]


def _supported(ty) -> bool:
    """Whether `words` lays out an argument of numba type ty."""
    if isinstance(ty, (types.Array, types.Integer, types.Boolean)):
        return True
    if isinstance(ty, types.Float):
        return ty.bitwidth in (32, 64)
    if isinstance(ty, types.UniTuple):   # 8-byte members: the tuple's words need no padding
        d = ty.dtype
        return isinstance(d, types.Array) or (isinstance(d, (types.Integer, types.Float))
                                              and d.bitwidth == 64)
    return False


def words(ty, v, out: list[int]) -> None:
    """Append argument v of numba type ty as numba's data model stores it, in int64 words
    (a number in the low bytes of its own word)."""
    if isinstance(ty, types.Array):
        out += [0, 0, v.size, v.itemsize, v.ctypes.data, *v.shape, *v.strides]
    elif isinstance(ty, types.Float):
        w = np.zeros(1, np.int64)
        w.view(np.float64 if ty.bitwidth == 64 else np.float32)[0] = v
        out.append(int(w[0]))
    elif isinstance(ty, (types.Integer, types.Boolean)):
        w = int(v) & _MASK   # two's complement in 64 bits: a uint64 past 2**63 too
        out.append(w - (1 << 64) if w >> 63 else w)
    else:   # a UniTuple (_supported)
        for x in v:
            words(ty.dtype, x, out)


def _slot(ctx, ty) -> int:
    return (ctx.get_abi_sizeof(ctx.data_model_manager[ty].get_data_type()) + 7) // 8 * 8


_TRAMPOLINES: dict[tuple, int] = {}
_LIBRARIES: list = []   # the trampolines' code, kept for the process


@global_compiler_lock
def trampolines(keys: list[tuple]) -> list[int]:
    """The addresses of the trampolines of `keys`, each (argument types, return type,
    checks): `i32 f(kernel, words)` calls the numba function at `kernel` with the arguments
    laid out in `words` and returns 0 where it returned, else its error code (1 where
    `checks` and its integer result is not negative). The missing ones are compiled together,
    one library (LLVM's passes and linking once, not once each: ~10 ms a trampoline)."""
    missing = list(dict.fromkeys(k for k in keys if k not in _TRAMPOLINES))
    if missing:
        ctx = cpu_target.target_context
        name = f"ggraph_trampolines_{len(_LIBRARIES)}"
        lib = ctx.codegen().create_library(name)
        mod = ctx.create_module(name)
        names = [f"{name}_{i}" for i in range(len(missing))]
        for key, fname in zip(missing, names):
            _trampoline(ctx, mod, fname, *key)
        lib.add_ir_module(mod)
        lib.finalize()
        _LIBRARIES.append(lib)
        for key, fname in zip(missing, names):
            _TRAMPOLINES[key] = lib.get_pointer_to_function(fname)
    return [_TRAMPOLINES[k] for k in keys]


def _trampoline(ctx, mod, name: str, args: tuple, restype, checks: bool) -> None:
    fn = ir.Function(mod, _TRAMPOLINE, name)
    b = ir.IRBuilder(fn.append_basic_block())
    fnty = ctx.call_conv.get_function_type(restype, args)
    values, off = [], 0
    for ty in args:
        dm = ctx.data_model_manager[ty]
        at = b.bitcast(b.gep(fn.args[1], [ir.Constant(_I64, off)]),
                       dm.get_data_type().as_pointer())
        values.append(dm.load_from_data_pointer(b, at))
        off += _slot(ctx, ty)
    retty = ctx.call_conv.get_return_type(restype).pointee
    ret = cgutils.alloca_once(b, retty)
    b.store(cgutils.get_null_value(retty), ret)
    exc = cgutils.alloca_once(b, fnty.args[1].pointee)
    code = b.call(b.bitcast(fn.args[0], fnty.as_pointer()),
                  [ret, exc] + list(ctx.get_arg_packer(args).as_arguments(b, values)))
    ok = b.or_(b.icmp_signed("==", code, RETCODE_OK), b.icmp_signed("==", code, RETCODE_NONE))
    if checks:
        got = b.load(ret)
        ok = b.and_(ok, b.icmp_signed("<", got, ir.Constant(got.type, 0)))
    failed = b.select(b.icmp_signed("==", code, RETCODE_OK), ir.Constant(_I32, 1), code)
    b.ret(b.select(ok, ir.Constant(_I32, 0), failed))


@dataclass
class Step:
    """One kernel call of a native run: its compile result and arguments; `checks` where its
    integer result is an index check's; `again`, the Python call that makes the step (and,
    for a check, its kernel) again, to raise its error."""
    compiled: Any
    args: tuple
    checks: bool
    again: Callable[[], None]
    forks: bool = False   # its kernel may start a parallel region of its own
    team: Any = None      # team.TeamForm: how a team makes the call

    @property
    def skip(self) -> int:
        """The steps `again` makes: a check's composite makes its kernel's too."""
        return 2 if self.checks else 1


@dataclass
class Native:
    """Consecutive steps run by one call of the driver, or by a team of `threads` threads
    where `team` and every parallel kernel of the steps has a team form (backends/cpu/team.py)."""
    steps: list[Step]
    team: bool = False
    table: np.ndarray = field(init=False)
    words: list[np.ndarray] = field(init=False)
    drive: Callable[..., int] = field(init=False)   # team.driver(), without a team
    at: int = field(init=False)   # the table's address
    threads: int = field(init=False)

    def __post_init__(self) -> None:
        self.words = []
        self.state = T.new_state()
        self.threads = _team_threads(self.steps) if self.team else 0
        if self.threads:
            self._lay_team()
            return
        # one row a step, made by the team's driver as its thread 0 alone, through ctypes
        # (which releases the GIL, as a nogil kernel runs: no kernel's machine code needs it,
        # and a server's other threads go on while a long graph runs)
        self.drive = T.driver()
        rows = self._rows([(s.compiled, s.args, s.checks) for s in self.steps])
        self.table = np.array([(0,) + r for r in rows], np.int64).reshape(-1, T.WORDS)
        self.at = self.table.ctypes.data

    def _rows(self, calls: list[tuple[Any, tuple, bool]]) -> list[tuple[int, int, int]]:
        """(trampoline, kernel, words' address) of each (compile result, arguments, checks)."""
        via = trampolines([(tuple(c.signature.args), c.signature.return_type, checks)
                           for c, _, checks in calls])
        rows = []
        for (c, args, _), t in zip(calls, via):
            w: list[int] = []
            for ty, v in zip(c.signature.args, args):
                words(ty, v, w)
            self.words.append(np.array(w or [0], np.int64))
            kernel = c.library.get_pointer_to_function(c.fndesc.llvm_func_name)
            rows.append((t, kernel, self.words[-1].ctypes.data))
        return rows

    def _lay_team(self) -> None:
        """The team's table (team.py): a step without a team form one call row, one with a
        form its parts, a shared part as its header and a row per thread."""
        n = self.threads
        kinds: list[int] = []
        calls: list[tuple[Any, tuple, bool]] = []
        self.first: list[int] = []      # each step's first row
        self.step_of: list[int] = []    # each row's step
        self.parts: list = []           # what the rows address: the parts' work memory too
        shared = 0
        for i, s in enumerate(self.steps):
            self.first.append(len(kinds))
            parts = s.team.parts(n) if s.team is not None else [None]
            self.parts += parts
            for part in parts:
                if part is None:
                    kinds.append(0)
                    calls.append((s.compiled, s.args, s.checks))
                    continue
                if not part.shared:
                    kinds.append(0)
                    calls.append((overload(part.kernel, part.args), part.args, False))
                    continue
                kinds.append(-1 - shared)   # its header: counters filled in below
                calls.append(None)
                shared += 1
                for wk in range(n):
                    args = part.args + (wk, n)
                    kinds.append(0)
                    calls.append((overload(part.kernel, args), args, False))
            self.step_of += [i] * (len(kinds) - len(self.step_of))
        self.counters = np.zeros(max(1, shared) * 16, np.int64)   # 2 lines a team step
        real = self._rows([c for c in calls if c is not None])
        rows, it = [], iter(real)
        for kind in kinds:
            if kind < 0:
                rows.append((n, self.counters.ctypes.data + 128 * (-1 - kind), 0, 0))
            else:
                rows.append((0,) + next(it))
        self.table = np.array(rows, np.int64).reshape(-1, T.WORDS)
        self.at = self.table.ctypes.data
        self.team_at = T.driver_address()   # (taken once: it holds numba's compiler lock)

    def __call__(self) -> None:
        at, n = 0, len(self.steps)
        while at < n:
            if self.threads:
                self.counters.fill(0)
                # numba's threads now (a governor may run a graph on fewer): whoever comes
                # takes the shares, so the run needs no particular number
                T.TEAM(self.team_at, self.at, self.first[at], len(self.table), self.state,
                       numba.get_num_threads())
                failed = int(self.state[T.RESULT])
                failed = self.step_of[failed - 1] + 1 if failed else 0
            else:
                failed = self.drive(self.at, at, n, 0, self.state.ctypes.data)
            if not failed:
                return
            s = self.steps[failed - 1]
            s.again()   # raises the step's error, as its Python call does
            at = failed - 1 + s.skip


def _team_threads(steps: list[Step]) -> int:
    """The team's threads for a run of `steps` (numba's now), or 0 where a team would not
    help (one thread, nothing for it to share) or may not run (a kernel without a team form
    that starts a parallel region: inside the team's it would start a nested one, more
    threads than cores)."""
    n = numba.get_num_threads()
    if n < 2 or not any(s.team is not None for s in steps):
        return 0
    return 0 if any(s.forks and s.team is None for s in steps) else n


def _native(call, checks: bool, again) -> Step | None:
    """`call` as a Step where it is a direct kernel call (compile.direct) of arguments laid
    out here; np.copyto(d, s) of one shape and type as the copy kernel's call."""
    if not isinstance(call, partial) or call.keywords:
        return None
    if call.func is np.copyto and len(call.args) == 2:
        d, s = call.args
        if not (type(d) is type(s) is np.ndarray and d.shape == s.shape and
                d.dtype == s.dtype and d.dtype.kind in "fiub" and d.ndim <= 4):
            return None
        lift = (None,) * (4 - d.ndim)   # views: 4-D with leading dimensions of 1
        return Step(_copy_kernel(d.dtype), (d[lift], s[lift]), checks, again)
    cres = getattr(call, "compiled", None)
    if cres is None or not all(_supported(t) for t in cres.signature.args):
        return None
    # a kernel returns nothing (a returned array would never be released here), a check
    # its first bad index
    ret = cres.signature.return_type
    if not (isinstance(ret, types.Integer) if checks else ret == types.none):
        return None
    return Step(cres, call.args, checks, again, getattr(call, "parallel", True),
                getattr(call, "team", None))


def lay_out(calls: list, team: bool = False) -> list:
    """`calls` as Native runs and the Python calls between them (module docstring); with
    `team`, a run a team can make is made so (Native)."""
    out: list = []
    run: list[Step] = []

    def python(c) -> None:
        if run:
            out.append(Native(list(run), team))
            run.clear()
        out.append(c)

    def add(c) -> None:
        parts = steps(c)
        if parts is None:
            s = _native(c, False, c)
            python(c) if s is None else run.append(s)
        elif parts[0][0]:   # an index check and its kernel: both native, or the composite
            check, kernel = _native(parts[0][1], True, c), _native(parts[1][1], False, c)
            if check is None or kernel is None:
                python(c)
            else:
                run.extend((check, kernel))
        else:
            for _, p in parts:
                add(p)

    for c in calls:
        add(c)
    if run:
        out.append(Native(list(run), team))
    return out


@dataclass
class Loop:
    """A bound call list as a Session runs it (module docstring); through `fallback` alone
    where ENABLED was off when the list was bound."""
    calls: list
    fallback: Callable[[list], None]
    enabled: bool = field(default_factory=lambda: ENABLED)
    team: bool = field(default_factory=lambda: TEAM)
    runs: int = 0
    items: list | None = None

    def __call__(self) -> None:
        if self.items is None:
            self.runs += 1
            if self.runs < 2 or not self.enabled:
                self.fallback(self.calls)
                return
            try:
                self.items = lay_out(self.calls, self.team)
            except Exception as e:   # noqa: BLE001 - the graph still runs, through Python
                warnings.warn(f"native_loop: {len(self.calls)} calls left to the Python loop: "
                              f"laying them out failed ({type(e).__name__}: {e})",
                              RuntimeWarning, stacklevel=2)
                self.items = [partial(self.fallback, self.calls)]
        for item in self.items:
            item()
