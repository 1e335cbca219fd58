"""A paired A/B of one CPU decode change on a noisy machine: two engines of the same model in
one process, one built with the change switched off, taking decode tokens in turn (the order
alternating), so that a stretch when the host is slow falls on both. Prints each side's
median, quartiles and means per token and the paired difference, also over the faster and
slower half of pairs (benchlib.by_spell).

    python benchmarks/ab_decode.py -m qwen2.5-coder-1.5b --without fused-products -t 2 -n 200
    python benchmarks/ab_decode.py --without q8k-encoder --json out.json

The changes that can be switched off (each through its module's switch, off only while its
engine builds and binds its graphs; a graph bound again later, when the context grows past a step of cells, takes
the code as it is, so keep -n below the first step):
- fused-products: products of one input run apart (backends/cpu/fusion.py's PRODUCTS);
- products-across: only consecutive products of one input run as one call, not Q, K and V
  with a bias add, a rope or a cache write between them (fusion.BETWEEN set to 0);
- product-bias: a product's bias add (Qwen2's Q, K and V) runs by its own call, not folded
  into the product's (fusion.PRODUCT_BIAS set to False);
- q8k-encoder: the K-quants' activations through the shared Q8_K encoder, not qact.py's
  (its entry taken out of qact.ENCODERS);
- direct-calls: the bound calls go through numba's dispatcher, not straight to the compiled
  code (backends/cpu/compile.py's DIRECT);
- hugepages: the packed weights in plain numpy arrays, not on the 2 MiB-page arena
  (backends/cpu/hugepages.py; GGRAPH_HUGEPAGES=0 while its engine's backend is made);
- weight-prefetch: the packed products ask for no weight line ahead (kernels.PREFETCH set to
  0), against the host's choice (qmem.prefetch_choice) or, with --prefetch LOCALITY:BYTES,
  against that one (e.g. 0:8192, prefetchnta 8 KiB ahead, where the host's choice is none):

    python benchmarks/ab_decode.py --without weight-prefetch --prefetch 0:8192 -t 1

- work-stealing: a packed product's threads take only their own share of its row groups,
  not the others' once theirs are done (kernels.PACKED_STEAL set to False);
- native-loop: a graph's calls made by Python one after the other, not from machine code
  (backends/cpu/native_loop.py's ENABLED set to False);
- team: a native run's parallel kernels each fork and join numba's threads, not one team of
  threads making the whole run (backends/cpu/native_loop.py's TEAM set to False);
- fine-tail: a packed product's threads take each share's last runs whole, not in quarters
  (kernels.PACKED_TAIL set to 0);
- shared-work: each packed product quantizes its columns into buffers of its own, not into
  those its graph's products of the same shape share (kernels.SHARED_WORK set to False).
Whole-benchmark speed is `ggraph bench`; this is for telling a 1-3% change from the noise.
A change no switch turns off (a packed layout, the code LLVM is given) is measured against
an earlier revision by benchmarks/ab_revision.py, the same way.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (by_spell, model_option, out_option, spell_line, threads_option,
                      write_results)


_DEFAULTS: dict = {}


def set_change(what: str, on: bool, prefetch: tuple[int, int] | None = None) -> None:
    """Turn one change on or off through the switch its module exposes (`prefetch`: the
    weight-prefetch side's (locality, distance), the host's where None)."""
    from ggraph.backends.cpu import compile as cpu_compile, fusion, kernels, qact, qmem
    from ggraph.ir.types import GGMLType
    if what == "work-stealing":
        kernels.PACKED_STEAL = on
    elif what == "native-loop":
        from ggraph.backends.cpu import native_loop
        native_loop.ENABLED = on
    elif what == "team":
        from ggraph.backends.cpu import native_loop
        native_loop.TEAM = on
    elif what == "fine-tail":
        tail = _DEFAULTS.setdefault("tail", kernels.PACKED_TAIL)   # the default, taken once
        kernels.PACKED_TAIL = tail if on else 0
    elif what == "shared-work":
        kernels.SHARED_WORK = on
    elif what == "weight-prefetch":
        locality, distance = prefetch or HOST_PREFETCH
        qmem.PF_LOCALITY = locality if on else HOST_PREFETCH[0]
        kernels.PREFETCH = distance if on else 0
    elif what == "direct-calls":
        cpu_compile.DIRECT = on
    elif what == "hugepages":
        os.environ["GGRAPH_HUGEPAGES"] = "1" if on else "0"
    elif what == "fused-products":
        fusion.PRODUCTS = on
    elif what == "products-across":
        fusion.BETWEEN = 4 if on else 0
    elif what == "product-bias":
        fusion.PRODUCT_BIAS = on
    elif on:
        qact.ENCODERS[GGMLType.Q8_K] = qact.enc_q8_k
    else:   # kernels.act_encoder falls back to the shared codec's encoder
        qact.ENCODERS.pop(GGMLType.Q8_K, None)


def _host_prefetch() -> tuple[int, int]:
    from ggraph.backends.cpu import qmem
    return qmem.PF_LOCALITY, qmem.PF_DISTANCE


HOST_PREFETCH = _host_prefetch()


def _prefetch_arg(text: str) -> tuple[int, int]:
    try:
        locality, distance = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prefetch {text!r}: want LOCALITY:BYTES, e.g. 0:8192")
    if not (0 <= locality <= 3 and 0 < distance <= 1 << 20):
        raise argparse.ArgumentTypeError(f"--prefetch {text!r}: locality 0-3, bytes 1..1048576")
    return locality, distance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[
        model_option("qwen2.5-coder-1.5b"), threads_option(2), out_option("")])
    ap.add_argument("--without", required=True, choices=("direct-calls", "fused-products",
                                                           "hugepages", "product-bias",
                                                           "products-across",
                                                           "q8k-encoder", "shared-work",
                                                           "weight-prefetch", "work-stealing",
                                                           "fine-tail", "native-loop",
                                                           "team"))
    ap.add_argument("--prefetch", type=_prefetch_arg, default=None, metavar="LOCALITY:BYTES",
                    help="with --without weight-prefetch: the prefetch the other side asks for "
                         "(llvm locality 0-3: 0 prefetchnta .. 3 prefetcht0; bytes ahead); "
                         "default: this host's choice")
    ap.add_argument("-n", type=int, default=200, help="decode tokens each engine times")
    args = ap.parse_args()
    if args.without == "weight-prefetch" and (args.prefetch or HOST_PREFETCH)[1] == 0:
        ap.error("this host's choice is no weight prefetch (qmem.prefetch_choice): give the "
                 "other side one with --prefetch LOCALITY:BYTES")

    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    def engine(switched_off: bool) -> Engine:
        set_change(args.without, not switched_off, args.prefetch)
        try:
            e = Engine(str(args.model), EngineConfig(
                n_ctx=1024, n_threads=args.threads, adaptive_threads=False,
                reserve_outputs="last", flash_attn=True))
            e.eval([1, 2, 3, 4])
            e.eval([5])   # the decode graph bound with the switch as set
        finally:
            set_change(args.without, True, HOST_PREFETCH)
        return e

    sides = {"without": engine(True), "with": engine(False)}
    ms: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(args.n):
        order = list(sides.items()) if i % 2 == 0 else list(reversed(sides.items()))
        for k, e in order:
            t0 = time.perf_counter()
            e.eval([6 + i % 64])
            ms[k].append((time.perf_counter() - t0) * 1e3)
    rows = []
    for k, v in ms.items():
        a = np.sort(np.array(v))
        cut = len(a) // 10
        rows.append({"side": k, "median_ms": float(np.median(a)),
                     "p25_ms": float(np.percentile(a, 25)), "p75_ms": float(np.percentile(a, 75)),
                     "mean_ms": float(a.mean()),
                     "trimmed_mean_ms": float(a[cut:len(a) - cut].mean())})
        print(f"{args.without} {k:7s}: median {rows[-1]['median_ms']:7.2f} ms  p25 "
              f"{rows[-1]['p25_ms']:7.2f}  p75 {rows[-1]['p75_ms']:7.2f}  mean "
              f"{rows[-1]['mean_ms']:7.2f}  10%-trimmed mean {rows[-1]['trimmed_mean_ms']:7.2f}")
    d = np.array(ms["without"]) - np.array(ms["with"])
    print(f"paired (without - with): median {np.median(d):+.2f} ms a token, mean {d.mean():+.2f};"
          f" tokens where 'with' was faster: {np.mean(d > 0):.0%}")
    spells = by_spell(ms["without"], ms["with"], [float(x) for x in d])
    print(f"  by spell: {spell_line(spells, '{:+.3f} ms')}")
    if args.out:
        write_results(args.out, rows, args=args, threads=args.threads,
                      extra={"without": args.without, "tokens": args.n,
                             "prefetch": list(args.prefetch or HOST_PREFETCH),
                             "paired_median_ms": float(np.median(d)),
                             "paired_mean_ms": float(d.mean()),
                             "paired_median_ms_by_spell": spells})


if __name__ == "__main__":
    main()
