"""The Starlette app of `ggraph serve`: OpenAI's and llama-server's endpoints over the
continuous-batching scheduler (graphs/serving/scheduler.py).

Every request body is hostile: it is read up to `max_body` bytes (413 past that, before it is
all read), parsed strictly (graphs/serving/requests.py), and every refusal is OpenAI's error
object with 400, 401, 404, 413, 422 or 503, never a traceback. Token events come from the
scheduler's thread through `loop.call_soon_threadsafe` into one asyncio queue per request. A
client that leaves (a closed stream, or a dropped connection while it waits for a whole
answer) cancels its choices, and the scheduler frees their slots at the next token.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ggraph.graphs.gguf.gguf_file import GGUFError
from ggraph.graphs.runtime.sampling import Sampler, SamplerParams
from ggraph.graphs.serving.requests import Generation, RequestError, parse_json, parse_request
from ggraph.graphs.serving.scheduler import Choice, Event, Scheduler
from ggraph.graphs.tokenizers.tokenizer import TooManyTokens
from ggraph.tools.server import responses as R

MAX_BODY = 4 << 20   # bytes of a request body


@dataclass
class ServerState:
    """What the routes share: the model once loaded (None while loading), its name, the
    key clients must present, and the body limit."""
    model_name: str
    api_key: str | None = None
    max_body: int = MAX_BODY
    engine: Any = None
    scheduler: Scheduler | None = None
    load_error: str | None = None
    loaded: threading.Event = field(default_factory=threading.Event)


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(state: ServerState) -> Starlette:
    def guarded(fn: Callable[[Request], Any], auth: bool = True, model: bool = True
                ) -> Callable[[Request], Any]:
        """Auth, loading state and error shape around a route."""
        async def route(request: Request) -> Response:
            try:
                if auth:
                    check_key(request, state.api_key)
                if model and not state.loaded.is_set():
                    raise RequestError("Loading model", status=503, type="unavailable_error",
                                       code="loading", headers={"Retry-After": "1"})
                if model and state.scheduler is None:
                    raise RequestError(f"the model failed to load: {state.load_error}",
                                       status=503, type="unavailable_error")
                return await fn(request)
            except RequestError as e:
                return error_response(e)
        return route

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": 0, "owned_by": "ggraph",
            "meta": {"n_ctx_train": state.engine.model.hp.n_ctx_train,
                     "n_vocab": state.engine.model.hp.n_vocab}}]})

    async def metrics(request: Request) -> Response:
        s = state.scheduler
        assert s is not None
        return PlainTextResponse(s.metrics.prometheus(s.gauges(), s.counters()),
                                 media_type="text/plain; version=0.0.4")

    async def slots(request: Request) -> Response:
        assert state.scheduler is not None
        return JSONResponse(state.scheduler.slots_info())

    async def tokenize(request: Request) -> Response:
        body = await json_body(request, state.max_body)
        content = field_of(body, "content", str, "")
        special = field_of(body, "add_special", bool, False)
        pieces = field_of(body, "with_pieces", bool, False)
        extra = set(body) - {"content", "add_special", "with_pieces", "parse_special"}
        if extra:
            raise RequestError(f"'{sorted(extra)[0][:64]}' is not a known field",
                               param=sorted(extra)[0][:64], code="unknown_parameter")
        tok = state.engine.tokenizer
        ids = await run_in_threadpool(tok.encode, content, special, True, False)
        if pieces:
            return JSONResponse({"tokens": [{"id": t, "piece": tok.piece(t).decode(
                "utf-8", "replace")} for t in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(request: Request) -> Response:
        body = await json_body(request, state.max_body)
        ids = body.get("tokens", [])
        n_vocab = state.engine.model.hp.n_vocab
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("'tokens' must be an array of token ids", param="tokens",
                               code="invalid_type")
        bad_ids = [i for i, t in enumerate(ids) if not 0 <= t < n_vocab]
        if bad_ids:
            raise RequestError(f"'tokens[{bad_ids[0]}]' is {ids[bad_ids[0]]}, outside the "
                               f"vocabulary [0, {n_vocab})", param=f"tokens[{bad_ids[0]}]",
                               code="invalid_value")
        return JSONResponse({"content": state.engine.tokenizer.decode(ids)})

    def generation(endpoint: str) -> Callable[[Request], Any]:
        async def route(request: Request) -> Response:
            return await generate(request, endpoint, state)
        return route

    routes = [
        Route("/health", guarded(health, auth=False), methods=["GET"]),
        Route("/v1/health", guarded(health, auth=False), methods=["GET"]),
        Route("/v1/models", guarded(models, auth=False), methods=["GET"]),
        Route("/models", guarded(models, auth=False), methods=["GET"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/slots", guarded(slots), methods=["GET"]),
        Route("/tokenize", guarded(tokenize), methods=["POST"]),
        Route("/detokenize", guarded(detokenize), methods=["POST"]),
    ]
    for path, endpoint in (("/v1/chat/completions", "chat"), ("/chat/completions", "chat"),
                           ("/v1/completions", "completions"), ("/completions", "completions"),
                           ("/completion", "completion")):
        routes.append(Route(path, guarded(generation(endpoint)), methods=["POST"]))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(RequestError(
            f"{request.method} {request.url.path[:200]}: {exc.detail}", status=exc.status_code,
            type=kind))

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(RequestError(f"internal error: {type(exc).__name__}",
                                           status=500, type="server_error"))

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error,
                                                        Exception: server_error})


def check_key(request: Request, key: str | None) -> None:
    if key is None:
        return
    given = request.headers.get("authorization", "")
    token = given[7:].strip() if given[:7].lower() == "bearer " else \
        request.headers.get("x-api-key", "")
    if not token or not hmac.compare_digest(token.encode("utf-8", "replace"),
                                            key.encode("utf-8")):
        raise RequestError("Invalid API Key" if token else "Missing API key: send "
                           "'Authorization: Bearer KEY'", status=401,
                           type="authentication_error", code="invalid_api_key")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the body is {int(declared)} bytes; at most {limit}", status=413,
                           code="request_too_large")
    parts, n = [], 0
    async for part in request.stream():
        n += len(part)
        if n > limit:
            raise RequestError(f"the body is larger than {limit} bytes", status=413,
                               code="request_too_large")
        parts.append(part)
    return b"".join(parts)


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    body = parse_json(await read_body(request, limit))
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", code="invalid_type")
    return body


def field_of(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    v = body.get(name, default)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise RequestError(f"'{name}' must be a {kind.__name__}", param=name,
                           code="invalid_type")
    return v


def prompt_tokens(engine: Any, gen: Generation) -> list[int]:
    """The prompt's ids (chat: rendered by the model's template in its sandbox); 400 when
    it cannot be rendered or does not leave room for one token in a slot's context."""
    tok = engine.tokenizer
    n_ctx = engine.n_ctx_seq
    try:
        if gen.messages is not None:
            text = tok.render(gen.messages, max_chars=tok.chars_for(n_ctx))
        else:
            text = gen.prompt
        ids = list(text) if isinstance(text, list) else tok.encode(text, max_tokens=n_ctx)
    except TooManyTokens:
        ids = None
    except GGUFError as e:   # the chat template failed or ran too long: this request only
        raise RequestError(f"the chat template could not render these messages: {e}",
                           param="messages", code="template_error") from None
    if ids is None or len(ids) >= n_ctx:
        n = "more than" if ids is None else f"{len(ids)}, at least"
        raise RequestError(f"the prompt has {n} {n_ctx} tokens; a slot's context holds "
                           f"{n_ctx} (prompt and completion)", code="context_length_exceeded",
                           param="messages" if gen.messages is not None else "prompt")
    if not ids:
        raise RequestError("the prompt has no tokens (and the model adds no BOS token)",
                           param="prompt", code="invalid_value")
    return ids


def choice_samplers(gen: Generation, tokenizer: Any) -> list[Sampler]:
    """A sampler per choice (a given seed S: choice i draws with S + i); a grammar is
    compiled here (once per text), so one that does not parse is this request's 400."""
    from ggraph.graphs.grammar.gbnf import GrammarError

    seed = gen.sampling.seed
    out = []
    for i in range(gen.n):
        params = gen.sampling if gen.n == 1 or seed == 0xFFFFFFFF else \
            SamplerParams(**{**gen.sampling.__dict__, "seed": (seed + i) & 0xFFFFFFFF})
        try:
            out.append(Sampler(params, tokenizer))
        except GrammarError as e:
            missing = "llguidance" in str(e)
            raise RequestError(f"'grammar': {e}", param="grammar",
                               code="not_supported" if missing else "invalid_value") from None
    return out


async def generate(request: Request, endpoint: str, state: ServerState) -> Response:
    engine, sched = state.engine, state.scheduler
    assert sched is not None
    body = parse_json(await read_body(request, state.max_body))
    gen = parse_request(endpoint, body, engine.model.hp.n_vocab, len(sched.slots))
    ids = await run_in_threadpool(prompt_tokens, engine, gen)
    room = engine.n_ctx_seq - len(ids)
    max_tokens = room if gen.max_tokens < 0 else min(gen.max_tokens, room)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def emitter(i: int) -> Callable[[Event], None]:
        def emit(ev: Event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (i, ev))
            except RuntimeError:   # the event loop closed (shutdown): nobody is listening
                pass
        return emit

    samplers = await run_in_threadpool(choice_samplers, gen, engine.tokenizer)
    choices = [Choice(list(ids), max_tokens, s, emitter(i), gen.stop, gen.logprobs,
                      gen.want_logprobs, gen.cache_prompt, index=i)
               for i, s in enumerate(samplers)]
    sched.submit(choices)   # 503 when the queue is full
    reply = R.Reply(endpoint, gen.model or state.model_name, len(ids))
    results = [R.ChoiceResult(c) for c in choices]
    tok = engine.tokenizer
    if gen.stream:
        return StreamingResponse(stream(reply, gen, results, queue, sched, tok),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    watcher = asyncio.create_task(watch_disconnect(request, choices, sched))
    try:
        left = gen.n
        while left:
            i, ev = await queue.get()
            r = results[i]
            if ev.kind == "error":
                assert ev.error is not None
                raise ev.error
            if ev.kind == "token":
                r.text.append(ev.text)
                if ev.logprob is not None:
                    r.logprobs.append(ev.logprob)
            else:
                r.finish = ev.finish
                left -= 1
    finally:
        watcher.cancel()
        for c in choices:
            if c.finish is None:
                c.cancel()
        sched.wake()
    return JSONResponse(R.whole(reply, results, tok, gen.want_logprobs))


async def watch_disconnect(request: Request, choices: list[Choice], sched: Scheduler
                           ) -> None:
    """Cancel the choices when the client disconnects while it waits for a whole answer
    (the body has been read: the next message is the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            for c in choices:
                c.cancel()
            sched.wake()
            return


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def stream(reply: R.Reply, gen: Generation, results: list[R.ChoiceResult],
                 queue: asyncio.Queue, sched: Scheduler, tok: Any) -> AsyncIterator[str]:
    """Server-sent events: OpenAI's chunks ending with [DONE], or llama-server's /completion
    events ending with the stop: true object. Closing the stream (the client left) cancels
    the choices."""
    started = [False] * len(results)
    try:
        left = len(results)
        while left:
            i, ev = await queue.get()
            r = results[i]
            if ev.kind == "error":
                assert ev.error is not None
                yield sse(ev.error.body())
                return
            if ev.kind == "token":
                r.text.append(ev.text)
                lps = [ev.logprob] if ev.logprob is not None else None
                if lps:
                    r.logprobs.append(ev.logprob)   # type: ignore[arg-type]
                if not ev.text and not lps:
                    continue
                if reply.endpoint == "completion":
                    yield sse(R.completion_chunk(r, ev.text, tok, lps))
                else:
                    yield sse(R.chunk(reply, i, ev.text, None, tok, lps, not started[i]))
                started[i] = True
                continue
            r.finish = ev.finish
            left -= 1
            if reply.endpoint == "completion":
                yield sse(R.completion_final(reply, r, tok, gen.want_logprobs, r.content))
            else:
                yield sse(R.chunk(reply, i, None, ev.finish, tok, None, not started[i]))
        if reply.endpoint != "completion":
            if gen.include_usage:
                yield sse(R.usage_chunk(reply, results))
            yield "data: [DONE]\n\n"
    finally:
        for r in results:
            if r.choice.finish is None:
                r.choice.cancel()
        sched.wake()
