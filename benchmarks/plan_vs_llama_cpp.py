"""`ggraph plan` against llama.cpp's own memory report, same machine, same run.

For each model and setting (-c, -ub, -ctk, -ctv, flash attention) llama.cpp (llama-cpp-python,
built from source) creates a context and logs its KV cache lines and its CPU compute buffer;
ggraph plans the same from the GGUF header (`ggraph plan`'s library function, no weights read).
The KV cache lines must be llama.cpp's, word for word; ggraph's compute buffer should be at or
below llama.cpp's.
Prints a table and writes JSON (default benchmarks/results/plan_llama_cpp.json).

    python benchmarks/plan_vs_llama_cpp.py [--models smollm2,gemma3] [--json FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys

from ggraph.graphs.eval.bench import machine_info
from ggraph.ir.types import MIB

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (import_llama_cpp, llama_cpp_model, llama_cpp_version, out_option,
                    results_path, write_results)

SETTINGS = [  # (n_ctx, n_ubatch, type_k, type_v, flash_attn)
    (4096, 512, "f16", "f16", False),
    (4096, 512, "f16", "f16", True),
    (4096, 512, "q8_0", "q8_0", True),
    (8192, 512, "q4_0", "q4_0", True),
    (2048, 128, "f16", "f16", False),
    (8192, 256, "q8_0", "f16", True),
]


class LlamaLog:
    """Collects llama.cpp's log through llama_log_set (its memory lines)."""

    def __init__(self) -> None:
        llama_cpp = import_llama_cpp()
        self.lines: list[str] = []
        self._buf = ""

        @llama_cpp.llama_log_callback
        def cb(level, text, user_data):  # noqa: ARG001
            self._buf += text.decode("utf-8", "replace")
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                self.lines.append(line)

        self._cb = cb  # kept alive as long as the log is
        llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))


def llama_cpp_memory(path: str, n_ctx: int, n_ubatch: int, tk: str, tv: str, fa: bool,
                     log: LlamaLog) -> dict:
    log.lines.clear()
    llm = llama_cpp_model(path, n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch, type_k=tk,
                          type_v=tv, flash_attn=fa, threads=2, verbose=True,
                          swa_full=False)  # llama-cli's default; llama-cpp-python's is full
    del llm
    kv = [ln.strip() for ln in log.lines if "llama_kv_cache: size" in ln
          or "llama_kv_cache_iswa" in ln]
    kv_mib = sum(float(m.group(1)) for ln in kv if (m := re.search(r"size =\s*([\d.]+) MiB", ln))
                 and "llama_kv_cache:" in ln)
    buf = [float(m.group(1)) for ln in log.lines
           if (m := re.search(r"CPU compute buffer size =\s*([\d.]+) MiB", ln))]
    return {"kv_lines": kv, "kv_mib": kv_mib, "compute_mib": buf[-1] if buf else None}


def ggraph_memory(path: str, n_ctx: int, n_ubatch: int, tk: str, tv: str, fa: bool) -> dict:
    from ggraph.graphs.deploy.memory_plan import plan_model
    from ggraph.graphs.deploy.presets import header_model

    model, wbytes = header_model(path)
    r = plan_model(model, path, n_ctx, n_ubatch, 0, tk, tv, fa, strategy="default",
                   weight_bytes=wbytes)
    return {"kv_lines": r.kv_lines, "kv_mib": r.kv_bytes / MIB,
            "compute_mib": r.plan.size / MIB}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 parents=[out_option(results_path("plan_llama_cpp.json"))])
    ap.add_argument("--models", default="smollm2,gemma3")
    args = ap.parse_args()
    from ggraph.graphs.gguf.fetch import resolve_model

    log = LlamaLog()
    rows = []
    for name in args.models.split(","):
        path = resolve_model(name)
        for n_ctx, n_ub, tk, tv, fa in SETTINGS:
            setting = f"-c {n_ctx} -ub {n_ub} -ctk {tk} -ctv {tv}{' -fa' if fa else ''}"
            ref = llama_cpp_memory(path, n_ctx, n_ub, tk, tv, fa, log)
            try:
                ours = ggraph_memory(path, n_ctx, n_ub, tk, tv, fa)
            except (ValueError, KeyError) as e:
                ours = {"error": str(e)}
            rows.append({"model": name, "setting": setting, "llama_cpp": ref, "ggraph": ours})
            g_kv, g_cb = ours.get("kv_mib"), ours.get("compute_mib")
            print(f"{name:8} {setting:42} KV {ref['kv_mib']:8.2f} / "
                  f"{g_kv if g_kv is None else round(g_kv, 2)!s:>8} MiB  compute "
                  f"{ref['compute_mib']!s:>8} / {g_cb if g_cb is None else round(g_cb, 2)!s:>8}"
                  f" MiB  {ours.get('error', '')}", flush=True)
    out = write_results(args.out, rows, args=args, threads=2, extra={
        "cpu": machine_info().line, "llama_cpp": llama_cpp_version(),
        "note": "each cell: llama.cpp / ggraph; KV must be equal, ggraph's compute buffer "
                "at or below llama.cpp's"})
    # the KV lines must be the same text (sizes printed to 0.01 MiB, per cache); the compute
    # buffer at or below llama.cpp's
    bad = [r for r in rows if "error" in r["ggraph"]
           or r["ggraph"]["kv_lines"] != r["llama_cpp"]["kv_lines"]
           or (r["llama_cpp"]["compute_mib"] is not None
               and r["ggraph"]["compute_mib"] > r["llama_cpp"]["compute_mib"] + 0.005)]
    print(f"{len(rows) - len(bad)}/{len(rows)} settings: the same KV cache lines and a compute "
          f"buffer at or below llama.cpp's; CPU {out['cpu']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
