"""A native run made by a team of threads in one parallel region (backends/cpu/native_loop.py).

A decode step forks and joins numba's threads at every packed product and decode attention
(~170 times a Qwen2.5 1.5B token): a region's launch and join cost 1.6-2.6 and 1.0-1.4 us on
the 2-core AMD EPYC, more where the two vCPUs sit on different CCDs. Here the threads enter
one region for the whole run instead: thread 0 makes the run's calls in order, and at a team
step (a product or an attention cut into shares) publishes the step, and every thread takes
shares of it from the step's counter until none is left; thread 0 then waits until each share
taken has finished. The other threads wait between team steps, spinning on the published
step. Paired decode A/Bs at 2 threads (Zen 4; benchmarks/ab_decode.py --without team):
Qwen2.5 1.5B 0.5-0.8 ms a token faster of 20-31, SmolLM2 0.25-0.35 of 4-5.

A call a team can make carries its `team` form (TeamForm: the kernel calls of its parts, the
work memory they share made for the run's threads): the packed products of up to 3 columns
(kernels.packed_call: qtiles.k_packed_team) and the decode attention (attn_bind:
attn_decode.k_attn_team). Their shares run the same functions the kernels' own threads run,
so the bits are the same.

The table a team run walks has rows of 4 int64 words (kind, trampoline, kernel, argument
words): kind 0 a call (native_loop's trampoline of the kernel and its words); kind S > 0 a team
step whose S shares are the S rows after it (their own calls), its second word the address of
its two counters (shares taken, at byte 0; shares done, at byte 64), zeroed before each run.

Nothing waits on a thread that never arrives: a share is taken by whichever thread asks first,
so thread 0 takes them all when the others are late (or when numba runs the region's
iterations on fewer threads), and a late thread finds the step taken and the run ended.
No kernel of a team run may fork threads of its own (a parallel region inside the region
starts a nested team, more threads than cores: a kernel called so took 3.4 ms instead of
microseconds): native_loop lays out a team run only where every call is serial or has a form.

`ggraph_team(rows, start, n, tid, state)` runs rows start..n as thread `tid`: thread 0
returns 0 where every call returned, else 1 + the row that failed (the run stops there; a
share's failure ends its step first). `TEAM` is the region.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable

import numba
import numpy as np
from llvmlite import binding as llvm, ir
from numba import prange, types
from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from .compile import Compiler, PARALLEL

_I8P = ir.IntType(8).as_pointer()
_I32, _I64 = ir.IntType(32), ir.IntType(64)
_I64P = _I64.as_pointer()
_TRAMPOLINE = ir.FunctionType(_I32, [_I8P, _I8P])
_TEAM = ir.FunctionType(_I64, [_I64P, _I64, _I64, _I64, _I64P])

WORDS = 4          # a row's words
NONE, END = -1, -2  # the published step before the first and after the run
# state words, a cache line apart: the published step, the row that failed (+ 1), the result
STEP, FAILED, RESULT = 0, 8, 16
STATE_WORDS = 24

def _pause(b: ir.IRBuilder) -> None:
    """A spin-wait hint where the CPU has one (x86's pause)."""
    if llvm.get_process_triple().startswith(("x86_64", "i686", "i386")):
        fn = b.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(
            ir.VoidType(), []))
        b.call(fn, [])


def _word(b: ir.IRBuilder, base, i) -> ir.Value:
    return b.gep(base, [i if isinstance(i, ir.Value) else ir.Constant(_I64, i)])


def _call_row(b: ir.IRBuilder, rows, r) -> ir.Value:
    """The i32 code of row r's call."""
    at = b.mul(r, ir.Constant(_I64, WORDS))
    t, k, a = (b.load(_word(b, rows, b.add(at, ir.Constant(_I64, j)))) for j in (1, 2, 3))
    return b.call(b.inttoptr(t, _TRAMPOLINE.as_pointer()), [b.inttoptr(k, _I8P),
                                                            b.inttoptr(a, _I8P)])


def _take_shares(fn: ir.Function, b: ir.IRBuilder, rows, state, step, tag: str) -> None:
    """Shares of the team step at row `step` taken from its counter and run until none is
    left; each run share counted done; a failed one recorded in FAILED (first failure wins).
    Leaves b after the loop."""
    at = b.mul(step, ir.Constant(_I64, WORDS))
    shares = b.load(_word(b, rows, at))
    cnt = b.inttoptr(b.load(_word(b, rows, b.add(at, ir.Constant(_I64, 1)))), _I64P)
    done = _word(b, cnt, 8)
    take, run, out = (fn.append_basic_block(f"{tag}_{n}") for n in ("take", "run", "out"))
    b.branch(take)
    b.position_at_end(take)
    k = b.atomic_rmw("add", cnt, ir.Constant(_I64, 1), "seq_cst")
    b.cbranch(b.icmp_signed("<", k, shares), run, out)
    b.position_at_end(run)
    row = b.add(b.add(step, ir.Constant(_I64, 1)), k)
    code = _call_row(b, rows, row)
    failed = b.icmp_signed("!=", code, ir.Constant(_I32, 0))
    mark = b.select(failed, b.add(row, ir.Constant(_I64, 1)), ir.Constant(_I64, 0))
    with b.if_then(failed):
        b.cmpxchg(_word(b, state, FAILED), ir.Constant(_I64, 0), mark, "seq_cst", "seq_cst")
    b.atomic_rmw("add", done, ir.Constant(_I64, 1), "seq_cst")
    b.branch(take)
    b.position_at_end(out)


def _build(mod: ir.Module) -> None:
    fn = ir.Function(mod, _TEAM, "ggraph_team")
    rows, start, n, tid, state = fn.args
    entry = fn.append_basic_block("entry")
    b = ir.IRBuilder(entry)
    lead, wait_top = fn.append_basic_block("lead"), fn.append_basic_block("wait")
    b.cbranch(b.icmp_signed("==", tid, ir.Constant(_I64, 0)), lead, wait_top)

    # -- thread 0: the rows in order ----------------------------------------------------------
    b.position_at_end(lead)
    loop, body, call, team, bad, end = (fn.append_basic_block(x) for x in (
        "loop", "body", "call", "team", "bad", "end"))
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(_I64)
    i.add_incoming(start, lead)
    b.cbranch(b.icmp_signed("<", i, n), body, end)
    b.position_at_end(body)
    kind = b.load(_word(b, rows, b.mul(i, ir.Constant(_I64, WORDS))))
    b.cbranch(b.icmp_signed("==", kind, ir.Constant(_I64, 0)), call, team)
    b.position_at_end(call)
    code = _call_row(b, rows, i)
    nxt = b.add(i, ir.Constant(_I64, 1))
    i.add_incoming(nxt, call)
    b.cbranch(b.icmp_signed("==", code, ir.Constant(_I32, 0)), loop, bad)
    b.position_at_end(bad)
    b.branch(end)
    # a team step: published, shares taken, then every share taken waited for
    b.position_at_end(team)
    b.store_atomic(i, _word(b, state, STEP), "seq_cst", 8)
    _take_shares(fn, b, rows, state, i, "lead")
    at = b.mul(i, ir.Constant(_I64, WORDS))
    cnt = b.inttoptr(b.load(_word(b, rows, b.add(at, ir.Constant(_I64, 1)))), _I64P)
    spin, idle, after = (fn.append_basic_block(x) for x in ("spin", "idle", "after"))
    b.branch(spin)
    b.position_at_end(spin)
    got = b.load_atomic(_word(b, cnt, 8), "acquire", 8)
    b.cbranch(b.icmp_signed("<", got, kind), idle, after)
    b.position_at_end(idle)
    _pause(b)
    b.branch(spin)
    b.position_at_end(after)
    failed = b.load_atomic(_word(b, state, FAILED), "acquire", 8)
    step_end = b.add(b.add(i, ir.Constant(_I64, 1)), kind)
    i.add_incoming(step_end, after)
    b.cbranch(b.icmp_signed("==", failed, ir.Constant(_I64, 0)), loop, end)
    b.position_at_end(end)
    res = b.phi(_I64)
    res.add_incoming(ir.Constant(_I64, 0), loop)
    res.add_incoming(nxt, bad)
    res.add_incoming(failed, after)
    b.store_atomic(ir.Constant(_I64, END), _word(b, state, STEP), "seq_cst", 8)
    b.ret(res)

    # -- the other threads: each published step's shares, until the run ends -----------------
    b.position_at_end(wait_top)
    poll, seen_new, same, take = (fn.append_basic_block(x) for x in (
        "poll", "new", "same", "take"))
    b.branch(poll)
    b.position_at_end(poll)
    seen = b.phi(_I64)
    seen.add_incoming(ir.Constant(_I64, NONE), wait_top)
    cur = b.load_atomic(_word(b, state, STEP), "acquire", 8)
    finished = fn.append_basic_block("finished")
    check_new = fn.append_basic_block("check_new")
    b.cbranch(b.icmp_signed("==", cur, ir.Constant(_I64, END)), finished, check_new)
    b.position_at_end(check_new)
    fresh = b.and_(b.icmp_signed("!=", cur, seen), b.icmp_signed(">=", cur, ir.Constant(
        _I64, 0)))
    b.cbranch(fresh, take, same)
    b.position_at_end(same)
    _pause(b)
    seen.add_incoming(seen, same)
    b.branch(poll)
    b.position_at_end(take)
    _take_shares(fn, b, rows, state, cur, "help")
    b.branch(seen_new)
    b.position_at_end(seen_new)
    seen.add_incoming(cur, seen_new)
    b.branch(poll)
    b.position_at_end(finished)
    b.ret(ir.Constant(_I64, 0))


_DRIVER: dict[str, Any] = {}   # the driver's library (kept for the process), address, ctypes


@global_compiler_lock
def driver_address() -> int:
    """The driver's address (compiled once a process)."""
    if not _DRIVER:
        ctx = cpu_target.target_context
        lib = ctx.codegen().create_library("ggraph_team")
        mod = ctx.create_module("ggraph_team")
        _build(mod)
        lib.add_ir_module(mod)
        lib.finalize()
        address = lib.get_pointer_to_function("ggraph_team")
        _DRIVER.update(lib=lib, address=address, call=ctypes.CFUNCTYPE(
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_void_p)(address))
    return _DRIVER["address"]


def driver() -> Callable[..., int]:
    """The driver as a ctypes function of (rows, start, n, tid, state): a run without a team
    is its thread 0 alone (ctypes releases the GIL for the call)."""
    driver_address()
    return _DRIVER["call"]


@intrinsic
def _call_team(typingctx, drive, rows, start, n, tid, state):
    """drive(rows, start, n, tid, state) through its address (an argument: the kernel that
    calls it stays in numba's disk cache)."""
    def codegen(context, builder, sig, args):
        f = builder.inttoptr(args[0], _TEAM.as_pointer())
        return builder.call(f, [builder.inttoptr(args[1], _I64P), args[2], args[3], args[4],
                                builder.inttoptr(args[5], _I64P)])

    return types.int64(drive, rows, start, n, tid, state), codegen


def k_team(drive, rows, start, n, state, threads):
    """The team region: thread t of `threads` runs the driver as thread t; thread 0's
    result lands in state[RESULT]."""
    at = state.ctypes.data
    state[STEP] = NONE
    state[FAILED] = 0
    state[RESULT] = 0
    for t in prange(threads):
        r = _call_team(drive, rows, start, n, t, at)
        if t == 0:
            state[RESULT] = r


# nogil: the region runs as the native loop's driver does, without the GIL
TEAM = Compiler(numba.njit, cache=True, parallel=PARALLEL, nogil=True)(k_team)


def new_state() -> np.ndarray:
    return np.zeros(STATE_WORDS, np.int64)


@dataclass(frozen=True)
class Part:
    """One call of a team's form of a kernel call: `kernel` (a dispatcher) on `args`, by
    thread 0 alone, or `shared`: once a share, with (share, shares) after args."""
    kernel: Any
    args: tuple
    shared: bool = False


@dataclass(frozen=True)
class TeamForm:
    """How a team makes a bound kernel call (its `team` attribute): `parts(threads)`, the
    calls in order, with the work memory they share made for that many threads; `kernel`,
    the one dispatcher they call where there is one (whether it has compiled is known
    without making the parts)."""
    parts: Callable[[int], list[Part]]
    kernel: Any = None
