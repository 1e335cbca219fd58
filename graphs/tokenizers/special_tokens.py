"""A vocabulary's special token ids and its end-of-generation set, as llama.cpp derives them
(llama_vocab::impl::load).

Owns reading every `tokenizer.ggml.*_token_id` key (bos, eos, eot, eom, unk, sep, pad, mask and
the fill-in-the-middle ones), the per-model defaults llama.cpp starts from (SentencePiece: unk
0, bos 1, eos 2; byte-level BPE: bos and eos 11; a default outside the vocabulary is dropped),
the ids llama.cpp finds by their text when a key is absent (the end-of-turn token, the FIM
pad/repo/separator tokens), and the end-of-generation (EOG) set generation stops on:

- the FIM pad, repo and separator ids;
- every token whose text is one of EOG_TEXTS (`<|im_end|>`, `<end_of_turn>`, `<|endoftext|>`,
  `<|eot_id|>`, `<|eom_id|>`, `<EOT>`, `<|end|>`, ...);
- eos, eot and eom;
- minus llama.cpp's two exceptions: `<|end|>` when the vocabulary also has `<|return|>` and
  `<|call|>` (or `<|calls|>` and `<|flush|>`), and `</s>` when it has `<|tool_response>`.

Where llama.cpp warns about a key holding an id outside the vocabulary and falls back to the
default, ggraph refuses the file with a one-line error naming the key: a GGUF is hostile input.
When a vocabulary has several of the texts one id is looked for by, llama.cpp takes whichever
its hash map yields first (SmolLM2's eot is `<|endoftext|>` there, Qwen2.5's `<|im_end|>`);
ggraph takes the text listed first. Only which of two EOG tokens is "the" eot differs: the
EOG set holds both either way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ggraph.graphs.gguf.gguf_reader import GGUFError

_K = "tokenizer.ggml."

# the id keys llama.cpp reads, in its order; each name is a SpecialIds field. The deprecated
# prefix/suffix/middle keys fill the FIM fields when present.
KEYS: tuple[tuple[str, str], ...] = (
    ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
    ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
    ("pad", "padding_token_id"), ("mask", "mask_token_id"),
    ("fim_pre", "fim_pre_token_id"), ("fim_suf", "fim_suf_token_id"),
    ("fim_mid", "fim_mid_token_id"), ("fim_pad", "fim_pad_token_id"),
    ("fim_rep", "fim_rep_token_id"), ("fim_sep", "fim_sep_token_id"),
    ("fim_pre", "prefix_token_id"), ("fim_suf", "suffix_token_id"),
    ("fim_mid", "middle_token_id"),
)

# llama.cpp's defaults before the keys are read, by tokenizer model
_DEFAULTS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}}

# texts whose token ends generation (llama.cpp's list; the comments name who uses them)
EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",  # llama 3, chatml, harmony
    "<|flush|>", "<|calls|>",                                         # solar-open
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "[EOT]", "[EOS]",                                                 # kimi-k2
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",                      # deepseek
    "[e~[",                                                           # minimax
])

# texts llama.cpp takes an id from when its key is absent, in llama.cpp's order
_BY_TEXT: dict[str, tuple[str, ...]] = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
            "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
            "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>", "<|code_prefix|>",
                "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>", "<|code_suffix|>",
                "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>", "<|code_middle|>",
                "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


@dataclass(frozen=True)
class SpecialIds:
    """The special ids (None: the vocabulary has none) and the end-of-generation set."""
    bos: int | None = None
    eos: int | None = None
    eot: int | None = None
    eom: int | None = None
    unk: int | None = None
    sep: int | None = None
    pad: int | None = None
    mask: int | None = None
    fim_pre: int | None = None
    fim_suf: int | None = None
    fim_mid: int | None = None
    fim_pad: int | None = None
    fim_rep: int | None = None
    fim_sep: int | None = None
    eog: frozenset[int] = field(default_factory=frozenset)


def _what(v: Any) -> str:
    return f"{type(v).__name__} {str(v)[:60]!r}" if not isinstance(v, list) \
        else f"a list of {len(v)}"


def read_special_ids(md: dict[str, Any], tokens: list[str], model: str,
                     path: str = "") -> SpecialIds:
    """The special ids of a vocabulary of `tokens` (tokenizer model `model`: "llama" or
    "gpt2"). A key that is not a token id in [0, len(tokens)) is a GGUFError naming it."""
    n = len(tokens)
    ids: dict[str, int | None] = {name: None for name, _ in KEYS}
    for name, d in _DEFAULTS.get(model, {}).items():
        ids[name] = d if d < n else None        # llama.cpp: "out of vocab range, disabling"
    for name, key in KEYS:
        v = md.get(_K + key)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < n:
            raise GGUFError(f"{path}: {_K}{key} must be a token id in [0, {n}), got "
                            f"{_what(v)}")
        ids[name] = v
    wanted = {t for name, texts in _BY_TEXT.items() if ids[name] is None for t in texts}
    where: dict[str, int] = {}
    eog: set[int] = set()
    for i, text in enumerate(tokens):   # one pass over a vocabulary of up to 262k tokens
        if text in wanted:
            where[text] = i
        if text in EOG_TEXTS:
            eog.add(i)
    for name, texts in _BY_TEXT.items():
        if ids[name] is None:
            ids[name] = next((where[t] for t in texts if t in where), None)
    eog.update(i for i in (ids["fim_pad"], ids["fim_rep"], ids["fim_sep"], ids["eos"],
                           ids["eot"], ids["eom"]) if i is not None)
    return SpecialIds(**ids, eog=frozenset(_exceptions(eog, tokens)))


def _exceptions(eog: set[int], tokens: list[str]) -> set[int]:
    """llama.cpp's two exceptions: harmony-style vocabularies end a message with <|end|> but
    not generation; gemma4-style ones use </s> as text."""
    texts = {tokens[i]: i for i in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog = eog - {texts["<|end|>"]}
    if "<|tool_response>" in texts and "</s>" in texts:
        eog = eog - {texts["</s>"]}
    return eog
