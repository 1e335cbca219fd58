"""The two tokenizer models ggraph builds from a GGUF vocabulary with `tokenizers`, and how each
turns a token back into bytes.

Owns byte-level BPE (`tokenizer.ggml.model = "gpt2"`: merges from the file, the pre-tokenizer
chosen by `tokenizer.ggml.pre`) and SentencePiece (`"llama"`): a BPE with byte fallback whose
merges are derived from the scores as Hugging Face's GGUF converter derives them (every split of
a token into two tokens, ranked by the whole token's score), which reproduces llama.cpp's
llm_tokenizer_spm: it merges, anywhere in the text, the adjacent pair whose concatenation is the
best-scoring token, leftmost first, and spells what is left over in <0xXX> byte tokens. Both
models see text that partition() already cut around special tokens; neither holds added tokens.
"""
from __future__ import annotations

from operator import itemgetter
from typing import Any

from ggraph.graphs.gguf.gguf_reader import GGUFError
from ggraph.graphs.tokenizers.pretokenize import PreType, build_pre_tokenizer
from ggraph.graphs.tokenizers.tokenizer_vocab import Attr, Vocab, one_line

SPACE = "\u2581"  # SentencePiece's visible space
MAX_PIECE = 1 << 20  # bytes one token may decode to


def _rust_call(path: str, build: Any) -> Any:
    try:
        return build()
    except BaseException as e:  # a Rust panic is a BaseException (pyo3's PanicException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise GGUFError(f"{path}: the tokenizers library rejects the vocabulary "
                        f"({type(e).__name__}: {one_line(e)})") from None


def build_bpe(v: Vocab, pre: PreType) -> Any:
    """Byte-level BPE: the file's merges, ranked in file order, after `pre`'s regex splits."""
    from tokenizers import Tokenizer, models

    def build() -> Any:
        vocab = {t: i for i, t in enumerate(v.tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=v.merges, fuse_unk=False,
                                   ignore_merges=pre.ignore_merges))
        tok.pre_tokenizer = build_pre_tokenizer(pre)
        return tok

    return _rust_call(v.path, build)


def spm_merges(v: Vocab) -> list[tuple[str, str]]:
    """Merges for a SentencePiece vocabulary: for each token, each split into two tokens (the
    better-scoring halves first), all ordered by the whole token's score, best first (a stable
    sort, so equal scores keep vocabulary order)."""
    vocab = {t: i for i, t in enumerate(v.tokens)}
    scores = v.scores
    # both halves of a split are tokens, so a cut k is a token length and so is len(w) - k:
    # trying those lengths only costs the file's size, not the square of its longest token
    # (one token of 2^20 characters took two minutes)
    lengths = sorted({len(t) for t in v.tokens})
    have = set(lengths)
    ranked: list[tuple[float, str, str]] = []
    for w, s in zip(v.tokens, scores):
        n = len(w)
        ks = range(1, n) if n <= len(lengths) else lengths
        cuts = [k for k in ks if 0 < k < n and n - k in have and k in have and
                w[:k] in vocab and w[k:] in vocab]
        if len(cuts) == 1:
            k = cuts[0]
            ranked.append((s, w[:k], w[k:]))
        elif cuts:
            pairs = sorted(((w[:k], w[k:]) for k in cuts), reverse=True,
                           key=lambda p: (scores[vocab[p[0]]], scores[vocab[p[1]]]))
            ranked.extend((s, a, b) for a, b in pairs)
    ranked.sort(key=itemgetter(0), reverse=True)  # stable, also in reverse
    return [(a, b) for _, a, b in ranked]


def build_spm(v: Vocab) -> Any:
    """SentencePiece as a `tokenizers` BPE with byte fallback and no pre-tokenizer: llama.cpp
    merges across the whole text (spaces already "▁"), not word by word."""
    from tokenizers import Tokenizer, models

    merges = spm_merges(v)

    def build() -> Any:
        vocab = {t: i for i, t in enumerate(v.tokens)}
        return Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                                    fuse_unk=False))

    return _rust_call(v.path, build)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable character for each byte, inverted."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {chr(b): b for b in keep}
    n = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + n)] = b
            n += 1
    return out


_BYTES = _byte_decoder()


def _byte_token(text: str) -> bytes:
    # "<0xXX>" as llama.cpp's token_to_byte reads it (two hex digits after "<0x")
    try:
        return bytes([int(text[3:5], 16)])
    except ValueError:
        return b""


def piece(v: Vocab, tid: int, special: bool) -> bytes:
    """The bytes token `tid` stands for, as llama.cpp's token_to_piece gives them: CONTROL and
    UNKNOWN tokens only with `special`, USER_DEFINED ones verbatim, NORMAL ones unescaped (▁ to
    space for SentencePiece, GPT-2's byte characters back to bytes for BPE), BYTE tokens their
    byte, and tokens of any other type nothing."""
    a = v.attrs[tid]
    text = v.tokens[tid]
    if a & (Attr.CONTROL | Attr.UNKNOWN):
        return text.encode("utf-8") if special else b""
    if a & Attr.USER_DEFINED:
        return text.encode("utf-8")
    if a & Attr.NORMAL:
        if v.model == "llama":
            return text.replace(SPACE, " ").encode("utf-8")
        unknown = sum(ch not in _BYTES for ch in text)
        if unknown * len(text) > MAX_PIECE:   # llama.cpp repeats the whole token per char
            raise GGUFError(f"{v.path}: token {tid} has {len(text)} characters, {unknown} of "
                            f"them outside GPT-2's byte alphabet: spelled as llama.cpp spells "
                            f"them ([UNK_BYTE_0x..<token>] each) it would take "
                            f"{unknown * len(text)}+ bytes")
        out = bytearray()
        for ch in text:
            b = _BYTES.get(ch)
            if b is None:  # not a GPT-2 byte character: llama.cpp writes this marker
                out += f"[UNK_BYTE_0x{ch.encode('utf-8').hex()}{text}]".encode("utf-8")
            else:
                out.append(b)
        return bytes(out)
    if a & Attr.BYTE:
        return _byte_token(text)
    return b""
