"""Load benchmark of `ggraph serve` beside llama.cpp's llama-server, in the same run.

Per model, each server in turn (never both at once) starts on a free 127.0.0.1 port with the
same model, slots (-np, default 8: 8 clients each get one), unified KV cache (--ctx cells),
flash attention and threads. After /health answers 200 and a warm-up (one request, then -np
at once), each client count of -c sends --requests streamed chat completions (greedy, fixed
seed, --max-tokens; the same questions, tagged per cell and request so that no prompt repeats
one before it) from that many concurrent clients; then the server stops (SIGTERM, then kill).
Bounded: the start (--start-timeout), each cell (--time-limit: no request starts after it,
running ones are cut) and each request (--request-timeout).

Per cell: requests/s and generated tokens/s (usage.completion_tokens, or the text chunks of a
cut request) over the cell's wall time, time to first token (sending to the first SSE chunk
with text) p50/p99, inter-token latency (gaps between chunks with text) p50/p99, and ggraph's
over llama-server's tok/s and TTFT p99 ("x"). The issue's targets, checked under the table: at
8 clients, SmolLM2 and Qwen2.5 0.5B, -t 2: tok/s x >= 1 and TTFT p99 x <= 1.5.

--prefix adds the prefix-sharing scenario: 8 clients, --prefix-requests (16) requests, each a
long (~650-token) system prompt and a short question; once "unique" (a tag at the system
prompt's start: nothing to reuse), once "shared" (one system prompt for all). It reports the
prompt tokens reused (usage.prompt_tokens_details.cached_tokens, or llama-server's
timings.cache_n) and the TTFT gain, unique's p50 over shared's. --prefix-only: only that.

    python benchmarks/serve_load.py [-m default,qwen2.5-coder-0.5b] [-c 1,4,8,16]
        [--requests 32] [--max-tokens 64] [-np 8] [--ctx 8192] [-t 2] [-fa on] [--prefix]
        [--only ggraph|llama] [--time-limit 300] [-o benchmarks/results/serve_load.json]

llama-server: ~/.cache/llamacpp-tools/build/bin/llama-server (../shared/tools/
llamacpp-tools.sh builds it) or --llama-server PATH. The clients are standard-library threads.
A table on stdout; the JSON holds every cell, the server commands and the run record (CPU).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, model_arg, out_option, percentile, print_table, results_path,
                      threads_option, write_results)

HOST = "127.0.0.1"
LLAMA_SERVER = os.path.expanduser("~/.cache/llamacpp-tools/build/bin/llama-server")
SERVERS = ("ggraph", "llama-server")
PREFIX_CLIENTS = 8

QUESTIONS = [   # short and varied; request i asks QUESTIONS[i % 32]
    "What is the capital of France?", "Explain recursion in one paragraph.",
    "Write a haiku about autumn.", "How does a hash table work?", "Why is the sky blue?",
    "Give three tips for writing clean Python code.", "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.", "What is the difference between TCP and UDP?",
    "How do I reverse a list in Python?", "Name five prime numbers greater than 50.",
    "What is a binary search tree?", "Describe photosynthesis briefly.",
    "How many bytes are in a kilobyte?", "What does the acronym CPU stand for?",
    "Write a SQL query that counts rows in a table.", "Explain what an API is.",
    "What is the boiling point of water at sea level?", "How do vaccines work?",
    "List the planets of the solar system.", "What is the Pythagorean theorem?",
    "Translate 'good morning' into Spanish.", "What is a closure in JavaScript?",
    "Give a short definition of entropy.", "How does garbage collection work?",
    "What is the difference between a list and a tuple?", "What is the speed of light?",
    "Suggest a name for a pet turtle.", "Explain big-O notation simply.",
    "What is a mutex used for?", "How do I read a file line by line in C?",
    "What is the largest ocean on Earth?"]
TOPICS = ["algorithms", "databases", "networking", "security", "testing", "user interfaces",
          "compilers", "operating systems", "numerical code", "documentation", "deployment",
          "concurrency"]
ADVICE = ["name the trade-offs before recommending one option",
          "give a short example first and the general rule after it",
          "prefer the standard library over third-party packages where it is enough",
          "say which assumptions the answer depends on",
          "mention the most common mistake and how to avoid it",
          "keep the answer under one hundred words unless asked for more"]
SYSTEM = ("You are a careful, friendly assistant for a software team. Follow these rules:\n"
          + "\n".join(f"{i + 1}. When a question touches {TOPICS[i % len(TOPICS)]}, "
                      f"{ADVICE[i % len(ADVICE)]}." for i in range(30)))


def cpu_model() -> str | None:
    with open("/proc/cpuinfo") if os.path.exists("/proc/cpuinfo") else open(os.devnull) as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                    None)


# -- the servers ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_command(kind: str, model: str, port: int, a: argparse.Namespace) -> list[str]:
    common = ["-m", model, "--host", HOST, "--port", str(port), "-np", str(a.np),
              "-c", str(a.ctx), "-t", str(a.threads), "-fa", a.fa]
    if kind == "ggraph":
        return [sys.executable, "-m", "ggraph.cli", "serve", *common, "-kvu"]
    return [a.llama_server, *common, "-tb", str(a.threads), "--kv-unified", "--no-webui"]


def tail(log: Any, n: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode("utf-8", "replace")[-n:]


class Server:
    """One server process: started, ready (/health 200) or an error with its log's tail,
    and always stopped (SIGTERM, then kill)."""

    def __init__(self, kind: str, model: str, a: argparse.Namespace) -> None:
        self.kind, self.port = kind, free_port()
        self.cmd = server_command(kind, model, self.port, a)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> float:
        """Seconds until /health answered 200."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited ({self.proc.returncode}) before it "
                                   f"was ready:\n{tail(self.log)}")
            conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return time.monotonic() - t0
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
            time.sleep(0.5)
        raise RuntimeError(f"{self.kind} not ready after {timeout:.0f} s:\n{tail(self.log)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


# -- the clients ---------------------------------------------------------------------------------

def chat(port: int, messages: list[dict], max_tokens: int, deadline: float,
         timeout: float) -> dict[str, Any]:
    """One streamed chat completion, timed: TTFT, the gaps between text chunks, the tokens
    generated, the cached prompt tokens; cut at `deadline` (perf_counter)."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "seed": 42, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    r: dict[str, Any] = dict(ok=False, ttft=None, gaps=[], n_gen=0, chunks=0, prompt=None,
                             cached=None, error=None)   # n_gen: usage's, else the chunks
    t0 = last = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port,
                                      timeout=max(0.5, min(timeout, deadline - t0)))
    try:
        conn.request("POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            r["error"] = f"HTTP {resp.status}: {resp.read(300).decode('utf-8', 'replace')}"
            return r
        while True:
            line = resp.readline()
            now = time.perf_counter()
            if not line or now > deadline:
                r["error"] = "timed out" if line else "the stream ended before [DONE]"
                break
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                r["ok"] = True
                break
            ev = json.loads(data)
            if "error" in ev:
                r["error"] = json.dumps(ev["error"])[:300]
                break
            for ch in ev.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    if r["chunks"]:
                        r["gaps"].append(now - last)
                    else:
                        r["ttft"] = now - t0
                    last = now
                    r["chunks"] += 1
            if u := ev.get("usage"):
                r["n_gen"], r["prompt"] = u.get("completion_tokens", 0), u.get("prompt_tokens")
                r["cached"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
            if r["cached"] is None and isinstance(ev.get("timings"), dict):
                r["cached"] = ev["timings"].get("cache_n")   # llama-server's own report
    except (OSError, http.client.HTTPException, ValueError) as e:
        r["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        r["t_end"] = time.perf_counter()
    r["n_gen"] = r["n_gen"] or r["chunks"]
    return r


def run_cell(port: int, clients: int, n: int, messages: Callable[[int], list[dict]],
             max_tokens: int, time_limit: float, timeout: float) -> dict[str, Any]:
    """`n` requests from `clients` threads, each taking the next request when its last ends."""
    lock, nxt, results = threading.Lock(), [0], []
    t0 = time.perf_counter()
    end = t0 + time_limit

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                if i >= n or time.perf_counter() >= end:
                    return
                nxt[0] += 1
            r = chat(port, messages(i), max_tokens, min(time.perf_counter() + timeout, end),
                     timeout)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:   # a request ends by its deadline: the join's bound is only a guard
        t.join(max(0.0, end - time.perf_counter()) + 10)
    with lock:
        done = list(results)
    wall = max([r["t_end"] for r in done], default=time.perf_counter()) - t0
    ok = [r for r in done if r["ok"]]
    ttft = [r["ttft"] * 1e3 for r in done if r["ttft"] is not None]
    gaps = [g * 1e3 for r in done for g in r["gaps"]]
    gen = sum(r["n_gen"] for r in done)
    cached = [r["cached"] for r in done if r["cached"] is not None]
    prompts = [r["prompt"] for r in done if r["prompt"] is not None]
    errors = [r["error"] for r in done if r["error"]]
    return dict(clients=clients, requests=len(ok), sent=len(done), errors=len(errors),
                first_error=errors[0] if errors else None, wall_s=round(wall, 3),
                req_s=len(ok) / wall if wall > 0 else None,
                gen_tok_s=gen / wall if wall > 0 else None, gen_tokens=gen,
                ttft_p50_ms=percentile(ttft, 0.5), ttft_p99_ms=percentile(ttft, 0.99),
                itl_p50_ms=percentile(gaps, 0.5), itl_p99_ms=percentile(gaps, 0.99),
                prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None,
                cached_tokens_mean=sum(cached) / len(cached) if cached else None,
                cached_hits=sum(1 for r in done if (r["cached"] or 0) * 2 >= (r["prompt"] or 1)))


def questions(tag: str, system: str | None = None) -> Callable[[int], list[dict]]:
    """Request i's messages: question i, tagged with the cell and i at its start (no prompt
    repeats an earlier one's); "unique" puts the tag before the system prompt."""
    def messages(i: int) -> list[dict]:
        q = [{"role": "user", "content": f"[{tag}.{i}] {QUESTIONS[i % len(QUESTIONS)]}"}]
        if system is None:
            return q
        return [{"role": "system", "content": f"Conversation {tag}.{i}. {system}"
                 if tag == "unique" else system}, *q]
    return messages


# -- one server, one model -----------------------------------------------------------------------

def bench_server(kind: str, model: Any, a: argparse.Namespace) -> tuple[list[dict], dict]:
    """Start `kind` with `model`, warm it up, run the cells, stop it: rows and what ran."""
    base = dict(model=model.spec, server=kind)
    info: dict[str, Any] = dict(base)
    server = Server(kind, str(model), a)
    info["command"] = server.cmd
    rows = []
    try:
        info["ready_s"] = round(server.wait_ready(a.start_timeout), 2)
        print(f"serve_load: {kind} ready in {info['ready_s']} s ({model.spec}); warming up",
              file=sys.stderr, flush=True)
        w = chat(server.port, questions("warm")(0), a.max_tokens,
                 time.perf_counter() + a.start_timeout, a.start_timeout)
        if not w["ok"]:
            raise RuntimeError(f"{kind}: the warm-up request failed: {w['error']}")
        run_cell(server.port, a.np, a.np, questions("warm"), 8, a.time_limit,
                 a.request_timeout)
        cells = [] if a.prefix_only else [("short", c, questions(f"c{c}")) for c in a.clients]
        if a.prefix or a.prefix_only:
            cells += [(k, PREFIX_CLIENTS, questions(k, SYSTEM)) for k in ("unique", "shared")]
        for scenario, clients, messages in cells:
            n = a.requests if scenario == "short" else a.prefix_requests
            row = dict(base, scenario=scenario, **run_cell(
                server.port, clients, n, messages, a.max_tokens, a.time_limit,
                a.request_timeout))
            rows.append(row)
            print(f"serve_load: {kind} {scenario} x{clients}: {row['requests']}/{row['sent']} "
                  f"in {row['wall_s']} s; first error: {row['first_error']}", file=sys.stderr,
                  flush=True)
    except RuntimeError as e:
        info["error"] = str(e)
        print(f"serve_load: {e}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return rows, info


def add_ratios(rows: list[dict]) -> None:
    """ggraph's tok/s and TTFT p99 over llama-server's; the shared row's TTFT gain."""
    at = {(r["model"], r["server"], r["scenario"], r["clients"]): r for r in rows}
    for r in rows:
        peer = at.get((r["model"], "llama-server", r["scenario"], r["clients"]))
        if r["server"] == "ggraph" and peer:
            for k, out in (("gen_tok_s", "tok_s_ratio"), ("ttft_p99_ms", "ttft_p99_ratio")):
                if r.get(k) and peer.get(k):
                    r[out] = r[k] / peer[k]
        unique = at.get((r["model"], r["server"], "unique", r["clients"]))
        if r["scenario"] == "shared" and unique and unique["ttft_p50_ms"] and r["ttft_p50_ms"]:
            r["ttft_gain"] = unique["ttft_p50_ms"] / r["ttft_p50_ms"]


MS, X = "{:.1f}", "{:.2f}"
WHO = [Column("model", align="<"), Column("server", align="<")]
DONE = Column(lambda r: f"{r['requests']}/{r['sent']}", "done")
TTFT = [Column("ttft_p50_ms", "TTFT p50 ms", MS), Column("ttft_p99_ms", "TTFT p99 ms", MS)]
LOAD = [*WHO, Column("clients"), DONE, Column("req_s", "req/s", X),
        Column("gen_tok_s", "gen tok/s", MS), *TTFT, Column("itl_p50_ms", "ITL p50 ms", MS),
        Column("itl_p99_ms", "ITL p99 ms", MS), Column("tok_s_ratio", "tok/s x", X),
        Column("ttft_p99_ratio", "TTFT p99 x", X)]
PREFIX = [*WHO, Column("scenario", "system prompt", align="<"), Column("clients"), DONE,
          Column("prompt_tokens_mean", "prompt tok", "{:.0f}"),
          Column("cached_tokens_mean", "cached tok", "{:.0f}"), Column("cached_hits", "hits"),
          *TTFT, Column("gen_tok_s", "gen tok/s", MS), Column("ttft_gain", "TTFT gain", X),
          Column("ttft_p99_ratio", "TTFT p99 x", X)]


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets at 8 clients: tok/s ratio >= 1, TTFT p99 ratio <= 1.5."""
    return [dict(model=r["model"], tok_s_ratio=r.get("tok_s_ratio"),
                 ttft_p99_ratio=r.get("ttft_p99_ratio"),
                 met=r.get("tok_s_ratio", 0) >= 1.0 and r.get("ttft_p99_ratio", 9) <= 1.5)
            for r in rows if (r["server"], r["scenario"], r["clients"]) == ("ggraph", "short", 8)]


def int_list(s: str) -> list[int]:
    v = [int(x) for x in s.split(",") if x.strip().isdigit()]
    if not v or min(v) < 1 or len(v) != len(s.split(",")):
        raise argparse.ArgumentTypeError(f"a comma list of counts >= 1, got {s!r}")
    return v


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[threads_option(2, help="threads on both (default 2)"),
                                          out_option(results_path("serve_load.json"))])
    ap.add_argument("-m", "--model", action="append", metavar="NAME|PATH",
                    help="models (repeat it or a comma list; default: default, SmolLM2 135M)")
    ap.add_argument("-c", "--clients", type=int_list, default=[1, 4, 8, 16],
                    help="concurrent client counts (default 1,4,8,16)")
    ap.add_argument("--requests", type=int, default=32, help="requests per cell (default 32)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (default 64)")
    ap.add_argument("-np", "--parallel", dest="np", type=int, default=8, help="slots (default 8)")
    ap.add_argument("--ctx", type=int, default=8192,
                    help="unified KV cells (default 8192: the prefix run's prompts fit)")
    ap.add_argument("-fa", "--flash-attn", dest="fa", choices=("on", "off", "auto"),
                    default="on", help="flash attention on both (default on)")
    ap.add_argument("--prefix", action="store_true", help="add the prefix-sharing scenario")
    ap.add_argument("--prefix-only", action="store_true", help="run only that scenario")
    ap.add_argument("--prefix-requests", type=int, default=16,
                    help="requests per prefix cell (default 16: two per client)")
    ap.add_argument("--only", choices=("ggraph", "llama"), help="run one server only")
    ap.add_argument("--time-limit", type=float, default=300.0, help="s per cell (default 300)")
    ap.add_argument("--request-timeout", type=float, default=180.0,
                    help="s per request (default 180)")
    ap.add_argument("--start-timeout", type=float, default=600.0,
                    help="seconds for a server to load and answer its warm-up (default 600)")
    ap.add_argument("--llama-server", default=LLAMA_SERVER, metavar="PATH",
                    help="llama-server's binary (default ~/.cache/llamacpp-tools/build/bin/)")
    a = ap.parse_args(argv)
    for flag, v in (("--requests", a.requests), ("--max-tokens", a.max_tokens),
                    ("--prefix-requests", a.prefix_requests),
                    ("-np", a.np), ("--ctx", a.ctx), ("-t", a.threads)):
        if v < 1:
            ap.error(f"{flag} must be >= 1, got {v}")
    try:
        a.model = [model_arg(s.strip()) for m in (a.model or ["default"]) for s in m.split(",")
                   if s.strip()]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    kinds = [k for k in SERVERS if a.only is None or k.startswith(a.only)]
    if "llama-server" in kinds and not os.access(a.llama_server, os.X_OK):
        ap.error(f"no llama-server at {a.llama_server} (--llama-server PATH, or --only ggraph)")
    rows, servers = [], []
    for model in a.model:
        for kind in kinds:   # one server at a time: never both on the machine at once
            got, info = bench_server(kind, model, a)
            rows += got
            servers.append(info)
    add_ratios(rows)
    print(f"\n{a.requests} streamed chat requests per cell, {a.max_tokens} tokens max, "
          f"greedy; -np {a.np}, unified cache of {a.ctx}, -fa {a.fa}, -t {a.threads}; "
          f"x: ggraph over llama-server\n")
    load = [r for r in rows if r["scenario"] == "short"]
    if load:
        print_table(load, LOAD, sep="  ")
    met = targets(rows)
    for t in met:
        print(f"target at 8 clients, {t['model']}: tok/s x {t['tok_s_ratio'] or 0:.2f} "
              f"(>= 1), TTFT p99 x {t['ttft_p99_ratio'] or 0:.2f} (<= 1.5): "
              f"{'met' if t['met'] else 'NOT met'}")
    pre = [r for r in rows if r["scenario"] != "short"]
    if pre:
        print(f"\nprefix sharing: {PREFIX_CLIENTS} clients, {a.prefix_requests} requests, a long "
              f"system prompt; cached: prompt tokens the server reused (mean), hits: requests "
              f"that reused half their prompt or more; gain: unique's TTFT p50 over shared's\n")
        print_table(pre, PREFIX, sep="  ")
    for s in (s for s in servers if "error" in s):
        print(f"\n{s['server']} ({s['model']}) failed: {s['error']}")
    print(f"\ncpu: {cpu_model()}")
    write_results(a.out, rows, args=a, argv=argv, extra=dict(
        cpu_model=cpu_model(), servers=servers, targets=met, questions=QUESTIONS,
        system_prompt=SYSTEM))
    if any("error" in s for s in servers):
        sys.exit(1)


if __name__ == "__main__":
    main()
