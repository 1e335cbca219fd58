"""Which type each tensor of a model gets: llama-quantize's file types and its per-tensor rules.

Owns the names and ids of llama.cpp's quantization file types (`FTYPES`: Q4_K_M is 15, as in
llama.h's `llama_ftype`), and `choose_types`, which walks a model's tensor table as
llama-quantize does (src/llama-quant.cpp: `tensor_allows_quantization`, `tensor_get_category`,
`llama_tensor_get_type_impl`, `tensor_type_fallback`) and says, for every tensor, the type it
is written in. The rules are llama.cpp's, kept in its order so the two can be read side by side:

- only tensors of two or more dimensions whose name ends in "weight" are quantized, never norms,
  MoE routers, position embeddings and the other small tables llama.cpp lists;
- output.weight (or token_embd.weight when there is no output.weight: tied embeddings) gets Q6_K,
  or Q8_0 when its rows are not whole 256-blocks;
- attn_v and ffn_down get more bits in the first and last eighth of the layers and every third
  one between (`use_more_bits`) in Q4_K_M and Q5_K_M, Q5_K / Q4_K in Q3_K_M, and so on;
- a row that does not divide into the type's blocks falls back: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K
  to Q8_0, Q2_K/Q3_K to Q4_0, IQ4_XS to IQ4_NL, and to F16 when even 32 does not divide it.

The counters llama.cpp keeps (i_attention_wv, i_ffn_down, ...) advance in the order tensors are
visited: llama.cpp's weights_map order, layer number first and then name (`tensor_order`).
File types whose mixes need quantizers ggraph lacks (IQ1..IQ3, TQ, MXFP4) are refused by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ggraph.graphs.gguf.gguf_reader import type_sizes

# llama.h llama_ftype: name -> (id, the default tensor type). Aliases as llama-quantize's.
FTYPES: dict[str, tuple[int, str]] = {
    "F32": (0, "F32"), "F16": (1, "F16"), "BF16": (32, "BF16"),
    "Q4_0": (2, "Q4_0"), "Q4_1": (3, "Q4_1"), "Q5_0": (8, "Q5_0"), "Q5_1": (9, "Q5_1"),
    "Q8_0": (7, "Q8_0"),
    "Q2_K": (10, "Q2_K"), "Q2_K_S": (21, "Q2_K"),
    "Q3_K_S": (11, "Q3_K"), "Q3_K_M": (12, "Q3_K"), "Q3_K_L": (13, "Q3_K"),
    "Q4_K_S": (14, "Q4_K"), "Q4_K_M": (15, "Q4_K"),
    "Q5_K_S": (16, "Q5_K"), "Q5_K_M": (17, "Q5_K"),
    "Q6_K": (18, "Q6_K"),
    "IQ4_NL": (25, "IQ4_NL"), "IQ4_XS": (30, "IQ4_XS"),
}
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
# llama-quantize's file types that need quantizers ggraph does not have
NOT_HERE = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "IQ3_XXS", "IQ3_S",
            "IQ3_M", "IQ3_XS", "TQ1_0", "TQ2_0", "MXFP4_MOE", "Q1_0", "Q2_0", "COPY")
# the tensor types ggraph can write (quantize to, or convert to)
WRITABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
            "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
QUANTIZED = tuple(t for t in WRITABLE if t not in ("F32", "F16", "BF16"))


class MixError(ValueError):
    """A file type, tensor type or pattern llama-quantize would refuse, or ggraph cannot make."""


def parse_ftype(text: str) -> str:
    """A file type by llama-quantize's name (any case) or number, as its canonical name."""
    name = text.strip().upper()
    if name.isdigit():
        by_id = {i: n for n, (i, _) in FTYPES.items()}
        if int(name) in by_id:
            return by_id[int(name)]
        raise MixError(f"file type {text!r}: no llama.cpp file type has that number here "
                       f"(known: {', '.join(f'{n}={i}' for n, (i, _) in FTYPES.items())})")
    name = ALIASES.get(name, name)
    if name in FTYPES:
        return name
    if name in NOT_HERE:
        raise MixError(f"file type {text!r} is llama-quantize's, but ggraph has no quantizer "
                       f"for its mix (it makes {', '.join(FTYPES)})")
    raise MixError(f"file type {text!r} is not one of llama-quantize's "
                   f"({', '.join(FTYPES)}, or {', '.join(ALIASES)})")


def parse_type(text: str, what: str) -> str:
    """A tensor type by ggml's name (any case), one ggraph can write."""
    name = text.strip().upper()
    if name in WRITABLE:
        return name
    from gguf.constants import GGMLQuantizationType

    if name in GGMLQuantizationType.__members__:
        raise MixError(f"{what}: type {text!r} is ggml's, but ggraph cannot write it (it "
                       f"writes {', '.join(WRITABLE)})")
    raise MixError(f"{what}: {text!r} is not a ggml type name")


def parse_tensor_type(text: str) -> tuple[str, str]:
    """`--tensor-type PATTERN=TYPE`: llama-quantize lower-cases the pattern, a regular
    expression searched for in tensor names."""
    pattern, sep, tname = text.partition("=")
    if not sep or not pattern:
        raise MixError(f"--tensor-type {text!r}: expected PATTERN=TYPE, e.g. attn_q=q8_0")
    if not tname:
        raise MixError(f"--tensor-type {text!r}: the type after '=' is missing")
    try:
        re.compile(pattern.lower())
    except re.error as e:
        raise MixError(f"--tensor-type {text!r}: the pattern is not a regular expression "
                       f"({e})") from None
    return pattern.lower(), parse_type(tname, f"--tensor-type {text!r}")


@dataclass(frozen=True)
class MixOptions:
    """llama_model_quantize_params' choices: the file type and the overrides."""
    ftype: str = "Q4_K_M"
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    tensor_types: tuple[tuple[str, str], ...] = ()   # (pattern, type), first match wins
    pure: bool = False
    leave_output_tensor: bool = False
    has_imatrix: bool = False


@dataclass(frozen=True)
class ModelFacts:
    """The hyperparameters the rules read (llama_hparams / llama_model::type)."""
    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int
    is_70b: bool

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0


def _first(v: Any, default: int) -> int:
    if isinstance(v, (list, tuple)):
        return int(v[0]) if v else default
    return default if v is None else int(v)


def model_facts(metadata: Mapping[str, Any]) -> ModelFacts:
    arch = str(metadata.get("general.architecture", "llama"))
    n_layer = _first(metadata.get(f"{arch}.block_count"), 0)
    n_head = _first(metadata.get(f"{arch}.attention.head_count"), 0)
    n_head_kv = _first(metadata.get(f"{arch}.attention.head_count_kv"), n_head)
    n_expert = _first(metadata.get(f"{arch}.expert_count"), 0)
    # llama_model::type is LLM_TYPE_70B for llama (grouped KV heads) and qwen2 with 80 layers:
    # the one size whose attn_v rule differs
    is_70b = n_layer == 80 and (arch == "qwen2" or (arch == "llama" and n_head != n_head_kv))
    return ModelFacts(arch, n_layer, n_head, n_head_kv, n_expert, is_70b)


# ----------------------------------------------------------------------------- the tensor walk

def _layer(name: str) -> int:
    m = re.match(r"blk\.(-?\d+)\.", name)
    return int(m.group(1)) if m else -1


def tensor_order(names: Sequence[str]) -> list[str]:
    """llama.cpp's weights_map order: by the number after "blk." (none: -1, first), then by
    name (bytewise, as std::string's <)."""
    return sorted(names, key=lambda n: (_layer(n), n.encode()))


_NO_QUANT_PARTS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
    "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight",
    "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight",
    "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight",
    "time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight",
    ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd",
    ".patch_merger", "a.rvq.codebook", "mm.a.code_embd")
_GLM5_NEXT_NO_QUANT = (
    "hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
    "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight",
    "ssm_g_b.weight", "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight",
    "attn_v_b.weight")


def allows_quantization(name: str, ne: Sequence[int], arch: str, opts: MixOptions) -> bool:
    """llama.cpp's tensor_allows_quantization."""
    if len(ggml_dims(ne)) < 2 or not name.endswith("weight"):
        return False
    if any(p in name for p in _NO_QUANT_PARTS):
        return False
    if opts.leave_output_tensor and name == "output.weight":
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not (arch == "glm5-next" and any(p in name for p in _GLM5_NEXT_NO_QUANT))


def ggml_dims(ne: Sequence[int]) -> tuple[int, ...]:
    """The shape as ggml_n_dims counts it (and gguf writes it): trailing dimensions of 1 do
    not count, at least one does."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return tuple(ne[:n])


def category(name: str) -> str:
    """llama.cpp's tensor_get_category."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                      ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"),
                      ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                      ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if part in name:
            return cat
    return "other"


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or _cmod(i - n // 8, 3) == 2


def _cmod(a: int, b: int) -> int:
    """C's % (the sign of the dividend)."""
    r = abs(a) % b
    return -r if a < 0 else r


@dataclass
class _Counters:
    n_attention_wv: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0
    has_tied_embeddings: bool = True


@dataclass(frozen=True)
class TensorChoice:
    """One tensor's decision: its type in the file and the type it is written in."""
    name: str
    ne: tuple[int, ...]
    src_type: str
    new_type: str
    category: str
    quantize: bool            # new_type differs: the data is converted
    fallback: bool            # the mix's type did not fit the rows (llama.cpp's warning)
    requires_imatrix: bool


def _block(t: str) -> int:
    from gguf.constants import GGMLQuantizationType

    return type_sizes(int(GGMLQuantizationType[t]))[0]


def _layer_info(name: str, i: int, n: int, facts: ModelFacts) -> tuple[int, int]:
    if facts.n_expert > 1:
        layer = _layer(name)
        if not re.match(r"blk\.-?\d+\.", name):
            raise MixError(f"tensor {name!r}: no layer number in its name (needed for the "
                           f"expert model's rules)")
        if not 0 <= layer < n:
            raise MixError(f"tensor {name!r}: layer {layer} is outside [0, {n})")
        return layer, n
    return i, n


def _impl(c: _Counters, new: str, name: str, ne: Sequence[int], ftype: str, cat: str,
          facts: ModelFacts, opts: MixOptions) -> str:
    """llama_tensor_get_type_impl for the file types ggraph makes (the IQ1..IQ3, TQ and MXFP4
    branches are unreachable: parse_ftype refuses those types)."""
    arch = facts.arch
    if arch == "glm5-next" and any(p in name for p in ("attn_q_a", "attn_q_b", "nextn.eh_proj")):
        if new not in ("F32", "BF16", "F16"):
            return "Q8_0"
    if cat == "output" or (c.has_tied_embeddings and cat == "token_embd"):
        if opts.output_tensor_type is not None:
            return opts.output_tensor_type
        if arch == "falcon" or ne[0] % _block(new) != 0:
            return "Q8_0"
        return new if new == "Q8_0" else "Q6_K"
    if cat == "token_embd":
        return opts.token_embedding_type or new
    n_gqa = facts.n_gqa
    if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
        if ftype == "Q2_K":
            new = "Q4_K" if n_gqa >= 4 else "Q3_K"
        elif ftype == "Q2_K_S" and n_gqa >= 4:
            new = "Q4_K"
        elif ftype == "Q3_K_M":
            new = "Q5_K" if c.i_attention_wv < 2 else "Q4_K"
        elif ftype == "Q3_K_L":
            new = "Q5_K"
        elif ftype in ("IQ4_NL", "IQ4_XS") and n_gqa >= 4:
            new = "Q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(c.i_attention_wv, c.n_attention_wv):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and c.i_attention_wv < 4:
            new = "Q5_K"
        if facts.is_70b and new in ("Q3_K", "Q4_K"):
            new = "Q5_K"
        if facts.n_expert == 8:
            new = "Q8_0"
        c.i_attention_wv += 1
    elif cat == "attn_k":
        if facts.n_expert == 8:
            new = "Q8_0"
    elif cat == "ffn_down":
        i_layer, n_layer = _layer_info(name, c.i_ffn_down, facts.n_layer, facts)
        if ftype == "Q2_K":
            new = "Q3_K"
        elif ftype == "Q2_K_S":
            if i_layer < n_layer // 8:
                new = "Q4_K"
        elif ftype == "Q3_K_M":
            new = ("Q5_K" if i_layer < n_layer // 16 else
                   "Q4_K" if arch != "falcon" or use_more_bits(i_layer, n_layer) else "Q3_K")
        elif ftype == "Q3_K_L":
            new = "Q4_K" if arch == "falcon" else "Q5_K"
        elif ftype == "Q4_K_M":
            if arch == "falcon":
                new = ("Q6_K" if i_layer < n_layer // 16 else
                       "Q5_K" if use_more_bits(i_layer, n_layer) else "Q4_K")
            elif use_more_bits(i_layer, n_layer):
                new = "Q6_K"
        elif i_layer < n_layer // 8 and ftype in ("IQ4_NL", "IQ4_XS") and not opts.has_imatrix:
            new = "Q5_K"
        elif ftype == "Q5_K_M" and use_more_bits(i_layer, n_layer):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and arch != "falcon" and i_layer < n_layer // 8:
            new = "Q5_K"
        elif ftype in ("Q4_0", "Q5_0") and opts.has_imatrix and i_layer < n_layer // 8:
            # llama.cpp: guards the first ffn_down layers only when an imatrix is given
            new = "Q4_1" if ftype == "Q4_0" else "Q5_1"
        c.i_ffn_down += 1
    elif cat == "attn_output":
        if arch != "falcon":
            if facts.n_expert == 8:
                if ftype in ("Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS"):
                    new = "Q5_K"
            else:
                new = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(ftype, new)
        elif ftype == "Q3_K_L":
            new = "Q4_K"
    elif cat == "ffn_gate":
        _layer_info(name, c.i_ffn_gate, facts.n_layer, facts)
        c.i_ffn_gate += 1
    elif cat == "ffn_up":
        _layer_info(name, c.i_ffn_up, facts.n_layer, facts)
        c.i_ffn_up += 1
    return new


def _fallback(name: str, ne0: int, t: str) -> tuple[str, bool]:
    """tensor_type_fallback: (the type, whether it fell back)."""
    if ne0 % _block(t) == 0:
        return t, False
    out = {"IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0",
           "Q5_K": "Q5_1", "Q6_K": "Q8_0"}.get(t, t)
    if ne0 % _block(out) != 0:
        out = "F16"
    return out, True


def choose_types(tensors: Sequence[tuple[str, Sequence[int], str]],
                 metadata: Mapping[str, Any], opts: MixOptions) -> list[TensorChoice]:
    """Every tensor's type, in llama.cpp's visiting order (`tensor_order`); `tensors` are
    (name, ne, type name) as the input file has them."""
    facts = model_facts(metadata)
    ftype = opts.ftype
    default = FTYPES[ftype][1]
    by_name = {n: (tuple(int(x) for x in ne), t) for n, ne, t in tensors}
    order = tensor_order(list(by_name))
    c = _Counters()
    for n in order:
        cat = category(n)
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            c.n_attention_wv += 1
        if cat == "output":
            c.has_tied_embeddings = False
    out = []
    for n in order:
        ne, src = by_name[n]
        cat = category(n)
        fell = False
        if not allows_quantization(n, ne, facts.arch, opts):
            new = src
        elif opts.token_embedding_type is not None and cat == "token_embd" and not (
                # llama.cpp: an explicit --tensor-type may name this large separate table
                n == "per_layer_token_embd.weight" and
                any(re.search(p, n) for p, _ in opts.tensor_types)):
            new = opts.token_embedding_type
        elif opts.output_tensor_type is not None and cat == "output":
            new = opts.output_tensor_type
        else:
            new = default
            if default in QUANTIZED:
                manual = False
                for pattern, t in opts.tensor_types:
                    if re.search(pattern, n):
                        new, manual = t, True
                        break
                if not manual and not opts.pure:
                    new = _impl(c, new, n, ne, ftype, cat, facts, opts)
                new, fell = _fallback(n, ne[0], new)
        # tensor_requires_imatrix (its IQ1..IQ3 cases cannot arise here)
        needs = (n not in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight")
                 and new == "Q2_K" and ftype == "Q2_K_S")
        out.append(TensorChoice(n, ne, src, new, cat, new != src, fell, needs))
    return out
