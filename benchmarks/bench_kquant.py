"""ggml's CPU quantized mat-vec / mat-mat speed per weight type, beside the machine's copy
bandwidth, with ggraph's CPU backend measured in the same run where it can run the type.

For each weight type (Q4_0, Q4_1, Q5_0, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) and each
shape (Gemma-3-270M FFN up 640->2048 and down 2048->640, SmolLM2 FFN up 576->1536 and down
1536->576; K-quants need the row length K to be a multiple of 256, so they run on the "down"
shapes only) at 1 and 2 threads:

- mat-vec (n=1) "hot": one weight, in cache after the first run; GB/s of weight bytes read;
- mat-vec (n=1) "cold": a graph of R mul_mats over R copies of the weight (>= 64 MiB in all,
  twice the 32 MiB L3), as in a real decode step that streams every weight from memory;
  GB/s against the numpy copy bandwidth (bytes read per second of a 256 MiB np.copyto);
- mat-mat (n=512): GFLOPS (2*K*M*n / time).

ggml runs through libggml (llama-cpp-python's build) with cffi (ggraph.ggml_cdefs): a context
holding the tensors, one CPU buffer, ggml_backend_graph_compute on a CPU backend with n threads.
Weights are quantized by ggml itself (ggml_quantize_chunk) from N(0, 1) data. ggraph's side is
`ggraph_matvec_time` (the same graphs on ggraph's CPU backend, None where it cannot run the
type yet); its result is checked against ggml's by NMSE.

    python benchmarks/bench_kquant.py [--threads 1 2] [--types Q4_K Q6_K] [--quick]
                                      [--no-ggraph] [--json benchmarks/results/bench_kquant.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any, Callable

import numpy as np

from ggraph.ggml_cdefs import GGMLUnavailable, find_libggml

# weight type -> ggml_type id, block size, bytes per block (ggml.h / ggml-common.h)
TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "IQ4_XS": (23, 256, 136),
}
GGML_F32 = 0
# (label, K = row length, M = rows): weight ne [K, M], activations [K, n]
SHAPES = [("gemma3 ffn_up", 640, 2048), ("gemma3 ffn_down", 2048, 640),
          ("smollm2 ffn_up", 576, 1536), ("smollm2 ffn_down", 1536, 576)]
COLD_BYTES = 64 << 20


def best_of(fn: Callable[[], Any], min_s: float = 0.3, max_reps: int = 200) -> float:
    fn()  # warm-up
    times: list[float] = []
    t_end = time.perf_counter() + min_s
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def copy_gbs() -> float:
    a = np.ones(1 << 28, np.uint8)
    b = np.empty_like(a)
    dt = best_of(lambda: np.copyto(b, a), 0.5, 10)
    return a.nbytes / dt / 1e9  # bytes read per second (as much again is written)


def cpu_info() -> dict[str, Any]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name":
                    model = val.strip()
                elif key.strip() == "flags":
                    flags = set(val.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "amx_tile")
    return dict(model=model, cores=os.cpu_count(), flags=[f for f in wanted if f in flags])


# -- libggml -------------------------------------------------------------------------------------

# Only what this benchmark calls, with tensors opaque: no dependence on struct ggml_tensor's
# layout or on ggraph's type table (ggraph.ggml_cdefs.load() checks both, and refuses a
# ggraph whose types are not yet all named like ggml's).
_CDEFS = """
struct ggml_context; struct ggml_tensor; struct ggml_cgraph; struct ggml_backend;
struct ggml_backend_buffer; struct ggml_backend_buffer_type;
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
struct ggml_backend_buffer * ggml_backend_alloc_ctx_tensors_from_buft(struct ggml_context * ctx,
        struct ggml_backend_buffer_type * buft);
void ggml_backend_buffer_free(struct ggml_backend_buffer * buffer);
void ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset,
        size_t size);
void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset,
        size_t size);
int  ggml_backend_graph_compute(struct ggml_backend * backend, struct ggml_cgraph * cgraph);
void ggml_backend_free(struct ggml_backend * backend);
size_t ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start,
        int64_t nrows, int64_t n_per_row, const float * imatrix);
"""
_CPU_CDEFS = """
struct ggml_backend * ggml_backend_cpu_init(void);
void ggml_backend_cpu_set_n_threads(struct ggml_backend * backend_cpu, int n_threads);
"""


class LibGGML:
    """libggml-base and libggml-cpu through cffi (GGMLUnavailable where absent)."""

    def __init__(self) -> None:
        self.dir = find_libggml()
        try:
            import cffi
        except ImportError:
            raise GGMLUnavailable("the cffi package is missing: pip install 'cffi>=1.16'")
        self.ffi = cffi.FFI()
        self.ffi.cdef(_CDEFS)
        self.ffi.cdef(_CPU_CDEFS)
        ext = ".dylib" if platform.system() == "Darwin" else ".so"
        flags = self.ffi.RTLD_NOW | self.ffi.RTLD_GLOBAL
        self.base = self.ffi.dlopen(str(self.dir / f"libggml-base{ext}"), flags)
        self.cpu = self.ffi.dlopen(str(self.dir / f"libggml-cpu{ext}"), flags)

    def describe(self) -> str:
        s = self.ffi.string
        return (f"libggml {s(self.base.ggml_version()).decode()} (commit "
                f"{s(self.base.ggml_commit()).decode()}) from {self.dir}")

    def new_context(self, n_tensors: int, graph_size: int) -> Any:
        b = self.base
        mem = ((n_tensors + 4) * b.ggml_tensor_overhead()
               + b.ggml_graph_overhead_custom(graph_size, False) + 1024)
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


# -- ggml ---------------------------------------------------------------------------------------

class GGMLMulMat:
    """R mul_mats of one weight type (R copies of the weight bytes) sharing activations x."""

    def __init__(self, lib: Any, name: str, wbytes: np.ndarray, k: int, m: int, n: int,
                 copies: int, threads: int) -> None:
        self.lib, b, ffi = lib, lib.base, lib.ffi
        self.ctx = lib.new_context(2 * copies + 2, graph_size=2 * copies + 8)
        self.x = b.ggml_new_tensor_4d(self.ctx, GGML_F32, k, n, 1, 1)
        self.ws, self.outs = [], []
        graph = b.ggml_new_graph_custom(self.ctx, 2 * copies + 8, False)
        for _ in range(copies):
            w = b.ggml_new_tensor_4d(self.ctx, TYPES[name][0], k, m, 1, 1)
            o = b.ggml_mul_mat(self.ctx, w, self.x)
            b.ggml_build_forward_expand(graph, o)
            self.ws.append(w)
            self.outs.append(o)
        self.graph = graph
        self.buf = b.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx,
                                                             b.ggml_backend_cpu_buffer_type())
        assert b.ggml_nbytes(self.ws[0]) == wbytes.nbytes
        for w in self.ws:
            b.ggml_backend_tensor_set(w, ffi.from_buffer(wbytes), 0, wbytes.nbytes)
        self.backend = lib.cpu.ggml_backend_cpu_init()
        lib.cpu.ggml_backend_cpu_set_n_threads(self.backend, threads)
        self.shape = (n, m)

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
        b.ggml_backend_buffer_free(self.buf)
        b.ggml_backend_free(self.backend)
        b.ggml_free(self.ctx)


# -- ggraph (the hook) --------------------------------------------------------------------------

_GGRAPH_WHY: dict[str, str] = {}


def ggraph_matvec_time(type_name: str, rows: int, cols: int, n: int, threads: int,
                       wbytes: np.ndarray | None = None, xv: np.ndarray | None = None,
                       copies: int = 1) -> tuple[float, np.ndarray] | None:
    """Seconds per mul_mat of a (rows x cols) `type_name` weight by a (cols x n) f32 matrix on
    ggraph's CPU backend at `threads` threads (best of several runs; `copies` mul_mats over
    copies of the weight in one graph, time divided by copies), and the first result.

    None where ggraph cannot run it (the type is not a GGMLType member yet, or the CPU backend
    has no kernel for it); the reason is kept in _GGRAPH_WHY[type_name]. `wbytes` is the
    weight's raw bytes (ggml's layout); random N(0, 1) data quantized by ggraph otherwise."""
    try:
        import numba

        from ggraph import Context, build_graph, ops as O
        from ggraph.backends import get_backend
        from ggraph.types import GGMLType
    except ImportError as e:
        _GGRAPH_WHY[type_name] = f"ggraph's CPU backend unavailable: {e}"
        return None
    if type_name not in GGMLType.__members__:
        _GGRAPH_WHY[type_name] = f"{type_name} is not a ggraph GGMLType yet"
        return None
    t = GGMLType[type_name]
    rng = np.random.default_rng(0)
    try:
        ctx = Context()
        x = ctx.new_tensor(GGMLType.F32, (cols, n), "x").set_input()
        outs = []
        for i in range(copies):
            w = ctx.new_tensor(t, (cols, rows), f"w{i}")
            if wbytes is None:
                w.set_data(rng.standard_normal((rows, cols)).astype(np.float32))
                wbytes = w.data
            else:
                w.data = np.array(wbytes, dtype=np.uint8, copy=True)  # its own memory
            outs.append(O.mul_mat(w, x))
        graph = build_graph(*outs)
        numba.set_num_threads(threads)
        session = get_backend("cpu", n_threads=threads).session()
        if xv is None:
            xv = rng.standard_normal((n, cols)).astype(np.float32)
        feed = {x: xv}
        session.run(graph, feed)
        first = session.read(outs[0])
        dt = best_of(lambda: session.run(graph, feed))
    except Exception as e:  # noqa: BLE001 - any failure means "cannot run this type yet"
        _GGRAPH_WHY[type_name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return None
    return dt / copies, first


# -- the benchmark ------------------------------------------------------------------------------

def nmse(ref: np.ndarray, got: np.ndarray) -> float:
    r, g = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    return float(np.sum((r - g) ** 2) / max(np.sum(r * r), 1e-300))


def run(args: argparse.Namespace) -> dict[str, Any]:
    lib = LibGGML()
    bw = copy_gbs()
    print(f"{lib.describe()}\nnumpy copy bandwidth: {bw:.2f} GB/s read (256 MiB np.copyto)")
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(1)
    for name in args.types:
        _, block, size = TYPES[name]
        for label, k, m in SHAPES:
            if k % block:
                rows.append(dict(type=name, shape=label, k=k, m=m, skipped=f"K={k} is not a "
                                 f"multiple of the {name} block of {block}"))
                continue
            wbytes = lib.quantize(name, rng.standard_normal((m, k)).astype(np.float32))
            copies = max(1, -(-COLD_BYTES // wbytes.nbytes))
            for threads in args.threads:
                cases = [("mat-vec hot", 1, 1), ("mat-vec cold", 1, copies), ("mat-mat", 512, 1)]
                if args.quick:
                    cases = [c for c in cases if c[0] != "mat-vec hot"]
                for mode, n, r in cases:
                    xv = rng.standard_normal((n, k)).astype(np.float32)
                    mm = GGMLMulMat(lib, name, wbytes, k, m, n, r, threads)
                    try:
                        mm.set_x(xv)
                        dt = best_of(mm) / r
                        ref = mm.result()
                    finally:
                        mm.close()
                    row = dict(type=name, shape=label, k=k, m=m, n=n, threads=threads, mode=mode,
                               weight_bytes=int(wbytes.nbytes), copies=r, ggml_s=dt)
                    g = None if args.no_ggraph else ggraph_matvec_time(
                        name, m, k, n, threads, wbytes=wbytes, xv=xv, copies=r)
                    if g is not None:
                        row["ggraph_s"] = g[0]
                        row["ggraph_nmse_vs_ggml"] = nmse(ref, g[1])
                    elif not args.no_ggraph:
                        row["ggraph"] = _GGRAPH_WHY.get(name, "not run")
                    for who in ("ggml", "ggraph"):
                        s = row.get(f"{who}_s")
                        if s is None:
                            continue
                        if n == 1:
                            row[f"{who}_gbs"] = wbytes.nbytes / s / 1e9
                            row[f"{who}_of_copy_bw"] = row[f"{who}_gbs"] / bw
                        else:
                            row[f"{who}_gflops"] = 2.0 * k * m * n / s / 1e9
                    rows.append(row)
                    print(fmt_row(row), flush=True)
    return dict(cpu=cpu_info(), libggml=lib.describe(), copy_gbs=bw, rows=rows,
                note="2-core shared machine: other work may run beside it; best-of timings")


def fmt_row(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"{r['type']:<7}{r['shape']:<18}skipped: {r['skipped']}"

    def fig(who: str) -> str:
        if f"{who}_s" not in r:
            return "-"
        if r["n"] == 1:
            return (f"{r[f'{who}_s'] * 1e6:8.1f} us {r[f'{who}_gbs']:6.2f} GB/s "
                    f"({r[f'{who}_of_copy_bw']:.2f}x copy)")
        return f"{r[f'{who}_s'] * 1e3:8.2f} ms {r[f'{who}_gflops']:7.1f} GFLOPS"

    gg = fig("ggraph") if "ggraph_s" in r else r.get("ggraph", "-")
    if "ggraph_s" in r and "ggml_s" in r:
        gg += f" [{r['ggml_s'] / r['ggraph_s']:.2f}x ggml]"
    return (f"{r['type']:<7}{r['shape']:<18}{r['k']:>5}x{r['m']:<5} n={r['n']:<4} "
            f"t={r['threads']} {r['mode']:<13} ggml {fig('ggml'):<36} ggraph {gg}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    ap.add_argument("--quick", action="store_true", help="skip the hot-cache mat-vec")
    ap.add_argument("--no-ggraph", action="store_true", help="measure ggml only")
    ap.add_argument("--json", default="benchmarks/results/bench_kquant.json")
    args = ap.parse_args()
    try:
        result = run(args)
    except GGMLUnavailable as e:
        raise SystemExit(f"bench_kquant: libggml not available: {e}")
    result["args"] = dict(threads=args.threads, types=args.types, quick=args.quick,
                          ggraph=not args.no_ggraph)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"CPU: {result['cpu']['model']} ({result['cpu']['cores']} cores; "
          f"{', '.join(result['cpu']['flags'])})\nwrote {args.json}")


if __name__ == "__main__":
    main()
