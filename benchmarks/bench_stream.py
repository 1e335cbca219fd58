"""How close the CPU's packed mat-vec streams to the machine's read bandwidth, per weight type,
with the bandwidth measured between the rounds in the same process (issue 26: the share of
read bandwidth a decode step reaches is the product's share, less per-node costs).

For each type and shape, enough copies of one packed weight (backends/cpu/qpack.py) that their
bytes exceed the caches (--mib per case) are multiplied by one column in turn, as a decode step
reads its weights once each; each round first measures the read bandwidth
(backends/cpu/membw.py) at the same thread count, so every share is against a figure taken
seconds before it. Beside each product, the same copies read bare (membw.read_pieces: one
parallel sum per copy, as one product per copy): what the memory gives a stream of pieces of
that size without the products' arithmetic. Prints per type and shape the GB/s of each
round's best pass, its share, and the bare read's GB/s, and writes JSON (default
benchmarks/results/bench_stream.json). bench_kquant.py sets the same kernels beside ggml's;
this one only watches the memory.

    python benchmarks/bench_stream.py [-t 1] [--types Q4_0,Q4_K,Q6_K] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import Column, out_option, print_table, results_path, write_results

# (k, m): the 1.5B's ffn_up and ffn_down, and its K/V projections (small: per-call costs show)
SHAPES = {"1.5B ffn_up": (1536, 8960), "1.5B ffn_down": (8960, 1536), "1.5B attn_k": (1536, 256)}


def case(type_name: str, k: int, m: int, mib: int, rng: np.random.Generator):
    """(call, bare read, packed bytes, copies): the packed product of one type, bound to copies
    of one weight that together take about `mib` MiB, and a bare read of the same copies."""
    from ggraph.backends.cpu import kernels, qpack
    from ggraph.backends.cpu.membw import read_pieces
    from ggraph.codecs.buffers import encode_rows
    from ggraph.ir.types import GGMLType

    t = GGMLType.parse(type_name)
    raw = encode_rows(t, rng.standard_normal((m, k)).astype(np.float32)).reshape(m, -1)
    packed = qpack.pack(t, raw)
    copies = max(2, (mib << 20) // packed.nbytes)
    b = rng.standard_normal((1, 1, 1, k)).astype(np.float32)
    d = np.empty((1, 1, 1, m), np.float32)
    kern = kernels.packed_kernel(False, t, GGMLType.F32)
    pieces = [packed] + [packed.copy() for _ in range(copies - 1)]
    calls = [kernels.packed_call(kern, t, b, [(p, d, m)]) for p in pieces]
    calls[0]()   # compile (or load) before timing
    read_pieces(pieces[:1])

    def run() -> None:
        for call in calls:
            call()
    return run, partial(read_pieces, pieces), packed.nbytes, copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter,
                                 parents=[out_option(results_path("bench_stream.json"))])
    ap.add_argument("-t", "--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--types", default="Q4_0,Q4_K,Q5_K,Q6_K,Q8_0",
                    help="weight types (default Q4_0,Q4_K,Q5_K,Q6_K,Q8_0)")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma-separated names of {', '.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=5, help="passes over the copies per round")
    ap.add_argument("--mib", type=int, default=512, help="bytes of copies per case (MiB)")
    args = ap.parse_args()
    import numba

    from ggraph.backends.cpu.membw import read_bandwidth

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape {unknown[0]!r}; known: {', '.join(SHAPES)}")
    rng = np.random.default_rng(0)
    cases = {(ty.strip(), s): case(ty.strip(), *SHAPES[s], args.mib, rng)
             for ty in args.types.split(",") if ty.strip() for s in shapes}
    rows = []
    for threads in args.threads:
        numba.set_num_threads(threads)
        gbs: dict = {key: [] for key in cases}
        bws = []
        for _ in range(args.rounds):
            bw = read_bandwidth(threads)
            bws.append(bw)
            for key, (run, bare, nbytes, copies) in cases.items():
                best = min(_timed(run) for _ in range(args.passes)) / copies
                bare_best = min(_timed(bare) for _ in range(args.passes)) / copies
                gbs[key].append((nbytes / best / 1e9, bw, nbytes / bare_best / 1e9))
        for (ty, s), runs in gbs.items():
            shares = [g / bw for g, bw, _ in runs]
            rows.append(dict(type=ty, shape=s, k=SHAPES[s][0], m=SHAPES[s][1], threads=threads,
                             packed_bytes=cases[(ty, s)][2], copies=cases[(ty, s)][3],
                             gbs=[round(g, 2) for g, _, _ in runs],
                             read_gbs=[round(bw, 2) for _, bw, _ in runs],
                             bare_gbs=[round(x, 2) for _, _, x in runs],
                             bare_median=float(np.median([x for _, _, x in runs])),
                             gbs_median=float(np.median([g for g, _, _ in runs])),
                             share_min=min(shares), share_max=max(shares),
                             share_median=float(np.median(shares))))
    print_table(rows, [Column("type", align="<"), Column("shape", align="<"),
                       Column("threads"), Column("gbs_median", "GB/s", "{:.1f}"),
                       Column(lambda r: f"{r['share_min']:.0%}-{r['share_max']:.0%}",
                              "share of read bw (rounds)"),
                       Column("bare_median", "same pieces read bare GB/s", "{:.1f}"),
                       Column(lambda r: f"{min(r['read_gbs']):.1f}-{max(r['read_gbs']):.1f}",
                              "read GB/s")], markdown=True)
    write_results(args.out, rows, args=args)


def _timed(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
