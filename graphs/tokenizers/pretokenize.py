"""Pre-tokenizer types of byte-level BPE vocabularies (`tokenizer.ggml.pre`), as llama.cpp reads them.

Owns the registry from a pre-tokenizer name to what llama.cpp does with it: the list of regexes
that split the text before BPE, whether a word that is already a token skips the merges
(`ignore_merges`), whether detokenizing cleans spaces before punctuation, and the add_bos default.
llama.cpp applies the regexes one after another, each splitting every piece left by the previous
one into its matches and the text between them; `tokenizers`' Split(pattern, "isolated") does the
same, so a sequence of Splits followed by the GPT-2 byte mapping reproduces llama.cpp's words.

The regexes are the ones llama.cpp compiles (its adapted forms: `(?:'[sS]|...)` for `(?i:'s|...)`);
llama.cpp runs the GPT-2 regex through a hand-written matcher that also ends with `|\\s+`, which is
why GPT2 below has it. Pre types whose splitting llama.cpp does in custom code with no regex
equivalent (kimi-k2, afmoe, superbpe, tiny_aya) or on raw UTF-8 (gemma4, sarvam-moe, whitespace)
are not registered: loading one is an error that names the known types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ggraph.graphs.gguf.gguf_reader import GGUFError

PRE_KEY = "tokenizer.ggml.pre"

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CASED = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
_CASED2 = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
_DS3_MAIN = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
             r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"


@dataclass(frozen=True)
class PreType:
    """What llama.cpp does for one family of pre-tokenizer names."""
    regexes: tuple[str, ...]
    ignore_merges: bool = False      # a word that is a whole token is emitted without merging
    clean_spaces: bool = True        # detokenize drops the space in " ," " 's" ...
    add_bos: bool | None = None      # the default when tokenizer.ggml.add_bos_token is absent


DEFAULT = PreType((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_STARCODER = (r"\p{N}", GPT2)

# name -> behaviour; several names share one entry exactly as llama.cpp's switch does
PRE_TYPES: dict[str, PreType] = {
    "default": DEFAULT,
    "minicpm5": PreType((r"\p{N}{1,3}", LLAMA3.replace(r"|\p{N}{1,3}|", r"|\p{N}+|")),
                        ignore_merges=True),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"],
                    PreType((LLAMA3,), ignore_merges=True, add_bos=True)),
    "deepseek-coder": PreType(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+",
                               "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"),
                              clean_spaces=False),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"],
                    PreType((r"\p{N}{1,3}", _CJK_KANA, _DS3_MAIN), clean_spaces=False)),
    "falcon": PreType((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    **dict.fromkeys(["mpt", "olmo", "jais", "exaone4", "gpt-2", "phi-2", "jina-es", "jina-de",
                     "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert",
                     "jina-v1-en", "jina-v2-code", "roberta-bpe"], PreType((GPT2,))),
    **dict.fromkeys(["trillion", "granite-docling"], PreType((GPT2,), clean_spaces=False)),
    **dict.fromkeys(["starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"],
                    PreType(_STARCODER)),
    **dict.fromkeys(["smollm", "command-r"], PreType(_STARCODER, clean_spaces=False)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open",
                     "grok-2"], PreType((QWEN2,), clean_spaces=False)),
    **dict.fromkeys(["stablelm2", "megrez"], PreType((QWEN2,))),
    "qwen35": PreType((QWEN35,), clean_spaces=False),
    **dict.fromkeys(["dbrx", "smaug-bpe", "chatglm-bpe"], PreType((LLAMA3,))),
    **dict.fromkeys(["glm4", "glm5"], PreType((LLAMA3,), ignore_merges=True)),
    "poro-chat": PreType((_BLOOM,), clean_spaces=False),
    **dict.fromkeys(["bloom", "gpt3-finnish"], PreType((_BLOOM,))),
    "viking": PreType((_BLOOM, r"\p{N}"), clean_spaces=False),
    "tekken": PreType((_CASED + r"|" + _CASED2 + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+",),
                      clean_spaces=False, ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
                    PreType((_CASED + _CONTRACTIONS + "?|" + _CASED2 + _CONTRACTIONS
                             + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
                            clean_spaces=False)),
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"],
                    PreType((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+"
                             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",),
                            clean_spaces=False)),
    "seed-coder": PreType((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                           r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",),
                          clean_spaces=False),
    "ufakzeka": PreType((QWEN2[len(_CONTRACTIONS) + 1:],), clean_spaces=False),
    "laguna": PreType(("[^\\n]+|[\\n]+", QWEN2), clean_spaces=False),
}


def pre_type(metadata: dict[str, Any], path: str) -> tuple[str, PreType]:
    """The pre-tokenizer name and behaviour of a byte-level BPE vocabulary; llama.cpp reads a
    missing key as 'default' (with a warning about degraded quality) and refuses unknown names."""
    name = metadata.get(PRE_KEY)
    if name is None:
        return "default", DEFAULT
    if not isinstance(name, str):
        raise GGUFError(f"{path}: {PRE_KEY} must be a string, got {type(name).__name__}")
    found = PRE_TYPES.get(name)
    if found is None:
        raise GGUFError(f"{path}: {PRE_KEY} = {name[:60]!r} is not a pre-tokenizer ggraph knows "
                        f"(known: {', '.join(sorted(PRE_TYPES))})")
    return name, found


def build_pre_tokenizer(pre: PreType) -> Any:
    """The `tokenizers` pre-tokenizer for `pre`: its regex splits in order, then GPT-2's byte
    mapping (each UTF-8 byte to one printable character) without a further regex."""
    from tokenizers import Regex, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(r), "isolated") for r in pre.regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)
