"""GGUF tensor names from gguf-py's tables, and weights looked up by them.

gguf-py (`gguf.constants`) lists each architecture's tensors (`MODEL_TENSORS[MODEL_ARCH.X]`)
and their name templates (`TENSOR_NAMES`: `"blk.{bid}.attn_q"`). A `TensorNames` is one
architecture's table: logical name (the template without its `blk.{bid}.` prefix: `attn_q`,
`token_embd`) -> GGUF name, with the `.weight` or `.bias` suffix llama.cpp adds where it loads
the tensor (`tn(LLM_TENSOR_ATTN_Q, "weight", il)`). `expect_tensor` and `io_weights` look
weights up through `gguf.get`, which marks each tensor used (GGUFModel.check_all_used), and
fail naming the file and the tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, Keys
from gguf.constants import TENSOR_NAMES as GGUF_TENSOR_NAMES

from ggraph.ir.tensor import Tensor
from ggraph.ir.types import weight_types
from ggraph.ir.types import GGMLType

from ggraph.graphs.gguf.gguf_file import GGUFError, GGUFModel

BLOCK_PREFIX = "blk.{bid}."


def logical_name(t: MODEL_TENSOR) -> str:
    """gguf-py's template without the block prefix: ATTN_Q -> attn_q, TOKEN_EMBD -> token_embd."""
    return GGUF_TENSOR_NAMES[t].removeprefix(BLOCK_PREFIX)


def gguf_arch(name: str) -> MODEL_ARCH:
    """gguf-py's MODEL_ARCH for a `general.architecture` name."""
    for arch, arch_name in MODEL_ARCH_NAMES.items():
        if arch_name == name:
            return arch
    raise KeyError(f"gguf-py (gguf.constants) knows no architecture {name!r}")


@dataclass(frozen=True)
class TensorNames:
    """One architecture's tensors: logical name -> gguf-py template."""
    arch: str
    templates: Mapping[str, str]

    @classmethod
    def of(cls, arch: str) -> TensorNames:
        """The tensors gguf-py lists for `arch` (MODEL_TENSORS[MODEL_ARCH.X])."""
        return cls.from_tensors(arch, MODEL_TENSORS[gguf_arch(arch)])

    @classmethod
    def from_tensors(cls, arch: str, tensors: Iterable[MODEL_TENSOR]) -> TensorNames:
        """A table of gguf-py tensors for an architecture gguf-py does not list (yet)."""
        return cls(arch, {logical_name(t): GGUF_TENSOR_NAMES[t] for t in tensors})

    def __call__(self, logical: str, il: int | None = None, suffix: str = "weight") -> str:
        """The GGUF name: `attn_q`, 3 -> `blk.3.attn_q.weight`; suffix `bias` for biases."""
        template = self.templates.get(logical)
        if template is None:
            raise KeyError(f"architecture {self.arch!r} has no tensor {logical!r} in gguf-py's "
                           f"table; it has {', '.join(self.templates)}")
        if ("{bid}" in template) != (il is not None):
            raise ValueError(f"{self.arch} tensor {logical!r} ({template}): "
                             f"{'give its layer' if il is None else 'not a per-layer tensor'}")
        return f"{template.format(bid=il)}.{suffix}"


# what a norm or bias may be stored as (the element-wise ops' second operand)
VECTOR_TYPES = (GGMLType.F32, GGMLType.F16)


def expect_tensor(gguf: GGUFModel, names: TensorNames, logical: str, ne: tuple[int, ...],
                  il: int | None = None, *, optional: bool = False,
                  suffix: str = "weight") -> Tensor | None:
    """The weight `logical` (of layer il) with exactly ne; missing or mis-shaped is an error
    naming the file and the tensor (None for a missing optional one)."""
    name = names(logical, il, suffix)
    t = gguf.find(name, tuple(ne), optional)
    if t is None:
        if optional:
            return None
        raise GGUFError(f"{gguf.path}: tensor {name!r} is missing")
    want = tuple(ne) + (1,) * (4 - len(ne))
    if t.ne != want:
        raise GGUFError(f"{gguf.path}: tensor {name!r} has ne={list(t.ne[:len(ne)])}, "
                        f"expected {list(ne)} for this model's hyperparameters")
    # matrices go to mul_mat / get_rows, vectors (norms, biases) to element-wise ops: a type
    # they cannot take (I64, Q8_K, a quantized norm) is the file's error, not a graph's
    allowed = weight_types() if len(ne) > 1 else VECTOR_TYPES
    if t.type not in allowed:
        raise GGUFError(f"{gguf.path}: tensor {name!r} has type {t.type}; a "
                        f"{'matrix' if len(ne) > 1 else 'vector'} weight must be "
                        f"{'/'.join(str(x) for x in allowed)}")
    return t


def io_weights(gguf: GGUFModel, names: TensorNames, n_embd: int,
               n_vocab: int) -> dict[str, Tensor]:
    """Token embedding, output norm and output matrix (tied to the embedding when the file
    has no output.weight), under the keys token_embd, output_norm and output. The
    tokenizer's vocabulary must be as long as the embedding: a shorter one would leave rows
    that no token reaches and ids that no text decodes to."""
    tokens = gguf.metadata.get(Keys.Tokenizer.LIST)
    if isinstance(tokens, list) and len(tokens) != n_vocab:
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.tokens has {len(tokens)} tokens but the "
                        f"model's vocabulary (vocab_size, token_embd) has {n_vocab}")
    embd = expect_tensor(gguf, names, "token_embd", (n_embd, n_vocab))
    norm = expect_tensor(gguf, names, "output_norm", (n_embd,))
    out = expect_tensor(gguf, names, "output", (n_embd, n_vocab), optional=True)
    assert embd is not None and norm is not None
    return {"token_embd": embd, "output_norm": norm, "output": embd if out is None else out}


def vocab_size(gguf: GGUFModel, names: TensorNames) -> int:
    """n_vocab when the architecture's key is absent: the tokenizer's list, else the embedding."""
    tokens = gguf.metadata.get(Keys.Tokenizer.LIST)
    return len(tokens) if isinstance(tokens, list) and tokens else \
        gguf.tensor(names("token_embd")).ne[1]
