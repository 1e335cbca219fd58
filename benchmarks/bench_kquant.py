"""The kernel table: quantized mat-vec and mat-mat speed per weight type, ggraph's CPU products
beside ggml's own kernels (libggml: its plain CPU buffer and its CPU_REPACK buffer) and the
machine's read bandwidth, all measured in the same run.

For each weight type (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0, Q4_1, IQ4_XS; with --extras also
Q2_K and Q3_K, which ggraph does not pack) and shape, at each thread count (1 and 2):

- "mv cold" (n=1): a graph of R mul_mats over R copies of the weight, >= 512 MiB in all (16
  times the 32 MiB L3), so the weights stream from DRAM as in a real decode step: GB/s of
  stored (GGUF) weight bytes, and that as a share of the read bandwidth;
- "mv hot" (n=1, the small reference shape only): HOT_COPIES copies of the weight (~12 MiB
  for the Q4_K shape), in cache after the first call: one graph of them, so that a graph
  run's own fixed cost (ggraph's Session.run, ~0.1 ms of Python; ggml's graph_compute) is
  shared by 16 products rather than charged to one;
- "mm 512" (n=512, the Qwen2.5-1.5B shapes): a prompt's product, GFLOPS (2 K M n / time).

Shapes (weight ne [K, M] times activations [K, n]): Gemma-3-270M FFN down 2048 -> 640 (small,
for reference), Qwen2.5-1.5B FFN up 1536 -> 8960 and down 8960 -> 1536, Qwen2.5-7B FFN up
3584 -> 18944.

- ggml: libggml (llama-cpp-python's build) through cffi, the weights in ggml's plain CPU buffer
  (ggml_backend_cpu_buffer_type), ggml_backend_graph_compute on a CPU backend of n threads;
- ggml-repack: the same graph with the weights in the CPU device's extra buffer type
  CPU_REPACK (from the backend registry: ggml_backend_cpu_reg's proc address
  "ggml_backend_dev_get_extra_bufts"), where llama.cpp puts them at load; the activations
  stay in a plain buffer. "-" where the device does not take the product from that buffer
  (ggml_backend_dev_supports_op, llama.cpp's test: ggml does not repack the type on this CPU);
- ggraph: the same graph on ggraph's CPU backend at exactly n threads (no governor), the
  weights leaf tensors holding the same bytes, packed by the backend as when a model loads
  (its PackStore reading them through a WeightSource). The path that ran is reported:
  "packed" when the backend holds a packed copy of every weight, else the unpacked route.

Weights are quantized by ggml (ggml_quantize_chunk) from N(0, 1) data; ggml-repack's and
ggraph's results are checked against ggml's plain ones by NMSE. The read bandwidth is
ggraph.backends.cpu.membw's (a numba parallel reduction over 1 GiB, as `ggraph bench` takes
it) at each thread count, 5 reads at the start of the run and 5 at the end; the best is the
denominator of every share, as the kernels' times are their best: >= 3 calls over >= 0.3 s
after a warm-up call (the JSON keeps the medians too). The table says "x ggml" (ggraph over
ggml plain) and "x llama" (over what llama.cpp runs: ggml-repack where ggml repacks the type,
else plain).

    python benchmarks/bench_kquant.py [--threads 1 2] [--types Q4_K Q6_K] [--extras]
        [--shapes 1.5B-up 7B-up] [--quick] [--no-ggraph] [--json PATH]
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ggraph.backends.cpu.membw import read_bandwidth
from ggraph.backends.cpu.threads import configure_openmp
from ggraph.check.ggml_cdefs import GGMLUnavailable, find_libggml
from ggraph.graphs.eval.bench import load_average, machine_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, OwnBytes, header_lines, out_option, results_path, row_line,
                      threads_option, write_results)

# weight type -> ggml_type id, block size, bytes per block (ggml.h / ggml-common.h)
TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
    "Q8_0": (8, 32, 34), "Q4_0": (2, 32, 18), "Q5_0": (6, 32, 22), "Q4_1": (3, 32, 20),
    "IQ4_XS": (23, 256, 136), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110),
}
ISSUE_TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "Q4_1", "IQ4_XS"]
EXTRA_TYPES = ["Q2_K", "Q3_K"]
GGML_F32 = 0
COLD_BYTES = 512 << 20   # weight bytes one cold graph streams: 16 times the 32 MiB L3
HOT_COPIES = 16          # products in one "mv hot" graph (their weights stay in L3)


@dataclass(frozen=True)
class Shape:
    key: str               # --shapes name
    label: str
    k: int                 # row length (weight ne[0])
    m: int                 # rows (weight ne[1])
    modes: tuple[str, ...]


SHAPES = [Shape("small", "gemma3 ffn_down", 2048, 640, ("mv hot", "mv cold")),
          Shape("1.5B-up", "1.5B ffn_up", 1536, 8960, ("mv cold", "mm 512")),
          Shape("1.5B-down", "1.5B ffn_down", 8960, 1536, ("mv cold", "mm 512")),
          Shape("7B-up", "7B ffn_up", 3584, 18944, ("mv cold",))]
N_COLUMNS = {"mv hot": 1, "mv cold": 1, "mm 512": 512}  # activation columns per mode
ENGINES = ("ggml", "repack", "ggraph")


def timed(fn: Callable[[], Any], min_s: float = 0.3, max_reps: int = 100) -> tuple[float, float]:
    """(best, median) seconds of fn over >= 3 calls and >= min_s, after a warm-up call."""
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + min_s
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


# -- libggml -------------------------------------------------------------------------------------

# Only what this benchmark calls, with tensors opaque: no dependence on struct ggml_tensor's
# layout (ggraph.check.ggml_cdefs declares it in full and checks it, for ggraph.check.ggml_ref).
_CDEFS = """
struct ggml_context; struct ggml_tensor; struct ggml_cgraph; struct ggml_backend;
struct ggml_backend_buffer; struct ggml_backend_buffer_type; struct ggml_backend_reg;
struct ggml_backend_device;
typedef struct ggml_backend_buffer_type ** (*get_extra_bufts_t)(struct ggml_backend_device *);
typedef void (*ggml_log_callback)(int level, const char * text, void * user_data);
void ggml_log_set(ggml_log_callback log_callback, void * user_data);
struct ggml_init_params { size_t mem_size; void * mem_buffer; bool no_alloc; };
const char * ggml_version(void);
const char * ggml_commit(void);
size_t ggml_tensor_overhead(void);
size_t ggml_graph_overhead_custom(size_t size, bool grads);
struct ggml_context * ggml_init(struct ggml_init_params params);
void ggml_free(struct ggml_context * ctx);
struct ggml_tensor * ggml_new_tensor_4d(struct ggml_context * ctx, int type,
        int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
size_t ggml_nbytes(const struct ggml_tensor * tensor);
struct ggml_tensor * ggml_mul_mat(struct ggml_context * ctx, struct ggml_tensor * a,
        struct ggml_tensor * b);
struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
struct ggml_backend_buffer_type * ggml_backend_cpu_buffer_type(void);
const char * ggml_backend_buft_name(struct ggml_backend_buffer_type * buft);
struct ggml_backend_buffer * ggml_backend_alloc_ctx_tensors_from_buft(struct ggml_context * ctx,
        struct ggml_backend_buffer_type * buft);
void ggml_backend_buffer_free(struct ggml_backend_buffer * buffer);
void ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset,
        size_t size);
void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset,
        size_t size);
int  ggml_backend_graph_compute(struct ggml_backend * backend, struct ggml_cgraph * cgraph);
void ggml_backend_free(struct ggml_backend * backend);
struct ggml_backend_device * ggml_backend_reg_dev_get(struct ggml_backend_reg * reg,
        size_t index);
void * ggml_backend_reg_get_proc_address(struct ggml_backend_reg * reg, const char * name);
bool ggml_backend_dev_supports_op(struct ggml_backend_device * device,
        const struct ggml_tensor * op);
size_t ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start,
        int64_t nrows, int64_t n_per_row, const float * imatrix);
"""
_CPU_CDEFS = """
struct ggml_backend * ggml_backend_cpu_init(void);
void ggml_backend_cpu_set_n_threads(struct ggml_backend * backend_cpu, int n_threads);
struct ggml_backend_reg * ggml_backend_cpu_reg(void);
"""


class NotTaken(Exception):
    """ggml's CPU device does not run this product from the buffer type asked for."""


class LibGGML:
    """libggml-base and libggml-cpu through cffi (GGMLUnavailable where absent), the CPU
    device and its extra buffer types (CPU_REPACK, ...) from the backend registry."""

    def __init__(self) -> None:
        self.dir = find_libggml()
        try:
            import cffi
        except ImportError:
            raise GGMLUnavailable("the cffi package is missing: pip install 'cffi>=1.16'")
        self.ffi = ffi = cffi.FFI()
        ffi.cdef(_CDEFS)
        ffi.cdef(_CPU_CDEFS)
        ext = ".dylib" if platform.system() == "Darwin" else ".so"
        flags = ffi.RTLD_NOW | ffi.RTLD_GLOBAL
        # the OpenMP runtime's bounded spin before libggml-cpu loads the libgomp numba shares
        # (backends/cpu/threads.py), so neither side's idle threads spin long
        configure_openmp()
        self.base = ffi.dlopen(str(self.dir / f"libggml-base{ext}"), flags)
        self.cpu = ffi.dlopen(str(self.dir / f"libggml-cpu{ext}"), flags)
        self._quiet_logs()
        reg = self.cpu.ggml_backend_cpu_reg()
        self.dev = self.base.ggml_backend_reg_dev_get(reg, 0)
        self.extra: dict[str, Any] = {}
        fp = self.base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if fp != ffi.NULL:
            arr = ffi.cast("get_extra_bufts_t", fp)(self.dev)
            i = 0
            while arr != ffi.NULL and arr[i] != ffi.NULL:
                self.extra[ffi.string(self.base.ggml_backend_buft_name(arr[i])).decode()] = arr[i]
                i += 1

    def _quiet_logs(self) -> None:
        """ggml's warnings and errors to stderr, its debug and info lines dropped (the
        repack buffer logs a line per tensor it rewrites)."""
        last = [0]

        def log(level: int, text: Any, _: Any) -> None:
            if level != 5:   # GGML_LOG_LEVEL_CONT continues the line before
                last[0] = level
            if last[0] >= 3:  # GGML_LOG_LEVEL_WARN and up
                sys.stderr.write(self.ffi.string(text).decode(errors="replace"))

        self._log = self.ffi.callback("ggml_log_callback", log)   # kept alive with self
        self.base.ggml_log_set(self._log, self.ffi.NULL)

    def describe(self) -> str:
        s = self.ffi.string
        return (f"libggml {s(self.base.ggml_version()).decode()} (commit "
                f"{s(self.base.ggml_commit()).decode()}) from {self.dir}; CPU extra buffer "
                f"types: {', '.join(self.extra) or 'none'}")

    def new_context(self, n_tensors: int, graph_size: int = 0) -> Any:
        b = self.base
        mem = (n_tensors + 4) * b.ggml_tensor_overhead() + 1024
        if graph_size:
            mem += b.ggml_graph_overhead_custom(graph_size, False)
        ctx = b.ggml_init({"mem_size": mem, "mem_buffer": self.ffi.NULL, "no_alloc": True})
        if ctx == self.ffi.NULL:
            raise MemoryError(f"ggml_init failed for a context of {mem} bytes")
        return ctx

    def quantize(self, name: str, w: np.ndarray) -> np.ndarray:
        """ggml's own quantizer (ggml_quantize_chunk, no importance matrix): rows of w."""
        tid, block, size = TYPES[name]
        w = np.ascontiguousarray(w, dtype=np.float32)
        rows, k = w.shape
        out = np.zeros(rows * (k // block) * size, np.uint8)
        self.base.ggml_quantize_chunk(tid, self.ffi.cast("float *", w.ctypes.data),
                                      self.ffi.cast("void *", out.ctypes.data), 0, rows, k,
                                      self.ffi.NULL)
        return out


class GGMLMulMat:
    """R mul_mats of one weight type (R copies of the weight bytes, in buffer type `buft`:
    ggml's plain CPU buffer by default) sharing activations x (in a plain CPU buffer)."""

    def __init__(self, lib: LibGGML, name: str, wbytes: np.ndarray, k: int, m: int, n: int,
                 copies: int, buft: Any = None) -> None:
        self.lib, b, ffi = lib, lib.base, lib.ffi
        self.bufs: list[Any] = []
        self.backend = None
        self.ctx_w = lib.new_context(copies)
        self.ctx = lib.new_context(copies + 1, graph_size=2 * copies + 8)
        try:
            self.x = b.ggml_new_tensor_4d(self.ctx, GGML_F32, k, n, 1, 1)
            self.graph = b.ggml_new_graph_custom(self.ctx, 2 * copies + 8, False)
            ws, self.outs = [], []
            for _ in range(copies):
                w = b.ggml_new_tensor_4d(self.ctx_w, TYPES[name][0], k, m, 1, 1)
                o = b.ggml_mul_mat(self.ctx, w, self.x)
                b.ggml_build_forward_expand(self.graph, o)
                ws.append(w)
                self.outs.append(o)
            plain = b.ggml_backend_cpu_buffer_type()
            for ctx, bt in ((self.ctx_w, buft or plain), (self.ctx, plain)):
                buf = b.ggml_backend_alloc_ctx_tensors_from_buft(ctx, bt)
                if buf == ffi.NULL:
                    raise MemoryError("ggml_backend_alloc_ctx_tensors_from_buft failed")
                self.bufs.append(buf)
            if buft is not None and not b.ggml_backend_dev_supports_op(lib.dev, self.outs[0]):
                raise NotTaken(f"ggml's CPU device does not run {name} from "
                               f"{ffi.string(b.ggml_backend_buft_name(buft)).decode()}")
            assert b.ggml_nbytes(ws[0]) == wbytes.nbytes
            for w in ws:   # a repack buffer rewrites the blocks here, as at model load
                b.ggml_backend_tensor_set(w, ffi.from_buffer(wbytes), 0, wbytes.nbytes)
            self.backend = lib.cpu.ggml_backend_cpu_init()
        except BaseException:
            self.close()
            raise
        self.shape = (n, m)

    def threads(self, n: int) -> None:
        self.lib.cpu.ggml_backend_cpu_set_n_threads(self.backend, n)

    def set_x(self, xv: np.ndarray) -> None:
        xv = np.ascontiguousarray(xv, np.float32)
        self.lib.base.ggml_backend_tensor_set(self.x, self.lib.ffi.from_buffer(xv), 0, xv.nbytes)

    def __call__(self) -> None:
        status = self.lib.base.ggml_backend_graph_compute(self.backend, self.graph)
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute failed with status {status}")

    def result(self) -> np.ndarray:
        out = np.empty(self.shape, np.float32)
        self.lib.base.ggml_backend_tensor_get(self.outs[0], self.lib.ffi.from_buffer(out), 0,
                                              out.nbytes)
        return out

    def close(self) -> None:
        b = self.lib.base
        for buf in self.bufs:
            b.ggml_backend_buffer_free(buf)
        self.bufs = []
        if self.backend is not None:
            b.ggml_backend_free(self.backend)
            self.backend = None
        for ctx in (self.ctx_w, self.ctx):
            b.ggml_free(ctx)
        self.ctx_w = self.ctx = self.lib.ffi.NULL


# -- ggraph --------------------------------------------------------------------------------------

class GGraphMulMat:
    """The same R mul_mats as a ggraph graph: weight leaves (each its own copy of the bytes)
    times an input x, run on a CPU backend of exactly n threads."""

    def __init__(self, name: str, wbytes: np.ndarray, k: int, m: int, n: int,
                 copies: int) -> None:
        from ggraph import Context, build_graph, ops as O
        from ggraph.ir.types import GGMLType

        self.type, self.n, self.copies = GGMLType[name], n, copies
        ctx = Context()
        self.x = ctx.new_tensor(GGMLType.F32, (k, n), "x").set_input()
        self.outs = []
        for i in range(copies):
            w = ctx.new_tensor(self.type, (k, m), f"w{i}")
            w.data = np.array(wbytes, dtype=np.uint8, copy=True)   # its own memory
            self.outs.append(O.mul_mat(w, self.x))
        self.graph = build_graph(*self.outs)

    def run_at(self, threads: int, xv: np.ndarray, min_s: float
               ) -> tuple[float, float, np.ndarray, str, int]:
        """(best s, median s, the first product's result, the path that ran, packed bytes)
        at `threads` threads; the backend (and its packed copies) is dropped afterwards."""
        import numba

        from ggraph.backends import get_backend

        backend = get_backend("cpu", n_threads=threads, adaptive=False, weights=OwnBytes())
        session = None
        try:
            numba.set_num_threads(threads)
            session = backend.session()
            feed = {self.x: xv}
            session.run(self.graph, feed)   # packs the weights (PackStore) on first use
            first = np.array(session.read(self.outs[0]))
            best, med = timed(lambda: session.run(self.graph, feed), min_s)
            packs = backend.packs
            n_packed = len(packs) if packs is not None else 0
            packed_bytes = packs.nbytes if packs is not None else 0
        finally:
            session = backend = None   # its packed copies go with it
            gc.collect()
        return best, med, first, self._path(n_packed), packed_bytes

    def _path(self, n_packed: int) -> str:
        """The route the products took: "packed" (backends/cpu/qtiles.py) when the backend
        holds a packed copy of every weight; else the route kernels._mul_mat gives an unpacked
        weight (row dots below BLAS_MIN_N columns, then the integer GEMM or BLAS)."""
        from ggraph.backends.cpu.kernels import BLAS_MIN_N, GEMMS

        if n_packed == self.copies:
            return "packed"
        if n_packed:
            return f"packed {n_packed}/{self.copies}?"
        if self.n < BLAS_MIN_N:
            return "unpacked: rows"
        return f"unpacked: {'gemm' if self.type in GEMMS else 'blas'}"


# -- the table -----------------------------------------------------------------------------------

def nmse(ref: np.ndarray, got: np.ndarray) -> float:
    r, g = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    return float(np.sum((r - g) ** 2) / max(np.sum(r * r), 1e-300))


def measure(lib: LibGGML, args: argparse.Namespace, name: str, shape: Shape, mode: str,
            wbytes: np.ndarray, rng: np.random.Generator) -> list[dict[str, Any]]:
    """One row per thread count of one (type, shape, mode): each engine's weights set up once
    and timed at every thread count."""
    n, k, m = N_COLUMNS[mode], shape.k, shape.m
    copies = (max(1, -(-COLD_BYTES // wbytes.nbytes)) if mode == "mv cold" else
              HOT_COPIES if mode == "mv hot" else 1)
    xv = rng.standard_normal((n, k)).astype(np.float32)
    rows = {t: dict(type=name, shape=shape.label, k=k, m=m, n=n, threads=t, mode=mode,
                    weight_bytes=int(wbytes.nbytes), copies=copies) for t in args.threads}
    ref = None
    repack = lib.extra.get("CPU_REPACK")
    for who, buft in (("ggml", None), ("repack", repack)):
        if who == "repack" and repack is None:
            for r in rows.values():
                r["repack"] = "libggml has no CPU_REPACK buffer type"
            continue
        try:
            mm = GGMLMulMat(lib, name, wbytes, k, m, n, copies, buft)
        except NotTaken as e:
            for r in rows.values():
                r["repack"] = str(e)
            continue
        try:
            mm.set_x(xv)
            for t, r in rows.items():
                mm.threads(t)
                best, med = timed(mm, args.min_s)
                r[f"{who}_s"], r[f"{who}_s_median"] = best / copies, med / copies
                res = mm.result()
                if ref is None:
                    ref = res
                if who != "ggml":
                    r[f"{who}_nmse_vs_ggml"] = nmse(ref, res)
        finally:
            mm.close()
    if not args.no_ggraph:
        try:
            g = GGraphMulMat(name, wbytes, k, m, n, copies)
            for t, r in rows.items():
                best, med, first, path, packed = g.run_at(t, xv, args.min_s)
                r.update(ggraph_s=best / copies, ggraph_s_median=med / copies, path=path,
                         packed_bytes=packed, ggraph_nmse_vs_ggml=nmse(ref, first))
        except Exception as e:  # noqa: BLE001 - the table goes on; the row says why
            for r in rows.values():
                r.setdefault("ggraph", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        finally:
            g = None
            gc.collect()
    return list(rows.values())


def bandwidth(threads: int, runs: int) -> list[float]:
    """GB/s of `runs` single reads of membw's 1 GiB buffer at `threads` threads (each after
    a warm-up read): the table divides by the best, as it times kernels by their best."""
    return [read_bandwidth(threads, 1) for _ in range(runs)]


def derive(r: dict[str, Any], bw: dict[int, float]) -> None:
    """GB/s and share of the read bandwidth (mat-vec) or GFLOPS (mat-mat) per engine, and the
    ratios: ggraph over ggml plain, and over what llama.cpp runs (repack where it exists)."""
    for who in ENGINES:
        s = r.get(f"{who}_s")
        if s is None:
            continue
        if r["n"] == 1:
            r[f"{who}_gbs"] = r["weight_bytes"] / s / 1e9
            r[f"{who}_bw_share"] = r[f"{who}_gbs"] / bw[r["threads"]]
        else:
            r[f"{who}_gflops"] = 2.0 * r["k"] * r["m"] * r["n"] / s / 1e9
    if "ggraph_s" in r and "ggml_s" in r:
        r["ggraph_x_ggml"] = r["ggml_s"] / r["ggraph_s"]
        r["ggraph_x_llama_cpp"] = r.get("repack_s", r["ggml_s"]) / r["ggraph_s"]


def cell(r: dict[str, Any], who: str) -> str:
    """An engine's figure: GB/s (share of the read bandwidth) or GFLOPS; "err": it failed."""
    if f"{who}_s" not in r:
        return "err" if who == "ggraph" and "ggraph" in r else "-"
    if r["n"] == 1:
        return f"{r[f'{who}_gbs']:6.2f} ({r[f'{who}_bw_share']:4.0%})"
    return f"{r[f'{who}_gflops']:7.1f} GF"


COLUMNS = [Column("type", width=7, align="<"), Column("shape", width=16, align="<"),
           Column(lambda r: f"{r['k']:>5}x{r['m']:<5}", "K x M", width=11),
           Column("threads", "t", width=2, gap=" "), Column("mode", width=8, align="<", gap=" "),
           Column(lambda r: cell(r, "ggml"), "ggml", width=14),
           Column(lambda r: cell(r, "repack"), "ggml-repack", width=14),
           Column(lambda r: cell(r, "ggraph"), "ggraph", width=14),
           Column("ggraph_x_ggml", "x ggml", "{:.2f}x", 8),
           Column("ggraph_x_llama_cpp", "x llama", "{:.2f}x", 8),
           # the path that ran, or why ggraph did not
           Column(lambda r: r.get("path", r.get("ggraph", "-")), "ggraph path", align="<",
                  gap="  ")]
HEADER = header_lines(COLUMNS, sep="")[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    load_start = load_average()
    lib = LibGGML()
    print(lib.describe(), flush=True)
    if load_start[0] >= 0.5:
        print(f"note: load average {load_start[0]:.2f}: other work shares the cores, and "
              f"figures at more than one thread suffer most (ggml's threads spin at barriers)",
              flush=True)
    bw_start = {t: bandwidth(t, args.bw_runs) for t in args.threads}
    print("read bandwidth: " + ", ".join(f"{max(v):.1f} GB/s at {t} thread{'s' * (t > 1)}"
                                         for t, v in bw_start.items()), flush=True)
    print(HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(1)
    shapes = [s for s in SHAPES if s.key in args.shapes]
    for name in args.types:
        block = TYPES[name][1]
        for shape in shapes:
            if shape.k % block:
                rows.append(dict(type=name, shape=shape.label, k=shape.k, m=shape.m,
                                 skipped=f"K={shape.k} is not whole {name} blocks of {block}"))
                continue
            wbytes = lib.quantize(name, rng.standard_normal((shape.m, shape.k),
                                                            dtype=np.float32))
            for mode in shape.modes:
                if args.quick and mode == "mv hot":
                    continue
                t0 = time.perf_counter()
                got = measure(lib, args, name, shape, mode, wbytes, rng)
                for r in got:
                    r["case_s"] = time.perf_counter() - t0   # all engines and threads
                    derive(r, {t: max(v) for t, v in bw_start.items()})
                    print(row_line(r, COLUMNS, sep=""), flush=True)
                rows += got
    bw_end = {t: bandwidth(t, args.bw_runs) for t in args.threads}
    bw = {t: max(bw_start[t] + bw_end[t]) for t in args.threads}
    for r in rows:
        if "skipped" not in r:
            derive(r, bw)
    return dict(machine=machine_summary(), libggml=lib.describe(),
                repacked_by_ggml=sorted({r["type"] for r in rows if "repack_s" in r}),
                read_gbs={t: dict(used=bw[t], median=statistics.median(bw_start[t] + bw_end[t]),
                                  start=bw_start[t], end=bw_end[t]) for t in args.threads},
                load_avg=dict(start=load_start, end=load_average()), rows=rows,
                elapsed_s=time.perf_counter() - t_start, cold_bytes=COLD_BYTES,
                note="2-core shared machine: other work may run beside it; best-of timings, "
                     "medians kept as *_s_median")


def machine_summary() -> dict[str, Any]:
    """graphs/eval/bench.py's machine line, and the vector features ggraph's kernels compile for."""
    from ggraph.backends.cpu.qvec import FEATURES

    mi = machine_info()
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni",
              "avxvnni", "avx512bf16", "amx-tile")
    return dict(cpu=mi.cpu, n_cpus=mi.n_cpus, line=mi.line,
                features=[f for f in wanted if f"+{f}" in FEATURES])


def print_report(result: dict[str, Any]) -> None:
    print(f"\n{HEADER}")
    for r in result["rows"]:
        if "skipped" in r:
            print(f"{r['type']:<7}{r['shape']:<16}skipped: {r['skipped']}")
        else:
            print(row_line(r, COLUMNS, sep=""))
    print("mat-vec: GB/s of stored weight bytes (share of the read bandwidth at those threads); "
          "mat-mat: GFLOPS. x llama: ggraph over ggml-repack where ggml repacks the type, "
          "else over ggml plain")
    for t, b in result["read_gbs"].items():
        print(f"read bandwidth at {t} thread{'s' * (t > 1)}: {b['used']:.1f} GB/s, the best of "
              f"{len(b['start']) + len(b['end'])} runs at the start and the end (median "
              f"{b['median']:.1f}; a numba reduction over 1 GiB)")
    la = result["load_avg"]
    print(f"CPU: {result['machine']['line']}; {', '.join(result['machine']['features'])}\n"
          f"load average: {' '.join(f'{x:.2f}' for x in la['start'])} at the start, "
          f"{' '.join(f'{x:.2f}' for x in la['end'])} at the end; "
          f"{result['elapsed_s']:.0f} s in all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[threads_option([1, 2], many=True),
                                          out_option(results_path("bench_kquant.json"))])
    ap.add_argument("--types", nargs="+", choices=list(TYPES),
                    help=f"default: {' '.join(ISSUE_TYPES)} (with --extras also "
                         f"{' '.join(EXTRA_TYPES)})")
    ap.add_argument("--extras", action="store_true", help="add the types ggraph does not pack")
    ap.add_argument("--shapes", nargs="+", choices=[s.key for s in SHAPES],
                    help="default: all; with --quick, 1.5B-up")
    ap.add_argument("--quick", action="store_true",
                    help="the 1.5B-up shape only (unless --shapes), no hot mat-vec, shorter "
                         "timings and bandwidth runs")
    ap.add_argument("--min-s", type=float, help="seconds each timing runs at least "
                                                 "(default 0.3, 0.15 with --quick)")
    ap.add_argument("--no-ggraph", action="store_true", help="measure ggml only")
    args = ap.parse_args()
    args.types = args.types or ISSUE_TYPES + (EXTRA_TYPES if args.extras else [])
    args.shapes = args.shapes or (["1.5B-up"] if args.quick else [s.key for s in SHAPES])
    args.min_s = args.min_s or (0.15 if args.quick else 0.3)
    args.bw_runs = 3 if args.quick else 5
    try:
        result = run(args)
    except GGMLUnavailable as e:
        raise SystemExit(f"bench_kquant: libggml not available: {e}")
    result["args"] = dict(threads=args.threads, types=args.types, shapes=args.shapes,
                          quick=args.quick, min_s=args.min_s, ggraph=not args.no_ggraph)
    print_report(result)
    write_results(args.out, args=args, extra=result, load_start=result["load_avg"]["start"])


if __name__ == "__main__":
    main()
