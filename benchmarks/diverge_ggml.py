"""Where ggraph's logits (SmolLM2 by default, `--model gemma3`) part from llama.cpp's: node by
node against libggml.

1. ggraph's SmolLM2 graph run by the real libggml (ggraph.check.ggml_ref) gives the same logits as
   llama.cpp (llama-cpp-python) bit for bit or nearly: the graphs compute the same thing.
2. Then every node of ggraph's CPU run is compared with libggml's value of the same node, so
   the first node that differs, and how the difference grows, can be read off a table.

    python benchmarks/diverge_ggml.py [--model gemma3] [--ggml-exact] [--layers 3] [--json out]

libggml here keeps the weights in a plain CPU buffer, so no Q4_K weight is repacked as in
llama.cpp: with --ggml-exact ggraph then takes ggml's plain paths too (ggml_exact_kquants
PATHS.repack = False; --repacked keeps llama.cpp's paths, then the Q4_K products differ from
libggml's and the logits equal llama.cpp's), and the fusion pass is off (GGRAPH_FUSE=0).
Gemma 3 270M Q4_K_M: plain libggml's logits differ from llama.cpp's by NMSE 1.4e-3 (the
repacked Q4_K kernels round differently), ggraph --ggml-exact --repacked's by 0.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (import_llama_cpp, llama_cpp_model, model_option, out_option, results_path,
                    write_results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[model_option("default"), out_option(
                                     None, help="default: benchmarks/results/"
                                                "diverge_ggml[_MODEL].json")])
    ap.add_argument("-p", default="Once upon a time, in a small village,")
    ap.add_argument("--ggml-exact", action="store_true", help="ggraph's ggml_exact mode")
    ap.add_argument("--layers", type=int, default=3, help="layers shown node by node")
    ap.add_argument("--repacked", action="store_true",
                    help="--ggml-exact as llama.cpp computes (repacked Q4_K), not as libggml")
    args = ap.parse_args()
    name = args.model.spec
    if args.out is None:
        args.out = results_path(f"diverge_ggml{'' if name == 'default' else f'_{name}'}.json")
    if args.ggml_exact:
        os.environ["GGRAPH_FUSE"] = "0"   # read when backends/cpu/fusion.py is imported
    import_llama_cpp()   # before the CPU backend loads numba's OpenMP runtime

    from ggraph.backends.cpu import CPUBackend
    from ggraph.check.conformance import nmse
    from ggraph.check.ggml_ref import run_graph
    from ggraph.graphs.models.arch import model_class
    from ggraph.backends.cpu import ggml_exact_kquants
    from ggraph.graphs.gguf.gguf_file import load_gguf
    from ggraph.ir.tensor import Context

    path = str(args.model)
    llm = llama_cpp_model(path, n_ctx=256, n_batch=64, n_ubatch=64, threads=2, logits_all=True)
    bos = name != "default"    # SmolLM2's template adds none; Gemma's vocabulary does
    toks = llm.tokenize(args.p.encode(), add_bos=bos, special=False)
    llm.eval(toks)
    cpp = np.array(llm.scores[: len(toks)])
    f = load_gguf(path)
    m = model_class(f.arch, path)(f)
    ctx = Context()
    cache = m.new_cache(ctx, 256)
    mg = m.build(ctx, cache, len(toks), 256, len(toks))
    for t, v in m.batch_inputs(mg, cache, np.array(toks), 0, np.arange(len(toks))).items():
        t.set_data(v)
    nodes = [n for n in mg.graph.nodes if n.view_src is None]
    for n in nodes:
        n.set_output()          # keep every value: nothing reuses a node's memory
    ref = dict(zip(map(id, nodes), run_graph(mg.graph, nodes, n_threads=1)))
    ggml_exact_kquants.PATHS = ggml_exact_kquants.KQuantPaths(repack=args.repacked)
    s = CPUBackend(ggml_exact=args.ggml_exact).session()
    s.run(mg.graph, {})
    L = len(toks)
    ggml_logits = ref[id(mg.logits)].reshape(L, -1)
    ours = s.read(mg.logits).reshape(L, -1)
    out = {"model": name, "prompt": args.p, "tokens": toks, "ggml_exact": args.ggml_exact,
           "repacked": args.repacked,
           "nmse_ggml_on_ggraph_graph_vs_llama_cpp": float(nmse(cpp, ggml_logits)),
           "nmse_ggraph_vs_llama_cpp": float(nmse(cpp, ours)), "nodes": []}
    print(f"logits NMSE: libggml on ggraph's graph vs llama.cpp "
          f"{out['nmse_ggml_on_ggraph_graph_vs_llama_cpp']:.2e}; ggraph vs llama.cpp "
          f"{out['nmse_ggraph_vs_llama_cpp']:.2e}")
    print(f"{'node':28} {'op':10} {'equal':>6} {'NMSE vs libggml':>16}")
    shown = set(f"-{i}" for i in range(args.layers))
    for n in nodes:
        r = ref[id(n)]
        g = s.read(n).reshape(r.shape)
        e = float(nmse(r.astype(np.float64), g.astype(np.float64))) if np.any(r) else 0.0
        row = {"name": n.name, "op": str(n.op), "equal": bool(np.array_equal(r, g)), "nmse": e}
        out["nodes"].append(row)
        if any(n.name.endswith(x) for x in shown) or n is mg.logits:
            print(f"{n.name:28} {str(n.op):10} {str(row['equal']):>6} {e:16.2e}")
    write_results(args.out, args=args, extra=out, threads=2)   # llama.cpp's threads
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
