"""`ggraph serve` under faults: a flood of requests against a short queue (503 with
Retry-After, every accepted request completes), SIGTERM during generation (the running
stream finishes, then the process exits 0), and a fuzz of the HTTP API from fixed seeds
(every answer a well-formed success or OpenAI error, never a 500 or a traceback, and the
server still healthy afterwards)."""
from __future__ import annotations

import json
import random
import signal
import threading

import pytest

from serve_client import start

pytest.importorskip("starlette", reason="the test extra installs the server's packages")

Q = [{"role": "user", "content": "Tell me about the sea."}]


def test_queue_flood_gets_503_and_accepted_requests_complete(tmp_path):
    srv = start("-c", "256", "-np", "1", "--max-queue", "2", tmp=tmp_path)
    try:
        results: list[tuple[int, dict, bytes]] = []
        lock = threading.Lock()

        def one() -> None:
            r = srv.request("POST", "/v1/chat/completions",
                            {"messages": Q, "max_tokens": 16, "temperature": 0})
            with lock:
                results.append(r)
        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        statuses = sorted(s for s, _, _ in results)
        assert len(results) == 12 and set(statuses) <= {200, 503}, statuses
        busy = [(h, json.loads(b)) for s, h, b in results if s == 503]
        assert busy and all(h.get("retry-after") and e["error"]["code"] == "queue_full"
                            for h, e in busy)
        done = [json.loads(b) for s, _, b in results if s == 200]
        assert len(done) >= 3      # one slot and two waiting at least
        assert all(d["choices"][0]["finish_reason"] in ("stop", "length") for d in done)
    finally:
        assert srv.stop() == 0, srv.log_text()


def test_sigterm_lets_the_running_stream_finish(tmp_path):
    srv = start("-c", "256", "-np", "2", tmp=tmp_path)
    conn, lines = srv.stream("/v1/chat/completions", {"messages": Q, "max_tokens": 40,
                                                      "temperature": 0})
    first = [next(lines), next(lines)]
    srv.proc.send_signal(signal.SIGTERM)
    rest = list(lines)
    conn.close()
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(x) for x in first + rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert srv.proc.wait(60) == 0
    assert "server stopped" in srv.log_text()
    with pytest.raises(OSError):
        srv.request("GET", "/health", timeout=5)


# -- the fuzz --------------------------------------------------------------------------------

GEN = {"/v1/chat/completions": {"messages": Q, "max_tokens": 2},
       "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
       "/completion": {"prompt": "Hello", "n_predict": 2}}
OTHER = {"/tokenize": {"content": "Hello"}, "/detokenize": {"tokens": [1, 2, 3]}}
FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "stream", "logprobs",
          "top_logprobs", "max_tokens", "presence_penalty", "frequency_penalty", "messages",
          "prompt", "stream_options", "response_format", "n_predict", "n_probs", "model",
          "tokens", "content", "user", "bogus", "", "\u00e9\u0000", "grammar", "json_schema",
          "type", "properties", "items", "required", "$ref", "enum", "pattern"]


def value(rng: random.Random, depth: int = 0):
    kinds = [lambda: None, lambda: True, lambda: rng.randint(-3, 5),
             lambda: rng.choice([2 ** 31, -2 ** 63, 10 ** 30, 0]), lambda: rng.uniform(-5, 5),
             lambda: rng.choice([1e308, -0.0, 5e-324]), lambda: "",
             lambda: rng.choice(["x" * rng.randint(1, 3000), "\ud7ff\u200b", "<|im_end|>"]),
             lambda: rng.choice(["user", "system", "assistant", "tool"]),
             lambda: rng.randint(0, 50000),
             lambda: [rng.randint(-5, 200000) for _ in range(rng.randint(0, 4))],
             lambda: [value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
             lambda: {rng.choice(FIELDS): value(rng, depth + 1) for _ in range(rng.randint(0, 3))},
             lambda: [{"role": rng.choice(["user", "x"]), "content": value(rng, depth + 1)}]]
    return kinds[rng.randrange(len(kinds) if depth < 3 else len(kinds) - 3)]()


def case(rng: random.Random) -> tuple[str, str, bytes, bool]:
    """(method, path, body, bounded): a mutated request from a valid one."""
    pick = rng.random()
    path = rng.choice(list(GEN) if pick < 0.7 else list(OTHER) if pick < 0.85 else
                      ["/v1/models", "/nope", "/slots", "/metrics", "/health"])
    method = ("POST" if pick < 0.85 else "GET") if rng.random() < 0.95 else \
        rng.choice(["GET", "PUT", "DELETE", "POST"])
    base = dict(GEN.get(path) or OTHER.get(path) or {})
    kind = rng.random()
    if kind < 0.1:
        return method, path, bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))), True
    if kind < 0.15:
        raw = json.dumps(base).encode()
        return method, path, raw[:rng.randint(0, len(raw))], True
    if kind < 0.18:
        d = rng.randint(10, 3000)
        return method, path, b"[" * d + b"]" * d, True
    body = base
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if op < 0.2 and body:
            body.pop(rng.choice(list(body)))
        elif op < 0.6:
            body[rng.choice(FIELDS)] = value(rng)
        else:
            body[rng.choice(list(base) or FIELDS)] = value(rng)
    # generation stays short: a valid large max_tokens is capped by the 128-token context
    if path in GEN and not any(k in body for k in ("max_tokens", "n_predict")):
        body["max_tokens" if path != "/completion" else "n_predict"] = 2
    if rng.random() < 0.5:
        return method, path, json.dumps(body).encode(), True
    return method, path, json.dumps(body, allow_nan=True).encode(), True


def well_formed(status: int, headers: dict, data: bytes) -> None:
    assert status in (200, 400, 401, 404, 405, 413, 422, 503), (status, data[:300])
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events
        for e in events:
            if e != "[DONE]":
                json.loads(e)
        return
    if headers.get("content-type", "").startswith("text/plain"):
        assert status == 200
        return
    body = json.loads(data)
    if status >= 400:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    else:
        assert isinstance(body, (dict, list))


def test_fuzz_of_the_http_api(tmp_path):
    srv = start("-c", "128", "-np", "4", "-kvu", "--max-body", "200000", tmp=tmp_path)
    try:
        n, codes = 0, {}
        for seed in range(8):
            rng = random.Random(seed)
            for _ in range(70):
                method, path, body, _ = case(rng)
                status, headers, data = srv.request(method, path, body, timeout=120)
                well_formed(status, headers, data)
                n += 1
                codes[status] = codes.get(status, 0) + 1
        print("fuzz answers by status:", codes)
        assert n >= 500 and codes.get(200, 0) >= 50 and codes.get(400, 0) >= 100, codes
        assert srv.get("/health", key=None) == (200, b'{"status":"ok"}')
        status, data = srv.get("/slots")
        assert status == 200 and not any(s["is_processing"] for s in json.loads(data))
    finally:
        assert srv.stop() == 0
    log = srv.log_text()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
