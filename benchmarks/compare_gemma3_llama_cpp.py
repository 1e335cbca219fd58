"""Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 weights) in ggraph and in llama.cpp
(llama-cpp-python, same process, same machine), fed the same token ids (llama.cpp's):

- per-position logits of a prompt longer than the sliding window (512): NMSE and the KL
  divergence KL(llama.cpp || ggraph) of the next-token distributions, and top-1 agreement;
- greedy continuations of 16 tokens on a few prompts, with llama.cpp's top-2 logit margin at
  every step (a difference where the margin is tiny is a tie, not a bug);
- prompt processing of 512 tokens and generation of 64, both with the same thread count;
- the memory lines of both at -c 4096 -ub 512 (llama.cpp's iswa cache: the "non-SWA" and "SWA"
  caches, the CPU compute buffer), llama.cpp's captured from its log.

llama.cpp runs with swa_full=False (llama-cpp-python's default is the full-size SWA cache;
llama-cli's is not), so both size the SWA cache as pad256(n_swa + n_ubatch).

    python benchmarks/compare_gemma3_llama_cpp.py [--threads 2] [--ggml-exact] [--skip-speed]

writes benchmarks/results/gemma3_llama_cpp.json by default (gemma3_llama_cpp_ggml_exact.json
with --ggml-exact, which also turns the CPU backend's fusion pass off: its fused norm chain
rounds as ggraph does, not as ggml).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import platform
import sys
import time
from typing import Any

import numpy as np

from ggraph.check.conformance import nmse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (import_llama_cpp, llama_cpp_model, model_option, out_option,
                    print_peer_speed, results_path, threads_option, write_results)

PROMPTS = ["The capital of France is",
           "Once upon a time, in a small village,",
           "def fibonacci(n):",
           "The three primary colors are"]
# a prompt longer than Gemma 3's window of 512 tokens, so the sliding-window layers drop
# positions while the global ones keep them
LONG_TEXT = " ".join([
    "The history of the lighthouse begins with fires lit on hills to guide ships home.",
    "Later, towers of stone carried lamps of oil, and mirrors gathered their light.",
    "In the nineteenth century the Fresnel lens changed everything: rings of glass bent the",
    "beam so that a small flame could be seen from twenty miles away.",
    "Keepers lived in the towers with their families, trimming wicks and winding the clockwork",
    "that turned the lens through the night.",
    "Storms, isolation and the long winters made it a hard life, and many logbooks tell of",
    "shipwrecks they could not prevent and sailors they pulled from the sea.",
    "Electricity arrived slowly; some remote lights burned kerosene well into the twentieth",
    "century. Today most lighthouses are automated, watched by sensors and radio links.",
] * 7)
N_CTX = 4096
N_UBATCH = 512
MEMORY_WORDS = ("size =", "graph nodes", "graph splits")  # buffers, caches, graph


class LlamaLog:
    """llama.cpp's log lines, captured through llama_log_set while this object is alive."""

    def __init__(self) -> None:
        llama_cpp = import_llama_cpp()
        self.text: list[str] = []

        @llama_cpp.llama_log_callback
        def callback(level: int, text: bytes, user_data: Any) -> None:
            self.text.append(text.decode("utf-8", "replace"))

        self._cb = callback   # keep the ctypes callback alive
        llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))

    def memory_lines(self) -> list[str]:
        lines = "".join(self.text).splitlines()
        return [ln.strip() for ln in lines if any(w in ln for w in MEMORY_WORDS)]


def softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max(-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(-1, keepdims=True)


def kld(ref: np.ndarray, got: np.ndarray, rows: int = 32) -> np.ndarray:
    """KL(softmax(ref) || softmax(got)) per row (a few rows at a time: 262144 columns)."""
    out = []
    for i in range(0, len(ref), rows):
        p, q = softmax(ref[i:i + rows]), softmax(got[i:i + rows])
        out.append((p * (np.log(p + 1e-300) - np.log(q + 1e-300))).sum(-1))
    return np.concatenate(out)


def margin(logits: np.ndarray) -> float:
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


def both_logits(llm: Any, eng: Any, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every position's logits: llama.cpp's and ggraph's."""
    llm.reset()
    llm.eval(tokens)
    ref = np.array(llm.scores[: len(tokens)], np.float32)
    eng.reset()
    return ref, eng.eval(tokens, all_logits=True)


def compare_logits(llm: Any, eng: Any, tokens: list[int],
                   logits: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, Any]:
    ref, got = logits or both_logits(llm, eng, tokens)
    err = np.array([nmse(a, b) for a, b in zip(ref, got)])
    kl = kld(ref, got)
    same_top1 = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
    equal = [bool(np.array_equal(a, b)) for a, b in zip(ref, got)]
    return dict(n_tokens=len(tokens), nmse=float(nmse(ref, got)),
                positions_bit_equal=int(sum(equal)),
                first_position_not_equal=next((i for i, e in enumerate(equal) if not e), None),
                nmse_per_position=[float(e) for e in err],
                nmse_per_position_max=float(err.max()), nmse_per_position_mean=float(err.mean()),
                nmse_before_window=float(nmse(ref[:512], got[:512])),
                nmse_after_window=float(nmse(ref[512:], got[512:])) if len(tokens) > 512
                else None,
                kld_mean=float(kl.mean()), kld_max=float(kl.max()),
                kld_p99=float(np.quantile(kl, 0.99)), same_top1=same_top1)


def greedy(llm: Any, eng: Any, tokens: list[int], n_gen: int) -> dict[str, Any]:
    llm.reset()
    llm.eval(tokens)
    gen_cpp, margins = [], []
    for _ in range(n_gen):
        row = np.asarray(llm.scores[llm.n_tokens - 1])
        t = int(np.argmax(row))
        gen_cpp.append(t)
        margins.append(margin(row))
        llm.eval([t])
    eng.reset()
    gen_gg = list(eng.generate(tokens, n_gen, stop_at_eos=False))
    first = next((i for i, (a, b) in enumerate(zip(gen_cpp, gen_gg)) if a != b), None)
    return dict(tokens=tokens, llama_cpp=gen_cpp, ggraph=gen_gg, equal=gen_cpp == gen_gg,
                first_difference=first, margins_llama_cpp=margins,
                margin_at_first_difference=None if first is None else margins[first],
                text_llama_cpp=llm.detokenize(gen_cpp).decode("utf-8", "replace"),
                text_ggraph=llm.detokenize(gen_gg).decode("utf-8", "replace"))


def last_logits(llm: Any) -> np.ndarray:
    """The last token's logits of a context made without logits_all (llama-cpp-python then
    keeps no scores)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def speed(llm: Any, eng: Any) -> dict[str, float]:
    pp = [int(x) for x in np.random.default_rng(0).integers(100, 40000, 512)]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(pp)
    pp_cpp = 512 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(64):
        llm.eval([int(np.argmax(last_logits(llm)))])
    tg_cpp = 64 / (time.perf_counter() - t0)
    eng.reset()       # compile and bind the 512-token and decode graphs outside the timing
    eng.eval(pp)
    for i in range(4):
        eng.eval([10 + i])
    eng.reset()
    t0 = time.perf_counter()
    eng.eval(pp)
    pp_gg = 512 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    tok = 0
    for _ in range(64):
        tok = int(np.argmax(eng.eval([tok])))
    tg_gg = 64 / (time.perf_counter() - t0)
    # other work on the machine slows both; the load average says how busy it was
    return dict(pp512_llama_cpp=pp_cpp, pp512_ggraph=pp_gg, tg64_llama_cpp=tg_cpp,
                tg64_ggraph=tg_gg, load_average_1min=os.getloadavg()[0])


def write_dequantized(src: str, dst: str) -> None:
    """An F32 copy of a GGUF: every weight dequantized (gguf.quants), the metadata kept."""
    import gguf
    from gguf import quants

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    for t in r.tensors:
        arr = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, arr.reshape(tuple(int(x) for x in reversed(t.shape))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dequantized_check(path: str, tokens: list[int], quantized: tuple[np.ndarray, np.ndarray],
                      threads: int) -> dict[str, Any]:
    """Both runtimes on the F32 copy (the same weights, no quantized dot products), and each
    runtime's quantized logits against llama.cpp's F32 ones: which side the quantized
    difference comes from."""
    import tempfile

    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "f32.gguf")
        write_dequantized(path, f32)
        llm = llama_cpp_model(f32, n_ctx=1024, n_batch=N_UBATCH, n_ubatch=N_UBATCH,
                              swa_full=False, threads=threads, logits_all=True)
        eng = Engine(f32, EngineConfig(n_ctx=1024, n_ubatch=N_UBATCH, n_threads=threads))
        ref, got = both_logits(llm, eng, tokens)
        llm.close()
    q_cpp, q_gg = quantized
    res = {"f32_ggraph_vs_llama_cpp": compare_logits(None, None, tokens, (ref, got)),
           "quantized_llama_cpp_vs_f32": compare_logits(None, None, tokens, (ref, q_cpp)),
           "quantized_ggraph_vs_f32": compare_logits(None, None, tokens, (ref, q_gg))}
    for k, v in res.items():
        print(f"{k}: NMSE {v['nmse']:.2e}, KLD mean {v['kld_mean']:.2e}, same top-1 "
              f"{v['same_top1']:.4f}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[
        threads_option(2), model_option("gemma3"),
        out_option(None, help="default: benchmarks/results/gemma3_llama_cpp.json "
                              "(gemma3_llama_cpp_ggml_exact.json with --ggml-exact)")])
    ap.add_argument("--n-gen", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=1000,
                    help="tokens of the long prompt (past the 512-token window by default)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--dequantized", action="store_true",
                    help="also run both on an F32 copy of the model (weights dequantized): "
                         "the architecture alone, without the quantized dot products")
    ap.add_argument("--ggml-exact", action="store_true",
                    help="ggraph computes quantized mul_mat bit for bit as ggml's x86 CPU")
    args = ap.parse_args()
    if args.out is None:
        args.out = results_path("gemma3_llama_cpp"
                                + ("_ggml_exact" if args.ggml_exact else "") + ".json")
    if args.ggml_exact:   # read when the fusion module is first imported, below
        os.environ["GGRAPH_FUSE"] = "0"
    llama_cpp = import_llama_cpp()
    import numba

    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    numba.set_num_threads(args.threads)
    path = str(args.model)
    log = LlamaLog()
    peer = dict(n_batch=N_UBATCH, n_ubatch=N_UBATCH, swa_full=False, threads=args.threads)
    # memory lines and speed at -c 4096 (logits of the last token only: logits_all would
    # hold n_ctx x 262144 floats, 4 GiB)
    llm = llama_cpp_model(path, n_ctx=N_CTX, verbose=True, **peer)
    mem_cpp = log.memory_lines()
    eng = Engine(path, EngineConfig(n_ctx=N_CTX, n_ubatch=N_UBATCH, n_threads=args.threads,
                                    ggml_exact=args.ggml_exact))
    out: dict[str, Any] = {
        "model": os.path.basename(path), "llama_cpp_version": llama_cpp.__version__,
        "threads": args.threads, "ggml_exact": args.ggml_exact,
        "cpu": platform.processor() or platform.machine(),
        "memory": {"llama_cpp": mem_cpp, "ggraph": eng.memory_lines()}}
    print("memory, llama.cpp:\n  " + "\n  ".join(mem_cpp))
    print("memory, ggraph:\n  " + "\n  ".join(out["memory"]["ggraph"]))
    if not args.skip_speed:
        out["speed"] = speed(llm, eng)
        print_peer_speed(out["speed"], ("pp512", "tg64"))
    llm.close()
    # logits of every position: a context just large enough for the long prompt
    llm = llama_cpp_model(path, n_ctx=1024, logits_all=True, **peer)
    long_toks = llm.tokenize(LONG_TEXT.encode(), add_bos=True, special=False)[:args.long_tokens]
    long_logits = both_logits(llm, eng, long_toks)
    out["long_prompt"] = lg = compare_logits(llm, eng, long_toks, long_logits)
    print(f"long prompt ({lg['n_tokens']} tokens): NMSE {lg['nmse']:.2e} (per position max "
          f"{lg['nmse_per_position_max']:.2e}), KLD mean {lg['kld_mean']:.2e} max "
          f"{lg['kld_max']:.2e}, same top-1 {lg['same_top1']:.4f}, bit-equal positions "
          f"{lg['positions_bit_equal']}/{lg['n_tokens']}")
    out["prompts"] = []
    for prompt in PROMPTS:
        toks = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        row = dict(prompt=prompt, **greedy(llm, eng, toks, args.n_gen),
                   logits=compare_logits(llm, eng, toks))
        try:
            row["tokens_equal"] = eng.tokenizer.encode(prompt) == toks
        except Exception as e:  # the tokenizer may not build this vocabulary yet
            row["tokens_equal"] = f"ggraph tokenizer: {e}"
        out["prompts"].append(row)
        first = row["first_difference"]
        print(f"{prompt!r}: greedy {args.n_gen} "
              f"{'equal' if row['equal'] else f'differ at {first}'} (llama.cpp's smallest "
              f"top-2 margin {min(row['margins_llama_cpp']):.3f}"
              + ("" if first is None else f", at the difference "
                 f"{row['margin_at_first_difference']:.3f}") + f"), logits NMSE "
              f"{row['logits']['nmse']:.2e}, KLD {row['logits']['kld_mean']:.2e}, bit-equal "
              f"positions {row['logits']['positions_bit_equal']}/{row['logits']['n_tokens']}")
        print(f"   llama.cpp: {row['text_llama_cpp']!r}\n   ggraph:    {row['text_ggraph']!r}")
    llm.close()
    if args.dequantized:
        out["dequantized"] = dequantized_check(path, long_toks, long_logits, args.threads)
    write_results(args.out, args=args, extra=out)


if __name__ == "__main__":
    main()
