"""The architecture registry and the one table of GGUF tensor names.

An architecture registers a builder class under its `general.architecture` name; loading a
model looks it up here (an unknown name is a clear error listing the known ones), never in an
`if arch == ...` ladder.
"""
from __future__ import annotations

from typing import Any, Callable

from .gguf_file import GGUFError

# logical name -> GGUF tensor name ({il}: layer index)
TENSOR_NAMES: dict[str, str] = {
    "tok_embd": "token_embd.weight",
    "output_norm": "output_norm.weight",
    "output": "output.weight",
    "attn_norm": "blk.{il}.attn_norm.weight",
    "attn_q": "blk.{il}.attn_q.weight",
    "attn_k": "blk.{il}.attn_k.weight",
    "attn_v": "blk.{il}.attn_v.weight",
    "attn_output": "blk.{il}.attn_output.weight",
    "ffn_norm": "blk.{il}.ffn_norm.weight",
    "ffn_gate": "blk.{il}.ffn_gate.weight",
    "ffn_up": "blk.{il}.ffn_up.weight",
    "ffn_down": "blk.{il}.ffn_down.weight",
    # DeepSeek2 / MLA
    "attn_q_a": "blk.{il}.attn_q_a.weight",
    "attn_q_a_norm": "blk.{il}.attn_q_a_norm.weight",
    "attn_q_b": "blk.{il}.attn_q_b.weight",
    "attn_kv_a_mqa": "blk.{il}.attn_kv_a_mqa.weight",
    "attn_kv_a_norm": "blk.{il}.attn_kv_a_norm.weight",
    "attn_kv_b": "blk.{il}.attn_kv_b.weight",
    "attn_k_b": "blk.{il}.attn_k_b.weight",
    "attn_v_b": "blk.{il}.attn_v_b.weight",
    "ffn_gate_inp": "blk.{il}.ffn_gate_inp.weight",
    "exp_probs_b": "blk.{il}.exp_probs_b.bias",
    "ffn_gate_exps": "blk.{il}.ffn_gate_exps.weight",
    "ffn_up_exps": "blk.{il}.ffn_up_exps.weight",
    "ffn_down_exps": "blk.{il}.ffn_down_exps.weight",
    "ffn_gate_shexp": "blk.{il}.ffn_gate_shexp.weight",
    "ffn_up_shexp": "blk.{il}.ffn_up_shexp.weight",
    "ffn_down_shexp": "blk.{il}.ffn_down_shexp.weight",
}


def tensor_name(logical: str, il: int | None = None) -> str:
    return TENSOR_NAMES[logical].format(il=il)


ARCHITECTURES: dict[str, Callable[..., Any]] = {}


def register_arch(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        ARCHITECTURES[name] = cls
        return cls
    return deco


def model_class(arch: str, path: str = "") -> Callable[..., Any]:
    from . import deepseek2, llama  # noqa: F401 - importing registers the architectures

    cls = ARCHITECTURES.get(arch)
    if cls is None:
        raise GGUFError(f"{path or 'model'}: unknown architecture {arch!r}; ggraph builds "
                        f"{', '.join(sorted(ARCHITECTURES))}")
    return cls
