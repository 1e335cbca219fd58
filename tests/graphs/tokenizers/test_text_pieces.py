"""Long texts are tokenized in pieces (graphs/tokenizers/text_pieces.py) with the ids of the whole text:
checked at hundreds of piece boundaries (pieces of a few dozen characters) over the corpus and
texts made to be awkward at a cut, for byte-level BPE (SmolLM2's smollm pre-tokenizer, Qwen2.5's
qwen2) and SentencePiece (Gemma 3). Memory stays bounded: a 4 MB line tokenizes under an
address-space limit that tokenizing it whole exceeds, and a word longer than MAX_RUN is a
one-line error instead of an abort inside the Rust tokenizer.
"""
from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import pytest

from ggraph.graphs.tokenizers import text_pieces
from ggraph.graphs.gguf.gguf_file import load_gguf
from ggraph.graphs.tokenizers.tokenizer import Tokenizer
from paths import DATA

CORPUS = sorted((DATA / "corpus").glob("*.txt"))
AWKWARD = [
    "word " * 40 + "  \n\n   \t\n" * 9 + "x" * 300 + " 1234567890" * 20,
    "日本語のテキストと English と 123,456.78 と emoji 🙂🙂🙂 " * 12,
    " " * 500 + "a" + "\n" * 300 + "b" + "\t \t" * 100,
    "can't won't I'm we've they'll " * 20 + "<|im_start|>user\nhi<|im_end|>" * 5,
    "a.b,c;d!e?f" * 60 + "====" * 50 + "-->" * 40,
]


@functools.lru_cache(maxsize=None)
def tokenizer(name: str) -> Tokenizer:
    from ggraph.graphs.gguf.fetch import resolve_model

    path = resolve_model(name)
    return Tokenizer(load_gguf(path, with_data=False).metadata, path)


def whole_and_pieces(tok: Tokenizer, text: str, piece: int) -> tuple[list[int], list[int]]:
    try:
        tok.piece_chars = 1 << 40
        whole = tok.encode(text)
        tok.piece_chars = piece
        return whole, tok.encode(text)
    finally:
        tok.piece_chars = text_pieces.PIECE_CHARS


@pytest.mark.parametrize("name", ["default", "qwen2.5-coder-0.5b", "gemma3"])
def test_pieces_give_the_ids_of_the_whole(name, monkeypatch):
    tok = tokenizer(name)
    cuts = []
    real = text_pieces.pieces

    def counting(text, find_cut, piece=text_pieces.PIECE_CHARS):
        out = list(real(text, find_cut, piece))
        cuts.append(len(out) - 1)
        return iter(out)

    monkeypatch.setattr("ggraph.graphs.tokenizers.tokenizer.pieces", counting)
    texts = [p.read_text(encoding="utf-8") for p in CORPUS] + AWKWARD
    for piece in (41, 97):
        for text in texts:
            whole, cut = whole_and_pieces(tok, text, piece)
            assert cut == whole, (name, piece, text[:60])
    assert sum(cuts) > 300   # the boundaries were really there


def test_a_word_longer_than_max_run_is_an_error(monkeypatch):
    monkeypatch.setattr(text_pieces, "MAX_RUN", 4096)
    for name in ("default", "gemma3"):
        tok = tokenizer(name)
        monkeypatch.setattr(tok, "piece_chars", 1024)
        with pytest.raises(ValueError, match="one word of 4096"):
            tok.encode("x" * 10000)
        assert len(tok.encode("x " * 5000)) >= 5000     # the same length with places to cut


def test_lone_surrogates_read_as_replacement_characters():
    tok = tokenizer("default")
    raw = b"caf\xe9 ok"                       # latin-1, not UTF-8
    text = raw.decode("utf-8", "surrogateescape")
    assert tok.encode(text) == tok.encode(raw.decode("utf-8", "replace"))


def test_memory_stays_bounded():
    """4 MB without a newline under RLIMIT_AS: whole, the Rust tokenizer needs about 160
    bytes per byte (~640 MB more) and would abort; in pieces it needs a few tens of MB."""
    code = textwrap.dedent("""
        import resource, sys
        from ggraph.graphs.gguf.fetch import resolve_model
        from ggraph.graphs.gguf.gguf_file import load_gguf
        from ggraph.graphs.tokenizers.tokenizer import Tokenizer
        p = resolve_model("default")
        tok = Tokenizer(load_gguf(p, with_data=False).metadata, p)
        base = open(sys.argv[1]).read().replace("\\n", " ")
        text = (base * (4_000_000 // len(base) + 1))[:4_000_000]
        vm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")]
        limit = vm[0] * 1024 + 400 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(len(tok.encode(text)))
    """)
    corpus = str(DATA / "corpus" / "prose_en.txt")
    r = subprocess.run([sys.executable, "-c", code, corpus], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) > 500_000
