"""`ggraph serve`: an OpenAI-compatible HTTP server with continuous batching, as llama-server.

    ggraph serve -m MODEL [--host 127.0.0.1] [--port 8080] [-np N] [-c N] [--kv-unified]
                 [-fa on|off|auto] [-ctk T] [-ctv T] [-t N] [--api-key KEY] [-md DRAFT]

Endpoints: POST /v1/chat/completions, /v1/completions, /completion (llama-server's),
/tokenize, /detokenize; GET /v1/models, /health, /metrics (Prometheus), /slots. Streaming
is server-sent events ending with `data: [DONE]`.

llama-server's flag names and defaults: -np auto (-1) is 4 slots sharing one unified KV cache
of -c cells; -b 2048; the host is 127.0.0.1 unless told otherwise. ggraph's own:
--max-queue (choices that may wait for a slot before requests get 503 with Retry-After) and
--prefill-chunk (prompt tokens a step takes while other slots generate). -md DRAFT adds
speculative decoding for every slot (--spec-draft-n-max, --spec-draft-n-min, --draft-p-min
as llama.cpp's; graphs/serving/drafting.py). The server listens
at once and answers /health with 503 while the model loads. SIGTERM (or Ctrl-C) stops
accepting connections, lets running requests finish, then exits.

Needs the `ggraph[server]` extra (Starlette, uvicorn).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    from ggraph.tools.common.defaults import (N_BATCH, add_context_flags, add_flash_attn_flag,
                                              add_load_flags, add_lora_flags,
                                              add_threads_flag)

    p = sub.add_parser("serve", help="an OpenAI-compatible server (llama-server's flags)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="GGUF path or a model name")
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL")
    p.add_argument("-a", "--alias", default=None, help="the model's name in the API "
                   "(default: the file's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                   "127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=None, help="clients must send 'Authorization: Bearer "
                   "KEY' (or X-Api-Key)")
    p.add_argument("--api-key-file", default=None, help="read the key from a file's first "
                   "line")
    p.add_argument("-np", "--parallel", type=int, default=-1, metavar="N",
                   help="slots: sequences generated at once (default -1: 4 with a unified "
                        "cache, as llama-server's auto)")
    p.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true",
                   default=None, help="one KV cache all slots share (the default with -np "
                                      "auto)")
    p.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_false",
                   help="a stream of -c / -np cells per slot")
    add_context_flags(p)
    p.add_argument("-b", "--batch-size", type=int, default=N_BATCH,
                   help=f"tokens one decode step may take (default {N_BATCH})")
    p.add_argument("-ctk", "--cache-type-k", default="f16")
    p.add_argument("-ctv", "--cache-type-v", default="f16")
    add_flash_attn_flag(p)
    add_threads_flag(p)
    add_load_flags(p)
    add_lora_flags(p)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--metrics", action="store_true", help="accepted: /metrics is always on")
    p.add_argument("--no-warmup", action="store_true", help="skip the warmup run at load")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="choices that may wait for a slot; more get 503 (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="prompt tokens a step takes while other slots generate (default 256)")
    p.add_argument("--max-body", type=int, default=4 << 20, metavar="BYTES",
                   help="largest request body; larger ones get 413 (default 4 MiB)")
    s = p.add_argument_group("speculative decoding (llama-server's draft model flags)")
    from ggraph.tools.common.defaults import add_draft_flags

    add_draft_flags(s, "a draft model sharing the vocabulary: every generating slot checks its drafts in the decode batch")
    p.set_defaults(func=main)


def check(args: argparse.Namespace) -> None:
    from ggraph.tools.common.defaults import SIZE_BOUNDS, check_bounds, check_threads

    check_bounds(args, {**SIZE_BOUNDS, "batch_size": ("-b/--batch-size", 1, ""),
                        "max_queue": ("--max-queue", 0, ""),
                        "prefill_chunk": ("--prefill-chunk", 1, ""),
                        "max_body": ("--max-body", 1, " bytes")})
    check_threads(args.threads, args.backend)
    if args.model and args.model_opt and args.model != args.model_opt:
        raise ValueError(f"two models given: {args.model!r} and -m {args.model_opt!r}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.parallel == 0 or args.parallel < -1 or args.parallel > 256:
        raise ValueError(f"-np/--parallel must be -1 (auto) or 1..256, got {args.parallel}")
    if args.model_draft:
        from ggraph.graphs.runtime.speculative import SpecParams

        SpecParams(args.spec_draft_n_max, args.spec_draft_n_min, args.draft_p_min)


def api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file}: the first line is empty")
        return key
    return args.api_key or None


def main(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ggraph.tools.server.app import ServerState, create_app
    except ImportError as e:
        raise ValueError(f"ggraph serve needs the server extra: pip install 'ggraph[server]' "
                         f"({e})") from None
    from ggraph.graphs.gguf.fetch import resolve_model
    from ggraph.graphs.runtime.engine import EngineConfig
    from ggraph.tools.common.defaults import flash_attn_on, lora_config

    check(args)
    path = resolve_model(args.model_opt or args.model or "default")
    auto = args.parallel == -1
    n_slots = 4 if auto else args.parallel
    unified = args.kv_unified if args.kv_unified is not None else auto or n_slots == 1
    cfg = EngineConfig(n_ctx=args.ctx_size, n_ubatch=min(args.ubatch_size, args.batch_size),
                       type_k=args.cache_type_k, type_v=args.cache_type_v,
                       flash_attn=flash_attn_on(args.fa, args.backend), backend=args.backend,
                       n_threads=args.threads, reserve_outputs="last",
                       warmup=not args.no_warmup, n_seq_max=n_slots, kv_unified=unified,
                       use_mmap=args.mmap, use_mlock=args.mlock, loras=lora_config(args))
    state = ServerState(args.alias or os.path.basename(path), api_key(args), args.max_body)
    server = uvicorn.Server(uvicorn.Config(create_app(state), host=args.host, port=args.port,
                                           log_level="warning", access_log=False,
                                           lifespan="off"))
    loader = threading.Thread(target=load, args=(state, path, cfg, args, server), daemon=True)
    loader.start()
    print(f"main: server is listening on http://{args.host}:{args.port} - starting the "
          f"main loop", file=sys.stderr, flush=True)
    # uvicorn drains on SIGTERM/SIGINT, then restores the handlers it found and raises the
    # signal again; handlers that do nothing let the scheduler stop and the exit be clean
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _n, _frame: None)
    server.run()
    if state.scheduler is not None:   # uvicorn has drained the connections: stop the thread
        state.scheduler.drain(timeout=30.0)
    if state.load_error is not None:
        print(f"ggraph serve: error: {state.load_error}", file=sys.stderr)
        return 1
    print("main: server stopped", file=sys.stderr, flush=True)
    return 0


def load(state: Any, path: str, cfg: Any, args: argparse.Namespace, server: Any) -> None:
    """Load the model and start the scheduler while the server answers 503; a model that
    fails to load stops the server with its error."""
    from ggraph.graphs.gguf.fetch import resolve_model
    from ggraph.graphs.runtime.engine import Engine
    from ggraph.graphs.runtime.speculative import SpecParams
    from ggraph.graphs.serving.drafting import Drafter
    from ggraph.graphs.serving.scheduler import Scheduler, SchedulerConfig

    try:
        t0 = time.perf_counter()
        engine = Engine(path, cfg)
        engine.tokenizer   # a model ggraph cannot tokenize cannot serve text
        for line in engine.load_notes() + engine.memory_lines():
            print(line, file=sys.stderr)
        drafter = None
        if args.model_draft:   # its own cache, a sequence per slot, as the target's
            draft = Engine(resolve_model(args.model_draft), cfg)
            drafter = Drafter.for_target(engine, draft, SpecParams(
                args.spec_draft_n_max, args.spec_draft_n_min, args.draft_p_min))
            print(f"main: draft model {os.path.basename(draft.file.path)}: up to "
                  f"{args.spec_draft_n_max} tokens a slot and step", file=sys.stderr)
        state.engine = engine
        state.scheduler = Scheduler(engine, SchedulerConfig(
            n_batch=args.batch_size, prefill_chunk=args.prefill_chunk,
            max_queue=args.max_queue), drafter)
        n, kind = len(state.scheduler.slots), "unified" if cfg.kv_unified else "a stream each"
        print(f"main: model loaded in {time.perf_counter() - t0:.1f} s: {n} slots, "
              f"{engine.n_ctx_seq} tokens of context each ({kind})", file=sys.stderr,
              flush=True)
    except Exception as e:  # noqa: BLE001 - any load failure: say it, stop serving
        state.load_error = f"{type(e).__name__}: {e}" if not isinstance(
            e, (ValueError, OSError)) else str(e)
        server.should_exit = True
    finally:
        state.loaded.set()
