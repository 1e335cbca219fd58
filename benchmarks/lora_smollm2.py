"""LoRA fine-tuning of SmolLM2 135M (issue 33's must-show), measured in one run:

1. the text (tests/data/train/fdr_state_of_the_union.txt, public domain) is cut at a
   sentence near --train-share of its characters: ggraph trains on the first part (`ggraph finetune`'s
   LoraFinetune, -c tokens a window, --epochs) and the rest is held out. One epoch by
   default: on 4.4k training tokens a second one overfits (held-out perplexity, by the
   trainer's own graph: 49.3 before, 38.7 after one epoch, 42.1 after two; rank 8 on attn_q
   and attn_v, lr 1e-3);
2. perplexity of the held-out part, in chunks of -c tokens, before and after, by ggraph
   (the adapter applied as `--lora` applies it) and by llama.cpp (llama-cpp-python's
   `lora_path` loading the adapter file ggraph wrote): the drop must be at least 10%;
3. the KL divergence between llama.cpp's and ggraph's next-token distributions with the
   adapter, beside llama.cpp's own spread (flash attention on against off), over the held-out
   chunks;
4. training tokens per second, ggraph's step beside torch's on the same windows (the torch
   twin of benchmarks/lora_torch.py: the same dequantized weights, adapter and AdamW), the
   same threads, one after the other.

    python benchmarks/lora_smollm2.py [-m smollm2] [-c 128] [--epochs 1] [--lr 1e-3]
        [--rank 8] [--alpha 16] [-t 2] [-o results.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, llama_cpp_model, print_table, results_path,  # noqa: E402
                      threads_option, write_markdown_table, write_results)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "tests", "data", "train", "fdr_state_of_the_union.txt")
COLUMNS = [Column("what", align="<"), Column("value", fmt="{}", align="<")]


def split_text(text: str, share: float) -> tuple[str, str]:
    """(training part, held-out part): cut at the end of the sentence before `share` of the
    characters (the addresses are one line each)."""
    at = int(len(text) * share)
    cut = text.rfind(". ", 0, at)
    cut = cut + 1 if cut > 0 else at
    return text[:cut], text[cut:].lstrip()


def chunks(tokens: list[int], n: int) -> list[list[int]]:
    return [tokens[i:i + n] for i in range(0, len(tokens) - n + 1, n)]


def nll_and_logp(logits: np.ndarray, chunk: list[int]) -> tuple[float, np.ndarray]:
    """(summed NLL of tokens 1.. of the chunk, log-probabilities of every position)."""
    from ggraph.graphs.eval.perplexity import log_softmax

    lp = log_softmax(logits)
    return float(-lp[np.arange(len(chunk) - 1), chunk[1:]].sum()), lp


def ggraph_engine(model: str, adapter: str | None, n_ctx: int, threads: int):
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    return Engine(model, EngineConfig(n_ctx=n_ctx, n_threads=threads,
                                      loras=((adapter, 1.0),) if adapter else ()))


def llama_logits(llm, chunk: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(chunk)
    return np.array(llm.scores[:len(chunk)], dtype=np.float32)


def perplexities(model: str, adapter: str | None, cks: list[list[int]], threads: int
                 ) -> dict:
    """ggraph's and llama.cpp's perplexity over the chunks, their per-position KLD, and
    llama.cpp's own spread (flash attention on vs off)."""
    kw = dict(n_ctx=len(cks[0]), n_batch=len(cks[0]), threads=threads, logits_all=True)
    if adapter:
        kw["lora_path"] = adapter
    llm = llama_cpp_model(model, **kw)
    llm_fa = llama_cpp_model(model, flash_attn=True, **kw)
    eng = ggraph_engine(model, adapter, len(cks[0]), threads)
    out = {"ggraph": 0.0, "llama_cpp": 0.0, "kld": [], "kld_spread": [], "n": 0}
    for ck in cks:
        g, glp = nll_and_logp(eng.eval(ck, all_logits=True, n_past=0).reshape(len(ck), -1), ck)
        l, llp = nll_and_logp(llama_logits(llm, ck), ck)
        _, flp = nll_and_logp(llama_logits(llm_fa, ck), ck)
        out["ggraph"] += g
        out["llama_cpp"] += l
        out["n"] += len(ck) - 1
        out["kld"] += list((np.exp(llp) * (llp - glp)).sum(-1))
        out["kld_spread"] += list((np.exp(llp) * (llp - flp)).sum(-1))
    return {"ppl_ggraph": float(np.exp(out["ggraph"] / out["n"])),
            "ppl_llama_cpp": float(np.exp(out["llama_cpp"] / out["n"])),
            "kld_mean": float(np.mean(out["kld"])), "kld_max": float(np.max(out["kld"])),
            "spread_mean": float(np.mean(out["kld_spread"])),
            "spread_max": float(np.max(out["kld_spread"]))}


def torch_tokens_per_s(model: str, ft, n_ctx: int, threads: int, steps: int) -> float:
    import lora_torch

    tm = lora_torch.load_llama(model, targets=ft.settings.targets, rank=ft.settings.rank,
                               alpha=ft.settings.alpha)
    a0 = {name: tuple(ft.trainer.values(t).reshape(t.ne[1], t.ne[0]) for t in (lw.a, lw.b))
          for name, lw in ft.adapter.weights.items()}
    tm.set_lora(a0)
    data = ft.dataset(open(TEXT).read())
    s = lora_torch.time_steps(tm, data.data[:steps], data.labels[:steps], steps, threads,
                              lr=ft.settings.lr)
    return n_ctx / s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter,
                                 parents=[threads_option(2)])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-c", "--ctx", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--train-share", type=float, default=0.8)
    ap.add_argument("--torch-steps", type=int, default=3)
    ap.add_argument("-o", "--out", default=results_path("lora_smollm2.json"))
    args = ap.parse_args(argv)
    threads = args.threads[0] if isinstance(args.threads, list) else args.threads
    from ggraph.backends import get_backend
    from ggraph.graphs.gguf.fetch import resolve_model
    from ggraph.graphs.train.lora import LoraFinetune, LoraSettings

    model = str(resolve_model(args.model))
    train_text, held = split_text(open(TEXT).read(), args.train_share)
    st = LoraSettings(rank=args.rank, alpha=args.alpha, n_ctx=args.ctx, lr=args.lr,
                      epochs=args.epochs, val_split=0.0)
    ft = LoraFinetune.create(model, st, get_backend("cpu", n_threads=threads))
    cks = chunks(ft.tokenizer.encode(held, add_bos=False), args.ctx)
    print(f"held out: {len(cks)} chunks of {args.ctx} tokens", file=sys.stderr)
    before = perplexities(model, None, cks, threads)
    torch_tps = torch_tokens_per_s(model, ft, args.ctx, threads, args.torch_steps)
    t0 = time.perf_counter()
    hist = ft.train(train_text, progress=None)
    train_s = time.perf_counter() - t0
    n_tokens = sum(r.seen for r in hist.train)
    adapter = os.path.join(tempfile.mkdtemp(), "smollm2-lora.gguf")
    ft.save(adapter)
    after = perplexities(model, adapter, cks, threads)
    drop = 1 - after["ppl_ggraph"] / before["ppl_ggraph"]
    rows = [
        {"what": "perplexity before (ggraph / llama.cpp)",
         "value": f"{before['ppl_ggraph']:.3f} / {before['ppl_llama_cpp']:.3f}"},
        {"what": "perplexity after (ggraph / llama.cpp, adapter)",
         "value": f"{after['ppl_ggraph']:.3f} / {after['ppl_llama_cpp']:.3f}"},
        {"what": "perplexity drop (ggraph; target >= 10%)", "value": f"{drop:.1%}"},
        {"what": "KLD llama.cpp vs ggraph with the adapter: mean / max",
         "value": f"{after['kld_mean']:.2e} / {after['kld_max']:.2e}"},
        {"what": "llama.cpp's own spread (FA on vs off): mean / max",
         "value": f"{after['spread_mean']:.2e} / {after['spread_max']:.2e}"},
        {"what": f"training tokens/s, {threads} threads (ggraph / torch)",
         "value": f"{n_tokens / train_s:.1f} / {torch_tps:.1f}"},
        {"what": "training loss per epoch (ggraph)",
         "value": ", ".join(f"{e.loss:.3f}" for e in hist.train)},
    ]
    print_table(rows, COLUMNS)
    write_results(args.out, rows, args=args, extra={
        "before": before, "after": after, "ppl_drop": drop, "train_tokens": n_tokens,
        "train_seconds": train_s, "torch_tokens_per_s": torch_tps,
        "step_losses": hist.step_losses})
    write_markdown_table(args.out, rows, COLUMNS)
    return 0 if drop >= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
