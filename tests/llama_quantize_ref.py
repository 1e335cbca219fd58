"""llama.cpp's quantizer as the reference for `ggraph quantize`: `llama_model_quantize` (the code
behind llama-quantize, src/llama-quant.cpp) through llama-cpp-python's bindings, set up as
tools/quantize/quantize.cpp sets it up — the importance matrix as `llama_model_imatrix_data`
and its four quantize.imatrix.* keys as kv overrides, in that program's order.

`llama_quantize(...)` returns None when it wrote the file, or why it could not run.
"""
from __future__ import annotations

import ctypes
import os
from typing import Sequence

import numpy as np

try:
    import llama_cpp
except ImportError as e:  # pragma: no cover - the test extra installs it
    llama_cpp = None
    WHY = f"llama-cpp-python is not installed ({e})"
else:
    WHY = ""

_INT, _STR = 0, 3   # LLAMA_KV_OVERRIDE_TYPE_INT, _STR


def _type_id(name: str | None) -> int:
    from gguf.constants import GGMLQuantizationType

    if name is None:   # GGML_TYPE_COUNT: "not set", as the default parameters say
        return llama_cpp.llama_model_quantize_default_params().output_tensor_type
    return int(GGMLQuantizationType[name])


def _override(key: str, value: int | str) -> "llama_cpp.llama_model_kv_override":
    o = llama_cpp.llama_model_kv_override()
    o.key = key.encode()
    if isinstance(value, str):
        o.tag = _STR
        o.value.val_str = value.encode()[:127]
    else:
        o.tag = _INT
        o.value.val_i64 = value
    return o


def llama_quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype_id: int,
                   imatrix: object | None = None, *, output_tensor_type: str | None = None,
                   token_embedding_type: str | None = None,
                   tensor_types: Sequence[tuple[str, str]] = (), pure: bool = False,
                   leave_output_tensor: bool = False, allow_requantize: bool = False,
                   threads: int = 2) -> str | None:
    """Quantize with libllama; `imatrix` is a graphs.quantize.quantize.Imatrix (its values as
    llama-quantize's load_imatrix leaves them)."""
    if llama_cpp is None:
        return WHY
    p = llama_cpp.llama_model_quantize_default_params()
    p.nthread = threads
    p.ftype = ftype_id
    p.output_tensor_type = _type_id(output_tensor_type)
    p.token_embedding_type = _type_id(token_embedding_type)
    p.allow_requantize = allow_requantize
    p.quantize_output_tensor = not leave_output_tensor
    p.pure = pure
    keep: list[object] = []          # what the pointers in p point into
    if imatrix is not None and imatrix.values:
        names = list(imatrix.values)
        arr = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()
        for i, n in enumerate(names):
            v = np.ascontiguousarray(imatrix.values[n], dtype=np.float32)
            keep.append(v)
            arr[i].name = n.encode()
            arr[i].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = v.size
        p.imatrix = arr
        keep.append(arr)
        kvs = [("quantize.imatrix.file", imatrix.file)]
        if imatrix.datasets:
            kvs.append(("quantize.imatrix.dataset", imatrix.datasets[0]))
        kvs.append(("quantize.imatrix.entries_count", len(names)))
        if imatrix.chunk_count > 0:
            kvs.append(("quantize.imatrix.chunks_count", imatrix.chunk_count))
        ov = (llama_cpp.llama_model_kv_override * (len(kvs) + 1))()
        for i, (k, v) in enumerate(kvs):
            ov[i] = _override(k, v)
        p.kv_overrides = ov
        keep.append(ov)
    if tensor_types:
        tt = (llama_cpp.llama_model_tensor_override * (len(tensor_types) + 1))()
        for i, (pattern, t) in enumerate(tensor_types):
            tt[i].pattern = pattern.encode()
            tt[i].type = _type_id(t)
        tt[len(tensor_types)].type = _type_id(None)
        p.tt_overrides = tt
        keep.append(tt)
    rc = llama_cpp.llama_model_quantize(os.fspath(src).encode(), os.fspath(dst).encode(),
                                        ctypes.byref(p))
    return None if rc == 0 else f"llama_model_quantize returned {rc}"


def first_difference(a: str | os.PathLike, b: str | os.PathLike) -> str | None:
    """None when the files are the same bytes, else where they first differ: the header, or
    a tensor's name and the byte within it."""
    from ggraph.graphs.gguf.gguf_reader import read_header

    x, y = open(a, "rb").read(), open(b, "rb").read()
    if x == y:
        return None
    n = min(len(x), len(y))
    i = next((k for k in range(0, n, 4096) if x[k:k + 4096] != y[k:k + 4096]), n)
    i = next((k for k in range(i, min(n, i + 4096)) if x[k] != y[k]), n)
    h = read_header(b)
    for t in h.tensors:
        start = h.data_offset + t.offset
        if start <= i < start + t.nbytes:
            return f"byte {i}: tensor {t.name!r} byte {i - start} (sizes {len(x)}, {len(y)})"
    return f"byte {i}: the header (data starts at {h.data_offset}; sizes {len(x)}, {len(y)})"
