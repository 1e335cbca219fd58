"""How the CPU's kernels are compiled: the numba target and its compilers (parallel or
serial, with or without the fast-math flags, without the GIL for threads of our own), the size
below which a node runs on one thread, and `compiled`, which binds a template to the codecs of
its types. The kernel tables (backends/cpu/kernels.py and the training ops' modules beside it)
all bind through here. Their bound calls are made here too: `direct` calls them without
numba's dispatch, `in_turn` runs a group's calls one after the other, and `index_checked`
puts the check of data-borne indices before a kernel that would read out of bounds;
`dispatcher_calls` lists the kernel calls `direct` would make direct, composites opened, and
`steps` opens one composite into the calls it makes (backends/cpu/native_loop.py)."""
from __future__ import annotations

from functools import partial

import numba
import numpy as np
from numba.core.dispatcher import Dispatcher

from ggraph import config
from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from ..jit import Compiler, Target
from . import fastmath
from . import templates as K

PARALLEL = config.numba_parallel()
# Helpers (device functions) are not cached on disk, only the kernels that call them: numba
# links a helper loaded from its cache as machine code, which no newly compiled kernel can
# inline, so a kernel compiled after its helpers were cached in another process lost their
# vectorized loops (a GELU 10x slower). Compiled from source, every helper inlines; a cached
# kernel holds its helpers' code already and compiles none of them.
TARGET = Target(
    "cpu",
    numba.njit,
    numba.njit(fastmath={"reassoc", "contract", "nsz", "arcp"}),
    overrides=fastmath.OVERRIDES,
    device_ieee=numba.njit(error_model="numpy"),
)
KERNEL = Compiler(numba.njit, cache=True, parallel=PARALLEL)
SERIAL = Compiler(numba.njit, cache=True)
SERIAL_NOGIL = Compiler(numba.njit, cache=True, nogil=True)  # threads of our own (blas.py)
FAST_FLAGS = {"reassoc", "contract", "nsz", "arcp"}
SERIAL_NOGIL_FAST = Compiler(numba.njit, cache=True, nogil=True, fastmath=FAST_FLAGS)
KERNEL_FAST = Compiler(numba.njit, cache=True, parallel=PARALLEL, fastmath=FAST_FLAGS)
SERIAL_FAST = Compiler(numba.njit, cache=True, fastmath=FAST_FLAGS)
# Multiply-adds may fuse, nothing may reassociate: a kernel whose result must not depend on how
# LLVM optimized it (numba runs a parallel kernel's loop body optimized once where it compiled
# it, twice where it loaded it from its cache: qvec.py's fixed-order dots say more)
ORDERED_FLAGS = {"contract"}
KERNEL_ORDERED = Compiler(numba.njit, cache=True, parallel=PARALLEL, fastmath=ORDERED_FLAGS)
SERIAL_ORDERED = Compiler(numba.njit, cache=True, fastmath=ORDERED_FLAGS)
INLINE_FAST = Compiler(numba.njit, inline="always", fastmath=FAST_FLAGS)
PARALLEL_MIN_WORK = 1 << 16  # below this many element-operations threads cost more than they save
# products (multiply-adds) below this run on one thread: waking the other threads and joining
# them costs ~3 us while they spin and ~50 us once they sleep (passive waiting, the default:
# backends/cpu/threads.py), more than halving a small mat-vec saves
PARALLEL_MIN_PRODUCT = config.parallel_min_product()

# float32 exp, ~1 ulp, branch-free: loops of it vectorize (fastmath.py). Multiply-adds may
# fuse; nothing may reassociate: (x * log2e + R) - R rounds x * log2e to an integer
EXPF = numba.njit(fastmath={"contract"})(fastmath.expf)


def is_small(node: Tensor) -> bool:
    """Too little work to fork threads for: tiny element-wise ops, mat-vecs of small rows."""
    work = node.nelements
    if node.op == OpKind.SET_ROWS:  # the node is the whole destination; the rows written count
        work = node.src[1].nelements
    if node.op in (OpKind.MUL_MAT, OpKind.MUL_MAT_ID, OpKind.FLASH_ATTN_EXT):
        work *= node.src[0].ne[0] if node.op != OpKind.FLASH_ATTN_EXT else node.src[1].ne[1]
        return work < PARALLEL_MIN_PRODUCT
    return work < PARALLEL_MIN_WORK


def compiled(template, serial: bool = False, fast: bool = False, **types: T):
    """`template` bound to the codecs of `types` (role -> type): dec_<role>, enc_<role>, ...;
    `fast`: compiled with the fast-math flags (sums in any order) and the float32 `expf`."""
    names = {"expf": EXPF} if fast else {}
    for role, t in types.items():
        c = TARGET.codec(t)
        names.update({f"dec_{role}": c.dec, f"enc_{role}": c.enc, f"dot_{role}": c.dot})
    tag = "_".join(f"{r}{t}" for r, t in types.items()) + ("_serial" if serial else "") + \
        ("_fast" if fast else "")
    deco = (SERIAL_FAST if serial else KERNEL_FAST) if fast else (
        SERIAL if serial else KERNEL)
    return TARGET.bind(template, deco, tag, **names)


def compiled_for(template, node: Tensor):
    """`template` (no codecs: float32 arrays) compiled for `node`'s size: serial when the
    node is too small to fork threads for (the fused kernels of backends/cpu/fusion.py)."""
    return compiled(template, is_small(node))


def compiled_nogil(template):
    """`template` compiled serial and without the GIL, to run in threads of our own (the
    attention group of backends/cpu/attn_fusion.py), with the float32 `expf` and F16
    `round_half` bound."""
    return TARGET.bind(template, SERIAL_NOGIL_FAST, "nogil", expf=EXPF,
                       round_half=ROUND_HALF)



# b rounded to F16 and back in k_mul_mat_half: one vcvtps2ph/vcvtph2ps pair with F16C
ROUND_HALF = TARGET.device(fastmath.round_half_f16c) if fastmath.F16C else TARGET.bind(
    fastmath.round_half_soft, TARGET.device, "")


def row_decoder(t: T):
    """k_dequant_rows bound to type t's decoder, serial and without the GIL: the rows the
    BLAS paths' own threads decode (mul_mat's of a batch, out_prod's) before numpy's matmul."""
    return TARGET.bind(K.k_dequant_rows, SERIAL_NOGIL, f"a{t}_nogil", dec_a=TARGET.codec(t).dec)


# a bound call's compiled code called without numba's dispatch: 341 calls in a Qwen2.5 1.5B
# decode step, each paying the dispatcher's typing of its ~11 arguments (~3 us measured)
DIRECT = config.direct_calls()


def calls_in(*positions: int):
    """Marks a function whose positional arguments at `positions` are bound calls, or lists
    of them (in_turn, a kernel after its index check): `direct` makes those direct too."""
    def mark(f):
        f.bound_calls_at = positions
        return f
    return mark


def direct(call):
    """`call` (a bound kernel call: functools.partial of a numba dispatcher over fixed
    arguments) as a call of the machine code compiled for exactly those arguments' types
    (compiled now if it is not yet), skipping the dispatch that types every argument on each
    call; a call of a function marked by `calls_in` (a fusion group's in_turn, an index
    check and its kernel) has the calls it is bound to made so. Anything else, or a call
    whose arguments numba cannot type, is returned as it is (its dispatcher reports the
    error when it runs)."""
    if not DIRECT or not isinstance(call, partial) or call.keywords:
        return call
    f = call.func
    if not isinstance(f, Dispatcher):
        at = getattr(f, "bound_calls_at", ())
        if not at:
            return call
        args = list(call.args)
        for i in at:
            args[i] = [direct(c) for c in args[i]] if isinstance(args[i], list) \
                else direct(args[i])
        return partial(f, *args)
    try:
        cres = overload(f, call.args)
    except Exception:   # noqa: BLE001 - the dispatcher's own call says what is wrong
        return call
    out = partial(cres.entry_point, *call.args)
    out.__dict__.update(call.__dict__)   # what the call keeps alive (kernels.packed_call's)
    # the compile result whose machine code the call runs (native_loop.py calls it natively)
    out.compiled = cres
    out.parallel = bool(f.targetoptions.get("parallel"))   # it may start a parallel region
    return out


def overload(f: Dispatcher, args: tuple):
    """f's compile result for the types of `args` (compiled now where it is not yet; one
    compiled already is found without compile()'s locks and events)."""
    sig = tuple(arg_type(f, a) for a in args)
    done = f.overloads.get(sig)
    if done is None:
        f.compile(sig)
        done = f.overloads[sig]
    return done


def dispatcher_calls(calls, teams: bool = False) -> list[partial]:
    """The bound kernel calls among `calls` that `direct` makes direct (partials of a numba
    dispatcher), the ones inside a function marked by `calls_in` too, and with `teams` the
    calls of each one's team form (backends/cpu/team.py: what a native run's team would
    make) while the form's kernel has compiled nothing in this process (a graph bound again
    each 256 cells makes no parts' work memory then), in order (what compile_ahead.py
    compiles before `direct` runs)."""
    out: list[partial] = []

    def walk(call) -> None:
        if not isinstance(call, partial) or call.keywords:
            return
        if isinstance(call.func, Dispatcher):
            out.append(call)
            team = getattr(call, "team", None) if teams else None
            if team is not None and team.kernel is not None and team.kernel.overloads:
                team = None
            for part in team.parts(2) if team is not None else ():
                out.append(partial(part.kernel, *part.args, *((0, 2) if part.shared else ())))
            return
        for i in getattr(call.func, "bound_calls_at", ()):
            for c in call.args[i] if isinstance(call.args[i], list) else [call.args[i]]:
                walk(c)

    for c in calls:
        walk(c)
    return out


# numba's type of an ndarray argument by what it is made of: numba.typeof builds it in Python
# each time (~10 us), and a decode graph bound again when its cache view grows a step of cells
# types ~3400 arguments (30 of the ~75 ms that binding took for Qwen2.5 0.5B, Zen 4)
_ARRAY_TYPES: dict[tuple, object] = {}


def arg_type(f: Dispatcher, a: object) -> object:
    """numba's type of argument `a` (f.typeof_pyval's), plain ndarrays and tuples of them from
    a cache keyed by dtype, dimensions, layout, writability and alignment: all numba's Array
    type depends on."""
    if type(a) is np.ndarray:
        fl = a.flags
        key = (a.dtype, a.ndim, fl.c_contiguous, fl.f_contiguous, fl.writeable, fl.aligned)
        t = _ARRAY_TYPES.get(key)
        if t is None:
            t = _ARRAY_TYPES[key] = f.typeof_pyval(a)
        return t
    if type(a) is tuple and a and all(type(x) is np.ndarray for x in a):
        return numba.types.BaseTuple.from_types([arg_type(f, x) for x in a])
    return f.typeof_pyval(a)


def steps(call) -> list[tuple[bool, object]] | None:
    """What a composite call (`in_turn`'s group, `index_checked`'s check and kernel) does, in
    order, as (checks, call): a call that `checks` returns the first bad index (negative
    where there is none), after which the composite raises (backends/cpu/native_loop.py
    runs the steps from machine code). None where `call` is not a composite."""
    if not isinstance(call, partial) or call.keywords:
        return None
    if call.func is in_turn:
        return [(False, call.args[0])] + [(False, c) for c in call.args[1]]
    if call.func is _checked:
        return [(True, call.args[4]), (False, call.args[5])]
    return None


@calls_in(0, 1)
def in_turn(first, rest) -> None:
    """Calls `first`, then each of `rest` (a fusion group whose members run by their own
    calls: backends/cpu/fusion.py)."""
    first()
    for c in rest:
        c()


_FIRST_BAD_INDEX = SERIAL(K.k_first_bad_index)


def index_checked(node: Tensor, idx: np.ndarray, n: int, what: str, run) -> partial:
    """`run` (a bound call) after a check of its indices `idx`, which come from data (tokens,
    cache cells, routing): the kernels do not bounds-check (numba), so an index outside
    [0, n) is an error naming the node instead of a crash."""
    i4 = idx[(None,) * (4 - idx.ndim)]   # a view (never a copy): the check reads each run's ids
    return partial(_checked, node, i4, n, what, partial(_FIRST_BAD_INDEX, i4, n), run)


@calls_in(4, 5)
def _checked(node: Tensor, i4: np.ndarray, n: int, what: str, check, run) -> None:
    at = check()
    if at >= 0:
        raise IndexError(f"{node.op} {node.describe()}: {what} {i4.reshape(-1)[at]} is "
                         f"outside [0, {n})")
    run()
