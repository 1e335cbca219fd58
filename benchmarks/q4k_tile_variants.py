"""What Q4_K's decode tile pays for, cold, at one thread (issue 26: at 1 thread the packed
Q4_K product streamed at 86-95% of a bare read of its own pages; Q4_0, Q6_K and Q8_0 at theirs).

Variants of the tile (backends/cpu/qtiles.py's k_tile), each built from the product's own
lane primitives (backends/cpu/qlanes.py) into a loop over 1 GiB of tiles of R = 16 rows, one
activation column whose block changes with each tile (--blocks of them in a row, as a row group
walks its blocks), streamed cold in paired rounds (the order alternating) beside a bare read
of the same machine (membw.read_bandwidth) and hot over 512 KiB (L2):

- tile: as the product computes it: the header's four lines read whole first (ld6: the 6-bit
  scales and mins, four sub-blocks a load; ldh: d, dmin), then 4 pairs of sub-blocks, a
  compiler barrier before each (qmem.in_order) and their sums pinned after (lpin), each
  pair's scales taken from the header's registers (lmulb), the mins dotted as bytes;
- header after: the same, the scales' lines read after the first pair of each half and the
  mins', d and dmin after the last pair (the tile's first form on these primitives);
- no mins: the tile without its mins term;
- header unread: the 2304-byte tile with only its quants read;
- quants only: tiles of 2048 bytes, quants and nothing else;
- scales in L1: header unread, the scales decoded and applied as the tile does but read from
  a small array that stays in L1 (the work without the header's loads);
- no pin, no barrier: the tile without lpin, or without qmem.in_order.

A variant's GB/s counts its tile's bytes. The sums are not checked (the bytes are filler):
this watches the stream, not the results. The product's tile before (a plane of scales a
16-byte load, read as each pair's sums were scaled, the mins widened to i16 pairs) streamed
at 82-95% of the bare read on a Zen 4 EPYC (stop 62, five runs, bare read 29-34 GB/s), with
its header unread or quants only at 94-105%: the header's reads between the pairs cost, not
its bytes. A variant's gain here has not always carried to the product (docs/performance.md).

    python benchmarks/q4k_tile_variants.py [--rounds 6] [--blocks 6] [--variants tile,no-mins]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import Column, out_option, print_table, results_path, write_results

R = 16
VARIANTS = {"tile": set(), "header-after": {"after"}, "no-mins": {"nomins"},
            "header-unread": {"unread"}, "quants-only": {"quants"},
            "scales-in-l1": {"unread", "l1scales"}, "no-pin": {"nopin"},
            "no-barrier": {"nobar"}}


def source(flags: set[str], blocks: int) -> tuple[str, int]:
    """The variant's loop as Python source, and its tile's bytes."""
    tile = 2048 if "quants" in flags else 2304
    q0 = "at" if "quants" in flags else "at + 256"
    plain = bool(flags & {"quants", "unread"})
    h = "0" if "l1scales" in flags else "at"       # where the scales are read from
    src_arr = "sc" if "l1scales" in flags else "w"
    scales = [f"sc03 = ld6({src_arr}, {h}, {h}, 0, 16)",
              f"sc47 = ld6({src_arr}, {h} + {8 * R}, {h}, 1, 16)"]
    rest = [f"m03 = ld6(w, at + {4 * R}, at, 0, 16)",
            f"m47 = ld6(w, at + {8 * R}, at + {4 * R}, 2, 16)",
            f"d = ldh(w, at + {12 * R}, 16)", f"dmin = ldh(w, at + {14 * R}, 16)"]
    lines = []
    if not plain and "after" not in flags:
        lines += scales + ([] if "nomins" in flags else rest[:2]) + rest[2:]
    elif "l1scales" in flags:
        lines += scales
    for jp in range(4):
        if "nobar" not in flags:
            lines.append("in_order()")
        lines.append("s0, s1 = lzero(16, 1), lzero(16, 1)")
        for k in range(8):
            y = f"pb + {4 + 64 * jp + 4 * k}"
            lines += [f"v = ldq(w, {q0} + {64 * (8 * jp + k)}, 16)",
                      f"s0 = dpb(s0, lo4(v), q, {y})", f"s1 = dpb(s1, hi4x(v), q, {y} + 32)"]
        lines.append("s1 = lnib(s1)" if "nopin" in flags else "s0, s1 = lpin(s0), lpin(lnib(s1))")
        if plain and "l1scales" not in flags:
            lines.append("isum = ladd(isum, ladd(s0, s1))")
            continue
        if "after" in flags and jp in (0, 2):
            lines.append(scales[jp // 2])
        v, i = "sc03" if jp < 2 else "sc47", 2 * (jp % 2)
        lines.append(f"isum = ladd(isum, ladd(lmulb(s0, {v}, {i}), lmulb(s1, {v}, {i + 1})))")
    if plain:
        lines.append("acc = ffma(acc, isum, ldh(sc, 0, 16), cf32(q, pb, 1))")
    else:
        if "after" in flags:
            lines += ([] if "nomins" in flags else rest[:2]) + rest[2:]
        lines.append("acc = ffma(acc, isum, d, cf32(q, pb, 1))")
        if "nomins" not in flags:
            lines += ["mlo = dpb(dpb(lzero(16, 1), m03, ysb, 0), m47, ysb, 8)",
                      "mhi = dpb(dpb(lzero(16, 1), m03, ysb, 4), m47, ysb, 12)",
                      "acc = ffms(acc, laddsh(mlo, mhi, 7), dmin, cf32(q, pb, 1))"]
    body = "\n".join("        " + line for line in lines)
    return (f"def f(w, q, ysb, sc, n, out):\n    acc = fzero(16, 1)\n"
            f"    for it in range(n):\n        at = it * {tile}\n"
            f"        pb = 292 * (it % {blocks})\n        isum = lzero(16, 1)\n{body}\n"
            f"    fstore(out, 0, 0, acc)\n"), tile


def build(flags: set[str], blocks: int):
    import numba

    from ggraph.backends.cpu import qlanes
    from ggraph.backends.cpu.qmem import in_order

    src, tile = source(flags, blocks)
    names = {n: getattr(qlanes, n) for n in ("ldq", "lo4", "hi4x", "dpb", "lzero", "ladd",
                                             "laddsh", "lnib", "ffma", "ffms", "fzero", "ldh",
                                             "cf32", "fstore", "ld6", "lmulb", "lpin")}
    names["in_order"] = in_order
    exec(src, names)   # noqa: S102 - our own generated source, no input in it
    return numba.njit(names["f"]), tile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[
        out_option(results_path("q4k_tile_variants.json"))])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--blocks", type=int, default=6,
                    help="activation blocks of a row (6: a 1536-wide row, 35: 8960)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    import numba

    from ggraph.backends.cpu.membw import read_bandwidth
    from ggraph.backends.cpu.threads import configure_openmp

    configure_openmp()
    numba.set_num_threads(1)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        sys.exit(f"q4k_tile_variants: unknown variant(s) {', '.join(unknown)}; "
                 f"the variants are {', '.join(VARIANTS)}")
    big = np.ones(1 << 30, np.uint8)
    big[::7] = 3
    hot = np.ones(1 << 19, np.uint8)
    q = np.ones((1, 292 * args.blocks), np.uint8)
    ysb, sc = np.ones((1, 16), np.uint8), np.zeros(64, np.uint8)
    out = np.zeros((1, 16), np.float32)
    kernels = {v: build(VARIANTS[v], args.blocks) for v in names}
    for f, tile in kernels.values():   # compile before timing
        f(hot, q, ysb, sc, hot.size // tile - 1, out)
    cold: dict[str, list[float]] = {v: [] for v in names}
    warm: dict[str, list[float]] = {v: [] for v in names}
    bare: list[float] = []
    for r in range(args.rounds):
        for v in (names if r % 2 == 0 else names[::-1]):
            f, tile = kernels[v]
            n, nh = big.size // tile - 1, hot.size // tile - 1
            t0 = time.perf_counter()
            f(big, q, ysb, sc, n, out)
            cold[v].append(n * tile / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for _ in range(200):
                f(hot, q, ysb, sc, nh, out)
            warm[v].append(200 * nh * tile / (time.perf_counter() - t0) / 1e9)
        bare.append(read_bandwidth(1, 1))
        print(f"round {r + 1}/{args.rounds}: bare read {bare[-1]:.1f} GB/s", flush=True)
    read = float(np.median(bare))
    rows = [{"variant": v, "cold_gbs": float(np.median(cold[v])),
             "share": float(np.median(cold[v])) / read, "hot_gbs": float(np.median(warm[v])),
             "cold_rounds": cold[v]} for v in names]
    print(f"bare read {read:.1f} GB/s (median of {len(bare)}), {args.blocks} blocks a row")
    print_table(rows, [Column("variant", align="<"), Column("cold_gbs", "cold GB/s", "{:.1f}"),
                       Column("share", "share", "{:.0%}"), Column("hot_gbs", "hot GB/s", "{:.1f}")])
    write_results(args.out, rows, args=args, threads=1,
                  extra={"bare_reads_gbs": bare, "blocks": args.blocks})


if __name__ == "__main__":
    main()
