"""Request bodies checked into records (graphs/serving/requests.py): every refusal names the
field, in OpenAI's error shape, and the accepted ones map onto llama.cpp's sampler chain."""
from __future__ import annotations

import json

import pytest

from ggraph.graphs.runtime.sampling import LLAMA_DEFAULT_SEED
from ggraph.graphs.serving.requests import RequestError, parse_json, parse_request

MSG = [{"role": "user", "content": "hi"}]


def refused(endpoint, body, n_vocab=1000, max_n=4) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_request(endpoint, body, n_vocab, max_n)
    err = e.value
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err


def test_chat_fields_map_onto_the_sampler_chain():
    g = parse_request("chat", {"messages": MSG, "temperature": 0, "top_k": 5, "top_p": 0.5,
                               "min_p": 0.1, "seed": 3, "presence_penalty": 0.5,
                               "frequency_penalty": -0.5, "max_tokens": 7, "n": 2,
                               "stop": "x", "stream": True,
                               "stream_options": {"include_usage": True},
                               "logprobs": True, "top_logprobs": 3}, 1000, 4)
    s = g.sampling
    assert (s.temp, s.top_k, s.top_p, s.min_p, s.seed) == (0.0, 5, 0.5, 0.1, 3)
    assert (s.penalty_present, s.penalty_freq) == (0.5, -0.5)
    assert (g.max_tokens, g.n, g.stop, g.stream, g.include_usage) == (7, 2, ("x",), True, True)
    assert (g.want_logprobs, g.logprobs) == (True, 3)
    # llama-server's defaults where the request is silent, a random seed
    d = parse_request("chat", {"messages": MSG}, 1000, 4)
    assert (d.sampling.temp, d.sampling.top_k, d.max_tokens) == (0.8, 40, -1)
    assert d.sampling.seed == LLAMA_DEFAULT_SEED


def test_constrained_output_becomes_gbnf():
    g = parse_request("chat", {"messages": MSG, "response_format": {"type": "json_object"}},
                      1000, 4)
    assert "root ::=" in g.sampling.grammar          # {} means any object, as llama-server
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g2 = parse_request("chat", {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, 1000, 4)
    g3 = parse_request("completion", {"prompt": "x", "json_schema": schema}, 1000, 4)
    assert g2.sampling.grammar == g3.sampling.grammar and 'a-kv ::=' in g2.sampling.grammar
    g4 = parse_request("completions", {"prompt": "x", "grammar": 'root ::= "yes"'}, 1000, 4)
    assert g4.sampling.grammar == 'root ::= "yes"'
    assert parse_request("chat", {"messages": MSG, "response_format": {"type": "text"}},
                         1000, 4).sampling.grammar == ""


def test_completion_shapes():
    g = parse_request("completions", {"prompt": ["Once"], "logprobs": 2}, 1000, 4)
    assert (g.prompt, g.max_tokens, g.logprobs, g.want_logprobs) == ("Once", 16, 2, True)
    g = parse_request("completion", {"prompt": [1, 2, 3], "n_predict": 5, "n_probs": 2}, 1000, 4)
    assert (g.prompt, g.max_tokens, g.logprobs) == ([1, 2, 3], 5, 2)


@pytest.mark.parametrize("body, param, code", [
    ({"messages": MSG, "max_token": 3}, "max_token", "unknown_parameter"),
    ({"messages": MSG, "temperature": "hot"}, "temperature", "invalid_type"),
    ({"messages": MSG, "temperature": -1}, "temperature", "invalid_value"),
    ({"messages": MSG, "top_p": 0}, "top_p", "invalid_value"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"messages": MSG, "max_tokens": -5}, "max_tokens", "invalid_value"),
    ({"messages": MSG, "max_tokens": True}, "max_tokens", "invalid_type"),
    ({"messages": MSG, "n": 1000000}, "n", "invalid_value"),
    ({"messages": MSG, "n": 5}, "n", "invalid_value"),
    ({"messages": MSG, "seed": 2 ** 40}, "seed", "invalid_value"),
    ({"messages": MSG, "stop": ["a"] * 17}, "stop", "invalid_value"),
    ({"messages": MSG, "stop": 3}, "stop", "invalid_type"),
    ({"messages": []}, "messages", "invalid_type"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra",
     "unknown_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "not_supported"),
    ({}, "messages", "missing_required_parameter"),
    ({"messages": MSG, "response_format": {"type": "json_object", "schema": 5}},
     "response_format.schema", "invalid_type"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type",
     "invalid_value"),
    ({"messages": MSG, "grammar": 'root ::= "a"', "json_schema": {}}, "json_schema",
     "invalid_value"),
    ({"messages": MSG, "grammar": 5}, "grammar", "invalid_type"),
    ({"messages": MSG, "json_schema": {"$ref": "#/nope"}}, "json_schema", "invalid_value"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools", "not_supported"),
    ({"messages": MSG, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x", "unknown_parameter"),
])
def test_chat_refusals_name_the_field(body, param, code):
    err = refused("chat", body)
    assert (err.status, err.param, err.code) == (400, param, code)
    assert param.split("[")[0].split(".")[0] in err.message


@pytest.mark.parametrize("body, param", [
    ({"prompt": [5, 1000]}, "prompt[1]"),
    ({"prompt": [-1]}, "prompt[0]"),
    ({"prompt": []}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
])
def test_completion_refusals(body, param):
    assert refused("completions", body).param == param


def test_a_body_that_is_no_object():
    assert refused("chat", [1, 2]).code == "invalid_type"


@pytest.mark.parametrize("raw, says", [
    (b"\xff\xfe{}", "not UTF-8"),
    (b'{"a": NaN}', "NaN"),
    (b'{"a": Infinity}', "Infinity"),
    (b'{"a": ', "not valid JSON"),
    (b"[" * 100 + b"]" * 100, "nested"),
    (b"[" * 100000 + b"]" * 100000, "nested"),
])
def test_strict_json(raw, says):
    with pytest.raises(RequestError) as e:
        parse_json(raw)
    assert says in e.value.message and e.value.status == 400


def test_null_fields_are_absent():
    g = parse_request("chat", json.loads('{"messages": [{"role": "user", "content": "x"}], '
                                         '"temperature": null, "stop": null}'), 1000, 4)
    assert g.sampling.temp == 0.8 and g.stop == ()
