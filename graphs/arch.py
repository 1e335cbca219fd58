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


def expect_tensor(gguf: Any, logical: str, ne: tuple[int, ...], il: int | None = None,
                  optional: bool = False) -> Any:
    """The weight `logical` (of layer il) with exactly ne; missing or mis-shaped is an error
    naming the file and the tensor (None for a missing optional one)."""
    name = tensor_name(logical, il)
    t = gguf.get(name)
    if t is None:
        if optional:
            return None
        raise GGUFError(f"{gguf.path}: tensor {name!r} is missing")
    want = tuple(ne) + (1,) * (4 - len(ne))
    if t.ne != want:
        raise GGUFError(f"{gguf.path}: tensor {name!r} has ne={list(t.ne[:len(ne)])}, "
                        f"expected {list(ne)} for this model's hyperparameters")
    return t


def io_weights(gguf: Any, n_embd: int, n_vocab: int) -> dict[str, Any]:
    """Token embedding, output norm and output matrix (tied to the embedding when the file
    has no output.weight). The tokenizer's vocabulary must be as long as the embedding: a
    shorter one would leave rows that no token reaches and ids that no text decodes to."""
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != n_vocab:
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.tokens has {len(tokens)} tokens but the "
                        f"model's vocabulary (vocab_size, token_embd) has {n_vocab}")
    w = {"tok_embd": expect_tensor(gguf, "tok_embd", (n_embd, n_vocab)),
         "output_norm": expect_tensor(gguf, "output_norm", (n_embd,)),
         "output": expect_tensor(gguf, "output", (n_embd, n_vocab), optional=True)}
    if w["output"] is None:
        w["output"] = w["tok_embd"]
    return w


def vocab_size(gguf: Any) -> int:
    """n_vocab when the architecture's key is absent: the tokenizer's list, else the embedding."""
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    return len(tokens) if isinstance(tokens, list) and tokens else \
        gguf.tensor(tensor_name("tok_embd")).ne[1]


ARCHITECTURES: dict[str, Callable[..., Any]] = {}


def register_arch(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        ARCHITECTURES[name] = cls
        return cls
    return deco


def build_model(gguf: Any, **overrides: Any) -> Any:
    """The architecture's model over a loaded file, which must hold exactly the tensors that
    model uses."""
    model = model_class(gguf.arch, gguf.path)(gguf, **overrides)
    gguf.check_all_used()
    return model


def model_class(arch: str, path: str = "") -> Callable[..., Any]:
    from . import deepseek2, llama  # noqa: F401 - importing registers the architectures

    cls = ARCHITECTURES.get(arch)
    if cls is None:
        raise GGUFError(f"{path or 'model'}: unknown architecture {arch!r}; ggraph builds "
                        f"{', '.join(sorted(ARCHITECTURES))}")
    return cls
