"""LoRA adapter files: llama.cpp's adapter GGUF read into a `LoraAdapter`, and written.

The format is what convert_lora_to_gguf.py writes and llama_adapter_lora_init reads:
general.type = "adapter", general.architecture = the base model's, adapter.type = "lora",
adapter.lora.alpha (f32; 0 when absent), and per adapted base weight `<base>.lora_a`
(ne [n_in, r]) and `<base>.lora_b` (ne [r, n_out]); for the token embedding a is stored
[r, n_vocab] and b [r, n_embd]. Tensors ending in `_norm.weight` (mergekit's norm vectors)
are ignored, as llama.cpp ignores them.

Loading goes through graphs/gguf (load_gguf), which bounds every length and offset by the
file; the adapter's tensors are leafs over the bytes read into memory (no mapping is kept),
in whatever type the file stores (F32, F16, BF16, Q8_0: the converter's --outtype).
llama.cpp's checks come with its wording and one line each: wrong general.type or
adapter.type, arch mismatch (naming both), a lone lora_a or lora_b, an unexpected suffix,
and, against a model, a base tensor missing or a shape that does not fit it.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from ggraph.ir.types import GGMLType

from ggraph.graphs.gguf.gguf_file import load_gguf
from ggraph.graphs.gguf.gguf_reader import GGUFError, ValueType
from ggraph.graphs.gguf.gguf_writer import GGUFWriter
from ggraph.graphs.models.lora import LoraAdapter, LoraWeight, is_embedding

KEY_TYPE = "general.type"
KEY_ADAPTER = "adapter.type"
KEY_ALPHA = "adapter.lora.alpha"
SUFFIX_A, SUFFIX_B = ".lora_a", ".lora_b"


def _str(meta: Mapping[str, Any], key: str) -> str:
    v = meta.get(key, "")
    return v if isinstance(v, str) else ""


def load_lora_adapter(path: str | os.PathLike, scale: float = 1.0, arch: str | None = None,
                      base: Mapping[str, Any] | None = None) -> LoraAdapter:
    """The adapter in `path` with user scale `scale`. With `arch`, its architecture must be
    that; with `base` ({name: Tensor} of the model's weights, e.g. GGUFModel.tensors), every
    pair is checked against its weight (LoraAdapter.check; Architecture.set_loras also does)."""
    path = os.fspath(path)
    f = load_gguf(path, mmap=False)
    meta = f.metadata
    gtype = _str(meta, KEY_TYPE)
    if gtype != "adapter":
        raise GGUFError(f"{path}: expect general.type to be 'adapter', but got: {gtype!r}")
    ad_arch = _str(meta, "general.architecture")
    if arch is not None and ad_arch != arch:
        raise GGUFError(f"{path}: model arch and LoRA arch mismatch (model {arch!r}, LoRA "
                        f"{ad_arch!r})")
    atype = _str(meta, KEY_ADAPTER)
    if atype != "lora":
        raise GGUFError(f"{path}: expect adapter.type to be 'lora', but got: {atype!r}")
    alpha = meta.get(KEY_ALPHA, 0.0)
    kt = f.kv_types.get(KEY_ALPHA)
    if kt is not None and kt.type != ValueType.FLOAT32:
        raise GGUFError(f"{path}: {KEY_ALPHA} must be a FLOAT32, got "
                        f"{f.kv_types.get(KEY_ALPHA)}")
    pairs: dict[str, dict[str, Any]] = {}
    for name, t in f.tensors.items():
        if name.endswith(SUFFIX_A) or name.endswith(SUFFIX_B):
            part = name[-1]
            pairs.setdefault(name[:-len(SUFFIX_A)], {})[part] = t
        elif name.endswith("_norm.weight"):
            continue   # llama.cpp does not apply norm vectors either
        else:
            raise GGUFError(f"{path}: LoRA tensor '{name}' has unexpected suffix")
    weights = {}
    for name, ab in pairs.items():
        if "a" not in ab or "b" not in ab:
            raise GGUFError(f"{path}: LoRA tensor pair for '{name}' is missing one component")
        for t in ab.values():
            if t.type in (GGMLType.I32, GGMLType.I64):
                raise GGUFError(f"{path}: LoRA tensor '{t.name}' has type {t.type}, not a "
                                f"float type")
        weights[name] = LoraWeight(ab["a"], ab["b"])
    adapter = LoraAdapter(ad_arch, weights, float(alpha), float(scale), path,
                          {k: v for k, v in meta.items() if not isinstance(v, list)})
    if base is not None:
        adapter.check(arch if arch is not None else ad_arch, base)
    return adapter


def parse_lora_flags(lora: Sequence[str] = (), lora_scaled: Sequence[str] = ()
                     ) -> list[tuple[str, float]]:
    """llama.cpp's --lora FNAME[,FNAME...] (scale 1) and --lora-scaled FNAME:SCALE[,...]
    (common/arg.cpp), as (path, scale) in the order given: --lora's first, then
    --lora-scaled's. A bad item is a ValueError in llama.cpp's words."""
    out: list[tuple[str, float]] = []
    for value in lora:
        out += [(item, 1.0) for item in value.split(",") if item]
    for value in lora_scaled:
        for item in value.split(","):
            parts = item.split(":")
            if len(parts) != 2:
                raise ValueError(f"--lora-scaled {value!r}: lora-scaled format: FNAME:SCALE")
            try:
                s = float(parts[1])
            except ValueError:
                raise ValueError(f"--lora-scaled {value!r}: scale {parts[1]!r} is not a "
                                 f"number (format: FNAME:SCALE)") from None
            out.append((parts[0], s))
    return out


def _values(name: str, arr: Any, ne: tuple[int, ...], what: str) -> np.ndarray:
    a = np.asarray(arr, dtype=np.float32)
    want = tuple(reversed(ne))
    if a.shape != want:
        raise ValueError(f"write_lora_adapter: {name}.{what} has shape {a.shape}, expected "
                         f"{want} (numpy order of ne={list(ne)})")
    return np.ascontiguousarray(a)


def write_lora_adapter(path: str | os.PathLike, model_arch: str, alpha: float,
                       tensors: Mapping[str, tuple[Any, Any]],
                       type: GGMLType | str = GGMLType.F32,
                       metadata: Mapping[str, str] | None = None) -> str:
    """Write an adapter GGUF llama.cpp loads. tensors: {base weight name: (a, b)} as numpy
    arrays in numpy order (ggml ne reversed), as PEFT stores them: for a matrix of ne
    [n_in, n_out], a is (r, n_in) and b is (n_out, r) (written as `.lora_a` ne [n_in, r] and
    `.lora_b` ne [r, n_out]); for the token embedding (ne [n_embd, n_vocab]) a is (n_vocab,
    r) and b is (n_embd, r), llama.cpp's flipped layout. type: F32 (the converter's default)
    or F16. metadata: more string keys (general.name ...)."""
    ty = GGMLType[type.upper()] if isinstance(type, str) else GGMLType(type)
    if ty not in (GGMLType.F32, GGMLType.F16):
        raise ValueError(f"write_lora_adapter: type {ty} (F32 or F16)")
    w = GGUFWriter(path, arch=model_arch)
    w.add_str(KEY_TYPE, "adapter")
    for k, v in (metadata or {}).items():
        w.add_str(k, v)
    w.add_str(KEY_ADAPTER, "lora")
    w.add_f32(KEY_ALPHA, float(alpha))
    for name, (a, b) in tensors.items():
        a_np, b_np = np.asarray(a), np.asarray(b)
        if a_np.ndim != 2 or b_np.ndim != 2:
            raise ValueError(f"write_lora_adapter: {name}: a and b must be 2-D, got "
                             f"{a_np.shape} and {b_np.shape}")
        if is_embedding(name):
            r = a_np.shape[1]
            a_ne, b_ne = (r, a_np.shape[0]), (r, b_np.shape[0])
        else:
            r = a_np.shape[0]
            a_ne, b_ne = (a_np.shape[1], r), (r, b_np.shape[0])
        for suffix, arr, ne in ((SUFFIX_A, a_np, a_ne), (SUFFIX_B, b_np, b_ne)):
            vals = _values(name, arr, ne, suffix[1:])
            if ty == GGMLType.F16:
                vals = vals.astype(np.float16)
            w.add_tensor(name + suffix, ne, ty, vals)
    return w.write()


def load_loras(loras: Sequence[tuple[str, float]], arch: str, devices: str = ""
               ) -> list[LoraAdapter]:
    """(path, scale) pairs (EngineConfig.loras, parse_lora_flags) loaded for a model of
    `arch` (Architecture.set_loras checks the pairs against its weights)."""
    from ggraph.backends.registry import parse_device

    refs = [parse_device(e) for e in devices.split(",") if e.strip()]
    if any(r is not None and r.remote for r in refs):
        raise ValueError("LoRA adapters run on local devices only (remote stages load the "
                         "model file alone)")
    return [load_lora_adapter(path, scale, arch) for path, scale in loras]


class WeightFiles:
    """The CPU backend's weight source (backends/cpu/packstore.py's WeightSource) when
    adapters are loaded: the model file's weights are read from the file, an adapter's from
    its own bytes (they are not a view of the model file, so its offsets do not apply)."""

    def __init__(self, file: Any) -> None:
        self.file = file

    def _owned(self, t: Any) -> bool:
        return self.file.tensors.get(t.name) is t

    def read_rows(self, t: Any, row0: int, out: np.ndarray) -> None:
        if self._owned(t):
            self.file.read_rows(t, row0, out)
            return
        rows = np.asarray(t.data).reshape(t.ne[1], -1)
        out[...] = rows[row0:row0 + out.shape[0]]

    def release(self, t: Any) -> None:
        if self._owned(t):
            self.file.release(t)
