"""Compiled-kernel cache keys are derived from what a kernel is compiled from (backends/jit.py:
Target.key_of), never written by hand: the same inputs give the same key in every process,
and changing any source a template reads, any bound value or the compiler's options gives a
new key (numba's disk cache would otherwise hand back stale machine code)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import numba
import numpy as np
import pytest

from ggraph.backends import jit
from ggraph.backends.cpu.kernels import TARGET
from ggraph.backends.shared.bound import bound
from paths import ROOT
from source_files import py_files


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _modules(tmp_path, helper_body="return x + 1"):
    (tmp_path / "helper_mod.py").write_text(f"def helper(x):\n    {helper_body}\n")
    (tmp_path / "tmpl_mod.py").write_text(
        "from helper_mod import helper\n\n\ndef template(x):\n    return helper(x) * K\n")
    sys.path.insert(0, str(tmp_path))
    try:
        sys.modules.pop("helper_mod", None)
        return _load(tmp_path / "tmpl_mod.py", "tmpl_mod")
    finally:
        sys.path.remove(str(tmp_path))


def test_keys_follow_sources_values_and_options(tmp_path):
    serial = jit.Compiler(numba.njit, cache=True, fastmath={"contract", "nsz"})
    m = _modules(tmp_path)
    base = TARGET.key_of(m.template, serial, {"K": 3})
    assert base == TARGET.key_of(m.template, serial, {"K": 3})
    # the same options written in another order: the same key
    same = jit.Compiler(numba.njit, fastmath={"nsz", "contract"}, cache=True)
    assert TARGET.key_of(m.template, same, {"K": 3}) == base
    assert TARGET.key_of(m.template, serial, {"K": 4}) != base            # a bound value
    assert TARGET.key_of(m.template, serial, {"K": np.arange(3)}) != \
        TARGET.key_of(m.template, serial, {"K": np.arange(4)})               # an array's bytes
    parallel = jit.Compiler(numba.njit, cache=True, parallel=True)
    assert TARGET.key_of(m.template, parallel, {"K": 3}) != base          # the options
    assert TARGET.key_of(m.template, serial, {"K": 3}, tag="avx2") != base  # the tag
    # the file of a function the template calls (not bound: read from its module) changes
    jit._FILE_HASHES.clear()
    m2 = _modules(tmp_path, "return x + 2")
    jit._FILE_HASHES.clear()
    assert TARGET.key_of(m2.template, serial, {"K": 3}) != base


def _twice(x):
    return 2 * x


inner = bound("inner")


def _outer(x):
    return inner(x) + 1


def test_a_binding_carries_its_key_into_bindings_of_it():
    inner = TARGET.bind(_twice, TARGET.device)
    assert isinstance(inner.ggraph_key, str) and len(inner.ggraph_key) == 12
    assert jit.value_key(inner) == inner.ggraph_key
    outer = TARGET.bind(_outer, TARGET.device, inner=inner)
    other = TARGET.bind(_outer, TARGET.device, inner=TARGET.bind(_twice, TARGET.device, "v2"))
    assert outer.ggraph_key != other.ggraph_key   # the inner binding's key flows into it
    assert outer(3) == 7


def test_code_without_a_file_is_keyed_by_its_code():
    """A template run from a string (the docs' examples) has no file: its code is the key."""
    ns: dict = {}
    exec(compile("def t(x):\n    return x * K\n", "<doc block>", "exec"), ns)
    ns2: dict = {}
    exec(compile("def t(x):\n    return x + K\n", "<doc block>", "exec"), ns2)
    serial = jit.Compiler(numba.njit)
    assert TARGET.key_of(ns["t"], serial, {"K": 2}) != TARGET.key_of(ns2["t"], serial, {"K": 2})


def test_keys_are_the_same_in_another_process():
    code = ("from ggraph.backends.cpu import kernels as k\n"
            "from ggraph.ir.types import GGMLType as T\n"
            "print(k.TARGET.key_of(k.K.k_copy_int, k._SERIAL, {}),"
            " k.packed_kernel(True, T.Q4_K, T.F32).ggraph_key)")
    a = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    b = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert a.returncode == 0, a.stderr[-2000:]
    assert a.stdout == b.stdout and len(a.stdout.split()) == 2


def test_a_rebinding_finds_the_binding_and_equal_constants_of_other_types_do_not():
    """bind() remembers the keys of values it has seen: the same template and values give the
    same kernel, and 1, True and 1.0 (equal in Python) stay three bindings."""
    a = TARGET.bind(_outer, TARGET.device, inner=TARGET.bind(_twice, TARGET.device), K=1)
    assert TARGET.bind(_outer, TARGET.device, inner=TARGET.bind(_twice, TARGET.device),
                       K=1) is a
    keys = {TARGET.bind(_outer, TARGET.device, inner=_twice, K=v).ggraph_key
            for v in (1, True, 1.0)}
    assert len(keys) == 3


# -- names bound per binding (backends/shared/bound.py) -------------------------------------

N = bound("N")


def _plus_n(x):
    return x + N


def test_a_name_bound_per_binding_is_declared_and_named_when_missing():
    """A template reads N, declared as bound: bound, it compiles with the value; left unbound,
    numba's error names it; called as plain Python, the stand-in says what it is."""
    serial = jit.Compiler(numba.njit, cache=False)
    assert TARGET.bind(_plus_n, serial, N=3)(4) == 7
    with pytest.raises(numba.core.errors.TypingError, match="'N'"):
        TARGET.bind(_plus_n, serial)(4)
    with pytest.raises(TypeError, match="N is bound per binding"):
        N()


def test_template_modules_declare_their_bound_names():
    """No `# noqa: F821` in the library: every name a template reads without defining it is
    declared with bound() in its module."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in py_files()
            for i, line in enumerate(p.read_text().splitlines(), 1) if "noqa: F821" in line]
    assert hits == []
