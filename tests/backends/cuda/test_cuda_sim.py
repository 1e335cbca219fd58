"""The CUDA backend under numba's CUDA simulator, against the numpy reference.

Runs in its own process with NUMBA_ENABLE_CUDASIM=1 set before numba is imported
(tests/run_cudasim.sh); otherwise the module skips. Covers: the kernel table (every OpKind, the
CPU table's accepts rules, the shared-memory caps), the conformance cases of every op and
accepted type combination (heavy ops deduplicated by type/path, see `_selected`; set
GGRAPH_CUDASIM_ALL=1 for every case), strided and permuted sources, odd sizes across tile
edges, the attention graphs of graphs/models/attention.py (plain, split over head groups, flash,
quantized K/V) planned by the real allocator (in-place softmax), device memory behaviour
(uploads cached by tensor identity, static caches kept across runs, strided reads/writes,
128-byte alignment), and the scheduler splitting a model across CPU and CUDA
(tools/gpu_check.py --tiny itself: tests/tools/test_gpu_check.py).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from sim_guard import require_simulator  # noqa: E402

require_simulator()

from ggraph.backends.cuda import runtime as R  # noqa: E402

from ggraph import Context, GGMLType as T, build_graph, ops as O  # noqa: E402
from ggraph.backends.base import UnsupportedOpError  # noqa: E402
from ggraph.backends.cuda import CUDABackend  # noqa: E402
from ggraph.backends.cuda import kernels as CK, templates as K, templates_mm as KM  # noqa
from ggraph.backends.cuda import templates_attn as KA  # noqa: E402
from ggraph.check.conformance import cases_for, compare, run_case  # noqa: E402
from ggraph.ir.opkind import OpKind  # noqa: E402
from ggraph.check.reference import run_reference  # noqa: E402
from ggraph.tools import gpu_check  # noqa: E402

pytestmark = pytest.mark.cudasim
sys.setswitchinterval(5e-4)  # simulated threads wait on each other at barriers: switch sooner

BACKEND = CUDABackend()
HEAVY = (OpKind.MUL_MAT, OpKind.MUL_MAT_ID, OpKind.FLASH_ATTN_EXT, OpKind.SOFT_MAX,
         OpKind.OUT_PROD)
STRUCT = {"src", "a", "b", "sinks", "freq_factors", "softcap", "max_bias", "mode", "dim",
          "order", "head_offset", "n_b", "mask"}


def _selected() -> list:
    """Every case of the cheap ops; for the heavy ops (seconds each in the simulator) the first
    case of each type combination and structural variant (strided, sinks, ALiBi, softcap,
    GQA, mat-vec vs tiled path, broadcast)."""
    out, seen = [], set()
    for c in cases_for():
        v = dict(c.vars)
        if c.op in HEAVY and os.environ.get("GGRAPH_CUDASIM_ALL") != "1":
            key = tuple(sorted((n, str(x)) for n, x in v.items()
                               if n.startswith("type") or n in STRUCT))
            if c.op == OpKind.MUL_MAT:
                key += (v["n"] <= CK.MV_MAX_N, v.get("nr") not in (None, [1, 1]))
            if c.op == OpKind.FLASH_ATTN_EXT:
                key += (v.get("nr", 1) > 1,)
            if c.op == OpKind.MUL_MAT_ID and v["type"] != T.F32:
                key = tuple(kv for kv in key if kv[0] != "n_b")
            if (c.op, key) in seen:
                continue
            seen.add((c.op, key))
        out.append(c)
    return out


def _geometry_subset() -> list:
    """For the run at GPU geometry in CI (tests/conftest.py): per op, the first case of float
    and of quantized types (another decoder path), and mul_mat's mat-vec and tiled kernels."""
    out, seen = [], set()
    for c in _selected():
        v = dict(c.vars)
        key = (c.op, any(getattr(x, "is_quantized", False) for x in v.values()))
        if c.op == OpKind.MUL_MAT:
            key += (v["n"] <= CK.MV_MAX_N,)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


CASES = _geometry_subset() if os.environ.get("GGRAPH_CUDASIM_SUBSET") == "geometry" \
    else _selected()


def _check(out, inputs=None, tol=1e-7, backend=BACKEND, allocator=None):
    out.set_output()
    g = build_graph(out)
    ref = run_reference(g, inputs).read(out)
    s = backend.session(allocator=allocator) if allocator else backend.session()
    s.run(g, inputs)
    ok, err, why = compare(ref, s.read(out), tol)
    assert ok, f"nmse={err:.3e} > {tol} {why}"
    return s, g


# -- the kernel table -------------------------------------------------------------------------

def test_table_covers_every_op():
    assert set(CK.KERNELS) == set(OpKind)
    assert BACKEND.name == "cuda" and BACKEND.buffers.alignment == 128


def test_accepts_match_cpu_on_every_case():
    from ggraph.backends.cpu import CPUBackend

    cpu = CPUBackend()
    nodes = []
    for c in cases_for():
        nodes += build_graph(c.make()[1]).nodes
    for gc in gpu_check.attention_cases(tiny=True):
        nodes += build_graph(gc[1](Context(), np.random.default_rng(0))[0]).nodes
    diff = [n.describe() for n in nodes if cpu.supports(n) != BACKEND.supports(n)]
    assert not diff, diff[:5]


def test_shared_memory_caps_refuse_with_reason():
    ctx = Context()
    big = KA.FA_DMAX + 32
    q = ctx.new_tensor(T.F32, (big, 1, 1), "q")
    k = ctx.new_tensor(T.F16, (big, 8, 1), "k")
    fa = O.flash_attn_ext(q, k, ctx.new_tensor(T.F16, (32, 8, 1)), None, 1.0)
    assert not BACKEND.supports(fa)
    assert "K heads above" in CK.KERNELS[OpKind.FLASH_ATTN_EXT].why_not
    srt = O.argsort(ctx.new_tensor(T.F32, (K.SORT_MAX + 1, 2)))
    assert not BACKEND.supports(srt) and "shared memory" in CK.KERNELS[OpKind.ARGSORT].why_not
    with pytest.raises(UnsupportedOpError, match="cannot run"):
        BACKEND.session().prepare(build_graph(srt))


# -- conformance cases ------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_conformance_case(case):
    r = run_case(case, BACKEND)
    assert r.status == "OK", r.line()


def test_shared_arrays_survive_thread_switches(monkeypatch):
    """The simulator's shared arrays are found or made by a check and then a set; a thread
    switched out between the two once made its own array, and a q4_K product read garbage
    (nmse 0.23). With the window between the two widened to 2 ms, every thread of a block still
    shares one array (backends/cuda/runtime.py makes the two one step)."""
    import time
    from numba.cuda.simulator import kernelapi

    class SlowLookup(dict):
        def get(self, key, default=None):
            found = super().get(key, default)
            time.sleep(0.002)
            return found

    made = kernelapi.FakeCUDAShared.__init__

    def init(self, *args, **kw):
        made(self, *args, **kw)
        self._allocations = SlowLookup()

    monkeypatch.setattr(kernelapi.FakeCUDAShared, "__init__", init)
    wanted = {"MUL_MAT(type=q4_K,m=12,n=5,k=256,b=strided)",
              "MUL_MAT_ID(type=q4_K,n_expert=4,n_used=2,n_b=1,m=9,k=256)"}
    cases = [c for c in cases_for([OpKind.MUL_MAT, OpKind.MUL_MAT_ID]) if c.label in wanted]
    assert len(cases) == len(wanted)
    for case in cases:
        r = run_case(case, BACKEND)
        assert r.status == "OK", r.line()


def test_every_op_and_type_is_in_the_selection():
    full = {(c.op, tuple(str(v) for n, v in c.vars if n.startswith("type")))
            for c in cases_for()}
    got = {(c.op, tuple(str(v) for n, v in c.vars if n.startswith("type"))) for c in CASES}
    assert full == got


# -- odd sizes, strides, paths -------------------------------------------------------------------

@pytest.mark.parametrize("wt", [T.F32, T.F16, T.BF16, T.Q4_1])
@pytest.mark.parametrize("n", [3, 20])
def test_mul_mat_across_tile_edges(wt, n):
    """M and N past one tile, K not a multiple of the chunk (float weights), both paths."""
    rng = np.random.default_rng(1)
    ctx = Context()
    k = 64 if wt.is_quantized else 40
    m = KM.MM_TM + 5
    w = ctx.new_tensor(wt, (k, m, 2)).set_data(rng.uniform(-1, 1, (2, m, k)))
    x = ctx.new_tensor(T.F16, (k, n, 4)).set_input()
    _check(O.mul_mat(w, x), {x: rng.uniform(-1, 1, x.shape)}, 5e-4)


def test_two_tiled_products_of_one_kernel_in_one_graph():
    """Both products bind the same compiled kernel, the first with the larger grid."""
    rng = np.random.default_rng(9)
    ctx = Context()
    m1 = 4 * KM.MM_TM + 3
    w1 = ctx.new_tensor(T.F32, (64, m1)).set_data(rng.uniform(-1, 1, (m1, 64)))
    w2 = ctx.new_tensor(T.F32, (m1, 12)).set_data(rng.uniform(-1, 1, (12, m1)))
    x = ctx.new_tensor(T.F32, (64, 12)).set_input()
    _check(O.mul_mat(w2, O.mul_mat(w1, x)), {x: rng.uniform(-1, 1, x.shape)}, 5e-4)


def test_mul_mat_permuted_weights_and_transposed_activations():
    rng = np.random.default_rng(2)
    ctx = Context()
    w = ctx.new_tensor(T.F16, (32, 3, 9)).set_data(rng.uniform(-1, 1, (9, 3, 32)))
    wp = O.permute(w, 0, 2, 1, 3)                       # [32, 9, 3]: rows strided
    x = ctx.new_tensor(T.F32, (12, 32, 3)).set_input()  # transposed below: [32, 12, 3]
    _check(O.mul_mat(wp, O.transpose(x)), {x: rng.uniform(-1, 1, x.shape)}, 5e-4)


@pytest.mark.parametrize("kv", [T.F16, T.Q8_0, T.Q4_1])
def test_flash_attn_without_mask_and_dv_ne_dk(kv):
    rng = np.random.default_rng(3)
    ctx = Context()
    q = ctx.new_tensor(T.F32, (64, 2, 4)).set_input()
    k = ctx.new_tensor(kv, (64, 40, 2)).set_data(rng.uniform(-1, 1, (2, 40, 64)))
    v = ctx.new_tensor(kv, (32, 40, 2)).set_data(rng.uniform(-1, 1, (2, 40, 32)))
    _check(O.flash_attn_ext(q, k, v, None, 0.125), {q: rng.uniform(-1, 1, q.shape)}, 5e-4)


def test_get_rows_and_rms_norm_of_strided_views():
    rng = np.random.default_rng(4)
    ctx = Context()
    a = ctx.new_tensor(T.F32, (8, 33, 3)).set_input()
    p = O.permute(a, 1, 0, 2, 3)                        # [33, 8, 3], nb0 = 33*4
    idx = ctx.new_tensor(T.I32, (5, 3)).set_data(rng.integers(0, 8, (3, 5)))
    _check(O.add(O.rms_norm(p, 1e-6), O.sum_rows(p)), {a: rng.uniform(-1, 1, a.shape)})
    _check(O.get_rows(p, idx), {a: rng.uniform(-1, 1, a.shape)})


# -- graphs with the real allocator -----------------------------------------------------------

# the attention graphs of tools/gpu_check.py that the conformance cases do not cover already:
# quantized K through mul_mat (V transposed), flash on quantized and bf16 caches, split
ATTENTION = [g for g in gpu_check.attention_cases(tiny=True) if g[0] in (
    "attention(kv=q4_0,flash)", "attention(kv=q8_0,flash)", "attention(kv=bf16,flash)",
    "attention(k=q8_0,v=f16,plain)", "attention(k=q8_0,split)")]


@pytest.mark.parametrize("gc", ATTENTION, ids=lambda g: g[0])
def test_attention_graph(gc):
    r = gpu_check.run_graph_case(gc, BACKEND)
    assert r.ok, f"{gc[0]}: nmse={r.nmse:.3e} {r.detail}"


def test_split_attention_with_alibi_runs_softmax_in_place():
    gc = next(g for g in gpu_check.attention_cases(tiny=True) if "split,alibi" in g[0])
    r = gpu_check.run_graph_case(gc, BACKEND)
    assert r.ok, f"nmse={r.nmse:.3e} {r.detail}"
    s, g = r.session, r.graph
    soft = [n for n in g.nodes if n.op == OpKind.SOFT_MAX]
    assert len(soft) > 1, "the graph did not split over head groups"
    assert s.allocator.alignment == 128
    assert any(s.plan.placement(n).reused is not None for n in soft), \
        "no softmax ran in place: the aliasing path is not exercised"
    assert all(s.plan.offset(n) % 128 == 0 for n in g.nodes if n in s.plan)


# -- device memory ----------------------------------------------------------------------------

def test_weights_upload_once_and_again_after_set_data(monkeypatch):
    calls = []
    real = R.upload_bytes
    monkeypatch.setattr(R, "upload_bytes", lambda host: calls.append(host.nbytes) or real(host))
    rng = np.random.default_rng(5)
    backend = CUDABackend()
    ctx = Context()
    w = ctx.new_tensor(T.Q8_0, (64, 6)).set_data(rng.uniform(-1, 1, (6, 64)))
    x = ctx.new_tensor(T.F32, (64, 2)).set_input()
    out = O.mul_mat(w, x)
    for _ in range(2):
        _check(out, {x: rng.uniform(-1, 1, x.shape)}, 5e-4, backend=backend)
    assert calls == [w.nbytes]
    w.set_data(rng.uniform(-1, 1, (6, 64)))
    _check(out, {x: rng.uniform(-1, 1, x.shape)}, 5e-4, backend=backend)
    assert calls == [w.nbytes, w.nbytes]


def test_static_cache_persists_across_runs():
    rng = np.random.default_rng(6)
    ctx = Context()
    cache = ctx.new_tensor(T.Q4_0, (64, 8), "cache")
    cache.buffer = "kv_cache"
    src = ctx.new_tensor(T.F32, (64, 3)).set_input()
    idx = ctx.new_tensor(T.I64, (3,)).set_data(np.array([6, 1, 3]))
    rows = ctx.new_tensor(T.I32, (4,)).set_data(np.array([1, 3, 6, 0]))
    written = O.set_rows(cache, src, idx)
    vals = {src: rng.uniform(-1, 1, src.shape)}
    both = O.get_rows(written, rows)                    # the reference runs both steps at once
    expect = run_reference(build_graph(both), vals).read(both)
    s = BACKEND.session()
    s.run(build_graph(written), vals)                   # step 1 writes the cache
    later = O.get_rows(cache, rows).set_output()        # step 2 reads it back
    s.run(build_graph(later))
    np.testing.assert_array_equal(s.read(later), expect)


def test_read_and_write_through_strided_views():
    rng = np.random.default_rng(7)
    ctx = Context()
    t = ctx.new_tensor(T.F16, (6, 5, 2), "t")
    t.buffer = "scratch"
    s = BACKEND.session()
    base = rng.uniform(-1, 1, t.shape).astype(np.float16).astype(np.float32)
    s.write(t, base)
    view = O.permute(t, 1, 0, 2, 3)                     # [5, 6, 2]
    vals = rng.uniform(-1, 1, view.shape).astype(np.float16).astype(np.float32)
    s.write(view, vals)
    np.testing.assert_array_equal(s.read(view), vals)
    np.testing.assert_array_equal(s.read(t), np.swapaxes(vals, -1, -2))
    win = O.view_2d(t, 3, 2, t.nb[1], t.nb[0])          # a window: the rest is untouched
    s.write(t, base)
    s.write(win, np.zeros(win.shape))
    got, want = s.read(t), base.copy()
    want[0, 0, :2, 1:4] = 0
    np.testing.assert_array_equal(got, want)


def test_decode_steps_reuse_the_session():
    rng = np.random.default_rng(8)
    ctx = Context()
    w = ctx.new_tensor(T.Q4_1, (64, 16)).set_data(rng.uniform(-1, 1, (16, 64)))
    s = BACKEND.session()
    for _ in range(3):
        x = ctx.new_tensor(T.F32, (64, 1), "x").set_input()
        out = O.soft_max_ext(O.mul_mat(w, O.rms_norm(x, 1e-6)), None, 0.5).set_output()
        g = build_graph(out)
        vals = {x: rng.uniform(-1, 1, x.shape)}
        s.run(g, vals)
        ok, err, why = compare(run_reference(g, vals).read(out), s.read(out), 5e-4)
        assert ok, err


# -- a model across devices --------------------------------------------------------------------

def test_scheduler_splits_a_model_across_cpu_and_cuda(tmp_path):
    """The tiny llama with its last layer of 2 on CUDA (the scheduler copies activations and
    inputs across): the logits of the CPU alone, and the same greedy tokens. SmolLM2 itself
    takes minutes per token in the simulator: benchmarks/sched_smollm2_cudasim.py."""
    from ggraph.check.conformance import nmse
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama

    p = write_tiny_llama(tmp_path / "t.gguf", TinyLlama(n_layer=2, n_embd=64))
    cfg = dict(n_ctx=64, n_ubatch=8, reserve_outputs="last")
    cpu = Engine(str(p), EngineConfig(**cfg))
    split = Engine(str(p), EngineConfig(devices="cuda", n_gpu_layers=1, **cfg))
    a, b = cpu.eval([5, 6, 7, 8]), split.eval([5, 6, 7, 8])
    assert nmse(a, b) < 1e-6
    tok = int(np.argmax(a))
    assert tok == int(np.argmax(b))
    # one decode step (each simulated step costs seconds)
    a, b = cpu.eval([tok]), split.eval([tok])
    assert nmse(a, b) < 1e-6 and int(np.argmax(a)) == int(np.argmax(b))
    sch = split.session.schedule(split.worst_case.graph)
    assert [split.device_names[s.device] for s in sch.splits] == ["CPU", "CUDA0", "CPU"]
    assert split.session.placement[split.cache.k[1]] == 0
    assert split.session.placement[split.cache.k[0]] == 1


# -- in place under the real planner (issue #14) ------------------------------------------------
# A few cases of the in-place ops with the result in its source's memory, planned by the real
# allocator at CUDA's alignment (the whole in-place mode on the CPU: test_conformance_inplace.py;
# here each case costs seconds). add runs on each of its sources in turn.

from ggraph.check.conformance import inplace_graph, run_case_inplace  # noqa: E402


def _inplace_case(op, **want):
    return next(c for c in cases_for([op])
                if all(str(dict(c.vars).get(k)) == str(v) for k, v in want.items()))


INPLACE = [
    (OpKind.ADD, dict(type="f32", ne_b=[64, 5, 3, 2]), 0),
    (OpKind.ADD, dict(type="f32", ne_b=[64, 5, 3, 2]), 1),
    (OpKind.SCALE, dict(type="f16"), 0),
    (OpKind.RMS_NORM, dict(ne=[33, 2]), 0),
    (OpKind.ROPE, dict(type="f32", mode=2, n_dims=32), 0),
    (OpKind.SOFT_MAX, dict(mask="f16", scale=0.125), 0),
]


@pytest.mark.parametrize("op,want,src", INPLACE,
                         ids=[f"{o.value}-src{s}-{i}" for i, (o, _, s) in enumerate(INPLACE)])
def test_inplace_case(op, want, src):
    case = _inplace_case(op, **want)
    _, node, source = inplace_graph(case, src)
    assert source is node.src[src] and source.op == OpKind.CONT   # a planned intermediate
    r = run_case_inplace(case, BACKEND, src=src)
    assert r.status == "OK" and r.variant == f"in place on src{src}", r.line()
