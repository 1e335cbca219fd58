"""An op's record is enough for the modules that consume records: toy ops defined outside
ggraph.ops (tests/toy_ops.py) with the record fields (GGMLMap op/cdecl/build/probe/limits/
cpu_limits, GGMLMap.unary, OpDef.src_labels) are drawn by ggraph.pictures.dot and run, probed and
refused by ggraph.check.ggml_ref without a line of those files naming them.

The toys join the process-wide registry, so they live in a child process; its facts come back
as JSON. Also checked here, in this process: every real record's ggml mapping is complete
(ggml_ref and ggml_cdefs keep no per-op tables to fall back on).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ggraph.check import ggml_ref
from ggraph.ops import REGISTRY
from paths import TESTS

HERE = TESTS   # toy_ops.py lives there

try:
    ggml_ref.load()
    WHY = ""
except ggml_ref.GGMLUnavailable as e:
    WHY = str(e)


def _toy_facts(use_ggml: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    args = [sys.executable, str(HERE / "toy_ops.py")] + (["ggml"] if use_ggml else [])
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _edges(src: str) -> list[str]:
    return [ln.strip() for ln in src.splitlines() if " -> " in ln]


def test_toy_ops_are_drawn_from_their_records():
    f = _toy_facts(use_ggml=False)
    sub, neg = _edges(f["dot_sub"]), _edges(f["dot_neg"])
    assert len(sub) == 2 and 'label="src0"' in sub[0] and 'label="src1"' in sub[1]
    assert len(neg) == 1 and "label=" not in neg[0]  # one source: nothing to tell apart
    assert "toy_sub" in f["dot_sub"] and "toy_neg" in f["dot_neg"]


@pytest.mark.skipif(bool(WHY), reason=f"libggml not available: {WHY}")
def test_toy_ops_run_and_are_refused_in_ggml_from_their_records():
    f = _toy_facts(use_ggml=True)
    # enum values read through the records' probes and checked by ggml's names
    assert f["ggml_names"] == {"toy_sub": "SUB", "toy_neg": "UNARY"} and f["neg_sub_op"]
    assert f["sub_err"] < 1e-6 and f["neg_err"] < 1e-6
    assert f["sub_broadcast"] == [False, "toy_sub: ggml mapping takes b of a's shape only"]
    ok, why = f["sub_strided"]
    assert not ok and why.startswith("ggml's CPU toy_sub needs source 0 with packed rows")
    ok, why = f["neg_strided"]
    assert not ok and why == "ggml's unary toy_neg needs packed rows (nb0 = type size)"
    # registered after load(): unknown then, probed on first use, and it runs
    assert not f["late_known_before"] and f["late_name"] == "DIV" and f["late_err"] < 1e-6


def test_every_ggml_mapped_record_can_be_probed():
    """An op that maps to ggml gives a probe, or is element-wise (the default probe)."""
    lacking = [str(k) for k, d in REGISTRY.items()
               if d.ggml is not None and d.ggml.probe is None and d.elementwise is None]
    assert not lacking, f"records mapped to ggml without a GGMLMap.probe: {lacking}"


@pytest.mark.skipif(bool(WHY), reason=f"libggml not available: {WHY}")
def test_every_record_with_a_ggml_mapping_is_known_to_the_loaded_library():
    lib = ggml_ref.load()
    mapped = {k for k, d in REGISTRY.items() if d.ggml is not None}
    assert mapped and mapped <= set(lib.op) | set(lib.missing)
    assert all(k in lib.sub for k, d in REGISTRY.items()
               if d.ggml_op is not None and d.ggml_op[0] in ("UNARY", "GLU"))
