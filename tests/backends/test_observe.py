"""Observed runs (backends/observe.py, issue 32): ggml's eval callback for a Session and a
MultiSession. Every node of a SmolLM2 decode step is handed over with the value it has when
the planner keeps it alive, on one device and split over two (a second CPU backend stands in
for a device, as in test_runner.py); the fused prompt attention hands its K*Q and softmax;
outputs are bitwise those of an unobserved run; ask is consulted once per node before
anything runs, values come in execution order, and receive returning False stops the run."""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from ggraph import Context, build_graph, ops
from ggraph.backends.base import Observer, Recorder
from ggraph.backends.cpu import CPUBackend
from ggraph.backends.fusion_rules import Group
from ggraph.backends.observe import schedule
from ggraph.backends.multi import MultiSession
from ggraph.backends.profile import Profile
from ggraph.codecs import buffers
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.ir.opkind import OpKind

PROMPT = "The capital of France is"
# 19 tokens: a prompt ubatch of >= 16 queries takes the fused attention (attn_fusion.py)
LONG_PROMPT = ("The capital of France is Paris, and the capital of Germany is Berlin. The "
               "capital of Italy")
TOKEN = 12


@pytest.fixture(scope="module")
def smollm2() -> str:
    from ggraph.graphs.gguf.fetch import default_model

    return str(default_model())


def _engine(path: str, devices: str = "") -> Engine:
    # two devices: layers 0-14 on CPU1, the rest and the output on the host (3 splits)
    return Engine(path, EngineConfig(n_ctx=64, n_ubatch=32, devices=devices,
                                     n_gpu_layers=15 if devices else -1))


def _kept_alive(eng: Engine, n_tokens: int, n_outputs: int):
    """The graph `eng` runs next for a ubatch of n_tokens, every node made a graph output
    before its first run: the planner keeps them all alive, so each can be read after it."""
    mg = eng.build(n_tokens, eng.cache.n_kv(), n_outputs)
    for n in mg.graph.nodes:
        n.set_output()
    return mg.graph


def _ran(eng: Engine, rec: Recorder, n_tokens: int, n_outputs: int):
    """The graph of `eng`'s last run, the one `rec` watched."""
    g = eng.build(n_tokens, eng.cache.n_kv(), n_outputs).graph
    assert rec.order and rec.order[0] in set(g.nodes)
    return g


def _raw(runner, t) -> np.ndarray:
    """A copy of the bytes of pre-allocated `t` (a KV cache tensor) wherever runner keeps it."""
    sessions = getattr(runner, "sessions", None)
    s = sessions[runner.placement[t]] if sessions is not None else runner
    buf, off = s.storage(t)
    return np.array(np.asarray(buf)[off:off + t.nbytes])


@pytest.mark.parametrize("devices", ["", "cpu"], ids=["one_device", "two_devices"])
def test_every_node_of_a_decode_step(smollm2, devices):
    eng, ref = _engine(smollm2, devices), _engine(smollm2, devices)
    prompt = eng.tokenizer.encode(PROMPT)
    eng.eval(prompt)
    ref.eval(prompt)
    cache = {t: _raw(eng.runner, t) for t in eng.cache.k + eng.cache.v}
    asked: list = []

    def ask(node):
        assert not rec.order, "ask is consulted before any value is handed"
        asked.append(node)
        return True

    rec = Recorder(ask=ask)
    got = eng.eval([TOKEN], observe=rec.observer)
    g = _ran(eng, rec, 1, 1)
    # the same step unobserved: the same logits, bit for bit
    eng.truncate(len(prompt))
    np.testing.assert_array_equal(got, eng.eval([TOKEN]))
    # ask once per node, in execution order; every node handed once, in that order
    if devices:
        order = [n for split in eng.runner.schedule(g).splits for n in split.nodes]
    else:
        order = list(eng.runner.plan.order)
    assert len(order) == len(g.nodes) == len(set(order))
    assert asked == order and rec.order == order
    # each value is the one the node has when the planner keeps it alive
    kept = _kept_alive(ref, 1, 1)
    np.testing.assert_array_equal(ref.eval([TOKEN]), got)
    writes = {n.owner: i for i, n in enumerate(rec.order) if n.op == OpKind.SET_ROWS}
    for i, (a, b) in enumerate(zip(g.nodes, kept.nodes)):
        assert (a.name, a.op) == (b.name, b.op)
        pos = rec.order.index(a)
        if a.owner in cache and pos < writes[a.owner]:
            # a view of the KV cache run before this step's write into it: its value is the
            # cache before the step (the keep-alive run reads it afterwards)
            want = buffers.read(cache[a.owner], a.view_offs, a)
        else:
            want = ref.runner.read(b)
        np.testing.assert_array_equal(rec.values[a], want, err_msg=f"node {i} {a.name}")


def test_prompt_attention_hands_its_kq_and_softmax(smollm2, monkeypatch):
    """A 19-token prompt runs the fused attention, which never writes K*Q and the softmax to
    memory; asked for them, it fills host arrays instead (the output is computed as before:
    unfusing would change how it rounds). The reference is ggraph's unfused K*Q and softmax
    kernels on the observed run's own k, q and mask."""
    eng = _engine(smollm2)
    prompt = eng.tokenizer.encode(LONG_PROMPT)
    assert len(prompt) >= 16
    plain = eng.eval(prompt, n_past=0, all_logits=True)
    g = eng.build(len(prompt), eng.cache.n_kv(), len(prompt)).graph   # the next eval's graph
    kqs = [n for n in g.nodes if re.fullmatch(r"kq-\d+", n.name)]
    sms = {n.src[0]: n for n in g.nodes if n.op == OpKind.SOFT_MAX}
    assert len(kqs) == eng.model.hp.n_layer and all(kq in sms for kq in kqs)
    wanted = {t for kq in kqs for t in (kq, sms[kq], *kq.src)}
    rec = Recorder(ask=lambda n: n in wanted)
    fed: dict = {}     # the inputs the run was fed (the mask: a leaf, freed after its use)
    run = eng.runner.run
    monkeypatch.setattr(eng.runner, "run", lambda graph, inputs=None, **kw: run(
        graph, fed.update(inputs) or inputs, **kw))
    got = eng.eval(prompt, n_past=0, all_logits=True, observe=rec.observer)
    np.testing.assert_array_equal(got, plain)
    assert rec.order[0] in set(g.nodes) and set(rec.order) == wanted
    for kq in kqs:
        sm = sms[kq]
        assert rec.order.index(kq) + 1 == rec.order.index(sm)
        want_kq, want_sm = _unfused_attention(kq, sm, rec, fed[sm.src[1]])
        # K*Q: the group's own product (BLAS over the F16-rounded queries) against the
        # mat-mul kernel's; equal today, but two code paths whose float32 sums of 64 products
        # may be ordered differently: a few ulps of the largest score
        scale = np.abs(want_kq).max()
        np.testing.assert_allclose(rec.values[kq], want_kq, rtol=0, atol=1e-5 * scale,
                                   err_msg=kq.name)
        # the softmax: the fused path's rows (attention.py's expf, float64 sum) against the
        # soft_max kernel's (its own exp): weights in [0, 1] within 1e-5 (1.3e-6 measured);
        # the masked cells exactly 0 in both
        np.testing.assert_allclose(rec.values[sm], want_sm, rtol=0, atol=1e-5, err_msg=sm.name)
        assert np.array_equal(rec.values[sm] == 0, want_sm == 0)


def _unfused_attention(kq, sm, rec: Recorder, mask_value: np.ndarray):
    """K*Q and its softmax by the unfused CPU kernels, from the k and q the run handed over
    and the mask it was fed."""
    ctx = Context("ref")
    k, q = kq.src
    mask = sm.src[1]
    kk = ctx.new_tensor(k.type, k.ne, "k").set_data(rec.values[k])
    qq = ctx.new_tensor(q.type, q.ne, "q").set_data(rec.values[q])
    mm = ctx.new_tensor(mask.type, mask.ne, "mask").set_data(mask_value)
    p = sm.params
    kq2 = ops.mul_mat(kk, qq)
    sm2 = ops.soft_max_ext(kq2, mm, p.scale, p.max_bias, head_offset=p.head_offset,
                           n_head=p.n_head)
    kq2.set_output()
    sm2.set_output()
    s = CPUBackend(fuse=False).session()
    s.run(build_graph(sm2))
    return s.read(kq2), s.read(sm2)


# -- a small graph ------------------------------------------------------------------------------

def _counting(op: OpKind, ran: list) -> CPUBackend:
    """A CPU backend whose `op` kernel appends its node to `ran` each time it runs."""
    b = CPUBackend(fuse=False)
    k = b.kernels[op]

    def fn(node, s):
        if not k.bind:
            ran.append(node)
            return k.fn(node, s)
        call = k.fn(node, s)
        return None if call is None else (lambda: (ran.append(node), call()))

    b.kernels = {**b.kernels, op: replace(k, fn=fn)}
    return b


def _chain():
    """x -> a = 2x -> b = a + 1 -> c = b * b (the output)."""
    ctx = Context()
    x = ctx.new_tensor("f32", (8,), name="x").set_input()
    a = ops.scale(x, 2.0).set_name("a")
    b = ops.add(a, ctx.from_numpy(np.ones(8, np.float32), name="one")).set_name("b")
    c = ops.mul(b, b).set_name("c").set_output()
    return build_graph(c), x, (a, b, c)


@pytest.mark.parametrize("multi", [False, True], ids=["session", "multi"])
def test_receive_returning_false_stops_the_run(multi):
    ran: list = []
    backends = [_counting(OpKind.MUL, ran) for _ in range(2 if multi else 1)]
    runner = MultiSession(backends) if multi else backends[0].session()
    g, x, (a, b, c) = _chain()
    xv = np.arange(8, dtype=np.float32)
    stop = Recorder(stop_after=a)
    runner.run(g, {x: xv}, observe=stop.observer)
    assert stop.order == [a] and ran == []          # the product after `a` never ran
    # (the kernel sees the node a device runs: under a MultiSession, its clone)
    full = Recorder()
    runner.run(g, {x: xv}, observe=full.observer)
    assert full.order == [a, b, c] and [n.name for n in ran] == ["c"]
    np.testing.assert_array_equal(full.values[a].ravel(), 2 * xv)
    np.testing.assert_array_equal(full.values[c].ravel(), (2 * xv + 1) ** 2)
    np.testing.assert_array_equal(runner.read(c).ravel(), (2 * xv + 1) ** 2)


def test_plain_runs_keep_their_bound_calls_and_observers_ask_by_name():
    g, x, (a, b, c) = _chain()
    s = CPUBackend().session()
    xv = np.arange(8, dtype=np.float32)
    s.run(g, {x: xv})
    calls = s.bound_calls
    seen: list = []
    s.run(g, {x: xv + 1}, observe=Observer.named(r"^[ab]$", lambda n, v: seen.append(
        (n, v.copy()))))
    assert [n for n, _ in seen] == [a, b]
    np.testing.assert_array_equal(seen[1][1].ravel(), 2 * (xv + 1) + 1)
    s.run(g, {x: xv})
    assert s.bound_calls is calls                   # the plain path was not bound again
    np.testing.assert_array_equal(s.read(c).ravel(), (2 * xv + 1) ** 2)
    only_c = Recorder(ask=Observer.of([c], print).ask)
    s.run(g, {x: xv}, observe=only_c.observer)
    assert only_c.order == [c]
    with pytest.raises(ValueError, match="profile or observe"):
        s.run(g, {x: xv}, profile=Profile(), observe=only_c.observer)


def test_a_view_of_a_held_value_goes_with_its_group():
    """A group holding a member's bytes outside memory (the fused attention's K*Q) may share
    its host array with the next group of its kind: a view of that member is handed with the
    group that holds it, from those bytes, not at its own place."""
    g, x, (a, b, c) = _chain()
    v = ops.reshape(a, 2, 4).set_name("a (reshaped)")
    held = np.arange(8, dtype=np.float32)
    first = Group((a,), lambda: None, {a: held.view(np.uint8)})
    second = Group((b,), lambda: None)
    steps = schedule([a, v, b], [first, second], [a, v, b])
    assert [[h.node for h in st.handoffs] for st in steps] == [[a, v], [b]]
    assert steps[0].call is first.call and steps[1].call is second.call
    h = steps[0].handoffs[1]
    np.testing.assert_array_equal(buffers.read(h.held, v.view_offs, v), held.reshape(1, 1, 4, 2))
    assert steps[1].handoffs[0].held is None      # read from memory


def test_hand_gives_the_inputs_of_asked_products(smollm2, devices="cpu"):
    """Observer.hand: a product asked stands for its activations (llama-imatrix's use); each
    is handed once, when computed, with the value it has in a run that hands everything; a
    source another split computes is handed there (split over two devices: the one-device
    path is the same schedule, and test_imatrix runs it)."""
    eng, ref = _engine(smollm2, devices), _engine(smollm2, devices)
    prompt = eng.tokenizer.encode(LONG_PROMPT)
    products: list = []

    def ask(node):
        if node.op == OpKind.MUL_MAT and (node.src[0].name or "").startswith("blk."):
            products.append(node)
            return True
        return False

    got = Recorder(ask=ask)
    obs = Observer(got.ask, got.receive, hand=lambda n: (n.src[1],))
    logits = eng.eval(prompt, all_logits=True, observe=obs)
    everything = Recorder()
    np.testing.assert_array_equal(ref.eval(prompt, all_logits=True, observe=everything.observer),
                                  logits)
    wanted = {p.src[1] for p in products}
    assert len(products) == 7 * 30 and len(wanted) < len(products)   # q, k, v share theirs
    assert set(got.order) == wanted and len(got.order) == len(wanted)
    names = [n.name for n in everything.order]
    assert [n.name for n in got.order] == [n for n in names if n in {w.name for w in wanted}]
    by_name = {n.name: v for n, v in everything.values.items()}
    for n in got.order:
        np.testing.assert_array_equal(got.values[n], by_name[n.name], err_msg=n.name)
