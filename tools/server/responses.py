"""The bodies the server answers with, per endpoint: OpenAI's chat.completion and
text_completion objects (whole, and as stream chunks) and llama-server's /completion object.
Plain dicts from a finished or running choice's record (`ChoiceResult`); no HTTP here."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ggraph.graphs.serving.scheduler import Choice, TokenLogprob


@dataclass
class ChoiceResult:
    """What one choice produced so far."""
    choice: Choice
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None

    @property
    def content(self) -> str:
        return "".join(self.text)


@dataclass
class Reply:
    """One request's identity and prompt, shared by its chunks."""
    endpoint: str
    model: str
    n_prompt: int
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        prefix = {"chat": "chatcmpl", "completions": "cmpl"}.get(self.endpoint, "cmpl")
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"


def _finish(why: str | None) -> str | None:
    return None if why is None else "length" if why == "length" else "stop"


def usage(reply: Reply, results: list[ChoiceResult]) -> dict[str, Any]:
    done = sum(r.choice.n_generated for r in results)
    cached = results[0].choice.n_cached if results else 0
    return {"prompt_tokens": reply.n_prompt, "completion_tokens": done,
            "total_tokens": reply.n_prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_text(tok: Any, t: int) -> str:
    return tok.piece(t).decode("utf-8", "replace")


def chat_logprobs(tok: Any, lps: list[TokenLogprob]) -> dict[str, Any]:
    def one(t: int, lp: float) -> dict[str, Any]:
        return {"token": _token_text(tok, t), "logprob": lp, "bytes": list(tok.piece(t))}
    return {"content": [{**one(x.token, x.logprob),
                         "top_logprobs": [one(t, lp) for t, lp in x.top]} for x in lps]}


def completion_logprobs(tok: Any, lps: list[TokenLogprob], offset0: int = 0
                        ) -> dict[str, Any]:
    offsets, at = [], offset0
    for x in lps:
        offsets.append(at)
        at += len(_token_text(tok, x.token))
    return {"tokens": [_token_text(tok, x.token) for x in lps],
            "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{_token_text(tok, t): lp for t, lp in x.top} for x in lps],
            "text_offset": offsets}


def whole(reply: Reply, results: list[ChoiceResult], tok: Any,
          want_logprobs: bool) -> dict[str, Any]:
    """The non-streamed answer."""
    if reply.endpoint == "completion":
        return completion_final(reply, results[0], tok, want_logprobs, "".join(
            results[0].text))
    choices = []
    for i, r in enumerate(results):
        if reply.endpoint == "chat":
            choices.append({"index": i, "message": {"role": "assistant", "content": r.content},
                            "logprobs": chat_logprobs(tok, r.logprobs) if want_logprobs
                            else None, "finish_reason": _finish(r.finish)})
        else:
            choices.append({"index": i, "text": r.content, "finish_reason": _finish(r.finish),
                            "logprobs": completion_logprobs(tok, r.logprobs) if want_logprobs
                            else None})
    return {"id": reply.id, "object": "chat.completion" if reply.endpoint == "chat"
            else "text_completion", "created": reply.created, "model": reply.model,
            "system_fingerprint": "ggraph", "choices": choices,
            "usage": usage(reply, results)}


def chunk(reply: Reply, index: int, text: str | None, finish: str | None, tok: Any,
          lps: list[TokenLogprob] | None, first: bool = False) -> dict[str, Any]:
    """One streamed chunk of choice `index` (chat or completions)."""
    if reply.endpoint == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        c: dict[str, Any] = {"index": index, "delta": delta,
                             "logprobs": chat_logprobs(tok, lps) if lps else None,
                             "finish_reason": _finish(finish)}
        obj = "chat.completion.chunk"
    else:
        c = {"index": index, "text": text or "",
             "logprobs": completion_logprobs(tok, lps) if lps else None,
             "finish_reason": _finish(finish)}
        obj = "text_completion"
    return {"id": reply.id, "object": obj, "created": reply.created, "model": reply.model,
            "system_fingerprint": "ggraph", "choices": [c]}


def usage_chunk(reply: Reply, results: list[ChoiceResult]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if reply.endpoint == "chat" else "text_completion"
    return {"id": reply.id, "object": obj, "created": reply.created, "model": reply.model,
            "system_fingerprint": "ggraph", "choices": [], "usage": usage(reply, results)}


def _probs(tok: Any, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"id": x.token, "token": _token_text(tok, x.token), "logprob": x.logprob,
             "bytes": list(tok.piece(x.token)),
             "top_logprobs": [{"id": t, "token": _token_text(tok, t), "logprob": lp,
                               "bytes": list(tok.piece(t))} for t, lp in x.top]}
            for x in lps]


def completion_final(reply: Reply, r: ChoiceResult, tok: Any, want_logprobs: bool,
                     content: str) -> dict[str, Any]:
    """llama-server's /completion object, with stop: true (the last stream event too)."""
    c = r.choice
    stop_type = ("word" if c.stopped_by is not None else "limit" if r.finish == "length"
                 else "eos" if r.finish == "stop" else "none")
    prompt_s = max(c.t_first - c.t_started, 0.0) if c.t_first else 0.0
    gen_s = max(c.t_done - c.t_first, 0.0) if c.t_first and c.t_done else 0.0
    n_prompt = reply.n_prompt - c.n_cached
    out = {"content": content, "id_slot": c.slot, "stop": True, "model": reply.model,
           "tokens_predicted": c.n_generated, "tokens_evaluated": reply.n_prompt,
           "truncated": False, "stop_type": stop_type, "stopping_word": c.stopped_by or "",
           "tokens_cached": reply.n_prompt + c.n_generated,
           "timings": {"cache_n": c.n_cached, "prompt_n": n_prompt,
                       "prompt_ms": prompt_s * 1e3,
                       "prompt_per_token_ms": prompt_s * 1e3 / max(n_prompt, 1),
                       "prompt_per_second": n_prompt / prompt_s if prompt_s else 0.0,
                       "predicted_n": c.n_generated, "predicted_ms": gen_s * 1e3,
                       "predicted_per_token_ms": gen_s * 1e3 / max(c.n_generated - 1, 1),
                       "predicted_per_second": (c.n_generated - 1) / gen_s if gen_s else 0.0}}
    if want_logprobs:
        out["completion_probabilities"] = _probs(tok, r.logprobs)
    return out


def completion_chunk(r: ChoiceResult, text: str, tok: Any,
                     lps: list[TokenLogprob] | None) -> dict[str, Any]:
    """A streamed /completion event before the last."""
    out: dict[str, Any] = {"content": text, "stop": False, "id_slot": r.choice.slot}
    if lps:
        out["completion_probabilities"] = _probs(tok, lps)
    return out
