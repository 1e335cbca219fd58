"""The KV cache: per-layer K and V tensors of a runtime-chosen type, pre-allocated leafs that
set_rows writes (quantizing on write) and attention reads (dequantizing on read).

Without flash attention V is stored transposed ([kv_size, n_embd_v]: one row per channel) so
that V*softmax is a plain mul_mat; block types cannot hold one value per row, hence a
quantized V cache requires flash attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ggraph.tensor import Context, Tensor
from ggraph.type_records import kv_types
from ggraph.types import GGMLType, row_size, MIB

CACHE_TYPES = kv_types()  # -ctk/-ctv: the types whose record says kv=True


@dataclass
class KVCache:
    size: int
    n_layer: int
    type_k: GGMLType
    type_v: GGMLType
    v_trans: bool
    k: list[Tensor] = field(default_factory=list)
    v: list[Tensor] = field(default_factory=list)
    n_used: int = 0  # cells holding tokens (one sequence, positions 0..n_used-1)

    @classmethod
    def create(cls, ctx: Context, n_layer: int, n_embd_k: int, n_embd_v: int, size: int,
               type_k: GGMLType | str = "f16", type_v: GGMLType | str = "f16",
               flash_attn: bool = False) -> "KVCache":
        tk, tv = cache_type("K", type_k), cache_type("V", type_v)
        if tv.is_quantized and not flash_attn:
            raise ValueError(f"a quantized V cache ({tv}) needs flash attention (--fa): without "
                             f"it V is stored transposed, one value per row, which blocks of 32 "
                             f"values cannot hold")
        for role, t, n in (("K", tk, n_embd_k), ("V", tv, n_embd_v)):
            if n % t.block_size:
                raise ValueError(f"{role} rows of {n} values do not fit {t} blocks of "
                                 f"{t.block_size}")
        c = cls(size, n_layer, tk, tv, v_trans=not flash_attn)
        for il in range(n_layer):
            k = ctx.new_tensor(tk, (n_embd_k, size), name=f"cache_k_l{il}")
            v = ctx.new_tensor(tv, (size, n_embd_v) if c.v_trans else (n_embd_v, size),
                               name=f"cache_v_l{il}")
            k.buffer = v.buffer = "kv_cache"
            c.k.append(k)
            c.v.append(v)
        return c

    @property
    def bytes_k(self) -> int:
        return sum(t.nbytes for t in self.k)

    @property
    def bytes_v(self) -> int:
        return sum(t.nbytes for t in self.v)

    @property
    def nbytes(self) -> int:
        return self.bytes_k + self.bytes_v

    def summary(self) -> str:
        """llama.cpp's line: `llama_kv_cache: size = 90.00 MiB (4096 cells, 30 layers, 1/1
        seqs), K (f16): 45.00 MiB, V (f16): 45.00 MiB`."""
        return (f"llama_kv_cache: size = {self.nbytes / MIB:7.2f} MiB ({self.size:6d} cells, "
                f"{self.n_layer:3d} layers,  1/1 seqs), K ({self.type_k}): "
                f"{self.bytes_k / MIB:7.2f} MiB, V ({self.type_v}): {self.bytes_v / MIB:7.2f} MiB")


def cache_type(role: str, t: GGMLType | str) -> GGMLType:
    """The type of the `role` (K or V) cache; one not in CACHE_TYPES is an error."""
    parsed = GGMLType.parse(t)
    if parsed not in CACHE_TYPES:
        raise ValueError(f"{role} cache type {parsed} is not supported; use one of "
                         f"{', '.join(str(x) for x in CACHE_TYPES)}")
    return parsed


def kv_cache_bytes(n_layer: int, n_embd_k: int, n_embd_v: int, size: int, type_k: GGMLType,
                   type_v: GGMLType) -> int:
    """The formula: row_size(type, n_embd) * kv_size per layer, K plus V."""
    return n_layer * size * (row_size(type_k, n_embd_k) + row_size(type_v, n_embd_v))
