"""Memory-side primitives of the CPU's packed products (backends/cpu/qtiles.py, qpack.py) and
of the decode attention (backends/cpu/attn_decode.py): whether and how far ahead to prefetch
on this CPU, the prefetch hints themselves, an unaligned word load, the atomic counter from
which threads take runs of work, and the thread count of the parallel loops running now.
The vector arithmetic over row lanes is qlanes.py's.

- `prefetch_choice` (vendor, family) -> (locality, distance), chosen by measurement per CPU,
  and this host's PF_LOCALITY, PF_DISTANCE (benchmarks/ab_decode.py switches PF_LOCALITY
  before kernels compile, to measure the other choices);
- `prefetch` (a hint of the host's locality), `prefetch_l1` (into L1, whatever the host);
- `load_u32` (an unaligned little-endian word), `load_f32` (a float32 by address),
  `u8_ptr`, `i32_ptr`, `f32_ptr` (pointers at addresses, for numba.carray: the arrays a
  packed product reaches by address rather than as arguments, qtiles.k_mul_mat_packed),
  `fetch_add` (an atomic counter), `thread_count` (numba's threads now, callable from cached
  code), `in_order` (a compiler barrier: the loads after it are not hoisted among those
  before, so a cold stream asks for its lines in order: qtiles.k_pair).

Offsets are byte offsets into 1-D uint8 arrays; a prefetch never faults, so its offset may
run past the array's end.
"""
from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .qvec import ptr_at
from .threads import configure_openmp

_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _cpu_id() -> tuple[str, int]:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD") and cpu family ("", 0
    where unreadable)."""
    vendor, family = "", 0
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    vendor = value.strip()
                elif key.strip() == "cpu family" and value.strip().isdigit():
                    family = int(value.strip())
                if not line.strip():   # the first CPU's block is enough
                    break
    except OSError:
        pass
    return vendor, family


def prefetch_choice(vendor: str, family: int) -> tuple[int, int]:
    """(locality, distance) of the software prefetch on a CPU: `prefetch`'s llvm locality (the
    weight streams and the decode attention's rows) and how many bytes ahead the packed
    products ask for their weights' lines (0: they ask for none). Chosen by measurement:

    - Intel Xeon: prefetchnta starves the streams. On Emerald Rapids, into L2 (2: prefetcht1)
      took the packed Q8_0 mat-vec from 10 to 21-22 GB/s of the 22.6 GB/s read bandwidth at 2
      threads (benchmarks/bench_kquant.py, mv cold) and SmolLM2 tg64 from 0.85x to 1.23x
      llama.cpp. On Ice Lake (model 106), into L1 (3: prefetcht0) 16 KiB ahead beat t1 at 8
      KiB: the Qwen2.5 1.5B Q4_K 1536x8960 mat-vec 88 -> 99% of the read bandwidth at 1
      thread and 83 -> 90% at 2, and a Qwen2.5 1.5B decode step 115-119 -> 106-111 ms at 1
      thread (the L1, 48 KiB, holds 16 KiB ahead of a single stream);
    - AMD Zen 5 (family 26): non-temporal (0: prefetchnta; each line is read once per token,
      and keeping it out of L2/L3 leaves them to what is reused) 8 KiB ahead streamed Q4_K
      at 65-73% of a core's read bandwidth against 54% with none (on 4 KiB pages, before the
      packed weights moved to 2 MiB ones: backends/cpu/hugepages.py);
    - AMD Zen 4 (family 25, EPYC model 17) and any CPU not measured: none. On Zen 4 the
      hardware prefetcher streams the packed weights faster alone: prefetchnta 8 KiB ahead
      held the Qwen2.5 1.5B decode to 14.8 tok/s at 1 thread and 23.1 at 2 against 21.4 and
      29.1 without (ggraph bench tg64), prefetcht0 16 KiB ahead and prefetcht1 8 KiB to
      18.3-20.0 GB/s of Q4_K mat-vec at 1 thread against 21-24. ggml asks for none either.
      The decode attention keeps its prefetch of K/V rows ahead (attn_bind.DECODE_PREFETCH),
      non-temporal, as on Zen 5.
    """
    if vendor == "GenuineIntel":
        return 3, 16384
    if vendor == "AuthenticAMD" and family >= 26:
        return 0, 8192
    return 0, 0


PF_LOCALITY, PF_DISTANCE = prefetch_choice(*_cpu_id())


@intrinsic
def load_f32(typingctx, addr, i):
    """float32 element i of the row at address addr (an int64 from the array's ctypes.data;
    the caller keeps that array alive and i within it: nothing is checked)."""
    def codegen(context, builder, sig, args):
        base = builder.inttoptr(args[0], _F32.as_pointer())
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        return builder.load(builder.gep(base, [idx]))

    return types.float32(addr, i), codegen


@intrinsic
def load_u32(typingctx, arr, off):
    """The little-endian uint32 at byte off of a uint8 array (one unaligned load)."""
    def codegen(context, builder, sig, args):
        return builder.load(ptr_at(context, builder, sig.args[0], args[0], args[1], _I32),
                            align=1)

    return types.uint32(arr, off), codegen


def _prefetch(locality: int | None):
    """The codegen of a read prefetch of arr's line at byte off with llvm's `locality`
    (0: non-temporal .. 3: into L1; None: PF_LOCALITY as it is when a kernel compiles, which
    benchmarks/ab_decode.py switches)."""
    def codegen(context, builder, sig, args):
        level = PF_LOCALITY if locality is None else locality
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        p = builder.bitcast(builder.gep(ary.data, [args[1]]), ir.IntType(8).as_pointer())
        fnty = ir.FunctionType(ir.VoidType(), [p.type, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, level),
                          ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return codegen


@intrinsic
def prefetch(typingctx, arr, off):
    """Ask for the cache line of arr at byte off ahead of its use (a hint: never faults, so
    off may run past the array's end)."""
    return types.none(arr, off), _prefetch(None)


@intrinsic
def prefetch_l1(typingctx, arr, off):
    """Ask for the cache line of arr at byte off into L1 (prefetcht0, on every CPU): data
    read again and again that the weight stream pushes out between its uses (a hint: never
    faults, so off may run past the array's end)."""
    return types.none(arr, off), _prefetch(3)


@intrinsic
def fetch_add(typingctx, arr, i, v):
    """Atomically add v to int64 arr[i] and return the value it had: shared counters from
    which threads take units of work (no bounds check: i must be in range)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", builder.gep(ary.data, [idx]), val, "monotonic")

    return types.int64(arr, i, v), codegen


def _pointer(typingctx, addr, dtype):
    """The typing and codegen of a pointer to `dtype` at int64 address `addr`."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return types.CPointer(dtype)(addr), codegen


@intrinsic
def u8_ptr(typingctx, addr):
    """A uint8 pointer at address addr (an array's ctypes.data, which the caller keeps alive:
    numba.carray(u8_ptr(addr), n) is the array again, without its unboxing at the call)."""
    return _pointer(typingctx, addr, types.uint8)


@intrinsic
def i32_ptr(typingctx, addr):
    """An int32 pointer at address addr (as u8_ptr)."""
    return _pointer(typingctx, addr, types.int32)


@intrinsic
def f32_ptr(typingctx, addr):
    """A float32 pointer at address addr (as u8_ptr)."""
    return _pointer(typingctx, addr, types.float32)


@intrinsic
def in_order(typingctx):
    """A compiler barrier (an empty asm that clobbers memory): no load or store is moved
    across it, so the loads of the steps after it issue after those before it."""
    def codegen(context, builder, sig, args):
        builder.asm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", [], True)
        return context.get_dummy_value()

    return types.none(), codegen


def load_threads() -> None:
    """The threading layer loaded, whose `get_num_threads` the code of `thread_count` calls:
    typing a kernel that reads it loads the layer, but a kernel loaded from numba's cache is
    not typed, and its call would go to a symbol not yet there (a crash). Binders of such
    kernels call this (cheap once done)."""
    configure_openmp()          # before numba's threads start (threads.py)
    numba.get_num_threads()


@intrinsic
def thread_count(typingctx):
    """The threads numba's parallel loops run on now (numba.set_num_threads), read from the
    threading layer's symbol as those loops read it: numba.get_num_threads() in compiled
    code calls through a ctypes pointer, which keeps the caller out of the on-disk cache.
    A kernel that reads it is bound after `load_threads` (its cached code calls the layer)."""
    load_threads()              # the threading layer loaded and its symbols added

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(cgutils.intp_t, []),
                                            "get_num_threads")
        return builder.call(fn, [])

    return types.intp(), codegen


__all__ = ["PF_DISTANCE", "PF_LOCALITY", "f32_ptr", "fetch_add", "i32_ptr", "in_order",
           "load_f32", "load_threads", "load_u32", "prefetch", "prefetch_choice", "prefetch_l1",
           "thread_count", "u8_ptr"]
