"""`ggraph run --dump-tensors REGEX`: each node whose name the pattern finds, printed as it is
computed, in llama.cpp's llama-eval-callback format (common/debug.cpp,
common_debug_cb_eval and common_debug_print_tensor):

    ggml_debug: NAME = (TYPE) OP(SRC0{ne0, ne1, ne2, ne3}, SRC1{...}}) = {ne0, ne1, ne2, ne3}
        [
            [
                [     -0.0065,       0.0086,      -0.0000,    ..., (the last 3)  ],
            ],
        ]
        sum = 1.850136

(NAME right-aligned to 24 characters, OP to 10; per ne3 slice, ne2 blocks of ne1 rows): the
first and last 3 values of each dimension and the sum of all of them. The header line is
llama.cpp's byte for byte, the '}' after the second source included (its format string has
it), so that the two dumps diff line by line; the sum is taken in float64 where llama.cpp adds
float32 values one by one, so its last digits may differ on large tensors. Quantized nodes get
the header only, as there.

The values come from an Observer (backends/observe.py) that the Engine hands to each graph it
runs (the prompt's, then each generated token's): a node is asked for only when its name
matches.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from ggraph.backends.observe import Observer
from ggraph.ir.tensor import Tensor

INDENT = "    "
N_SHOWN = 3   # values shown at each end of a dimension (llama.cpp's n)


@dataclass
class TensorDump:
    """--dump-tensors' observer: asks for the nodes whose name `rx` finds (re.search) and
    prints each to `out` (stdout when None, where llama.cpp prints them too). The first dump
    of each run starts on a line of its own: the generated text before it has none."""
    rx: re.Pattern[str]
    out: TextIO | None = None
    new_run: bool = True      # ask was consulted since the last dump: a new graph runs

    @classmethod
    def of(cls, pattern: str, out: TextIO | None = None) -> "TensorDump":
        """A pattern that does not compile is a one-line ValueError."""
        try:
            return cls(re.compile(pattern), out)
        except re.error as e:
            raise ValueError(f"--dump-tensors {pattern!r} is not a regular expression: "
                             f"{e}") from None

    @property
    def observer(self) -> Observer:
        return Observer(self.ask, self.receive)

    def ask(self, node: Tensor) -> bool:
        self.new_run = True
        return self.rx.search(node.name or "") is not None

    def receive(self, node: Tensor, value: np.ndarray) -> None:
        stream = self.out if self.out is not None else sys.stdout
        lead, self.new_run = ("\n" if self.new_run else ""), False
        stream.write(lead + "\n".join(dump_lines(node, value)) + "\n")
        stream.flush()


def _ne(t: Tensor) -> str:
    return ", ".join(str(n) for n in t.ne)


def header(node: Tensor) -> str:
    """llama.cpp's line for a node: name, type, op, sources with their shapes, shape."""
    s0, s1 = node.src[0] if node.src else None, node.src[1] if len(node.src) > 1 else None
    src0 = f"{s0.name}{{{_ne(s0)}}}" if s0 is not None else ""
    src1 = f"{s1.name}{{{_ne(s1)}}}" if s1 is not None else ""
    op = str(node.op).upper() if node.op is not None else "NONE"
    return (f"ggml_debug: {node.name:>24} = ({node.type}) {op:>10}({src0}, {src1}}}) = "
            f"{{{_ne(node)}}}")


def value_lines(value: np.ndarray) -> list[str]:
    """The values block: per ne3 slice, the leading and trailing N_SHOWN entries of each
    dimension ("..." between) and the sum of every value (llama.cpp prints it per slice)."""
    ne3, ne2, ne1, ne0 = value.shape
    total = float(np.sum(value, dtype=np.float64))
    lines: list[str] = []
    for i3 in range(ne3):
        lines.append(INDENT + "[")
        for i2 in _indices(ne2):
            if i2 is None:
                lines.append(INDENT * 2 + "..., ")
                continue
            lines.append(INDENT * 2 + "[")
            for i1 in _indices(ne1):
                if i1 is None:
                    lines.append(INDENT * 3 + "..., ")
                    continue
                row = value[i3, i2, i1]
                cells = []
                for i0 in _indices(ne0):
                    cells.append("   ..., " if i0 is None else
                                 f"{float(row[i0]):12.4f}" + (", " if i0 < ne0 - 1 else ""))
                lines.append(INDENT * 3 + "[" + "".join(cells) + "  ],")
            lines.append(INDENT * 2 + "],")
        lines.append(INDENT + "]")
        lines.append(INDENT + f"sum = {total:f}")
    return lines


def _indices(n: int) -> list[int | None]:
    """0..n-1, or the first and last N_SHOWN with None between when n > 2 * N_SHOWN."""
    if n > 2 * N_SHOWN:
        return [*range(N_SHOWN), None, *range(n - N_SHOWN, n)]
    return list(range(n))


def dump_lines(node: Tensor, value: np.ndarray) -> list[str]:
    """What --dump-tensors prints for one node: its header, then its values unless its type
    is quantized."""
    lines = [header(node)]
    if not node.type.is_quantized:
        lines += value_lines(np.asarray(value).reshape(node.shape))
    return lines
