"""The in-place conformance mode (issue #14): every case of every op ggml-alloc may run in
place, with its result in its source's memory under the real planner, on the CPU backend.

The mode must really alias (the plan reuses the source, the kernel's arrays share memory), must
fail loudly when the plan does not, and must catch kernels that are right out of place and
wrong in place; those are swapped into a copy of the CPU kernel table.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ggraph.plan.alloc import GraphAllocator, plan_graph
from ggraph.backends.base import Kernel
from ggraph.backends.cpu import CPUBackend
from ggraph.check.conformance import (NoInPlaceSource, Summary, cases_for,
                                cases_inplace, inplace_graph, inplace_ops, run_case,
                                run_case_inplace)
from ggraph.ir.opkind import OpKind
from ggraph.ops.registry import REGISTRY

RUNS = list(cases_inplace())


def _id(run) -> str:
    case, src = run
    return f"{case.label} src{src}" if src is not None else f"{case.label} (no source)"


def _case(op: OpKind, **want):
    return next(c for c in cases_for([op])
                if all(str(dict(c.vars).get(k)) == str(v) for k, v in want.items()))


def _patched(op: OpKind, fn) -> CPUBackend:
    cpu = CPUBackend()
    cpu.kernels = {**CPUBackend.kernels, op: Kernel(fn)}
    return cpu


# -- coverage -----------------------------------------------------------------------------------

def test_inplace_ops_are_the_records_with_the_flag():
    flagged = {k for k, d in REGISTRY.items() if d.inplace}
    assert set(inplace_ops()) == flagged
    assert {OpKind.SOFT_MAX, OpKind.ROPE, OpKind.RMS_NORM, OpKind.ADD, OpKind.SILU} <= flagged
    assert not REGISTRY[OpKind.MUL_MAT].inplace and OpKind.MUL_MAT not in inplace_ops()


def test_every_inplace_op_has_a_case_that_runs_in_place():
    ran = {case.op for case, src in RUNS if src is not None}
    assert ran == set(inplace_ops()), set(inplace_ops()) - ran
    # a source of the result's layout at any position: add(a, b) of one shape runs on b too
    assert any(src == 1 for case, src in RUNS if case.op == OpKind.ADD)


def test_naming_an_op_that_never_runs_in_place_is_an_error():
    with pytest.raises(ValueError, match="never runs in place"):
        list(cases_inplace([OpKind.NORM]))


# -- the plan ---------------------------------------------------------------------------------

def test_the_source_is_planned_and_the_real_planner_reuses_it():
    graph, node, source = inplace_graph(_case(OpKind.SOFT_MAX, mask="f16"))
    assert source.op == OpKind.CONT and source is node.src[0]   # a planned intermediate
    for alignment in (32, 128):
        for strategy in ("default", "ggml"):
            plan = plan_graph(graph, alignment, strategy)
            assert plan.placement(node).reused is source
            assert plan.offset(node) == plan.offset(source)


def test_the_kernel_arrays_alias():
    seen = []

    def spy(node, s):
        seen.append(np.shares_memory(s.arr(node), s.arr(node.src[0])))
        real = CPUBackend.kernels[OpKind.SILU]
        call = real.fn(node, s)
        if real.bind:                                    # a binder returns the bound call
            call()

    r = run_case_inplace(_case(OpKind.SILU, type="f32"), _patched(OpKind.SILU, spy))
    assert r.status == "OK" and seen == [True], (r.line(), seen)


def test_src1_variant_aliases_the_second_source():
    case = _case(OpKind.ADD, type="f32", ne_b=[64, 5, 3, 2])
    graph, node, source = inplace_graph(case, 1)
    assert source is node.src[1] and node.src[0].op is None   # a stays a leaf with host data
    plan = plan_graph(graph, 32)
    assert plan.placement(node).reused is source


def test_a_case_without_a_source_of_the_result_layout_is_skipped_not_passed():
    case = _case(OpKind.SILU, src="strided")
    with pytest.raises(NoInPlaceSource, match="never runs it in place"):
        inplace_graph(case)
    r = run_case_inplace(case, CPUBackend())
    assert r.status == "skipped" and "src0 f32" in r.detail, r.line()
    s = Summary("cpu", [r])
    assert (s.passed, s.tested, s.skipped, s.failed) == (0, 0, 1, 0)
    with pytest.raises(ValueError, match="cannot hold the result"):
        inplace_graph(_case(OpKind.ADD, type="f32", ne_b=[64, 1, 3, 1]), 1)


def test_a_plan_that_does_not_reuse_the_source_fails_loudly(monkeypatch):
    case = _case(OpKind.SILU, type="f32")
    # the planner stops treating silu as in-place-capable: same graph, no reuse
    monkeypatch.setitem(REGISTRY, OpKind.SILU,
                        dataclasses.replace(REGISTRY[OpKind.SILU], inplace=False))
    r = run_case_inplace(case, CPUBackend())
    assert r.status == "FAIL" and "not in place" in r.detail, r.line()
    assert r.nmse < 1e-7   # the values were right: only the aliasing check caught it


def test_the_planner_given_is_the_one_used():
    calls = []

    class Spy(GraphAllocator):
        def alloc(self, graph, reserve_on_growth=False):
            calls.append(graph)
            return super().alloc(graph, reserve_on_growth)

    r = run_case_inplace(_case(OpKind.RMS_NORM, ne=[33, 2]), CPUBackend(),
                         allocator=Spy(alignment=32, strategy="ggml"))
    assert r.status == "OK" and calls, r.line()


# -- every case on the CPU --------------------------------------------------------------------

@pytest.mark.parametrize("run", RUNS, ids=_id)
def test_cpu_case_in_place(run):
    case, src = run
    r = run_case_inplace(case, CPUBackend(), src=src)
    if src is None:
        assert r.status == "skipped", r.line()
    else:
        assert r.status == "OK" and r.variant == f"in place on src{src}", r.line()


# -- kernels that are right out of place and wrong in place ------------------------------------

def _softmax_rereads_source(node, s):
    # sums the exponentials by reading the source again after writing the destination: in
    # place, the source already holds the exponentials
    sc = node.params.scale
    d = s.arr(node)
    m = (s.arr(node.src[0]) * sc).max(axis=-1, keepdims=True)
    d[...] = np.exp(s.arr(node.src[0]) * sc - m)
    d /= np.exp(s.arr(node.src[0]) * sc - m).sum(axis=-1, keepdims=True)


def _rms_norm_writes_rows_early(node, s):
    # row by row, writes each element before it has read the rest of the row
    x, d = s.arr(node.src[0]), s.arr(node)
    n0 = x.shape[-1]
    for row in np.ndindex(*x.shape[:-1]):
        for i in range(n0):
            d[row + (i,)] = x[row + (i,)] / np.sqrt(np.mean(x[row] ** 2) + node.params.eps)


def _add_copies_a_first(node, s):
    # d = a, then d += b: right when d aliases a (or nothing), wrong when d aliases b
    d = s.arr(node)
    d[...] = s.arr(node.src[0])
    d += s.arr(node.src[1])


@pytest.mark.parametrize("op,fn,want", [
    (OpKind.SOFT_MAX, _softmax_rereads_source, dict(mask="none", scale=1.0)),
    (OpKind.RMS_NORM, _rms_norm_writes_rows_early, dict(ne=[33, 2])),
])
def test_a_kernel_wrong_in_place_is_caught(op, fn, want):
    case = _case(op, **want)
    bad = _patched(op, fn)
    assert run_case(case, bad).status == "OK"            # the normal mode cannot see it
    r = run_case_inplace(case, bad)
    assert r.status == "FAIL" and r.nmse > 1e-4, r.line()
    assert run_case_inplace(case, CPUBackend()).status == "OK"


def test_a_kernel_wrong_only_when_the_result_aliases_src1_is_caught():
    case = _case(OpKind.ADD, type="f32", ne_b=[64, 5, 3, 2])
    bad = _patched(OpKind.ADD, _add_copies_a_first)
    assert run_case(case, bad).status == "OK"
    assert run_case_inplace(case, bad, src=0).status == "OK"
    r = run_case_inplace(case, bad, src=1)
    assert r.status == "FAIL" and r.nmse > 1e-2 and r.variant == "in place on src1", r.line()


def test_writes_outside_the_planned_tensors_hit_the_canaries():
    def overrun(node, s):
        s.arr(node)[...] = s.arr(node.src[0]) * node.params.s + node.params.b
        buf, off = s.storage(node)
        buf[off + node.nbytes: off + node.nbytes + 8] = 0     # into the alignment padding

    case = _case(OpKind.SCALE, type="f32")
    r = run_case_inplace(case, _patched(OpKind.SCALE, overrun))
    assert r.status == "FAIL" and "canary" in r.detail, r.line()


# -- the command ----------------------------------------------------------------------------

def test_command_inplace(capsys, tmp_path):
    import json

    from ggraph.cli import main

    out = tmp_path / "r.json"
    assert main(["conformance", "--inplace", "--op", "silu,add", "-q", "--json",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "11/11 tests passed in place, 2 skipped" in text, text
    rep = json.loads(out.read_text())[0]
    assert rep["mode"] == "inplace" and rep["skipped"] == 2
    assert any(c["case"].endswith("in place on src1") for c in rep["cases"])
    assert main(["conformance", "--inplace", "--op", "norm"]) == 1
    assert "never runs in place" in capsys.readouterr().err
    assert main(["conformance", "--inplace", "--mode", "perf"]) == 1
    assert "--mode test only" in capsys.readouterr().err
