"""No hidden parallel regions in the CPU's parallel kernels.

Under numba's parallel=True, an array expression outside the prange loops (np.zeros, np.ones,
np.full, a slice assignment such as `a[:] = 0`) becomes a parallel loop of its own: one more
fork and join on every call. A decode step calls the packed products and the decode attention
~150 times, and `taken = np.zeros(...)` in k_mul_mat_packed and `mf = np.zeros(...)` in
k_flash_attn_decode cost Qwen2.5 1.5B 0.4-0.6 ms a token at 2 threads (paired A/B, AMD EPYC
Zen 4). Such arrays are made with np.empty and filled by plain loops instead; this check reads
every function of backends/cpu that has a prange loop and fails on those expressions outside
its prange bodies (inside a prange body they run serially in each thread, as wanted).
"""
from __future__ import annotations

import ast
from pathlib import Path

from paths import ROOT

FILLS = {"zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "arange"}


def _is_prange_loop(node: ast.AST) -> bool:
    return (isinstance(node, ast.For) and isinstance(node.iter, ast.Call)
            and isinstance(node.iter.func, ast.Name) and node.iter.func.id == "prange")


def _outside_prange(fn: ast.FunctionDef):
    """Every node of fn except those inside its prange loops."""
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        if _is_prange_loop(node):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _slices(target: ast.AST) -> bool:
    if not isinstance(target, ast.Subscript):
        return False
    parts = target.slice.elts if isinstance(target.slice, ast.Tuple) else [target.slice]
    return any(isinstance(p, ast.Slice) for p in parts)


def hidden_regions(source: str, name: str = "<source>") -> list[str]:
    """`name:line function: what` for each array expression outside the prange bodies of the
    functions in `source` that have a prange loop."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef) or not any(
                _is_prange_loop(n) for n in ast.walk(fn)):
            continue
        for node in _outside_prange(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "np"
                    and node.func.attr in FILLS):
                found.append(f"{name}:{node.lineno} {fn.name}: np.{node.func.attr}")
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AugAssign) else [])
            if any(_slices(t) for t in targets):
                found.append(f"{name}:{node.lineno} {fn.name}: slice assignment")
    return sorted(found)


def test_the_check_finds_what_it_looks_for():
    src = ("def k(a, n):\n"
           "    t = np.zeros(n)\n"
           "    a[:, 0] = 0.0\n"
           "    for i in prange(n):\n"
           "        row = np.zeros(4)\n"
           "        a[i, :] = row\n"
           "    return t\n"
           "def serial(a):\n"
           "    a[:] = np.zeros(3)\n")
    assert hidden_regions(src, "x.py") == ["x.py:2 k: np.zeros", "x.py:3 k: slice assignment"]


def test_parallel_kernels_have_no_array_expressions_outside_prange():
    found = []
    for path in sorted(Path(ROOT, "backends", "cpu").glob("*.py")):
        found += hidden_regions(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, ("array expressions outside prange bodies (each a parallel loop of "
                       "its own under parallel=True: np.empty and a plain loop instead):\n"
                       + "\n".join(found))
