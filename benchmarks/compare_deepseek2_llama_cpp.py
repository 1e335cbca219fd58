"""A tiny random DeepSeek2 (MLA + MoE, F32 weights) in llama.cpp and in ggraph, same tokens.

Writes the tiny GGUF (graphs/testing/tiny_deepseek2.py: q_lora, YaRN with a log multiplier, a dense
leading layer, sigmoid MoE with exp_probs_b, group-limited routing, a shared expert), runs
llama.cpp through llama-cpp-python (logits for every token, then greedy decoding) and ggraph's
reference executor and CPU backend on the same tokens, and prints the logits NMSE of each
ggraph run against llama.cpp. Both attention tensor layouts are compared: the MLA file
(attn_k_b/attn_v_b, llama.cpp's absorbed MLA path) and the legacy file (attn_kv_b, llama.cpp's
decompressed MHA path). ggraph runs its absorbed path, its flash-attention path and the
per-head-group decompressing flash path with `--amb`-style iteration forced on.

    pip install llama-cpp-python   # builds llama.cpp from source (minutes)
    python benchmarks/compare_deepseek2_llama_cpp.py [--tokens 24] [--json PATH]

writes benchmarks/results/deepseek2_llama_cpp.json by default.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import numpy as np

from ggraph.check.conformance import nmse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import import_llama_cpp, llama_cpp_model, out_option, results_path, write_results

N_TOKENS = 24
N_GEN = 8
N_CTX = 256


def llama_cpp_logits(path: str, tokens: list[int], flash: bool = False, cache: str = "f32",
                     n_gen: int = N_GEN) -> tuple[np.ndarray, list[int]]:
    """All-token logits of `tokens` and the greedy continuation, from llama.cpp."""
    llm = llama_cpp_model(path, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, logits_all=True,
                          flash_attn=flash, threads=2, type_k=cache, type_v=cache)
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], np.float32)
    gen = []
    for _ in range(n_gen):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        gen.append(t)
        llm.eval([t])
    llm.close()
    return logits, gen


def ggraph_logits(path: str, tokens: list[int], *, backend: str = "cpu", path_name: str =
                  "absorbed", amb_mib: int = 0, n_ctx: int = N_CTX,
                  cache: str = "f32") -> np.ndarray:
    """All-token logits from ggraph: the reference executor or a backend, one MLA path."""
    from ggraph.graphs.models.archs import deepseek2
    from ggraph.graphs.gguf.gguf_file import load_gguf

    from ggraph.check.reference import run_reference
    from ggraph.ir.tensor import Context

    model = deepseek2.DeepSeek2Model(load_gguf(path))
    flash = path_name != "absorbed"
    ctx = Context()
    cache = model.new_cache(ctx, n_ctx, cache, flash_attn=flash)
    mg = model.build(ctx, cache, len(tokens), n_ctx, len(tokens), flash, amb_mib,
                     path=path_name)
    inputs = model.batch_inputs(mg, cache, np.asarray(tokens), 0, np.arange(len(tokens)))
    if backend == "reference":
        out = run_reference(mg.graph, inputs).read(mg.logits)
    else:
        from ggraph.backends import get_backend

        out = get_backend(backend).session().run(mg.graph, inputs).read(mg.logits)
    return np.asarray(out).reshape(len(tokens), -1)


def ggraph_greedy(path: str, tokens: list[int], n_gen: int = N_GEN) -> list[int]:
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    eng = Engine(path, EngineConfig(n_ctx=N_CTX, n_ubatch=64, type_k="f32"))
    return list(eng.generate(tokens, n_gen, stop_at_eos=False))


def variants() -> dict[str, Any]:
    """Other hyperparameter forms llama.cpp reads, each checked on the reference executor."""
    from ggraph.graphs.testing.tiny_deepseek2 import TinyDeepSeek2

    return {
        "yarn without log multiplier": TinyDeepSeek2(yarn_log_mul=0.0, seed=5),
        "V2-Lite-style log multiplier 0.0707, factor 40": TinyDeepSeek2(
            yarn_log_mul=0.0707, yarn_factor=40, yarn_orig_ctx=64, seed=6),
        "no rope scaling, MoE only, 1 expert used": TinyDeepSeek2(
            yarn_factor=0, n_layer_dense_lead=0, n_expert_used=1, seed=4),
        "softmax gating, no groups, no bias, no norm": TinyDeepSeek2(
            gating=1, n_expert_groups=0, exp_probs_b=False, expert_weights_norm=False,
            expert_weights_scale=1.0, seed=3),
        "Lite (no q_lora; llama.cpp needs 27 layers)": TinyDeepSeek2(
            q_lora_rank=0, n_layer=27, seed=8),
    }


def compare(workdir: str, n_tokens: int = N_TOKENS, seed: int = 1,
            runs: tuple[tuple[str, str, int, int], ...] | None = None) -> dict[str, Any]:
    """Write the tiny models, run both, return the NMSE figures."""
    from ggraph.graphs.testing.tiny_deepseek2 import TinyDeepSeek2, write_tiny_deepseek2

    rng = np.random.default_rng(seed)
    tokens = [int(x) for x in rng.integers(3, 250, n_tokens)]
    # (backend, MLA path, amb MiB, n_ctx): the amb runs attend over 4096 cells, so K*Q (3 MiB:
    # 3 groups at amb 1) and the decompressed K/V (2 MiB per head: 8 groups at amb 3) iterate
    runs = runs or (("reference", "absorbed", 0, N_CTX), ("cpu", "absorbed", 0, N_CTX),
                    ("cpu", "absorbed", 1, 4096), ("cpu", "absorbed-fa", 0, N_CTX),
                    ("reference", "decompress-fa", 0, N_CTX), ("cpu", "decompress-fa", 3, 4096))
    out: dict[str, Any] = {"tokens": tokens, "files": {}}
    for layout in ("split", "legacy"):
        path = write_tiny_deepseek2(os.path.join(workdir, f"tiny_deepseek2_{layout}.gguf"),
                                    TinyDeepSeek2(kv_b=layout, weight_type="f32"))
        ref, gen_cpp = llama_cpp_logits(path, tokens)
        res: dict[str, Any] = {"greedy_llama_cpp": gen_cpp, "nmse": {}}
        for backend, p, amb, n_ctx in runs:
            got = ggraph_logits(path, tokens, backend=backend, path_name=p, amb_mib=amb,
                                n_ctx=n_ctx)
            res["nmse"][f"{backend}/{p}" + (f"/amb{amb}" if amb else "")] = nmse(ref, got)
        # the same with flash attention on both sides, and with f16 caches on both sides
        ref_fa, _ = llama_cpp_logits(path, tokens, flash=True, n_gen=0)
        res["nmse_llama_cpp_fa_vs_plain"] = nmse(ref, ref_fa)
        res["nmse"]["cpu/absorbed-fa vs llama.cpp fa"] = nmse(
            ref_fa, ggraph_logits(path, tokens, path_name="absorbed-fa"))
        ref16, _ = llama_cpp_logits(path, tokens, cache="f16", n_gen=0)
        res["nmse"]["cpu/absorbed f16 cache vs llama.cpp f16"] = nmse(
            ref16, ggraph_logits(path, tokens, cache="f16"))
        res["nmse_llama_cpp_f16_vs_f32_cache"] = nmse(ref, ref16)
        res["greedy_ggraph"] = ggraph_greedy(path, tokens)
        res["greedy_equal"] = res["greedy_ggraph"] == gen_cpp
        out["files"][layout] = res
    out["variants"] = {}
    for i, (name, cfg) in enumerate(variants().items()):
        path = write_tiny_deepseek2(os.path.join(workdir, f"variant{i}.gguf"), cfg)
        ref, _ = llama_cpp_logits(path, tokens, n_gen=0)
        out["variants"][name] = nmse(ref, ggraph_logits(path, tokens, backend="reference"))
    out["max_nmse"] = max([v for r in out["files"].values() for v in r["nmse"].values()] +
                          list(out["variants"].values()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[out_option(results_path("deepseek2_llama_cpp.json"))])
    ap.add_argument("--tokens", type=int, default=N_TOKENS)
    args = ap.parse_args()
    llama_cpp = import_llama_cpp()
    with tempfile.TemporaryDirectory() as d:
        out = compare(d, args.tokens)
    out["llama_cpp_python_version"] = llama_cpp.__version__
    for layout, r in out["files"].items():
        print(f"{layout} file ({'attn_k_b/attn_v_b' if layout == 'split' else 'attn_kv_b'}), "
              f"{len(out['tokens'])} tokens, F32 weights, F32 caches unless named:")
        for k, v in r["nmse"].items():
            print(f"  logits NMSE ggraph {k:<40} vs llama.cpp: {v:.3e}")
        print(f"  (llama.cpp against itself: flash attention {r['nmse_llama_cpp_fa_vs_plain']:.3e}"
              f", f16 cache {r['nmse_llama_cpp_f16_vs_f32_cache']:.3e})")
        print(f"  greedy {len(r['greedy_llama_cpp'])} tokens "
              f"{'equal' if r['greedy_equal'] else 'DIFFER'}: llama.cpp {r['greedy_llama_cpp']}, "
              f"ggraph {r['greedy_ggraph']}")
    print("variants (reference executor, F32 caches):")
    for k, v in out["variants"].items():
        print(f"  logits NMSE {k:<48} vs llama.cpp: {v:.3e}")
    print(f"max NMSE {out['max_nmse']:.3e} (target < 1e-4)")
    write_results(args.out, args=args, extra=out, threads=2)   # llama.cpp's threads


if __name__ == "__main__":
    main()
