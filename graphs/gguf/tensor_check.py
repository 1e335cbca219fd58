"""`--check-tensors`: scan a model's weights for inf and NaN before running it.

Weights come from untrusted files; a NaN in one scale silently turns every logit into NaN. Like
llama.cpp's --check-tensors, this reads float weights and the f16 scales of quantized blocks
(ggraph.codecs.quants.first_nonfinite) and names the first bad tensor, row and element or block.
A file is scanned once per process (keyed by path, size and modification time).
"""
from __future__ import annotations

import os

from ggraph.codecs.quants import first_nonfinite

from ggraph.graphs.gguf.gguf_file import GGUFError, GGUFModel

_checked: set[tuple[str, int, int]] = set()


def check_tensors(model: GGUFModel) -> None:
    """GGUFError naming the first weight holding inf/NaN; nothing when all are finite."""
    try:
        st = os.stat(model.path)
        key = (os.path.realpath(model.path), st.st_size, st.st_mtime_ns)
    except OSError:
        key = None
    if key is not None and key in _checked:
        return
    for name, t in model.tensors.items():
        if t.data is None:
            continue
        i = first_nonfinite(t.type, t.data)
        if i < 0:
            continue
        per_row = t.ne[0] // t.type.block_size
        unit = "block" if t.type.is_quantized else "element"
        raise GGUFError(f"{model.path}: tensor {name!r} ({t.type}, ne={list(t.ne)}) holds inf "
                        f"or NaN in row {i // per_row}, {unit} {i % per_row} (found by "
                        f"--check-tensors)")
    if key is not None:
        _checked.add(key)
