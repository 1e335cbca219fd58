"""Tokenizer metadata built by hand for the hostile-input tests: a small valid byte-level
BPE vocabulary to break key by key, and the one-line GGUFError loading it must raise
(tests/graphs/tokenizers/test_tokenizer_safety.py, tests/graphs/gguf/test_fuzz_findings.py)."""
from __future__ import annotations

import pytest

from ggraph.graphs.gguf.gguf_file import GGUFError
from ggraph.graphs.tokenizers.tokenizer import Tokenizer

PATH = "/models/evil.gguf"
K = "tokenizer.ggml."
TEMPLATE = "tokenizer.chat_template"


def small(**changes) -> dict:
    """A valid little byte-level BPE vocabulary; keyword `x_y` sets key tokenizer.ggml.x_y,
    None deletes it (`chat_template` sets tokenizer.chat_template)."""
    md = {K + "model": "gpt2",
          K + "tokens": ["<unk>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "Ġ"],
          K + "token_type": [3, 3, 3, 1, 1, 1, 1],
          K + "merges": ["a b"],
          K + "bos_token_id": 1, K + "eos_token_id": 2, K + "add_bos_token": False}
    for k, v in changes.items():
        key = TEMPLATE if k == "chat_template" else K + k
        if v is None:
            md.pop(key, None)
        else:
            md[key] = v
    return md


def error(md: dict, *, chat: bool = False) -> str:
    """The message of the GGUFError that loading (or chatting with) md raises: one line that
    names the file."""
    with pytest.raises(GGUFError) as e:
        tok = Tokenizer(md, PATH)
        if chat:
            tok.chat("hi", "be brief")
    msg = str(e.value)
    assert "\n" not in msg and PATH in msg, msg
    return msg
