"""Per-node profiles of graph runs (backends/profile.py): every call timed once per run, under
its op and its node's name pattern, with the bytes and FLOPs the nodes move and compute."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ggraph import Context, build_graph, ops
from ggraph.backends.cpu import CPUBackend
from ggraph.backends.profile import Profile, node_bytes, node_flops, pattern
from ggraph.ir.types import GGMLType as T


def _graph(k: int = 64, m: int = 32, n: int = 3):
    ctx = Context()
    rng = np.random.default_rng(0)
    w = ctx.from_numpy(rng.standard_normal((m, k)).astype(np.float32), name="blk.0.w")
    x = ctx.new_tensor("f32", (k, n), name="x").set_input()
    h = ops.mul_mat(w, x).set_name("ffn_up-0")
    y = ops.scale(ops.silu(h).set_name("act-0"), 2.0).set_name("out-0").set_output()
    return build_graph(y), x, w, h, y, rng.standard_normal((n, k)).astype(np.float32)


def test_every_call_is_counted_per_run():
    g, x, w, h, y, xv = _graph()
    prof = Profile()
    sess = CPUBackend(fuse=False).session()
    for _ in range(3):
        sess.run(g, {x: xv}, profile=prof)
    assert prof.runs == 3
    assert {k: s.calls for k, s in prof.by_op.items()} == {"mul_mat": 3, "silu": 3, "scale": 3}
    assert {k for k in prof.by_pattern} == {"ffn_up", "act", "out"}
    assert all(s.seconds > 0 for s in prof.by_op.values())
    assert prof.run_seconds >= prof.kernel_seconds > 0
    mm = prof.by_op["mul_mat"]
    assert mm.flops == 3 * 2 * 64 * 32 * 3
    assert mm.bytes == 3 * (w.nbytes + x.nbytes + h.nbytes)
    # the run's results are the unprofiled run's
    want = CPUBackend(fuse=False).session().run(g, {x: xv}).read(y)
    np.testing.assert_array_equal(sess.read(y), want)


def test_table_and_json():
    g, x, *_, xv = _graph()
    prof = Profile()
    sess = CPUBackend().session()
    with prof.attach(sess):
        sess.run(g, {x: xv})
        sess.run(g, {x: xv})
    assert sess.profile is None          # attach restores
    sess.run(g, {x: xv})                 # not recorded
    assert prof.runs == 2
    lines = prof.table()
    assert lines[0].split()[:3] == ["op", "calls", "ms/run"]
    body = lines[1:-1]
    assert {ln.split()[0] for ln in body} == set(prof.by_op)
    # slowest first, shares add up to 100%
    secs = [prof.by_op[ln.split()[0]].seconds for ln in body]
    assert secs == sorted(secs, reverse=True)
    assert sum(float(ln.split()[4].rstrip("%")) for ln in body) == pytest.approx(100, abs=0.5)
    assert "GFLOPS" in lines[0] and lines[-1].startswith("total")
    assert len(prof.table(by="name", top=1)) == 3
    data = json.loads(json.dumps(prof.to_json()))
    assert data["runs"] == 2 and {r["key"] for r in data["by_op"]} == set(prof.by_op)
    prof.reset()
    assert prof.runs == 0 and not prof.by_op
    with pytest.raises(ValueError, match="by 'op' or 'name'"):
        prof.rows("layer")


def test_attach_refuses_a_runner_without_profiles():
    with pytest.raises(TypeError, match="cannot be profiled"):
        with Profile().attach(object()):
            pass


def test_rows_bytes_count_the_rows_touched():
    ctx = Context()
    table = ctx.new_tensor(T.Q8_0, (64, 1000), name="token_embd.weight")
    idx = ctx.new_tensor("i32", (2,), name="ids")
    rows = ops.get_rows(table, idx)
    assert node_bytes(rows) == 2 * table.row_bytes + idx.nbytes + rows.nbytes
    cache = ctx.new_tensor("f16", (64, 1000), name="cache_k_l3")
    new = ctx.new_tensor("f32", (64, 2), name="k")
    sr = ops.set_rows(cache, new, idx)
    assert node_bytes(sr) == new.nbytes + idx.nbytes + 2 * cache.row_bytes
    assert node_flops(rows) == 0
    sr.set_name("cache_k_l3 (set_rows)")
    assert pattern(sr) == "cache_k_l (set_rows)"
    assert pattern(ops.scale(new, 1.0)) == "scale"
