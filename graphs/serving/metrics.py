"""The server's counters and gauges, and their Prometheus text (GET /metrics).

The names are llama-server's (`llamacpp:` prefix, SV/server-task.cpp), so a dashboard made
for llama-server reads ggraph's; `requests_total`, `requests_rejected_total`,
`prompt_tokens_cached_total`, `requests_queued` and the `kv_cache_*` gauges are ggraph's
additions (the issue asks for the queue and the KV cells in use)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Metrics:
    prompt_tokens_total: int = 0          # prompt tokens evaluated (cached ones not)
    prompt_tokens_cached_total: int = 0   # prompt tokens reused from the cache
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0               # engine.decode calls
    n_tokens_max: int = 0                 # the most tokens one decode evaluated
    requests_total: int = 0
    requests_rejected_total: int = 0      # refused with 503 (queue full, shutting down)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw: float) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def prometheus(self, gauges: dict[str, tuple[float, str]],
                   more: dict[str, tuple[float, str]] | None = None) -> str:
        """The text exposition format: the counters (with `more`, name -> (value, help)),
        then `gauges`."""
        counters = {
            "prompt_tokens_total": "Number of prompt tokens processed.",
            "prompt_tokens_cached_total": "Number of prompt tokens reused from the KV cache.",
            "prompt_seconds_total": "Prompt process time.",
            "tokens_predicted_total": "Number of generation tokens processed.",
            "tokens_predicted_seconds_total": "Predict process time.",
            "n_decode_total": "Total number of llama_decode() calls.",
            "requests_total": "Requests accepted.",
            "requests_rejected_total": "Requests refused because the queue was full.",
        }
        lines: list[str] = []
        with self.lock:
            values = {n: (getattr(self, n), h) for n, h in counters.items()} | (more or {})
            for name, (v, help_) in values.items():
                lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} counter",
                          f"llamacpp:{name} {_num(v)}"]
            gauges = {"n_tokens_max": (self.n_tokens_max, "Largest observed n_tokens."),
                      **gauges}
        for name, (v, help_) in gauges.items():
            lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} gauge",
                      f"llamacpp:{name} {_num(v)}"]
        return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"
