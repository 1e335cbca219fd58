"""The tokenizer gives llama.cpp's token ids. Every corpus file (tests/data/corpus) is tokenized
by both, for SmolLM2 (byte-level BPE, pre-tokenizer 'smollm') and Gemma 3 (SentencePiece), and
decoded back: llama.cpp live with llama-cpp-python installed, else the ids it gave, recorded in
tests/data/llama_cpp/ by scripts/record_llama_cpp.py. Besides, the rules are checked on crafted
inputs: each pre-tokenizer's splits, SentencePiece merging by score, byte fallback, the space
prefix, special-token matching; expected values follow from the rules, not from a run."""
from __future__ import annotations


import pytest
from llama_cpp_ref import RECORD, live, recorded, sha256_text

from ggraph.graphs.gguf.gguf_reader import GGUFError, read_header
from ggraph.graphs.tokenizers.pretokenize import PRE_TYPES
from ggraph.graphs.tokenizers.tokenizer import Tokenizer
from paths import DATA

CORPUS = sorted((DATA / "corpus").glob("*.txt"))
K = "tokenizer.ggml."


def splits(pre: str, text: str) -> list[str]:
    """The words pre-tokenizer `pre` cuts `text` into (its regexes only, before the byte map)."""
    from tokenizers import Regex, pre_tokenizers

    seq = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated")
                                   for r in PRE_TYPES[pre].regexes])
    return [w for w, _ in seq.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre, text, words", [
    # gpt2: a run of spaces gives all but the last to \s+(?!\S); the last joins the next word
    ("gpt-2", "a  12", ["a", " ", " 12"]),
    ("gpt-2", "it's  ok\n", ["it", "'s", " ", " ok", "\n"]),
    # smollm/starcoder: every digit alone first, so no space joins a digit
    ("smollm", "a  12", ["a", "  ", "1", "2"]),
    ("smollm", "\n\n   1.", ["\n\n   ", "1", "."]),
    # llama3: digits in threes, contractions in either case, punctuation keeps its newlines
    ("llama-bpe", "12345", ["123", "45"]),
    ("llama-bpe", "I'M here", ["I", "'M", " here"]),
    ("llama-bpe", "x;\n\ny", ["x", ";\n\n", "y"]),
    # qwen2: single digits
    ("qwen2", "v2024", ["v", "2", "0", "2", "4"]),
    # default: punctuation runs, then gpt2, then digit runs, then threes
    ("default", "a+=12345", ["a", "+=", "123", "45"]),
    # deepseek-v3: digits in threes before anything else, kana/han runs alone
    ("deepseek-v3", "x1234東京", ["x", "123", "4", "東京"]),
])
def test_pre_tokenizer_regexes(pre, text, words):
    assert splits(pre, text) == words
    assert "".join(words) == text


def test_unknown_pre_type_is_refused():
    md = gpt2_vocab(pre="no-such-pre")
    with pytest.raises(GGUFError) as e:
        Tokenizer(md, "x.gguf")
    msg = str(e.value)
    assert K + "pre" in msg and "'no-such-pre'" in msg and "llama-bpe" in msg and "smollm" in msg


def gpt2_vocab(**changes) -> dict:
    tokens = ["<|endoftext|>", "a", "b", "ab", "Ġ", "Ġab", "1", "2"]
    md = {K + "model": "gpt2", K + "pre": "smollm", K + "tokens": tokens,
          K + "token_type": [3] + [1] * (len(tokens) - 1),
          K + "merges": ["a b", "Ġ ab"]}
    md.update({K + k: v for k, v in changes.items()})
    return md


def test_bpe_follows_the_pre_type():
    tok = Tokenizer(gpt2_vocab(), "x.gguf")
    # smollm isolates digits: " 12" is " ", "1", "2" (gpt2 would try " 12" as one word)
    assert tok.encode("ab ab 12") == [3, 5, 4, 6, 7]
    assert tok.decode(tok.encode("ab ab 12")) == "ab ab 12"
    assert tok.encode("<|endoftext|>ab", special=False) != [0, 3]
    assert tok.encode("<|endoftext|>ab", special=True) == [0, 3]


def spm_vocab(add_space_prefix: bool = True, **scores: float) -> dict:
    """A small SentencePiece vocabulary: <unk> <s> </s> (CONTROL), 256 byte tokens, then text
    tokens; `scores` overrides a text token's score (by name: ab, bc, ...)."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    text = {"▁": -1.0, "a": -2.0, "b": -3.0, "c": -4.0, "ab": -5.0, "bc": -6.0, "▁a": -7.0,
            "▁ab": -8.0, "<b>": 0.0, "</s>x": 0.0}
    text.update(scores)
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *text]
    types = [2, 3, 3, *[6] * 256, *[4 if t in ("<b>", "</s>x") else 1 for t in text]]
    return {K + "model": "llama", K + "tokens": tokens, K + "token_type": types,
            K + "scores": [0.0] * 259 + list(text.values()),
            K + "add_space_prefix": add_space_prefix, K + "add_bos_token": True}


def ids_of(tok: Tokenizer, *names: str) -> list[int]:
    return [tok.tokens.index(n) for n in names]


def test_spm_merges_the_best_scoring_pair_first():
    tok = Tokenizer(spm_vocab(add_space_prefix=False), "x.gguf")
    assert tok.encode("abc", add_bos=False) == ids_of(tok, "ab", "c")  # ab (-5) beats bc (-6)
    tok = Tokenizer(spm_vocab(add_space_prefix=False, bc=-4.5), "x.gguf")
    assert tok.encode("abc", add_bos=False) == ids_of(tok, "a", "bc")


def test_spm_space_prefix_and_bos():
    tok = Tokenizer(spm_vocab(), "x.gguf")
    assert (tok.bos, tok.eos, tok.add_bos) == (1, 2, True)  # SentencePiece defaults
    assert tok.encode("ab") == [1] + ids_of(tok, "▁ab")
    assert tok.decode(tok.encode("ab")) == "<s>ab" and tok.decode(tok.encode("ab"), False) == "ab"
    # after a special token the text gets its space again (llama.cpp's is_prev_special)
    assert tok.encode("ab<s>ab", add_bos=False) == ids_of(tok, "▁ab", "<s>", "▁ab")
    no_prefix = Tokenizer(spm_vocab(add_space_prefix=False), "x.gguf")
    assert no_prefix.encode("ab", add_bos=False) == ids_of(no_prefix, "ab")


def test_spm_byte_fallback():
    tok = Tokenizer(spm_vocab(add_space_prefix=False), "x.gguf")
    ids = tok.encode("aé", add_bos=False)  # é is not a token: its UTF-8 bytes C3 A9 are
    assert ids == ids_of(tok, "a", "<0xC3>", "<0xA9>")
    assert tok.decode(ids) == "aé"
    assert tok.decode(ids[:2]) == "a\ufffd"  # half a character


def test_user_defined_tokens_always_match_control_tokens_only_when_parsing_specials():
    tok = Tokenizer(spm_vocab(add_space_prefix=False), "x.gguf")
    b = ids_of(tok, "<b>")
    assert tok.encode("a<b>a", add_bos=False, special=False) == ids_of(tok, "a") + b + \
        ids_of(tok, "a")
    plain = tok.encode("<s>", add_bos=False, special=False)
    assert 1 not in plain and tok.decode(plain) == "<s>"
    assert tok.encode("<s>", add_bos=False, special=True) == [1]


def test_longest_special_token_is_cut_first():
    # llama.cpp cuts the longest special token everywhere before shorter ones: "</s>x" (5
    # bytes, USER_DEFINED) wins over "</s>" (4, CONTROL) even though both start at 0
    tok = Tokenizer(spm_vocab(add_space_prefix=False), "x.gguf")
    assert tok.encode("</s>x", add_bos=False) == ids_of(tok, "</s>x")


def test_end_of_generation_texts_are_control_whatever_their_type():
    # llama.cpp makes "</s>" CONTROL even when the file says USER_DEFINED (Gemma 3 does), so
    # it is plain text unless specials are parsed
    md = spm_vocab(add_space_prefix=False)
    md[K + "token_type"][2] = 4
    tok = Tokenizer(md, "x.gguf")
    assert 2 not in tok.encode("a</s>", add_bos=False, special=False)
    assert tok.encode("a</s>", add_bos=False, special=True)[-1] == 2


def test_tokenize_command(tiny, tmp_path, capsysbinary):
    from ggraph.cli import main

    path = tiny
    text = tmp_path / "t.txt"
    text.write_bytes(b"ab ab")
    assert main(["tokenize", "-m", str(path), "-f", str(text), "--ids"]) == 0
    out = capsysbinary.readouterr().out
    tok = Tokenizer(read_header(path).metadata, str(path))
    assert out == (str(tok.encode("ab ab")).encode() + b"\n")
    assert main(["tokenize", "-m", str(path), "-p", "ab\\nab"]) == 0
    ids = tok.encode("ab\nab")  # -p processes escapes as llama-tokenize does
    assert capsysbinary.readouterr().out == b"".join(
        f"{i:6d} -> '".encode() + tok.piece(i) + b"'\n" for i in ids)


# -- the real files, against llama.cpp -----------------------------------------------------------

@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real(request):
    from ggraph.graphs.gguf.fetch import resolve_model

    path = resolve_model(request.param)
    return path, Tokenizer(read_header(path).metadata, path), request.param


def test_real_round_trip(real):
    _, tok, _ = real
    for f in CORPUS:
        text = f.read_text(encoding="utf-8")
        assert tok.decode(tok.encode(text, special=False), special=False) == text, f.name


def corpus_key(special: bool, add_bos: bool) -> str:
    return f"special={int(special)},add_bos={int(add_bos)}"


@pytest.mark.parametrize("special", [False, True])
def test_same_ids_as_llama_cpp(real, special):
    llama_cpp = live()
    path, tok, name = real
    if llama_cpp is not None:
        ref = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    else:  # the ids llama.cpp gave, recorded by scripts/record_llama_cpp.py
        rec = recorded(f"tokenizer_{name}", path)["corpus"]
    for f in CORPUS:
        text = f.read_text(encoding="utf-8")
        if llama_cpp is None:
            assert f.name in rec and rec[f.name]["sha256"] == sha256_text(text), (
                f"{f.name} changed since llama.cpp's ids were recorded: run {RECORD}")
        for add_bos in (False, True):
            ours = tok.encode(text, add_bos=add_bos and tok.add_bos, special=special)
            theirs = (ref.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)
                      if llama_cpp is not None else rec[f.name][corpus_key(special, add_bos)])
            assert ours == theirs, (f.name, add_bos, next(
                (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None))
