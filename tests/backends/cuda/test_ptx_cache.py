"""The PTX gate's disk cache (backends/cuda/ptx_cache.py): entries found again only for the
same kernel key, signature, architecture and toolchain, errors never kept, and nothing kept
with GGRAPH_PTX_CACHE=0."""
from __future__ import annotations

import types

import pytest

from ggraph.backends.cuda import ptx as P, ptx_cache as C


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GGRAPH_CACHE", str(tmp_path))
    monkeypatch.delenv("GGRAPH_PTX_CACHE", raising=False)
    return tmp_path / "ptx"


def _kernel(key: str | None, name: str = "k_x__tag"):
    k = types.SimpleNamespace(py_func=types.SimpleNamespace(__qualname__=name))
    if key is not None:
        k.ggraph_key = key
    return k


def test_a_variants_ptx_comes_back_only_under_its_own_key(tmp_path):
    lib = tmp_path / "libdevice.10.bc"
    lib.write_bytes(b"bitcode")
    name = C.variant_name(_kernel("abc"), "(float32,)", (9, 0), str(lib))
    C.save_ptx(name, ".visible .entry k() { ret; }")
    assert C.load_ptx(name) == ".visible .entry k() { ret; }"
    others = [C.variant_name(_kernel("abd"), "(float32,)", (9, 0), str(lib)),
              C.variant_name(_kernel("abc"), "(float64,)", (9, 0), str(lib)),
              C.variant_name(_kernel("abc"), "(float32,)", (8, 0), str(lib))]
    other_lib = tmp_path / "libdevice.11.bc"
    other_lib.write_bytes(b"another libdevice")
    others.append(C.variant_name(_kernel("abc"), "(float32,)", (9, 0), str(other_lib)))
    assert len(set(others) | {name}) == 5 and all(C.load_ptx(n) is None for n in others)
    # a kernel not bound through Target.bind has no key over its sources: never cached
    assert C.variant_name(_kernel(None), "(float32,)", (9, 0), str(lib)) is None


def test_ptxas_figures_are_kept_errors_are_not(monkeypatch, cache):
    calls = []
    answer: list = [{"registers": 40, "shared": 0, "local": 0, "spill_stores": 0,
                     "spill_loads": 0}]
    monkeypatch.setattr(P, "assemble", lambda ptxas, ptx, cc: calls.append(ptx) or answer[0])
    monkeypatch.setattr(C, "ptxas_version", lambda ptxas: "Build cuda_13.0")
    assert P.assembled("ptxas", "A", (9, 0)) == answer[0]
    assert P.assembled("ptxas", "A", (9, 0)) == answer[0] and calls == ["A"]
    assert P.assembled("ptxas", "A", (8, 0)) == answer[0] and calls == ["A", "A"]
    monkeypatch.setattr(C, "ptxas_version", lambda ptxas: "Build cuda_13.1")
    P.assembled("ptxas", "A", (9, 0))
    assert len(calls) == 3
    answer[0] = "ptxas failed: bad"
    assert P.assembled("ptxas", "B", (9, 0)) == "ptxas failed: bad"
    assert P.assembled("ptxas", "B", (9, 0)) == "ptxas failed: bad" and calls[-2:] == ["B", "B"]


def test_a_damaged_entry_is_compiled_again(cache):
    name = C.variant_name(_kernel("abc"), "()", (9, 0), C.__file__)
    cache.mkdir(parents=True)
    (cache / name).write_bytes(b"not gzip")
    assert C.load_ptx(name) is None
    (cache / "f.json").write_text("{not json")
    assert C.load_figures("f.json") is None
    (cache / "g.json").write_text('{"registers": "many"}')
    assert C.load_figures("g.json") is None


def test_switched_off_nothing_is_kept(monkeypatch, cache):
    monkeypatch.setenv("GGRAPH_PTX_CACHE", "0")
    name = C.variant_name(_kernel("abc"), "()", (9, 0), C.__file__)
    C.save_ptx(name, "ptx")
    assert C.load_ptx(name) is None and not cache.exists()
