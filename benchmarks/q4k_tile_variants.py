"""What Q4_K's decode tile pays for, cold, at one thread (issue 26: at 1 thread the packed
Q4_K product streams at 86-95% of a bare read of its own pages; Q4_0, Q6_K and Q8_0 at theirs).

Variants of the tile (backends/cpu/qtiles.py's k4_tile), each built from the product's own
lane primitives (backends/cpu/qlanes.py) into a loop over 1 GiB of tiles of R = 16 rows, one
activation column whose block changes with each tile (--blocks of them in a row, as a row group
walks its blocks), streamed cold in paired rounds (the order alternating) beside a bare read
of the same machine (membw.read_bandwidth) and hot over 512 KiB (L2):

- tile: as the product computes it: 4 pairs of sub-blocks, a compiler barrier before each
  (qmem.in_order), each pair's two 6-bit scales decoded from their planes (lmul6), the mins by
  pairs against the activation sums (dpw6), d and dmin applied per tile;
- no mins: the tile without its mins term;
- byte scales: the scales read as plain bytes (lmul), as a tile of decoded scales would hold;
- header unread: the 2304-byte tile with only its quants read;
- quants only: tiles of 2048 bytes, quants and nothing else;
- no barrier: the tile without qmem.in_order;
- header last: the tile's 256 header bytes after its quants instead of before.

A variant's GB/s counts its tile's bytes. The sums are not checked (the bytes are filler):
this watches the stream, not the results. On a Zen 4 EPYC (stop 62, five runs, bare read
29-34 GB/s): the tile at 82-95% of the bare read (6 or 35 blocks a row); with its header
unread, or quants only, 94-105%; no mins 1-5% faster; byte scales, the barrier dropped or the
header last -11 to +3%, mostly slower. What costs is the header's reads and the scales' work
between the pairs, not the bytes; and a variant's gain here has not always carried to the
product (docs/performance.md: the scales and mins read four planes a load and transposed
ran 1.005x in the product).

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
VARIANTS = {"tile": set(), "no-mins": {"nomins"}, "byte-scales": {"bytes"},
            "header-unread": {"unread"}, "quants-only": {"quants"}, "no-barrier": {"nobar"},
            "header-last": {"last"}}


def _scale(jp: int, which: int, s: str, h: str, plain: bool) -> str:
    """The call applying sub-block 2 jp + which's scale to sums s (header at byte h)."""
    if plain:
        return f"lmul({s}, w, {h} + {(2 * jp + which) * R}, False)"
    if jp < 2:
        return f"lmul6({s}, w, {h} + {(2 * jp + which) * R}, 0, 0)"
    return (f"lmul6({s}, w, {h} + {(2 * jp + 4 + which) * R}, "
            f"{h} + {(2 * jp - 4 + which) * R}, 1)")


def source(flags: set[str], blocks: int) -> tuple[str, int]:
    """The variant's loop as Python source, and its tile's bytes."""
    tile = 2048 if "quants" in flags else 2304
    q0, h = ("at", "at + 2048") if "last" in flags else ("at + 256", "at")
    if "quants" in flags:
        q0 = "at"
    lines = []
    for jp in range(4):
        if "nobar" not in flags:
            lines.append("in_order()")
        lines.append("s0, s1 = lzero(16, 1), lzero(16, 1)")
        for k in range(8):
            y = f"pb + {4 + 64 * jp + 4 * k}"
            lines += [f"v = ldq(w, {q0} + {64 * (8 * jp + k)}, 16)",
                      f"s0 = dpb(s0, lo4(v), q, {y})", f"s1 = dpb(s1, hi4x(v), q, {y} + 32)"]
        if flags & {"quants", "unread"}:
            lines.append("isum = ladd(isum, ladd(s0, lnib(s1)))")
        else:
            plain = "bytes" in flags
            lines.append(f"isum = ladd(isum, ladd({_scale(jp, 0, 's0', h, plain)}, "
                         f"{_scale(jp, 1, 'lnib(s1)', h, plain)}))")
    if flags & {"quants", "unread"}:
        lines.append("acc = ffma(acc, isum, ldh(sc, 0, 16), cf32(q, pb, 1))")
    else:
        lines.append(f"acc = ffma(acc, isum, ldh(w, {h} + {12 * R}, 16), cf32(q, pb, 1))")
        if "nomins" not in flags:
            lines.append("msum = lzero(16, 1)")
            for pr in range(4):
                b = "0, 0" if pr < 2 else f"{h} + {2 * pr * R}, 2"
                lines.append(f"msum = dpw6(msum, w, {h} + {(4 + 2 * pr) * R}, {b}, ysb, "
                             f"{4 * pr})")
            lines.append(f"acc = ffms(acc, msum, ldh(w, {h} + {14 * R}, 16), cf32(q, pb, 1))")
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
                                             "lnib", "ffma", "ffms", "fzero", "ldh", "cf32",
                                             "fstore", "lmul6", "dpw6", "lmul")}
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
