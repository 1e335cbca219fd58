"""Hyperparameters read from GGUF keys through one table: each dataclass field names its key
(`{arch}` is the architecture prefix), whether it is required, and its default."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from .gguf_file import GGUFError

H = TypeVar("H")


def key(name: str, default: Any = MISSING) -> Any:
    """A dataclass field read from GGUF key `name` (required when there is no default)."""
    return field(default=default, metadata={"gguf": name})


def read_hparams(cls: type[H], metadata: dict[str, Any], arch: str, path: str = "",
                 **overrides: Any) -> H:
    """Fill `cls` from metadata; a missing required key is an error naming key and file."""
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        k = f.metadata.get("gguf")
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        if k is None:
            continue
        full = k.format(arch=arch)
        v = metadata.get(full)
        if v is None:
            if f.default is MISSING:
                raise GGUFError(f"{path or 'model'}: required key {full!r} is missing")
            continue
        if isinstance(v, list) and f.type in ("int", "float"):
            v = v[0]
        values[f.name] = v
    return cls(**values)


@dataclass(frozen=True)
class LlamaHParams:
    n_layer: int = key("{arch}.block_count")
    n_embd: int = key("{arch}.embedding_length")
    n_ctx_train: int = key("{arch}.context_length")
    n_ff: int = key("{arch}.feed_forward_length")
    n_head: int = key("{arch}.attention.head_count")
    n_head_kv: int = key("{arch}.attention.head_count_kv", 0)
    n_rot: int = key("{arch}.rope.dimension_count", 0)
    rope_freq_base: float = key("{arch}.rope.freq_base", 10000.0)
    rope_scaling_factor: float = key("{arch}.rope.scaling.factor", 0.0)
    rms_eps: float = key("{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    n_vocab: int = key("{arch}.vocab_size", 0)

    def __post_init__(self) -> None:
        if self.n_head_kv == 0:
            object.__setattr__(self, "n_head_kv", self.n_head)
        if self.n_rot == 0:
            object.__setattr__(self, "n_rot", self.n_embd // self.n_head)
        if self.n_head % self.n_head_kv:
            raise GGUFError(f"head_count {self.n_head} is not a multiple of head_count_kv "
                            f"{self.n_head_kv}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_gqa(self) -> int:
        return self.head_dim * self.n_head_kv

    @property
    def freq_scale(self) -> float:
        return 1.0 / self.rope_scaling_factor if self.rope_scaling_factor else 1.0
