"""`ggraph serve` as clients meet it: the `openai` package, unmodified, for chat (streamed and
not), completions, n=2, stop strings and seeds; greedy text equal to `ggraph run --temp 0`;
prompt reuse reported as cached tokens; llama-server's own endpoints; the API key; bad input
answered with OpenAI's error object; a client that leaves mid-stream freeing its slot."""
from __future__ import annotations

import json
import time

import pytest

from ggraph.cli import main
from serve_client import KEY, start

openai = pytest.importorskip("openai", reason="the test extra installs openai")

N_CTX = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start("-c", str(N_CTX), "-np", "4", "-kvu", "--api-key", KEY, "--max-body", "1000000",
                tmp=tmp_path_factory.mktemp("serve"))
    yield srv
    assert srv.stop() == 0, srv.log_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY,
                         max_retries=0, timeout=120)


Q = [{"role": "user", "content": "What is the capital of France?"}]


def test_greedy_chat_equals_ggraph_run(client, capsys):
    r = client.chat.completions.create(model="x", messages=Q, temperature=0, max_tokens=16)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 10
    assert main(["run", "-m", "default", "--chat", "-p", Q[0]["content"], "--temp", "0",
                 "-n", "16", "-c", str(N_CTX)]) == 0
    assert capsys.readouterr().out.strip() == text.strip() and text.strip()


def test_stream_equals_whole_and_reports_usage(client):
    kw = dict(model="x", messages=Q, temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    # the same prompt again: all of it but its last token comes from the cache
    u = chunks[-1].usage
    assert u.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1


def test_completions_n_seed_and_stop(client):
    kw = dict(model="x", prompt="Once upon a time", max_tokens=12, temperature=1.0,
              top_p=1.0, seed=42)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.object == "text_completion" and a.choices[0].text == b.choices[0].text
    two = client.completions.create(**kw, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == a.choices[0].text      # choice i samples with seed + i
    assert two.choices[1].text != two.choices[0].text
    assert two.usage.completion_tokens == sum(
        len(c.text) > 0 for c in two.choices) * 0 + two.usage.completion_tokens
    # a stop string: the text ends before it, finish_reason "stop"
    full = client.completions.create(model="x", prompt="1, 2, 3, 4,", max_tokens=16,
                                     temperature=0).choices[0].text
    assert " 6" in full, full
    cut = client.completions.create(model="x", prompt="1, 2, 3, 4,", max_tokens=16,
                                    temperature=0, stop=[" 6"])
    assert cut.choices[0].text == full[:full.index(" 6")]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.chat.completions.create(model="x", messages=Q, temperature=0, max_tokens=4,
                                       logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    for x in lp:
        assert x.logprob <= 0 and len(x.top_logprobs) == 3
        assert x.top_logprobs[0].token == x.token      # greedy: the top one was chosen
        assert x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob


def test_llama_server_endpoints(server):
    assert server.get("/health", key=None) == (200, b'{"status":"ok"}')
    status, models = server.get("/v1/models", key=None)
    assert status == 200 and json.loads(models)["data"][0]["id"].endswith(".gguf")
    status, c = server.post("/completion", {"prompt": "The capital of France is",
                                            "n_predict": 6, "temperature": 0})
    assert status == 200 and c["stop"] is True and c["tokens_predicted"] == 6
    assert c["stop_type"] == "limit" and c["timings"]["predicted_n"] == 6
    status, t = server.post("/tokenize", {"content": "Hello world"})
    assert status == 200 and len(t["tokens"]) >= 2
    status, d = server.post("/detokenize", {"tokens": t["tokens"]})
    assert (status, d["content"].strip()) == (200, "Hello world")
    status, text = server.get("/metrics")
    text = text.decode()
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
                 "llamacpp:requests_processing", "llamacpp:requests_queued",
                 "llamacpp:kv_cache_cells_used", "llamacpp:prompt_tokens_cached_total"):
        assert f"\n{name} " in text, name
    status, slots = server.get("/slots")
    slots = json.loads(slots)
    assert status == 200 and len(slots) == 4 and {s["n_ctx"] for s in slots} == {N_CTX}


def test_api_key(server):
    for key in (None, "wrong"):
        status, body = server.post("/v1/chat/completions", {"messages": Q}, key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error"


def error_of(server, path, body, **kw):
    status, _, data = server.request("POST", path, body, **kw)
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return status, err


def test_bad_input_gets_openai_errors(server):
    chat = "/v1/chat/completions"
    assert error_of(server, chat, b"{not json")[0] == 400
    assert error_of(server, chat, b'{"messages": [{"role": "user", "content": "\xff"}]}')[0] \
        == 400
    assert error_of(server, chat, {"messages": Q, "temperature": float("nan")})[0] == 400
    status, err = error_of(server, chat, {"messages": Q, "n": 10 ** 9})
    assert status == 400 and err["param"] == "n"
    status, err = error_of(server, chat, {"messages": Q, "max_tokens": -3})
    assert status == 400 and err["param"] == "max_tokens"
    status, err = error_of(server, chat, {"messages": Q, "bogus": 1})
    assert status == 400 and err["code"] == "unknown_parameter"
    status, err = error_of(server, chat, b"{" + b" " * 2_000_000 + b"}")
    assert status == 413
    status, err = error_of(server, chat, {"messages": [{"role": "user",
                                                        "content": "word " * 2000}]})
    assert status == 400 and err["code"] == "context_length_exceeded"
    status, err = error_of(server, "/v1/nowhere", {})
    assert status == 404
    # a huge max_tokens is capped by the context, not refused
    status, r = server.post(chat, {"messages": Q, "max_tokens": 10 ** 9, "temperature": 0})
    assert status == 200 and r["usage"]["total_tokens"] <= N_CTX


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
    "required": ["name", "age"], "additionalProperties": False}


def test_constrained_output(client, server):
    """response_format json_schema (the openai client), json_object, and llama-server's
    grammar and json_schema fields; n=2 with a grammar; a bad grammar is this request's 400."""
    pytest.importorskip("llguidance", reason="grammars are the ggraph[grammar] extra")
    jsonschema = pytest.importorskip("jsonschema")
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    r = client.chat.completions.create(
        model="x", messages=ask, max_tokens=80, seed=3, n=2, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), PERSON)
    r = client.chat.completions.create(model="x", messages=ask, max_tokens=120, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    status, c = server.post("/completion", {"prompt": "Is the sky blue? Answer:",
                                            "grammar": 'root ::= " yes" | " no"',
                                            "temperature": 0})
    assert status == 200 and c["content"] in (" yes", " no") and c["stop_type"] == "eos"
    status, c = server.post("/completion", {"prompt": "A person:", "json_schema": PERSON,
                                            "n_predict": 80, "seed": 1})
    assert status == 200 and c["stop_type"] == "eos"
    jsonschema.validate(json.loads(c["content"]), PERSON)
    status, err = error_of(server, "/completion", {"prompt": "x", "grammar": 'root ::= "a'})
    assert status == 400 and err["param"] == "grammar" and "unterminated string" in \
        err["message"]


def test_client_leaving_mid_stream_frees_its_slot(server):
    conn, lines = server.stream("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Count from 1 to 1000."}],
        "max_tokens": 400, "temperature": 0})
    for _ in range(3):
        next(lines)
    busy = [s for s in json.loads(server.get("/slots")[1]) if s["is_processing"]]
    assert len(busy) == 1
    conn.close()
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if not any(s["is_processing"] for s in json.loads(server.get("/slots")[1])):
            break
        time.sleep(0.05)
    slots = json.loads(server.get("/slots")[1])
    assert not any(s["is_processing"] for s in slots)
    gone = [s for s in slots if s["id"] == busy[0]["id"]][0]
    assert gone["n_cached_tokens"] < 100   # freed long before 400 tokens
    status, r = server.post("/v1/chat/completions", {"messages": Q, "max_tokens": 2})
    assert status == 200


def test_a_template_error_is_that_requests_400():
    """prompt_tokens turns the sandboxed template's error into the request's 400."""
    from ggraph.graphs.gguf.gguf_file import GGUFError
    from ggraph.graphs.serving.requests import RequestError, parse_request
    from ggraph.tools.server.app import prompt_tokens

    class Tok:
        def render(self, messages, max_chars=None):
            raise GGUFError("model.gguf: tokenizer.chat_template raised an error: roles must "
                            "alternate")

        def chars_for(self, n):
            return 4 * n

    class Eng:
        tokenizer, n_ctx_seq = Tok(), 512

    gen = parse_request("chat", {"messages": Q}, 1000, 4)
    with pytest.raises(RequestError) as e:
        prompt_tokens(Eng(), gen)
    assert e.value.status == 400 and "roles must alternate" in e.value.message
    assert e.value.code == "template_error"
