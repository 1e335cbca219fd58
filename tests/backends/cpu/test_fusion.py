"""The CPU fusion pass (backends/cpu/fusion.py): norm chains run as one call, bit for bit the
unfused run, and every value a later node or the caller reads is still written."""
from __future__ import annotations

import numpy as np
import pytest

from ggraph import Context, build_graph, ops
from ggraph.backends.cpu import CPUBackend
from ggraph.backends.cpu.fusion import overlap_safe
from ggraph.backends.profile import Profile

EPS = 1e-5


def _block(n0: int, rows: int, with_norm_reader: bool = False, out_residual: bool = True,
           rms: bool = True):
    """A transformer layer's norm block: s = x + r; d = norm(s) * w + bias; y = d @ ... (a
    mul standing for the next product) and s read again as the next residual."""
    ctx = Context()
    rng = np.random.default_rng(n0 + rows)
    x = ctx.new_tensor("f32", (n0, rows), name="x").set_input()
    r = ctx.new_tensor("f32", (n0, rows), name="r").set_input()
    w = ctx.from_numpy(rng.standard_normal(n0).astype(np.float32), name="w")
    bias = ctx.from_numpy(rng.standard_normal(n0).astype(np.float32), name="bias")
    s = ops.add(x, r).set_name("s")
    n = (ops.rms_norm(s, EPS) if rms else ops.norm(s, EPS)).set_name("n")
    m = ops.mul(n, w).set_name("m")
    d = ops.add(m, bias).set_name("d")
    out = ops.add(ops.scale(d, 0.5), s).set_name("out")   # s read after the group
    if with_norm_reader:
        out = ops.add(out, ops.scale(n, 2.0)).set_name("out2")
    out.set_output()
    if out_residual:
        s.set_output()
    inputs = {x: rng.standard_normal((rows, n0)).astype(np.float32),
              r: rng.standard_normal((rows, n0)).astype(np.float32)}
    return build_graph(out), inputs, dict(s=s, n=n, m=m, d=d, out=out)


def _run(fuse: bool, graph, inputs, read):
    sess = CPUBackend(fuse=fuse).session()
    prof = Profile()
    with sess:
        sess.run(graph, inputs, profile=prof)
        return {k: sess.read(t) for k, t in read.items()}, prof


@pytest.mark.parametrize("n0,rows", [(64, 1), (96, 3), (512, 160)], ids=["decode", "few",
                                                                          "parallel"])
@pytest.mark.parametrize("rms", [True, False], ids=["rms_norm", "norm"])
def test_fused_block_is_bitwise_the_unfused_one(n0, rows, rms):
    g, inputs, t = _block(n0, rows, rms=rms)
    read = dict(out=t["out"], s=t["s"])
    want, p0 = _run(False, g, inputs, read)
    got, p1 = _run(True, g, inputs, read)
    for k in read:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    norm = "rms_norm" if rms else "norm"
    assert f"add+{norm}+mul+add" in p1.by_op and f"add+{norm}+mul+add" not in p0.by_op
    # four calls became one
    assert sum(s.calls for s in p1.by_op.values()) == sum(s.calls for s in p0.by_op.values()) - 3


def test_an_intermediate_read_later_is_written():
    """n is read by a node after the group: the fused kernel writes it too."""
    g, inputs, t = _block(64, 2, with_norm_reader=True)
    want, _ = _run(False, g, inputs, dict(out=t["out"]))
    got, prof = _run(True, g, inputs, dict(out=t["out"]))
    assert any("rms_norm" in k and "+" in k for k in prof.by_op)
    np.testing.assert_array_equal(got["out"], want["out"])


def test_an_output_intermediate_is_readable():
    """s is an output the caller reads; d's inner values are freed (reads refused alike)."""
    g, inputs, t = _block(64, 2, out_residual=True)
    want, _ = _run(False, g, inputs, dict(s=t["s"]))
    got, _ = _run(True, g, inputs, dict(s=t["s"]))
    np.testing.assert_array_equal(got["s"], want["s"])
    sess = CPUBackend(fuse=True).session()
    with sess:
        sess.run(g, inputs)
        with pytest.raises(ValueError, match="freed by the plan"):
            sess.read(t["n"])


def test_no_chain_no_fusion():
    """A norm not followed by a broadcast op, or an add feeding no norm, stays unfused."""
    ctx = Context()
    x = ctx.new_tensor("f32", (32, 2), name="x").set_input()
    y = ops.scale(ops.rms_norm(ops.add(x, x), EPS), 3.0).set_output()
    g = build_graph(y)
    v = {x: np.arange(64, dtype=np.float32).reshape(2, 32)}
    (got, p), (want, _) = _run(True, g, v, dict(y=y)), _run(False, g, v, dict(y=y))
    np.testing.assert_array_equal(got["y"], want["y"])
    assert "add+rms_norm" in p.by_op and "scale" in p.by_op   # the scale is not a post op


def test_overlap_rule():
    buf = np.zeros(64, np.float32)
    a = buf[:32].reshape(1, 1, 1, 32)
    same = buf[:32].reshape(1, 1, 1, 32)
    shifted = buf[8:40].reshape(1, 1, 1, 32)
    apart = buf[32:].reshape(1, 1, 1, 32)
    assert overlap_safe([a], [same])          # in place: row read before it is written
    assert overlap_safe([a], [apart])
    assert not overlap_safe([a], [shifted])   # would overwrite rows still to be read
    assert not overlap_safe([], [a, shifted])


def test_engine_decode_is_unchanged_by_fusion(tmp_path):
    """A tiny llama's logits, prompt and decode, with and without the pass."""
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama

    path = str(write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama(n_layer=2, n_embd=64)))
    outs = []
    for fuse in (False, True):
        eng = Engine(path, EngineConfig(n_ctx=64, n_ubatch=8))
        eng.runner.backend.executor.fusion = fuse
        logits = [eng.eval([1, 2, 3, 4, 5], all_logits=True)]
        logits += [eng.eval([7]), eng.eval([9])]
        outs.append(logits)
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def _attention(nt: int, nkv: int, max_bias: float, window: int = 0):
    """A prompt's non-flash attention over F16 caches (V transposed and strided, as the cache
    stores it; 4 query heads on 2 KV heads): K*Q, soft_max_ext with a causal F16 mask (a
    sliding window where `window`; queries past nkv - nt see nothing), V*p."""
    hd, nh, nkv_h, n_ctx = 32, 4, 2, nkv + 16
    rng = np.random.default_rng(nt + nkv)
    ctx = Context()
    kc = ctx.new_tensor("f16", (hd, n_ctx, nkv_h), name="k_cache")
    kc.set_data(rng.standard_normal((nkv_h, n_ctx, hd)).astype(np.float32))
    vc = ctx.new_tensor("f16", (n_ctx, hd * nkv_h), name="v_cache")
    vc.set_data(rng.standard_normal((hd * nkv_h, n_ctx)).astype(np.float32))
    k = ops.view_3d(kc, hd, nkv, nkv_h, kc.nb[1], kc.nb[2], 0)
    v = ops.view_3d(vc, nkv, hd, nkv_h, vc.nb[1], vc.nb[1] * hd, 0)
    qin = ctx.new_tensor("f32", (hd, nh, nt), name="q").set_input()
    q = ops.permute(qin, 0, 2, 1, 3)
    mask = ctx.new_tensor("f16", (nkv, nt), name="mask").set_input()
    kq = ops.mul_mat(k, q).set_name("kq")
    p = ops.soft_max_ext(kq, mask, 1 / np.sqrt(hd), max_bias).set_name("p")
    out = ops.mul_mat(v, p).set_name("kqv").set_output()
    pos = np.arange(nt)[:, None] + (nkv - nt)           # query i sits at cell nkv - nt + i
    cell = np.arange(nkv)[None, :]
    seen = (cell <= pos) & ((cell > pos - window) if window else True)
    seen[nt // 2: nt // 2 + 3] = False                    # a few queries that see nothing
    m = np.where(seen, 0.0, -np.inf).astype(np.float32)
    return build_graph(out), {qin: rng.standard_normal((nt, nh, hd)).astype(np.float32),
                              mask: m}, dict(out=out)


@pytest.mark.parametrize("nt,nkv,max_bias,window", [(40, 40, 0.0, 0), (130, 200, 8.0, 0),
                                                    (100, 256, 0.0, 48)],
                         ids=["prompt", "alibi_past", "window"])
def test_attention_group_matches_the_unfused_nodes(nt, nkv, max_bias, window):
    """The attention group (backends/cpu/attn_fusion.py) skips the cells the mask hides: its
    output is the unfused nodes' up to the order of sums and F16 roundings of the weights,
    queries that see no cell give the same NaN rows, and the group did run."""
    g, inputs, read = _attention(nt, nkv, max_bias, window)
    want, p0 = _run(False, g, inputs, read)
    got, p1 = _run(True, g, inputs, read)
    w, o = want["out"], got["out"]
    np.testing.assert_array_equal(np.isnan(o), np.isnan(w))
    ok = ~np.isnan(w)
    assert np.isnan(w).any() and ok.any()
    assert np.abs(o[ok] - w[ok]).max() <= 2e-4 * np.abs(w[ok]).max()
    assert "mul_mat+soft_max+mul_mat" in p1.by_op and "mul_mat+soft_max+mul_mat" not in p0.by_op


def test_attention_of_a_few_queries_is_not_fused():
    g, inputs, read = _attention(4, 40, 0.0)
    _, prof = _run(True, g, inputs, read)
    assert "mul_mat+soft_max+mul_mat" not in prof.by_op


def _products(types: tuple[str, ...], k: int, cols: int, other_input: bool = False):
    """Products of leaf weights of `types` (rows 48, 40, 35: partial row groups) that read
    the same activations x (the last one reads x2 where `other_input`), each read after."""
    ctx = Context()
    rng = np.random.default_rng(k + cols)
    x = ctx.new_tensor("f32", (k, cols), name="x").set_input()
    x2 = ctx.new_tensor("f32", (k, cols), name="x2").set_input()
    ys = []
    for j, (t, m) in enumerate(zip(types, (48, 40, 35))):
        w = ctx.new_tensor(t, (k, m), name=f"w{j}")
        w.set_data(rng.standard_normal((m, k)).astype(np.float32))
        src = x2 if other_input and j == len(types) - 1 else x
        ys.append(ops.mul_mat(w, src).set_name(f"y{j}").set_output())
    out = ys[0]
    for y in ys[1:]:
        out = ops.concat(out, y, 0)
    inputs = {x: rng.standard_normal((cols, k)).astype(np.float32)}
    if other_input:
        inputs[x2] = rng.standard_normal((cols, k)).astype(np.float32)
    return build_graph(out.set_output()), inputs, {f"y{j}": y for j, y in enumerate(ys)}


@pytest.mark.parametrize("types", [("q4_k", "q4_k"), ("q8_0", "q8_0", "q8_0")],
                         ids=["gate_up", "qkv"])
@pytest.mark.parametrize("cols", [1, 3])
def test_products_of_one_input_run_as_one_call_bit_for_bit(types, cols):
    g, inputs, read = _products(types, 256, cols)
    want, p0 = _run(False, g, inputs, read)
    got, p1 = _run(True, g, inputs, read)
    for k in read:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    fused = "+".join(["mul_mat"] * len(types))
    assert fused in p1.by_op and p1.by_op[fused].calls == 1 and fused not in p0.by_op


@pytest.mark.parametrize("types,other", [(("q4_k", "q6_k"), False), (("q8_0", "q8_0"), True)],
                         ids=["two_types", "two_inputs"])
def test_products_of_other_types_or_inputs_stay_apart(types, other):
    g, inputs, read = _products(types, 256, 1, other_input=other)
    got, p1 = _run(True, g, inputs, read)
    assert "mul_mat+mul_mat" not in p1.by_op and p1.by_op["mul_mat"].calls == 2


@pytest.mark.parametrize("cols", [1, 3])
def test_products_of_one_shape_share_their_work_buffers_bit_for_bit(cols, monkeypatch):
    """Packed products of one shape that read other activations run one after the other in
    the same quantization buffers (kernels.packed_work): each fills them before it reads
    them, so their results are those of buffers of their own."""
    from ggraph.backends.cpu import kernels
    g, inputs, read = _products(("q8_0", "q8_0"), 256, cols, other_input=True)
    got, real = [], kernels.packed_work
    monkeypatch.setattr(kernels, "packed_work", lambda *a: got.append(real(*a)) or got[-1])
    shared, _ = _run(True, g, inputs, read)
    assert len(got) == 2 and all(x is y for x, y in zip(got[0], got[1]))
    monkeypatch.setattr(kernels, "SHARED_WORK", False)
    got.clear()
    own, _ = _run(True, g, inputs, read)
    assert len(got) == 2 and not any(x is y for x, y in zip(got[0], got[1]))
    for k in read:
        np.testing.assert_array_equal(shared[k], own[k], err_msg=k)


def test_a_cache_write_between_products_runs_in_its_place():
    """v = W_v x; cache[idx] = v (set_rows: a view that writes); k = W_k x. The products run
    as one call and the cache write after it, k written to its own memory only where it
    would have run: the plan may give k memory the write still reads (a fuzzed GGUF gave it
    the write's row indices: tests/graphs/gguf/test_gguf_fuzz.py)."""
    ctx = Context()
    rng = np.random.default_rng(3)
    x = ctx.new_tensor("f32", (256, 1), name="x").set_input()
    idx = ctx.new_tensor("i64", (1,), name="idx").set_input()
    cache = ctx.new_tensor("f32", (48, 4), name="cache")
    cache.set_data(np.zeros((4, 48), np.float32))
    ws = []
    for name in ("wv", "wk"):
        w = ctx.new_tensor("q4_k", (256, 48), name=name)
        ws.append(w.set_data(rng.standard_normal((48, 256)).astype(np.float32)))
    v = ops.mul_mat(ws[0], x).set_name("v")
    written = ops.set_rows(cache, v, idx)
    k = ops.mul_mat(ws[1], x).set_name("k")
    out = ops.add(ops.add(ops.view_1d(written, 48, 2 * 48 * 4), k), v).set_name("out")
    out.set_output()
    inputs = {x: rng.standard_normal((1, 256)).astype(np.float32),
              idx: np.array([2], np.int64)}
    g = build_graph(out)
    want, _ = _run(False, g, inputs, dict(out=out))
    got, prof = _run(True, g, inputs, dict(out=out))
    np.testing.assert_array_equal(got["out"], want["out"])
    assert "mul_mat+set_rows+mul_mat" in prof.by_op and "mul_mat" not in prof.by_op


def test_a_product_moved_before_a_reader_of_its_memory_keeps_that_memory_intact():
    """y = W_1 x; z = bias + y (broadcast to 2 columns); k = W_2 x, with k planned in y's
    memory (y is dead once z is computed). The call computes k before z: into a buffer, copied to k's memory after z
    has read y; writing k there first would change z."""
    ctx = Context()
    rng = np.random.default_rng(5)
    x = ctx.new_tensor("f32", (256, 1), name="x").set_input()
    bias = ctx.new_tensor("f32", (64, 2), name="bias")
    bias.set_data(rng.standard_normal((2, 64)).astype(np.float32))
    ws = []
    for name in ("w1", "w2"):
        w = ctx.new_tensor("q8_0", (256, 64), name=name)
        ws.append(w.set_data(rng.standard_normal((64, 256)).astype(np.float32)))
    y = ops.mul_mat(ws[0], x).set_name("y")
    z = ops.add(bias, y).set_name("z")   # 64 x 2, not in y's place: y dies at z
    k = ops.mul_mat(ws[1], x).set_name("k")
    out = ops.mul(z, k).set_name("out")   # k broadcast over z's columns
    out.set_output()
    inputs = {x: rng.standard_normal((1, 256)).astype(np.float32)}
    g = build_graph(out)
    want, _ = _run(False, g, inputs, dict(out=out))
    sess = CPUBackend(fuse=True).session()
    prof = Profile()
    with sess:
        sess.run(g, inputs, profile=prof)
        ya, ka = sess.arr(y), sess.arr(k)
        assert ya.ctypes.data == ka.ctypes.data   # the case: k planned over y
        got = sess.read(out)
    np.testing.assert_array_equal(got, want["out"])
    assert "mul_mat+add+mul_mat" in prof.by_op and "mul_mat" not in prof.by_op


def _biased(cols: int, read_product: bool = False):
    """Qwen2's Q, K and V: three Q4_K products of x, each plus a bias row (the second one's
    bias the add's first operand for one column), a node between the first two; y0 read after its add where
    `read_product` (then its add cannot stand in for it)."""
    ctx = Context()
    rng = np.random.default_rng(cols)
    x = ctx.new_tensor("f32", (256, cols), name="x").set_input()
    zs, ys = [], []
    for j, m in enumerate((48, 40, 35)):
        w = ctx.new_tensor("q4_k", (256, m), name=f"w{j}")
        w.set_data(rng.standard_normal((m, 256)).astype(np.float32))
        b = ctx.from_numpy(rng.standard_normal(m).astype(np.float32), name=f"b{j}")
        y = ops.mul_mat(w, x).set_name(f"y{j}")
        # ggml's add broadcasts its second operand only: the bias first where it is as big
        z = (ops.add(b, y) if j == 1 and cols == 1 else ops.add(y, b)).set_name(f"z{j}")
        ys.append(y)
        zs.append(ops.scale(z, 0.5).set_name("z0s") if j == 0 else z)
    out = ops.concat(ops.concat(zs[0], zs[1], 0), zs[2], 0).set_name("out")
    if read_product:
        out = ops.concat(out, ys[0], 0).set_name("out_y")
    out.set_output()
    return build_graph(out), {x: rng.standard_normal((cols, 256)).astype(np.float32)}, \
        {"out": out}


@pytest.mark.parametrize("cols", [1, 3, 40])
@pytest.mark.parametrize("read_product", [False, True], ids=["folded", "product_read"])
def test_bias_adds_run_in_their_products_call_bit_for_bit(cols, read_product):
    """Each product's bias add is folded into the products' call (product + bias written
    where the add's result lives; the one with a node before it through a buffer, copied at
    its add's turn), bit for bit the unfused nodes; a product read after its add is still
    written (the add then runs by its own call)."""
    g, inputs, read = _biased(cols, read_product)
    want, p0 = _run(False, g, inputs, read)
    got, p1 = _run(True, g, inputs, read)
    for k in read:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    fused = [k for k in p1.by_op if k.count("mul_mat") == 3]   # in the plan's order
    assert len(fused) == 1 and p1.by_op[fused[0]].calls == 1
    assert not any(k.count("mul_mat") > 1 for k in p0.by_op)
    alone = p1.by_op["add"].calls if "add" in p1.by_op else 0
    assert fused[0].split("+").count("add") + alone == 3 and (read_product or alone == 0)


def test_a_product_with_a_bias_alone_runs_as_one_call():
    ctx = Context()
    rng = np.random.default_rng(7)
    x = ctx.new_tensor("f32", (256, 1), name="x").set_input()
    w = ctx.new_tensor("q6_k", (256, 48), name="w")
    w.set_data(rng.standard_normal((48, 256)).astype(np.float32))
    b = ctx.from_numpy(rng.standard_normal(48).astype(np.float32), name="b")
    z = ops.add(ops.mul_mat(w, x), b).set_name("z").set_output()
    g, inputs = build_graph(z), {x: rng.standard_normal((1, 256)).astype(np.float32)}
    want, _ = _run(False, g, inputs, {"z": z})
    got, prof = _run(True, g, inputs, {"z": z})
    np.testing.assert_array_equal(got["z"], want["z"])
    assert prof.by_op["mul_mat+add"].calls == 1 and "mul_mat" not in prof.by_op
