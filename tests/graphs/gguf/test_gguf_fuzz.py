"""The GGUF fuzzers in CI: byte mutants and structured mutants at several settings (a few
hundred of each with fixed seeds; scripts/fuzz_gguf.py runs thousands), the rules that name
an outcome, and a hypothesis test of the header parser."""
from __future__ import annotations

import math
import struct
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ggraph.graphs.testing.fuzz_cases import MAX_MESSAGE, SETTINGS, clean_message, run_cli
from ggraph.graphs.testing.fuzz_structured import StructuredFuzz, plan_mutant, structured_bases
from ggraph.graphs.testing.gguf_fuzz import BAD_OUTCOMES, KINDS, fuzz, fuzz_bases, mutants
from ggraph.graphs.testing.gguf_mutate import MUTATORS
from ggraph.graphs.gguf.gguf_reader import GGUFError, ValueType as VT, read_header


def _check(report) -> None:
    print("\n" + report.table())
    bad = report.bad()
    assert not bad, "\n".join(f"{b.mutant.kind} {b.mutant.what}: {b.outcome}: {b.detail}"
                              for b in bad[:5])
    outcomes = {r.outcome for r in report.results}
    assert "clean error" in outcomes  # the fuzzer did reach the checks


def test_fuzz_tiny_models(tmp_path):
    for i, (name, path, _) in enumerate(fuzz_bases(tmp_path)):
        _check(fuzz(path, 200, seed=100 + i, timeout=60))


def test_fuzz_smollm2_header():
    from ggraph.graphs.gguf.fetch import default_model

    _check(fuzz(default_model(), 30, seed=7, timeout=60,
                kinds=("bitflip", "edge", "typeid", "truncate")))


def test_mutants_are_reproducible(tmp_path):
    path = fuzz_bases(tmp_path)[0][1]
    base = open(path, "rb").read()
    a = [m.data for m in mutants(base, 20, seed=3)]
    b = [m.data for m in mutants(base, 20, seed=3)]
    assert a == b and len({m.kind for m in mutants(base, 50, seed=3)}) == len(KINDS)
    assert all(o in ("traceback", "signal", "timeout") for o in BAD_OUTCOMES)


# -- structured mutants at several settings ------------------------------------------------------

@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return structured_bases(tmp_path_factory.mktemp("bases"))


def test_structured_fuzz(bases):
    """20 mutants, two of every kind (taken in turn), at 3 settings each (some through
    `ggraph run`), over two worker processes: no traceback, signal or timeout. (Thousands of
    cases, the kinds drawn by weight: scripts/fuzz_gguf.py.)"""
    fz = StructuredFuzz(bases, seed=27, per_mutant=3, timeout=60, cli_share=0.1,
                        repro="python scripts/fuzz_gguf.py --no-smollm2 --kinds-in-turn "
                              "--cli-share 0.1", in_turn=True)
    report = fz.run(60, jobs=2)
    print("\n" + report.table() + "\n" + report.table(lambda r: r.setting, "setting") +
          "".join("\nretried: " + r for r in fz.retried))
    bad = report.bad()
    assert not bad, "\n".join(f"{b.mutant.kind} {b.mutant.what} [{b.base}, {b.setting}, "
                              f"{b.via}]: {b.outcome}: {b.detail}\n  {b.repro}" for b in bad[:5])
    cases = [r for r in report.results if r.mutant.kind != "none"]
    assert len(cases) == 60
    assert sorted(r.mutant.kind for r in cases) == sorted(k for k in MUTATORS for _ in range(6))
    assert {r.setting for r in cases} == {s.name for s in SETTINGS}
    assert {r.base for r in cases} == {b.name for b, _ in bases}
    assert {"api", "cli"} <= {r.via for r in cases}
    assert {"clean error", "same output", "different output"} <= {r.outcome for r in cases}


def test_structured_mutants_are_reproducible(bases):
    for i in range(40):
        a, b = plan_mutant(bases, 5, i), plan_mutant(bases, 5, i)
        assert (a.base.name, a.mutation.kind, a.mutation.what, a.mutation.data,
                a.mutation.run, a.settings, a.cli) == \
            (b.base.name, b.mutation.kind, b.mutation.what, b.mutation.data, b.mutation.run,
             b.settings, b.cli)
    assert len({plan_mutant(bases, 5, i).mutation.kind for i in range(200)}) == len(MUTATORS)
    in_turn = [plan_mutant(bases, 5, i, in_turn=True).mutation.kind for i in range(20)]
    assert in_turn == list(MUTATORS) * 2


def test_clean_error_rules(tmp_path):
    from ggraph import ops
    from ggraph.graphs.gguf.gguf_file import load_gguf
    from ggraph.ir.tensor import Context

    with pytest.raises(GGUFError) as e:
        load_gguf(tmp_path / "none.gguf")
    assert clean_message(e.value) == f"{tmp_path / 'none.gguf'}: no such file"
    ctx = Context()
    with pytest.raises(ValueError) as e:   # a graph the builder should not have made
        ops.mul_mat(ctx.new_tensor("f32", (4, 2)), ctx.new_tensor("f32", (3, 2)))
    assert clean_message(e.value) is None
    with pytest.raises(ValueError) as e:
        np.zeros(3).reshape(2, 2)          # numpy's, not ggraph's
    assert clean_message(e.value) is None
    for exc in (KeyError("x"), RuntimeError("x"), MemoryError()):
        assert clean_message(exc) is None


@pytest.mark.parametrize("code, kind", [
    ("import sys; print('x'); print('ggraph run: error: bad', file=sys.stderr); sys.exit(1)",
     "error"),
    ("print('text')", "ok"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "signal"),
    ("raise KeyError('x')", "traceback"),
    ("import sys; print('ggraph run: error: ' + 'x' * 2000, file=sys.stderr); sys.exit(1)",
     "traceback"),
    ("import sys; print('ggraph run: error: a\\nggraph run: error: b', file=sys.stderr); "
     "sys.exit(1)", "traceback"),
    ("import sys; sys.exit(3)", "traceback"),
    ("import sys; print('usage: ...', file=sys.stderr); "
     "print('ggraph run: error: argument -x: invalid', file=sys.stderr); sys.exit(2)", "error"),
    ("import time; time.sleep(30)", "timeout"),
])
def test_cli_outcome_rules(code, kind):
    got, detail = run_cli([sys.executable, "-c", code], None, timeout=3)
    assert got == kind, detail
    assert MAX_MESSAGE == 1000


# -- hypothesis: the header parser on generated files -------------------------------------------

_FMT = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
        VT.INT32: "<i", VT.FLOAT32: "<f", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}
_RANGE = {"B": (0, 255), "b": (-128, 127), "H": (0, 65535), "h": (-32768, 32767),
          "I": (0, 2**32 - 1), "i": (-2**31, 2**31 - 1), "Q": (0, 2**64 - 1),
          "q": (-2**63, 2**63 - 1)}


def _scalar(vt: VT) -> st.SearchStrategy:
    if vt == VT.STRING:
        return st.text(max_size=12)
    if vt == VT.BOOL:
        return st.booleans()
    code = _FMT[vt][1]
    if code in "fd":
        return st.floats(width=32 if code == "f" else 64, allow_nan=False)
    lo, hi = _RANGE[code]
    return st.integers(lo, hi)


_SCALAR_TYPES = [t for t in VT if t != VT.ARRAY]


@st.composite
def _kv(draw):
    vt = draw(st.sampled_from(list(VT)))
    if vt == VT.ARRAY:
        et = draw(st.sampled_from(_SCALAR_TYPES))
        return vt, et, draw(st.lists(_scalar(et), max_size=6))
    return vt, None, draw(_scalar(vt))


def _enc_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _enc_value(vt: VT, v) -> bytes:
    if vt == VT.STRING:
        return _enc_str(v)
    if vt == VT.BOOL:
        return bytes([int(v)])
    return struct.pack(_FMT[vt], v)


@st.composite
def gguf_files(draw):
    """(bytes, metadata, tensors) of a valid GGUF: random keys of every type, and F32/F16/Q8_0
    tensors packed at aligned offsets."""
    keys = draw(st.lists(st.text(min_size=1, max_size=10), unique=True, max_size=6))
    kvs = {k: draw(_kv()) for k in keys if k != "general.alignment"}
    names = draw(st.lists(st.text(min_size=1, max_size=8), unique=True, max_size=4))
    types = {0: (1, 4), 1: (1, 2), 8: (32, 34)}
    tensors, offset = [], 0
    for n in names:
        ty = draw(st.sampled_from(sorted(types)))
        bs, ts = types[ty]
        ne = [draw(st.integers(1, 3)) * bs] + draw(st.lists(st.integers(1, 3), max_size=3))
        nbytes = math.prod(ne) // bs * ts
        tensors.append((n, tuple(ne), ty, offset))
        offset += nbytes + (-nbytes) % 32
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for k, (vt, et, v) in kvs.items():
        out += _enc_str(k) + struct.pack("<I", vt)
        if vt == VT.ARRAY:
            out += struct.pack("<IQ", et, len(v)) + b"".join(_enc_value(et, x) for x in v)
        else:
            out += _enc_value(vt, v)
    for n, ne, ty, off in tensors:
        out += _enc_str(n) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}q", *ne)
        out += struct.pack("<IQ", ty, off)
    out += b"\0" * ((-len(out)) % 32) + b"\x11" * offset
    return out, kvs, tensors


def _same(a, b) -> bool:
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(f=gguf_files(), cut=st.floats(0, 1), flips=st.lists(st.tuples(st.floats(0, 1),
                                                                       st.integers(0, 255)),
                                                             max_size=3))
def test_header_parser(tmp_path_factory, f, cut, flips):
    data, kvs, tensors = f
    path = tmp_path_factory.mktemp("hyp") / "h.gguf"
    path.write_bytes(data)
    hdr = read_header(path)  # the valid file reads back exactly
    assert set(hdr.metadata) == set(kvs)
    for k, (vt, et, v) in kvs.items():
        got = hdr.metadata[k]
        if vt == VT.FLOAT32:
            v = float(np.float32(v))
        if vt == VT.ARRAY and et == VT.FLOAT32:
            v = [float(np.float32(x)) for x in v]
        assert hdr.kv_types[k].type == vt and hdr.kv_types[k].element == et
        assert _same(got, v) if not isinstance(v, list) else \
            len(got) == len(v) and all(_same(x, y) for x, y in zip(got, v))
    assert [(t.name, t.ne, t.type_id, t.offset) for t in hdr.tensors] == tensors
    # any damage: a GGUFError or a file that still reads, nothing else
    bad = bytearray(data[:max(24, int(len(data) * cut))] if cut < 0.5 else data)
    for where, byte in flips:
        bad[int(where * (len(bad) - 1))] = byte
    path.write_bytes(bytes(bad))
    try:
        read_header(path)
    except GGUFError as e:
        assert str(e) and "\n" not in str(e)
