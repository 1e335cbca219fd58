"""Planning time of the graph allocator on 10,000-node graphs, both strategies.

Graphs: a llama-style decoder stack (rms_norm, projections, rope through reshape views, KV cache
writes through cpy views, attention with in-place soft_max, SwiGLU FFN, residual adds) cut to
the node budget, and a random DAG with views, in-place ops, inputs and outputs. Prints a table
(nodes/second per strategy, buffer sizes) and writes JSON (-o/--json, default
benchmarks/results/alloc.json).

    python benchmarks/bench_alloc.py [--nodes 10000] [--repeat 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import random
import sys
import time

from ggraph import Context, GGMLType, Graph, OpKind, Tensor
from ggraph import ops as O
from ggraph.plan.alloc import plan_graph
from ggraph.graphs.models.attention import AttentionShape, build_attention
from ggraph.ir.types import MIB

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, header_lines, out_option, repeat_option, results_path, row_line,
                    write_results)


def decoder_graph(n_nodes: int, n_embd: int = 4096, n_head: int = 32, n_head_kv: int = 8,
                  n_tokens: int = 512, n_kv: int = 4096, n_ff: int = 11008) -> Graph:
    """Layers of a llama-style decoder until the graph holds about `n_nodes` nodes."""
    ctx = Context("decoder")
    hd = n_embd // n_head

    def weight(*ne: int, t: str = "q8_0") -> Tensor:
        w = ctx.new_tensor(t, ne)
        w.buffer = "model"
        return w

    g = Graph(capacity=n_nodes + 256)
    x = ctx.new_tensor("f32", (n_embd, n_tokens), name="inp_embd").set_input()
    pos = ctx.new_tensor("i32", (n_tokens,), name="inp_pos").set_input()
    mask = ctx.new_tensor("f32", (n_kv, n_tokens), name="kq_mask").set_input()
    shape = AttentionShape(hd, n_head, n_head_kv, n_tokens, n_kv)
    il = 0
    while True:
        kc = ctx.new_tensor("f16", (hd * n_head_kv, n_kv), name=f"cache_k-{il}")
        vc = ctx.new_tensor("f16", (n_kv, hd * n_head_kv), name=f"cache_v-{il}")
        kc.buffer = vc.buffer = "kv_cache"
        cur = O.mul(O.rms_norm(x), weight(n_embd, t="f32"), name=f"attn_norm-{il}")
        q = O.rope_ext(O.reshape(O.mul_mat(weight(n_embd, n_embd), cur), hd, n_head, n_tokens),
                       pos, name=f"Qcur-{il}")
        k = O.rope_ext(O.reshape(O.mul_mat(weight(n_embd, hd * n_head_kv), cur), hd,
                                 n_head_kv, n_tokens), pos, name=f"Kcur-{il}")
        v = O.mul_mat(weight(n_embd, hd * n_head_kv), cur, name=f"Vcur-{il}")
        # KV cache writes through views, expanded before the attention reads the cache
        g.build_forward_expand(O.cpy(O.reshape(k, hd * n_head_kv, n_tokens),
                                     O.view_2d(kc, hd * n_head_kv, n_tokens, kc.nb[1], 0)))
        g.build_forward_expand(O.cpy(O.transpose(v),
                                     O.view_2d(vc, n_tokens, hd * n_head_kv, vc.nb[1], 0)))
        att = build_attention(q, kc, vc, mask, shape=shape, kq_scale=1 / math.sqrt(hd), il=il)
        x = O.add(O.mul_mat(weight(n_embd, n_embd), att), x, name=f"ffn_inp-{il}")
        cur = O.mul(O.rms_norm(x), weight(n_embd, t="f32"), name=f"ffn_norm-{il}")
        up = O.mul_mat(weight(n_embd, n_ff), cur)
        gate = O.mul_mat(weight(n_embd, n_ff), cur)
        cur = O.mul_mat(weight(n_ff, n_embd), O.mul(O.silu(gate), up))
        x = O.add(cur, x, name=f"l_out-{il}")
        g.build_forward_expand(x)
        il += 1
        if g.n_nodes + 40 > n_nodes:
            break
    out = O.mul_mat(weight(n_embd, 4096), O.rms_norm(x), name="result_output").set_output()
    return g.build_forward_expand(out)


def random_dag(n_nodes: int, seed: int = 0) -> Graph:
    """Random DAG: in-place and plain ops, reshapes, offset views, outputs; sources are
    drawn mostly from recent tensors, as in real graphs."""
    rnd = random.Random(seed)
    ctx = Context("random")
    pool = [ctx.new_tensor("f32", (rnd.choice([64, 256, 1024]), rnd.choice([1, 8, 32])),
                           name=f"in{i}").set_input() for i in range(8)]
    g = Graph(capacity=n_nodes + 64)
    inplace = [OpKind.ADD, OpKind.MUL, OpKind.SCALE, OpKind.SILU, OpKind.SOFT_MAX]
    while g.n_nodes < n_nodes - 1:
        a = pool[-1 - min(int(rnd.expovariate(0.3)), len(pool) - 1)]
        r = rnd.random()
        if r < 0.45:
            b = pool[-1 - min(int(rnd.expovariate(0.1)), len(pool) - 1)]
            t = Tensor(ctx, a.type, a.ne, op=rnd.choice(inplace), src=(a, b))
        elif r < 0.8:
            ne = (rnd.choice([64, 256, 1024, 4096]), rnd.choice([1, 8, 32]))
            t = Tensor(ctx, GGMLType.F32, ne, op=OpKind.MUL_MAT, src=(a,))
        elif a.is_contiguous():
            t = Tensor(ctx, a.type, (a.nelements,), op=OpKind.RESHAPE, src=(a,), view_src=a)
        else:
            continue
        if rnd.random() < 0.02:
            t.set_output()
        pool.append(t)
        g.build_forward_expand(t)
    return g


def bench(graph: Graph, strategy: str, repeat: int) -> dict:
    best, plan = math.inf, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = plan_graph(graph, strategy=strategy)
        best = min(best, time.perf_counter() - t0)
    return {"strategy": strategy, "nodes": graph.n_nodes, "leafs": graph.n_leafs,
            "planned": len(plan.placements), "seconds": best,
            "nodes_per_second": graph.n_nodes / best, "buffer_bytes": plan.size,
            "method": plan.method, "ggml_bytes": plan.ggml_size}


COLUMNS = [Column("graph", width=8, align="<"), Column("nodes", width=6),
           Column("strategy", width=8, align="<"), Column("seconds", fmt="{:.3f}", width=8),
           Column("nodes_per_second", "nodes/s", "{:.0f}", 9),
           Column(lambda r: r["buffer_bytes"] / MIB, "buffer MiB", "{:.2f}", 11),
           # the buffer saved against ggml's strategy
           Column(lambda r: 100 * (1 - r["buffer_bytes"] / r["ggml_bytes"]) if r["ggml_bytes"]
                  else 0, "saved", "{:.1f}%", 6),
           Column("method", "best candidate", align="<", gap="  ")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[
        repeat_option(3), out_option(results_path("alloc.json"))])
    ap.add_argument("--nodes", type=int, default=10000)
    args = ap.parse_args()
    graphs = {"decoder": decoder_graph(args.nodes), "random": random_dag(args.nodes)}
    rows = []
    print("\n".join(header_lines(COLUMNS)))
    for name, g in graphs.items():
        for strategy in ("ggml", "default"):
            r = bench(g, strategy, args.repeat)
            r["graph"] = name
            rows.append(r)
            print(row_line(r, COLUMNS))
    write_results(args.out, rows, args=args, rows_key="results",
                  extra={"python": platform.python_version(), "machine": platform.machine(),
                         "repeat": args.repeat})


if __name__ == "__main__":
    main()
