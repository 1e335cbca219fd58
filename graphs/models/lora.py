"""LoRA adapters in a model's graph, as llama.cpp applies them (forward only).

Owns `LoraWeight` (one base weight's pair a, b), `LoraAdapter` (the pairs of one adapter by
base weight name, its alpha and its user scale), the check of an adapter against a model's
weights, and the three products every builder routes its weights through:

- `lora_mm(w, x, loras)`: mul_mat(w, x) + s * mul_mat(b, mul_mat(a, x)) for each adapter
  that has w (llama.cpp's build_lora_mm);
- `lora_mm_id(w, x, ids, loras)`: the same with mul_mat_id for expert weights
  (build_lora_mm_id);
- `lora_get_rows(w, ids, loras)`: the token embedding's rows + s * mul_mat(b, get_rows(a,
  ids)) (build_inp_embd: token_embd's a is stored [r, n_vocab], b [r, n_embd]).

s = user * alpha / rank where alpha is set, else user (rank = b.ne[0]); an adapter of scale 0
is skipped. With no adapter (or none for w) each helper records exactly the one node it
replaces, with the same name, so a model's graph is unchanged. With adapters the result node
takes the name and the base product is named `<name>-base`.

Where ggraph differs from llama.cpp: a model whose output is tied to token_embd gets the
embedding's pair on its input rows only (llama.cpp would multiply by the flipped pair and
fail an assert); DeepSeek2's attn_q_a/q_b/kv_a_mqa and output take adapters here (llama.cpp
multiplies them with plain ggml_mul_mat); MLA's per-head attn_k_b/attn_v_b/attn_kv_b
products (graphs/models/mla.py) take none, as in llama.cpp.

An adapter's tensors are ordinary ggraph Tensors: leafs with data when loaded from a file
(graphs/models/lora_gguf.py), or a trainer's own parameter leafs (F32 [n_in, r] and [r, n_out]
per weight, see `LoraAdapter.new`). A builder reads its adapters from `Architecture.loras`
(graphs/models/arch.py; `set_loras` checks them against the model's weights).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from ggraph import ops as O
from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import GGMLType

from ggraph.graphs.gguf.gguf_reader import GGUFError

EMBD_SUFFIX = "token_embd.weight"   # llama.cpp's rule: a and b are flipped for embeddings


def is_embedding(name: str) -> bool:
    """Whether base weight `name` is a token embedding (its pair applies through get_rows)."""
    return name.endswith(EMBD_SUFFIX)


@dataclass(frozen=True)
class LoraWeight:
    """One base weight's pair. Matrices: a [n_in, r], b [r, n_out] (ggml ne), so
    b·(a·x) has w·x's shape. Token embedding: a [r, n_vocab], b [r, n_embd]."""
    a: Tensor
    b: Tensor

    @property
    def rank(self) -> int:
        return self.b.ne[0]


@dataclass
class LoraAdapter:
    """One adapter: pairs by base weight name (`blk.0.attn_q.weight`), alpha (0: none) and
    the user scale (llama.cpp's --lora-scaled; 1 for --lora)."""
    arch: str
    weights: dict[str, LoraWeight]
    alpha: float = 0.0
    scale: float = 1.0
    path: str = ""
    metadata: dict = field(default_factory=dict, repr=False)

    def effective_scale(self, lw: LoraWeight) -> float:
        """llama_adapter_lora_weight::get_scale: user * alpha / rank, or user without alpha."""
        return self.scale * self.alpha / lw.rank if self.alpha else self.scale

    @property
    def label(self) -> str:
        return self.path or f"LoRA adapter ({self.arch})"

    @classmethod
    def new(cls, ctx: Context, arch: str, shapes: Mapping[str, tuple[int, ...]], rank: int,
            alpha: float = 0.0, scale: float = 1.0, params: bool = True) -> LoraAdapter:
        """A fresh adapter of F32 leafs (no data) for the base weights `shapes` ({name: base
        ne}, e.g. {w.name: w.ne for w in ...}): rank-`rank` pairs named `<base>.lora_a` /
        `.lora_b` in the file's layout; with `params` marked as trainable parameters. The
        caller (a trainer) sets their values."""
        weights = {}
        for name, ne in shapes.items():
            if is_embedding(name):
                a_ne, b_ne = (rank, ne[1]), (rank, ne[0])
            else:
                a_ne, b_ne = (ne[0], rank), (rank, ne[1])
            a = ctx.new_tensor(GGMLType.F32, a_ne, f"{name}.lora_a")
            b = ctx.new_tensor(GGMLType.F32, b_ne, f"{name}.lora_b")
            if params:
                a.set_param()
                b.set_param()
            weights[name] = LoraWeight(a, b)
        return cls(arch, weights, alpha, scale)

    def check(self, arch: str, base: Mapping[str, Tensor]) -> None:
        """llama.cpp's checks against the model (arch, and each pair against its base weight
        in `base`, by name): a GGUFError naming the adapter and the tensor."""
        where = self.label
        if self.arch != arch:
            raise GGUFError(f"{where}: model arch and LoRA arch mismatch (model {arch!r}, "
                            f"LoRA {self.arch!r})")
        for name, lw in self.weights.items():
            w = base.get(name)
            if w is None:
                raise GGUFError(f"{where}: LoRA tensor '{name}' does not exist in base model "
                                f"(hint: maybe wrong base model?)")
            check_pair(where, name, w.ne, lw)


def check_pair(where: str, name: str, base_ne: Sequence[int], lw: LoraWeight) -> None:
    """The shape rule of llama_adapter_lora_init_impl for one pair against its base weight's
    ne (plus what ggraph's mul_mat needs: matching ranks and expert counts)."""
    a, b, base_ne = _ne4(lw.a.ne), _ne4(lw.b.ne), _ne4(base_ne)
    wrong = f"{where}: tensor '{name}' has incorrect shape (hint: maybe wrong base model?): " \
            f"base ne={list(base_ne)}, lora_a ne={list(a)}, lora_b ne={list(b)}"
    if is_embedding(name):
        if base_ne[0] != b[1] or base_ne[1] != a[1] or a[0] != b[0] or a[2:] != (1, 1) \
                or b[2:] != (1, 1):
            raise GGUFError(wrong)
        return
    if base_ne[0] != a[0] or base_ne[1] != b[1]:
        raise GGUFError(wrong)
    if a[1] != b[0]:
        raise GGUFError(f"{where}: tensor '{name}': lora_a tensor is not transposed (hint: "
                        f"adapter from \"finetune\" example is no longer supported): lora_a "
                        f"ne={list(a)}, lora_b ne={list(b)}")
    if a[2:] != base_ne[2:] or b[2:] != base_ne[2:]:
        raise GGUFError(wrong)


def _ne4(ne: Sequence[int]) -> tuple[int, ...]:
    return tuple(ne) + (1,) * (4 - len(ne))


def _applied(w: Tensor, loras: Iterable[LoraAdapter], embedding: bool
             ) -> list[tuple[LoraWeight, float]]:
    """The pairs of w (by name) with their scale, adapters of scale 0 left out. Matrix
    products skip embedding pairs (a model whose output is tied to token_embd multiplies by
    the embedding: llama.cpp would fail there, ggraph adapts the input rows only)."""
    out: list[tuple[LoraWeight, float]] = []
    for ad in loras:
        lw = ad.weights.get(w.name)
        if lw is None or ad.scale == 0.0 or is_embedding(w.name) != embedding:
            continue
        out.append((lw, ad.effective_scale(lw)))
    return out


def _product(pairs: list[tuple[LoraWeight, float]], name: str,
             base: Callable[[str], Tensor], delta: Callable[[LoraWeight], Tensor]) -> Tensor:
    """base(name) alone without pairs (the node it replaces, unchanged); else base named
    `<name>-base` plus each pair's delta scaled, the last add named `name`."""
    if not pairs:
        return base(name)
    res = base(f"{name}-base" if name else "")
    for i, (lw, s) in enumerate(pairs):
        res = O.add(res, O.scale(delta(lw), s),
                    name=name if i == len(pairs) - 1 else f"{name}-lora{i}")
    return res


def lora_mm(w: Tensor, x: Tensor, loras: Sequence[LoraAdapter] = (), name: str = "") -> Tensor:
    """w·x plus each adapter's s·b·(a·x) (build_lora_mm)."""
    return _product(_applied(w, loras, False), name, lambda n: O.mul_mat(w, x, name=n),
                    lambda lw: O.mul_mat(lw.b, O.mul_mat(lw.a, x)))


def lora_mm_id(w: Tensor, x: Tensor, ids: Tensor, loras: Sequence[LoraAdapter] = (),
               name: str = "") -> Tensor:
    """mul_mat_id(w, x, ids) plus each adapter's s·mul_mat_id(b, mul_mat_id(a, x, ids), ids)
    (build_lora_mm_id: a [n_in, r, n_expert], b [r, n_out, n_expert])."""
    return _product(_applied(w, loras, False), name,
                    lambda n: O.mul_mat_id(w, x, ids, name=n),
                    lambda lw: O.mul_mat_id(lw.b, O.mul_mat_id(lw.a, x, ids), ids))


def lora_get_rows(w: Tensor, ids: Tensor, loras: Sequence[LoraAdapter] = (),
                  name: str = "") -> Tensor:
    """The token embedding's rows plus each adapter's s·b·get_rows(a, ids) (build_inp_embd;
    b is used as stored, a's columns are the tokens)."""
    return _product(_applied(w, loras, True), name, lambda n: O.get_rows(w, ids, name=n),
                    lambda lw: O.mul_mat(lw.b, O.get_rows(lw.a, ids)))


def check_loras(adapters: Sequence[LoraAdapter], arch: str, base: Mapping[str, Tensor]
                ) -> tuple[LoraAdapter, ...]:
    """Every adapter checked against the model (LoraAdapter.check), as a tuple."""
    for ad in adapters:
        if not isinstance(ad, LoraAdapter):
            raise TypeError(f"expected LoraAdapter, got {type(ad).__name__}")
        ad.check(arch, base)
    return tuple(adapters)
