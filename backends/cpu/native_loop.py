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

A decode step of Qwen2.5 1.5B at 2 threads (Zen 4) is ~460 kernel calls; SmolLM2's ~490.
"""
from __future__ import annotations

import ctypes
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
from .compile import SERIAL, steps

# the native loop instead of Python's for every graph run more than once
# (GGRAPH_CPU_NATIVE_LOOP; tests and benchmarks/ab_decode.py switch it off for the graphs
# bound meanwhile)
ENABLED = config.native_loop()

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


_DRIVER: list = []


@global_compiler_lock
def _driver():
    """`i64 drive(rows, start, n)`: each row (trampoline, kernel, words) from start to n in
    turn; 0 where all returned, else 1 + the row that failed. Called without the GIL (ctypes
    releases it), as a nogil kernel runs: no kernel's machine code needs it (only its
    wrapper, to box results and raise), and other Python threads (a server's) go on while a
    long graph runs, as they did between the Python loop's calls."""
    if _DRIVER:
        return _DRIVER[0]
    ctx = cpu_target.target_context
    lib = ctx.codegen().create_library("ggraph_drive")
    mod = ctx.create_module("ggraph_drive")
    fn = ir.Function(mod, ir.FunctionType(_I64, [_I64.as_pointer(), _I64, _I64]), "ggraph_drive")
    entry, loop, body, bad, done = (fn.append_basic_block(n) for n in
                                    ("entry", "loop", "body", "bad", "done"))
    b = ir.IRBuilder(entry)
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(_I64)
    i.add_incoming(fn.args[1], entry)
    b.cbranch(b.icmp_signed("<", i, fn.args[2]), body, done)
    b.position_at_end(body)
    row = b.mul(i, ir.Constant(_I64, 3))
    t, k, a = (b.load(b.gep(fn.args[0], [b.add(row, ir.Constant(_I64, j))])) for j in range(3))
    code = b.call(b.inttoptr(t, _TRAMPOLINE.as_pointer()), [b.inttoptr(k, _I8P),
                                                            b.inttoptr(a, _I8P)])
    nxt = b.add(i, ir.Constant(_I64, 1))
    i.add_incoming(nxt, body)
    b.cbranch(b.icmp_signed("==", code, ir.Constant(_I32, 0)), loop, bad)
    b.position_at_end(bad)
    b.ret(nxt)
    b.position_at_end(done)
    b.ret(ir.Constant(_I64, 0))
    lib.add_ir_module(mod)
    lib.finalize()
    f = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(
        lib.get_pointer_to_function("ggraph_drive"))
    _DRIVER.append((lib, f))
    return _DRIVER[0]


@dataclass
class Step:
    """One kernel call of a native run: its compile result and arguments; `checks` where its
    integer result is an index check's; `again`, the Python call that makes the step (and,
    for a check, its kernel) again, to raise its error."""
    compiled: Any
    args: tuple
    checks: bool
    again: Callable[[], None]

    @property
    def skip(self) -> int:
        """The steps `again` makes: a check's composite makes its kernel's too."""
        return 2 if self.checks else 1


@dataclass
class Native:
    """Consecutive steps run by one call of the driver."""
    steps: list[Step]
    table: np.ndarray = field(init=False)
    words: list[np.ndarray] = field(init=False)
    drive: Callable[[int, int, int], int] = field(init=False)
    at: int = field(init=False)   # the table's address

    def __post_init__(self) -> None:
        self.drive = _driver()[1]
        self.words, rows = [], []
        via = trampolines([(tuple(s.compiled.signature.args), s.compiled.signature.return_type,
                            s.checks) for s in self.steps])
        for s, t in zip(self.steps, via):
            w: list[int] = []
            for ty, v in zip(s.compiled.signature.args, s.args):
                words(ty, v, w)
            self.words.append(np.array(w or [0], np.int64))
            kernel = s.compiled.library.get_pointer_to_function(s.compiled.fndesc.llvm_func_name)
            rows.append((t, kernel, self.words[-1].ctypes.data))
        self.table = np.array(rows, np.int64).reshape(-1, 3)
        self.at = self.table.ctypes.data

    def __call__(self) -> None:
        at, n = 0, len(self.steps)
        while at < n:
            failed = self.drive(self.at, at, n)
            if not failed:
                return
            s = self.steps[failed - 1]
            s.again()   # raises the step's error, as its Python call does
            at = failed - 1 + s.skip


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
    return Step(cres, call.args, checks, again)


def lay_out(calls: list) -> list:
    """`calls` as Native runs and the Python calls between them (module docstring)."""
    out: list = []
    run: list[Step] = []

    def python(c) -> None:
        if run:
            out.append(Native(list(run)))
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
        out.append(Native(list(run)))
    return out


@dataclass
class Loop:
    """A bound call list as a Session runs it (module docstring); through `fallback` alone
    where ENABLED was off when the list was bound."""
    calls: list
    fallback: Callable[[list], None]
    enabled: bool = field(default_factory=lambda: ENABLED)
    runs: int = 0
    items: list | None = None

    def __call__(self) -> None:
        if self.items is None:
            self.runs += 1
            if self.runs < 2 or not self.enabled:
                self.fallback(self.calls)
                return
            try:
                self.items = lay_out(self.calls)
            except Exception as e:   # noqa: BLE001 - the graph still runs, through Python
                warnings.warn(f"native_loop: {len(self.calls)} calls left to the Python loop: "
                              f"laying them out failed ({type(e).__name__}: {e})",
                              RuntimeWarning, stacklevel=2)
                self.items = [partial(self.fallback, self.calls)]
        for item in self.items:
            item()
