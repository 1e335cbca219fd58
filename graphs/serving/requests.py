"""Request bodies of the server's generation endpoints checked into records, every field by
what it may hold, before anything runs.

Three shapes: OpenAI's `/v1/chat/completions` (`messages`) and `/v1/completions` (`prompt`),
and llama-server's `/completion` (`prompt`, `n_predict`, `n_probs`). Each field has one rule
(its JSON type and range); a body that breaks one gets a `RequestError` naming the field, in
OpenAI's error shape, never a traceback. Unknown fields are refused (a misspelt `max_token`
would otherwise be ignored silently), and so are known ones this server does not do yet
(`tools`, `logit_bias`), each with its reason. Constrained output (`grammar`, `json_schema`,
`response_format` json_object / json_schema) becomes GBNF in the sampling record, a schema
converted as llama-server converts it. Sampling fields map onto llama.cpp's
sampler chain (graphs/runtime/sampling.py) with llama-server's defaults, not OpenAI's: a
request without `temperature` samples at 0.8, as llama-server does.

`parse_json` reads a body strictly: UTF-8 only, no NaN or Infinity, nesting bounded.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ggraph.graphs.grammar.gbnf import MAX_GRAMMAR_CHARS
from ggraph.graphs.runtime.sampling import LLAMA_DEFAULT_SEED, SamplerParams

MAX_STOPS = 16            # stop strings a request may give
MAX_STOP_CHARS = 256      # characters of each
MAX_MESSAGES = 4096
MAX_TOP_LOGPROBS = 20     # OpenAI's bound for chat; /v1/completions allows 5
MAX_DEPTH = 64            # JSON nesting


class RequestError(ValueError):
    """A request the server refuses: HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str, why: str, code: str = "invalid_value") -> RequestError:
    return RequestError(f"'{param}' {why}", param=param, code=code)


def parse_json(raw: bytes) -> Any:
    """The body as JSON: UTF-8 text, no NaN/Infinity, at most MAX_DEPTH levels deep."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the body is not UTF-8 (byte {e.start} is 0x{raw[e.start]:02x})",
                           code="invalid_json") from None

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")
    try:
        value = json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise RequestError("the body is nested too deeply", code="invalid_json") from None
    except ValueError as e:
        raise RequestError(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if _depth(value) > MAX_DEPTH:
        raise RequestError(f"the body is nested more than {MAX_DEPTH} levels deep",
                           code="invalid_json")
    return value


def _depth(v: Any) -> int:
    """Nesting depth, without recursion (a hostile body can be deep)."""
    best, todo = 0, [(v, 1)]
    while todo:
        x, d = todo.pop()
        best = max(best, d)
        if d > MAX_DEPTH:
            return d
        if isinstance(x, dict):
            todo.extend((y, d + 1) for y in x.values())
        elif isinstance(x, list):
            todo.extend((y, d + 1) for y in x)
    return best


# -- field rules ---------------------------------------------------------------------------

Rule = Callable[[str, Any], Any]


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo: int, hi: int) -> Rule:
    def rule(name: str, v: Any) -> int:
        if not is_int(v):
            raise bad(name, f"must be an integer, got {_kind(v)}", "invalid_type")
        if not lo <= v <= hi:
            raise bad(name, f"must be in [{lo}, {hi}], got {v}")
        return int(v)
    return rule


def number(lo: float, hi: float, lo_open: bool = False) -> Rule:
    def rule(name: str, v: Any) -> float:
        if not (is_int(v) or isinstance(v, float)):
            raise bad(name, f"must be a number, got {_kind(v)}", "invalid_type")
        f = float(v)
        if math.isnan(f) or math.isinf(f) or f > hi or f < lo or (lo_open and f == lo):
            raise bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
        return f
    return rule


def boolean(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {_kind(v)}", "invalid_type")
    return v


def string(max_chars: int) -> Rule:
    def rule(name: str, v: Any) -> str:
        if not isinstance(v, str):
            raise bad(name, f"must be a string, got {_kind(v)}", "invalid_type")
        if len(v) > max_chars:
            raise bad(name, f"is longer than {max_chars} characters")
        return v
    return rule


def anything(name: str, v: Any) -> Any:
    return v


def stops(name: str, v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad(name, "must be a string or a list of strings", "invalid_type")
    if len(items) > MAX_STOPS:
        raise bad(name, f"has {len(items)} strings; at most {MAX_STOPS}")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise bad(name, f"strings are at most {MAX_STOP_CHARS} characters")
    return tuple(s for s in items if s)


def _kind(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number")


def _stream_options(name: str, v: Any) -> bool:
    if v is None:
        return False
    if not isinstance(v, dict):
        raise bad(name, f"must be an object, got {_kind(v)}", "invalid_type")
    extra = set(v) - {"include_usage"}
    if extra:
        raise bad(f"{name}.{sorted(extra)[0]}", "is not a known field", "unknown_parameter")
    return boolean(f"{name}.include_usage", v.get("include_usage", False))


_NO_SCHEMA = object()


def _schema(name: str, v: Any) -> Any:
    if not isinstance(v, (dict, bool)):
        raise bad(name, f"must be a JSON Schema (an object or a boolean), got {_kind(v)}",
                  "invalid_type")
    return v


def _response_format(name: str, v: Any) -> Any:
    """The schema the output must follow (llama-server's reading), or _NO_SCHEMA for text."""
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise bad(name, "must be an object with a 'type'", "invalid_type")
    kind = v["type"]
    extra = set(v) - {"type", "schema", "json_schema"}
    if extra:
        raise bad(f"{name}.{sorted(map(str, extra))[0][:64]}", "is not a known field",
                  "unknown_parameter")
    if kind == "text":
        return _NO_SCHEMA
    if kind == "json_object":      # any JSON object, or the schema given beside it
        return _schema(f"{name}.schema", v.get("schema", {}))
    if kind == "json_schema":
        w = v.get("json_schema", {})
        if not isinstance(w, dict):
            raise bad(f"{name}.json_schema", f"must be an object, got {_kind(w)}",
                      "invalid_type")
        return _schema(f"{name}.json_schema.schema", w.get("schema", {}))
    raise bad(f"{name}.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _constraint(f: dict[str, Any]) -> str:
    """The GBNF a request asks for ("" for none): `grammar`, or the JSON Schema of
    `json_schema` / `response_format`, converted as llama-server converts it (an empty schema
    means any object)."""
    schemas = [(k, f[k]) for k in ("json_schema", "response_format")
               if k in f and f[k] is not _NO_SCHEMA]
    given = [k for k in ("grammar",) if f.get(k)] + [k for k, _ in schemas]
    if len(given) > 1:
        raise RequestError(f"give one of {' or '.join(given)}, not both (the output can follow "
                           f"one grammar)", param=given[1], code="invalid_value")
    if f.get("grammar"):
        return f["grammar"]
    if not schemas:
        return ""
    key, schema = schemas[0]
    if schema == {}:
        schema = {"type": "object"}
    from ggraph.graphs.grammar.json_schema import SchemaError, schema_to_gbnf
    try:
        return schema_to_gbnf(schema)
    except SchemaError as e:
        raise RequestError(f"'{key}': {e}", param=key, code="invalid_value") from None


def not_supported(why: str) -> Rule:
    def rule(name: str, v: Any) -> None:
        if v is None or v == [] or v == {}:
            return None
        raise RequestError(f"'{name}' is not supported by this server: {why}", param=name,
                           code="not_supported")
    return rule


# -- the records ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Generation:
    """One request's generation settings, whatever the endpoint (per choice: seed + i)."""
    endpoint: str                        # "chat", "completions" or "completion"
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    n: int = 1
    max_tokens: int = -1                 # -1: until end of generation or the context
    sampling: SamplerParams = field(default_factory=SamplerParams)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: int = 0                    # top alternatives per token (0: none)
    want_logprobs: bool = False
    cache_prompt: bool = True
    model: str | None = None


# OpenAI / llama-server sampling field -> SamplerParams field, with its rule
_SAMPLING: dict[str, tuple[str, Rule]] = {
    "temperature": ("temp", number(0.0, 100.0)),
    "top_p": ("top_p", number(0.0, 1.0, lo_open=True)),
    "top_k": ("top_k", integer(0, 1 << 30)),
    "min_p": ("min_p", number(0.0, 1.0)),
    "typical_p": ("typ_p", number(0.0, 1.0)),
    "presence_penalty": ("penalty_present", number(-2.0, 2.0)),
    "frequency_penalty": ("penalty_freq", number(-2.0, 2.0)),
    "repeat_penalty": ("penalty_repeat", number(0.0, 100.0, lo_open=True)),
    "repeat_last_n": ("penalty_last_n", integer(-1, 1 << 20)),
    "min_keep": ("min_keep", integer(0, 1 << 20)),
}

_COMMON: dict[str, Rule] = {
    "model": string(256),
    "stream": boolean,
    "stop": stops,
    "seed": integer(-1, LLAMA_DEFAULT_SEED),
    "user": string(256),
    "cache_prompt": boolean,
    "logit_bias": not_supported("logit biases are not applied"),
    "grammar": string(MAX_GRAMMAR_CHARS),
    "json_schema": _schema,
}

CHAT_FIELDS: dict[str, Rule] = {
    **_COMMON, "messages": anything, "n": integer(1, 1 << 20),
    "max_tokens": integer(-1, 1 << 30), "max_completion_tokens": integer(-1, 1 << 30),
    "stream_options": _stream_options, "logprobs": boolean,
    "top_logprobs": integer(0, MAX_TOP_LOGPROBS), "response_format": _response_format,
    "tools": not_supported("tool calls are not parsed"),
    "tool_choice": not_supported("tool calls are not parsed"),
    "functions": not_supported("function calls are not parsed"),
    "parallel_tool_calls": anything,
}
COMPLETIONS_FIELDS: dict[str, Rule] = {
    **_COMMON, "prompt": anything, "n": integer(1, 1 << 20),
    "max_tokens": integer(-1, 1 << 30), "stream_options": _stream_options,
    "logprobs": integer(0, 5), "echo": not_supported("the prompt is not echoed"),
    "suffix": not_supported("insertion (suffix) is not done"),
    "best_of": integer(1, 1),
}
COMPLETION_FIELDS: dict[str, Rule] = {
    **_COMMON, "prompt": anything, "n_predict": integer(-1, 1 << 30),
    "n_probs": integer(0, MAX_TOP_LOGPROBS),
}


def _checked(body: Any, rules: dict[str, Rule]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {_kind(body)}",
                           code="invalid_type")
    allowed = set(rules) | set(_SAMPLING)
    for k in body:
        if k not in allowed:
            raise bad(str(k)[:64], "is not a known field", "unknown_parameter")
    out: dict[str, Any] = {}
    for k, v in body.items():
        if k in _SAMPLING:
            name, rule = _SAMPLING[k]
            if v is not None:
                out["s_" + name] = rule(k, v)
        elif v is not None or k in ("stop",):
            out[k] = rules[k](k, v)
    return out


def _sampling(f: dict[str, Any]) -> SamplerParams:
    kw = {k[2:]: v for k, v in f.items() if k.startswith("s_")}
    kw["grammar"] = _constraint(f)
    seed = f.get("seed", -1)
    kw["seed"] = LLAMA_DEFAULT_SEED if seed in (-1, None) else seed
    try:
        return SamplerParams(**kw)
    except ValueError as e:   # a combination the chain refuses, named by its llama flag
        raise RequestError(str(e), code="invalid_value") from None


def _messages(v: Any) -> list[dict[str, str]]:
    if not isinstance(v, list) or not v:
        raise bad("messages", "must be a non-empty array of messages", "invalid_type")
    if len(v) > MAX_MESSAGES:
        raise bad("messages", f"has {len(v)} messages; at most {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(v):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(at, f"must be an object, got {_kind(m)}", "invalid_type")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad(f"{at}.{sorted(map(str, extra))[0][:64]}", "is not a known field",
                      "unknown_parameter")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(f"{at}.role", f"must be system, developer, user or assistant, got "
                      f"{str(role)[:64]!r}")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(f"{at}.content", m.get("content"))})
    return out


def _content(at: str, c: Any) -> str:
    """A message's text: a string, or OpenAI's array of text parts (joined)."""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, p in enumerate(c):
            if not isinstance(p, dict) or p.get("type") != "text" or \
                    not isinstance(p.get("text"), str):
                raise RequestError(f"'{at}[{j}]' must be a text part "
                                   f"({{\"type\": \"text\", \"text\": ...}}): this server reads "
                                   f"text only", param=f"{at}[{j}]", code="not_supported")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(at, f"must be a string or an array of text parts, got {_kind(c)}",
              "invalid_type")


def _prompt(v: Any, n_vocab: int) -> str | list[int]:
    """A prompt: text, token ids, or a one-element array of either (OpenAI's batch form with
    one prompt; several prompts in one request are refused)."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(is_int(t) for t in v):
        bad_ids = [i for i, t in enumerate(v) if not 0 <= t < n_vocab]
        if bad_ids:
            raise bad(f"prompt[{bad_ids[0]}]", f"is token {v[bad_ids[0]]}, outside the "
                      f"vocabulary [0, {n_vocab})")
        return [int(t) for t in v]
    if isinstance(v, list) and len(v) > 1 and all(isinstance(t, (str, list)) for t in v):
        raise RequestError("'prompt' with several prompts is not supported: send one request "
                           "per prompt", param="prompt", code="not_supported")
    raise bad("prompt", "must be a string or a non-empty array of token ids", "invalid_type")


def parse_request(endpoint: str, body: Any, n_vocab: int, max_n: int) -> Generation:
    """The Generation a body asks for at `endpoint` ("chat", "completions", "completion");
    `max_n`: the most choices one request may ask for (the server's slots)."""
    rules = {"chat": CHAT_FIELDS, "completions": COMPLETIONS_FIELDS,
             "completion": COMPLETION_FIELDS}[endpoint]
    f = _checked(body, rules)
    n = f.get("n", 1)
    if n > max_n:
        raise bad("n", f"is {n}, but this server generates at most {max_n} choices at once "
                  f"(its slots, -np)")
    kw: dict[str, Any] = dict(endpoint=endpoint, n=n, sampling=_sampling(f),
                              stop=f.get("stop", ()), stream=f.get("stream", False),
                              include_usage=f.get("stream_options", False),
                              cache_prompt=f.get("cache_prompt", True), model=f.get("model"))
    if endpoint == "chat":
        if "messages" not in f:
            raise bad("messages", "is required", "missing_required_parameter")
        kw["messages"] = _messages(f["messages"])
        kw["max_tokens"] = f.get("max_completion_tokens", f.get("max_tokens", -1))
        kw["want_logprobs"] = f.get("logprobs", False)
        kw["logprobs"] = f.get("top_logprobs", 0) if kw["want_logprobs"] else 0
        if "top_logprobs" in f and not kw["want_logprobs"] and f["top_logprobs"]:
            raise bad("top_logprobs", "needs 'logprobs': true")
    else:
        if "prompt" not in f:
            raise bad("prompt", "is required", "missing_required_parameter")
        kw["prompt"] = _prompt(f["prompt"], n_vocab)
        if endpoint == "completions":
            kw["max_tokens"] = f.get("max_tokens", 16)   # OpenAI's default for completions
            kw["want_logprobs"] = "logprobs" in f
            kw["logprobs"] = f.get("logprobs", 0)
        else:
            kw["max_tokens"] = f.get("n_predict", -1)
            kw["want_logprobs"] = f.get("n_probs", 0) > 0
            kw["logprobs"] = f.get("n_probs", 0)
    if kw["max_tokens"] == 0:
        raise bad("max_tokens", "must be at least 1 (or -1: until the end of generation)")
    return Generation(**kw)
