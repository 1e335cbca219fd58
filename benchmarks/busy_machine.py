"""Generation speed on a quiet and on a busy machine: ggraph (under several OpenMP wait
policies) and llama.cpp, each measured with and without one competing CPU-bound process per
core.

Each configuration runs in its own process, since libgomp reads its environment once, when
it is loaded. Every child loads SmolLM2, compiles and warms up; then, `--reps` times, each
child in turn decodes `--gen` tokens on the quiet machine, the competing processes
(`python -c "while 1: pass"`) start, each child decodes again, and they stop. Taking turns
spreads whatever else runs on the machine over every configuration; the figures are medians.

    python benchmarks/busy_machine.py [--threads 1 2] [--policies default passive ...]
                                      [--gen 32] [--reps 3] [--json out.json]

Policies: `default` leaves the environment as it is (ggraph's CPU backend then sets its own
defaults, backends/cpu/threads.py); `spin` forces libgomp's spinning (OMP_WAIT_POLICY=active);
`passive` (OMP_WAIT_POLICY=passive); `spinN` bounded spinning (GOMP_SPINCOUNT=N); NAME=VALUE
sets any variable, and several join with commas (`passive,GGRAPH_PARALLEL_MIN_PRODUCT=524288`);
`llama.cpp` measures llama-cpp-python instead of ggraph.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, header_lines, llama_cpp_model, out_option, repeat_option, row_line,
                    threads_option, write_results)

BUSY = "while 1: pass"


def policy_env(policy: str) -> dict[str, str]:
    """The environment of a configuration: comma-separated `spin`, `passive`, `spinN`
    (GOMP_SPINCOUNT=N), `default` (as it is) or NAME=VALUE settings."""
    env = dict(os.environ)
    for part in policy.split(","):
        if part == "spin":
            env["OMP_WAIT_POLICY"] = "active"
        elif part == "passive":
            env["OMP_WAIT_POLICY"] = "passive"
        elif part.startswith("spin"):
            env["GOMP_SPINCOUNT"] = part[4:]
        elif "=" in part:
            k, v = part.split("=", 1)
            env[k] = v
    return env


def child(args: argparse.Namespace) -> None:
    """One configuration, kept loaded: each line read from stdin decodes `--gen` tokens and
    prints the tok/s; the parent decides what load runs meanwhile."""
    import numpy as np

    from ggraph.graphs.gguf.fetch import resolve_model

    path = str(resolve_model("default"))
    prompt = list(range(100, 132))
    if args.policy.split(",")[0] == "llama.cpp":
        llm = llama_cpp_model(path, n_ctx=1024, n_batch=512, threads=args.threads)

        def step(tok: int) -> int:
            llm.eval([tok])
            return int(np.argmax(llm.scores[llm.n_tokens - 1]))

        def restart() -> None:
            llm.reset()
            llm.eval(prompt)
    else:
        from ggraph.graphs.runtime.engine import Engine, EngineConfig

        eng = Engine(path, EngineConfig(n_ctx=1024, n_ubatch=512, n_threads=args.threads,
                                        reserve_outputs="last"))

        def step(tok: int) -> int:
            return int(np.argmax(eng.eval([tok])))

        def restart() -> None:
            eng.reset()
            eng.eval(prompt)

    def decode() -> float:
        restart()   # the same n_kv every time: speeds compare like for like
        tok, t0 = 1, time.perf_counter()
        for _ in range(args.gen):
            tok = step(tok)
        return args.gen / (time.perf_counter() - t0)

    decode()  # compile, bind, warm
    print("ready", flush=True)
    for _ in sys.stdin:
        print(f"{decode():.4f}", flush=True)


class Child:
    """A configuration's process (see `child`)."""

    def __init__(self, policy: str, threads: int, gen: int) -> None:
        self.policy, self.threads = policy, threads
        cmd = [sys.executable, __file__, "--child", policy, "--threads", str(threads),
               "--gen", str(gen)]
        self.proc = subprocess.Popen(cmd, env=policy_env(policy), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.quiet: list[float] = []
        self.busy: list[float] = []

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"{self.policy} t{self.threads} did not start: {line!r}")

    def measure(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


COLUMNS = [Column(lambda r: r["policy"][:39], "policy", width=40, align="<"),
           Column("threads", width=8), Column("quiet_median", "quiet tok/s", "{:.2f}", 13),
           Column("busy_median", "busy tok/s", "{:.2f}", 12),
           Column(lambda r: r["busy_median"] / r["quiet_median"], "busy/quiet", "{:.2f}", 12)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[
        threads_option([1, 2], many=True), repeat_option(3, "--reps"), out_option("")])
    ap.add_argument("--policies", nargs="+", default=["default", "spin", "passive",
                                                      "llama.cpp"])
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--load", type=int, default=os.cpu_count() or 1,
                    help="competing processes (default: one per core)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.policy, args.threads = args.child, args.threads[0]
        child(args)
        return
    children = []
    try:
        for threads in args.threads:     # started one at a time: compiles do not overlap
            for policy in args.policies:
                c = Child(policy, threads, args.gen)
                c.wait_ready()
                children.append(c)
        # round robin, so that whatever else runs on the machine weighs on every
        # configuration alike
        for _ in range(args.repeat):
            for c in children:
                time.sleep(0.5)
                c.quiet.append(c.measure())
            procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.load)]
            try:
                time.sleep(0.3)
                for c in children:
                    c.busy.append(c.measure())
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
    finally:
        for c in children:
            c.close()
    rows = []
    print("\n".join(header_lines(COLUMNS, sep="")))
    for c in children:
        q, b = statistics.median(c.quiet), statistics.median(c.busy)
        rows.append(dict(policy=c.policy, threads=c.threads, quiet=c.quiet, busy=c.busy,
                         quiet_median=q, busy_median=b))
        print(row_line(rows[-1], COLUMNS, sep=""))
    if args.out:
        write_results(args.out, rows, args=args,
                      extra=dict(cpu_count=os.cpu_count(), load=args.load, gen=args.gen))


if __name__ == "__main__":
    main()
