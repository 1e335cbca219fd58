"""`ggraph serve -md`: speculative decoding for every slot keeps the greedy text (the answer
equals the one without a draft model) and llama-server's speculative counters count it."""
from __future__ import annotations

import json
import re

import pytest

from serve_client import start

pytest.importorskip("starlette", reason="the test extra installs the server's packages")
MSGS = [[{"role": "user", "content": q}] for q in ("What is the capital of France?",
                                                    "Name three colors.")]


def answers(srv) -> list[str]:
    out = []
    for m in MSGS:
        status, r = srv.post("/v1/chat/completions", {"messages": m, "temperature": 0,
                                                      "max_tokens": 24})
        assert status == 200, r
        out.append(r["choices"][0]["message"]["content"])
    return out


def test_draft_model_keeps_the_greedy_text(tmp_path):
    plain = start("-c", "512", "-np", "2", "-kvu", tmp=tmp_path)
    try:
        want = answers(plain)
    finally:
        assert plain.stop() == 0
    spec = start("-c", "512", "-np", "2", "-kvu", "-md", "default", "--spec-draft-n-max", "4",
                 tmp=tmp_path)
    try:
        assert answers(spec) == want
        metrics = spec.get("/metrics")[1].decode()
        drafted = int(re.search(r"\nllamacpp:spec_decode_num_draft_tokens_total (\d+)",
                                metrics).group(1))
        kept = int(re.search(r"\nllamacpp:spec_decode_num_accepted_tokens_total (\d+)",
                             metrics).group(1))
        assert drafted >= 8 and kept >= drafted // 2, metrics
        assert all(s["speculative"] for s in json.loads(spec.get("/slots")[1]))
    finally:
        assert spec.stop() == 0
