r"""Cutting a long text into pieces that tokenize alone to the ids of the whole, so that
tokenizing costs memory in proportion to a piece and not to the text (the Rust `tokenizers`
library takes about 200 bytes per input byte, and aborts the process when an allocation
fails).

A piece ends only where the tokenizer cannot join anything across the cut:
- byte-level BPE merges inside the words its pre-tokenizer splits the text into, so a cut
  at the start of a word changes nothing, provided the piece before it does not end in
  whitespace (the regexes' only lookahead, `\s+(?!\S)`, reads a text's end differently from
  a following word). The words near a cut are found by pre-tokenizing a window that goes
  MARGIN characters past it: the regexes match runs of one character class and look ahead
  one or two characters, so a word that starts that far from the window's end starts there
  in the whole text too;
- SentencePiece (llama.cpp's merges by score over the whole text) only makes vocabulary
  tokens, so a cut between two characters that are never adjacent inside any token is one no
  merge can cross.
A text with no such place for MAX_RUN characters (a 40 MB word) is refused with a one-line
error instead of being handed whole to the tokenizer.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

PIECE_CHARS = 1 << 16   # a piece's length before looking for a cut
MARGIN = 256            # characters pre-tokenized past a cut (far more than any lookahead)
MAX_RUN = 1 << 20       # the longest stretch without a place to cut that is tokenized whole


def valid_text(text: str) -> str:
    """`text` with lone surrogates (bytes that were not UTF-8, as Python's surrogateescape
    decodes them) as U+FFFD, which every tokenizer accepts."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogateescape" if _escaped(text) else "surrogatepass")
        return raw.decode("utf-8", "replace")


def _escaped(text: str) -> bool:
    try:
        text.encode("utf-8", "surrogateescape")
        return True
    except UnicodeEncodeError:
        return False


def pieces(text: str, find_cut: Callable[[str, int, int], int | None],
           piece: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of about `piece` characters, each cut where find_cut(text, start,
    limit) says (a cut in start+1 .. limit, or None when there is none); the search doubles
    up to MAX_RUN characters, then a ValueError names the place."""
    start = 0
    while len(text) - start > piece:
        span = piece
        while True:
            cut = find_cut(text, start, start + span)
            if cut is not None:
                break
            if span >= MAX_RUN:
                raise ValueError(f"the text has {MAX_RUN} characters from character {start} "
                                 f"on where the tokenizer could not be stopped and restarted "
                                 f"(one word of {MAX_RUN}+ characters); ggraph tokenizes such "
                                 f"text in pieces of at most that length")
            span = min(span * 2, MAX_RUN)
            if len(text) - start <= span:
                yield text[start:]
                return
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]


def bpe_cutter(pre_tokenizer: Any) -> Callable[[str, int, int], int | None]:
    r"""find_cut for byte-level BPE: the last word start in start+1..limit, from the words of
    text[start:limit + MARGIN] (start is a word start: the text's or an earlier cut), after a
    character that is not whitespace: a piece ending in whitespace would split differently
    (`\s+(?!\S)` keeps a run's last space for the next word, but not at the text's end)."""
    def find_cut(text: str, start: int, limit: int) -> int | None:
        words = pre_tokenizer.pre_tokenize_str(text[start:limit + MARGIN])
        starts = [start + a for _, (a, _) in words
                  if 0 < a <= limit - start and not text[start + a - 1].isspace()]
        return starts[-1] if starts else None
    return find_cut


def spm_cutter(tokens: list[str]) -> Callable[[str, int, int], int | None]:
    """find_cut for SentencePiece: the last place in start+1..limit between two characters
    that no token holds side by side (the pairs are gathered once, on the first long text)."""
    pairs: set[str] = set()
    for t in tokens:
        pairs.update(t[i:i + 2] for i in range(len(t) - 1))

    def find_cut(text: str, start: int, limit: int) -> int | None:
        for c in range(min(limit, len(text) - 1), start, -1):
            if text[c - 1:c + 1] not in pairs:
                return c
        return None
    return find_cut
