"""The deepseek2 builder (MLA + MoE) on tiny random GGUFs.

The absorbed MLA path is checked against a naive model written here in numpy straight from
the formulas (per-head decompressed K and V, YaRN rope, group-limited MoE), independent of
ggraph's ops; the flash paths and every head-group split against the absorbed path; the CPU
backend against the reference executor. Tolerances: 1e-10 NMSE between float64 computations
that differ only in rounding (reference executor, F32 cache), 1e-6 for the CPU backend with
an F16 cache. The comparison with llama.cpp itself is benchmarks/compare_deepseek2_llama_cpp.py
(run here too when llama-cpp-python is installed).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from llama_cpp_ref import array, live, recorded

from ggraph.graphs.models.archs import deepseek2
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.graphs.gguf.gguf_file import GGUFError, load_gguf
from ggraph.graphs.models.mla import MLAShape, absorbed_groups, decompress_groups, ik_decompress_niter
from ggraph.graphs.testing.tiny_deepseek2 import TinyDeepSeek2, write_tiny_deepseek2

from ggraph.check.conformance import nmse
from ggraph.ir.graph import GraphCapacityError
from ggraph.check.reference import run_reference
from ggraph.ir.tensor import Context
from ggraph.ir.types import MIB
from paths import ROOT



# -- an independent numpy model ---------------------------------------------------------------

def _tensors(path: str) -> tuple[dict, dict]:
    import gguf

    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items()}
    ws = {t.name: np.asarray(t.data, np.float64).reshape(tuple(reversed([int(x) for x in
                                                                          t.shape])))
          for t in r.tensors}
    return meta, ws


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, base: float, factor: float, orig: int,
          log_mul: bool) -> np.ndarray:
    """NORMAL-mode rope of x (T, ..., d) with YaRN (factor > 1): interpolation/extrapolation
    ramp between the correction dims; the magnitude factor is 1 when the file has a log
    multiplier (llama.cpp moves it into the attention scale), 1 + 0.1 ln(factor) otherwise."""
    d = x.shape[-1]
    i = np.arange(d // 2)
    extrap = pos[:, None] * base ** (-2.0 * i / d)
    theta, mag = extrap, 1.0
    if factor > 1:
        def cd(r: float) -> float:
            return d * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))
        lo, hi = max(0.0, math.floor(cd(32.0))), min(d - 1.0, math.ceil(cd(1.0)))
        ramp = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
        theta = extrap / factor * (1 - ramp) + extrap * ramp
        mag = 1.0 if log_mul else 1 + 0.1 * math.log(factor)
    shape = (len(pos),) + (1,) * (x.ndim - 2) + (d // 2,)
    c, s = np.cos(theta).reshape(shape) * mag, np.sin(theta).reshape(shape) * mag
    out = x.copy()
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    return out


def numpy_deepseek2(path: str, tokens: list[int]) -> np.ndarray:
    """All-token logits, attention done the naive way: each head's K and V decompressed from
    the latent, softmax(q k^T * scale + causal mask) v."""
    meta, W = _tensors(path)
    g = lambda k, d=None: meta.get(f"deepseek2.{k}", d)
    H, r, rope = g("attention.head_count"), g("attention.kv_lora_rank"), g("rope.dimension_count")
    hk = g("attention.key_length_mla") or g("attention.key_length")
    hv = g("attention.value_length_mla") or g("attention.value_length")
    nope, eps = hk - rope, g("attention.layer_norm_rms_epsilon")
    factor = g("rope.scaling.factor", 0.0) or 1.0
    log_mul = g("rope.scaling.yarn_log_multiplier", 0.0)
    mscale = (1 + 0.1 * math.log(factor)) * (1 + log_mul * math.log(factor)) if not log_mul \
        else 1 + log_mul * math.log(factor)
    scale = mscale ** 2 / math.sqrt(hk)
    orig = g("rope.scaling.original_context_length", 0) or g("context_length")
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    causal = np.where(np.arange(T)[None, :] <= np.arange(T)[:, None], 0.0, -np.inf)
    x = W["token_embd.weight"][tokens]
    for il in range(g("block_count")):
        b = lambda n, il=il: W[f"blk.{il}.{n}"]
        h = _rms(x, b("attn_norm.weight"), eps)
        if f"blk.{il}.attn_q_a.weight" in W:
            q = _rms(h @ b("attn_q_a.weight").T, b("attn_q_a_norm.weight"), eps)
            q = q @ b("attn_q_b.weight").T
        else:
            q = h @ b("attn_q.weight").T
        q = q.reshape(T, H, hk)
        q[..., nope:] = _rope(q[..., nope:], pos, g("rope.freq_base"), factor, orig,
                              bool(log_mul))
        kv = h @ b("attn_kv_a_mqa.weight").T
        c = _rms(kv[:, :r], b("attn_kv_a_norm.weight"), eps)
        k_pe = _rope(kv[:, r:], pos, g("rope.freq_base"), factor, orig, bool(log_mul))
        if f"blk.{il}.attn_kv_b.weight" in W:
            wkv = b("attn_kv_b.weight").reshape(H, nope + hv, r)
            wk, wv = wkv[:, :nope], wkv[:, nope:]
        else:
            wk, wv = b("attn_k_b.weight").transpose(0, 2, 1), b("attn_v_b.weight")
        heads = []
        for hh in range(H):
            k = np.concatenate([c @ wk[hh].T, k_pe], axis=1)             # (T, hk)
            v = c @ wv[hh].T                                              # (T, hv)
            s = q[:, hh] @ k.T * scale + causal
            p = np.exp(s - s.max(1, keepdims=True))
            heads.append((p / p.sum(1, keepdims=True)) @ v)
        x = x + np.concatenate(heads, axis=1) @ b("attn_output.weight").T
        h = _rms(x, b("ffn_norm.weight"), eps)
        silu = lambda z: z / (1 + np.exp(-z))
        if il < g("leading_dense_block_count", 0):
            x = x + (silu(h @ b("ffn_gate.weight").T) * (h @ b("ffn_up.weight").T)) \
                @ b("ffn_down.weight").T
            continue
        logits = h @ b("ffn_gate_inp.weight").T
        if g("expert_gating_func") == 2:
            probs = 1 / (1 + np.exp(-logits))
        else:
            probs = np.exp(logits - logits.max(1, keepdims=True))
            probs /= probs.sum(1, keepdims=True)
        sel = probs + (b("exp_probs_b.bias") if f"blk.{il}.exp_probs_b.bias" in W else 0)
        G, E = g("expert_group_count", 0), g("expert_count")
        out = np.zeros_like(x)
        for t in range(T):
            st = sel[t].copy()
            if G and G > 1:
                grp = st.reshape(G, E // G)
                score = np.sort(grp, axis=1)[:, -2:].sum(1)
                keep = np.argsort(-score, kind="stable")[: g("expert_group_used_count")]
                mask = np.full(G, -np.inf)
                mask[keep] = 0
                st = (grp + mask[:, None]).reshape(E)
            top = np.argsort(-st, kind="stable")[: g("expert_used_count")]
            wts = probs[t, top]
            if g("expert_weights_norm", False):
                wts = wts / max(wts.sum(), 6.103515625e-5)
            ws = g("expert_weights_scale", 0.0)
            if ws not in (0.0, 1.0):
                wts = wts * ws
            for e, wt in zip(top, wts):
                a = silu(b("ffn_gate_exps.weight")[e] @ h[t]) * (b("ffn_up_exps.weight")[e] @ h[t])
                out[t] += wt * (b("ffn_down_exps.weight")[e] @ a)
        if f"blk.{il}.ffn_up_shexp.weight" in W:
            out += (silu(h @ b("ffn_gate_shexp.weight").T) * (h @ b("ffn_up_shexp.weight").T)) \
                @ b("ffn_down_shexp.weight").T
        x = x + out
    x = _rms(x, W["output_norm.weight"], eps)
    return x @ W.get("output.weight", W["token_embd.weight"]).T


# -- helpers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds2")
    return {k: write_tiny_deepseek2(d / f"{k}.gguf", TinyDeepSeek2(kv_b=k))
            for k in ("split", "legacy", "both")}


def _model(path: str) -> deepseek2.DeepSeek2Model:
    return deepseek2.DeepSeek2Model(load_gguf(path))


def reference_logits(model, tokens, path="absorbed", amb=0, n_ctx=64, cache="f32",
                     backend: str | None = None):
    """All-token logits of one ubatch from a fresh cache; the graph too."""
    ctx = Context()
    flash = path != "absorbed"
    kv = model.new_cache(ctx, n_ctx, cache, flash_attn=flash)
    mg = model.build(ctx, kv, len(tokens), n_ctx, len(tokens), flash, amb, path=path)
    inputs = model.batch_inputs(mg, kv, np.asarray(tokens), 0, np.arange(len(tokens)))
    if backend is None:
        out = run_reference(mg.graph, inputs).read(mg.logits)
    else:
        from ggraph.backends import get_backend

        out = get_backend(backend).session().run(mg.graph, inputs).read(mg.logits)
    return np.asarray(out).reshape(len(tokens), -1), mg


def _groups(mg, prefix: str) -> list[str]:
    return [n.name for n in mg.graph.nodes if n.name.startswith(prefix)]


TOKENS = [5, 17, 33, 80, 120, 7, 9, 200, 61, 3, 44, 250]


# -- correctness -------------------------------------------------------------------------------

def test_absorbed_mla_matches_naive_numpy(files):
    want = numpy_deepseek2(files["split"], TOKENS)
    got, mg = reference_logits(_model(files["split"]), TOKENS)
    assert mg.path == "absorbed"
    assert nmse(want, got) < 1e-10


@pytest.mark.parametrize("cfg", [
    TinyDeepSeek2(q_lora_rank=0, gating=1, n_expert_groups=0, exp_probs_b=False,
                  expert_weights_norm=False, expert_weights_scale=1.0, seed=3),  # Lite, V2-style
    TinyDeepSeek2(yarn_factor=0, n_layer_dense_lead=0, n_expert_shared=0, n_expert_used=1,
                  seed=4),                                        # no rope scaling, all MoE
    TinyDeepSeek2(yarn_log_mul=0.0, seed=5),                      # YaRN without a multiplier
], ids=["lite-softmax", "no-yarn-moe-only", "yarn-no-log-mul"])
def test_variants_match_naive_numpy(tmp_path, cfg):
    p = write_tiny_deepseek2(tmp_path / "v.gguf", cfg)
    got, _ = reference_logits(_model(p), TOKENS)
    assert nmse(numpy_deepseek2(p, TOKENS), got) < 1e-10


def test_both_tensor_layouts_load_and_agree(files):
    a, _ = reference_logits(_model(files["split"]), TOKENS)
    m = _model(files["legacy"])          # attn_kv_b only: split into wk_b/wv_b at load
    b, _ = reference_logits(m, TOKENS)
    assert m.w["layers"][0]["mla"].wk_b.name == "blk.0.attn_k_b.weight"
    c, _ = reference_logits(_model(files["split"]), TOKENS, path="decompress-fa")  # rebuilt
    d, _ = reference_logits(_model(files["both"]), TOKENS, path="decompress-fa")
    for x in (b, c, d):
        assert nmse(a, x) < 1e-10


def test_amb_iterations_are_exact_in_the_reference(files):
    m = _model(files["split"])
    toks = list(np.random.default_rng(1).integers(3, 250, 32))
    plain, mg0 = reference_logits(m, toks, n_ctx=2048)
    split, mg1 = reference_logits(m, toks, amb=1, n_ctx=2048)   # K*Q 2 MiB: 2 groups of 4
    assert len(_groups(mg1, "kq-0-s")) == 2 and len(_groups(mg0, "kq-0")) == 1
    assert nmse(plain, split) < 1e-10


def test_flash_paths_match_the_absorbed_path(files):
    """absorbed-fa (FA over the latent) and decompress-fa (K/V decompressed per head group:
    1 MiB per head with an F32 cache, so 8 groups at amb 1) equal the absorbed path within
    1e-10 (F32 cache)."""
    m = _model(files["split"])
    toks = list(np.random.default_rng(2).integers(3, 250, 16))
    plain, _ = reference_logits(m, toks, n_ctx=2048)
    fa, _ = reference_logits(m, toks, path="absorbed-fa", n_ctx=2048)
    dec, mg = reference_logits(m, toks, path="decompress-fa", amb=1, n_ctx=2048)
    assert len(_groups(mg, "fattn-0-s")) == 8
    assert nmse(plain, fa) < 1e-10 and nmse(plain, dec) < 1e-10


def test_head_group_rules():
    # DeepSeek-R1 at 163000 x 512, amb 2048: the facts page's 20 steps give 19 groups of <= 7
    s = MLAShape(128, 512, 64, 128, 128, 512, 163000)
    assert s.kq_mib == 40750
    g = absorbed_groups(s, 2048)
    assert len(g) == 19 and max(n for _, n in g) == 7 and sum(n for _, n in g) == 128
    assert absorbed_groups(MLAShape(128, 512, 64, 128, 128, 1, 163000), 2048) == [(0, 128)]
    # decompress: ik_llama.cpp's divisor search runs 16 iterations of 8 heads (counting the
    # f32 K_nope+V only); the fit rule 15 of <= 9 heads, each with its f16 K within the cap
    assert ik_decompress_niter(s, 2048) == 16
    d = decompress_groups(s, 2048)
    assert len(d) == 15 and sum(n for _, n in d) == 128
    assert all(n * (256 * 4 + 192 * 2) * 163000 <= 2048 * MIB for _, n in d)
    # groups need not divide n_head: 1.5 MiB per head at amb 5 gives 3, 3, 2
    t = MLAShape(8, 64, 32, 32, 32, 64, 4096)
    assert decompress_groups(t, 5) == [(0, 3), (3, 3), (6, 2)]


# -- the CPU backend through the engine ----------------------------------------------------

def test_cpu_matches_reference_and_amb_many_iterations(files):
    """CPU, F16 cache: amb 1 over 4096 cells splits K*Q (8 MiB) into 8 single-head groups
    per layer; the logits equal the unsplit ones and the compute buffer shrinks."""
    toks = list(np.random.default_rng(3).integers(3, 250, 64))
    base = Engine(files["split"], EngineConfig(n_ctx=4096, n_ubatch=64))
    split = Engine(files["split"], EngineConfig(n_ctx=4096, n_ubatch=64, amb_mib=1))
    a = base.eval(toks, all_logits=True)
    b = split.eval(toks, all_logits=True)
    assert len(_groups(split.worst_case, "kq-1-s")) == 8
    assert nmse(a, b) < 1e-10
    assert split.reserve_plan.size < base.reserve_plan.size
    ref, _ = reference_logits(base.model, toks, n_ctx=4096, cache="f16")
    assert nmse(ref, a) < 1e-6


def test_cpu_flash_paths_and_decode_steps(files, monkeypatch):
    toks = list(np.random.default_rng(4).integers(3, 250, 24))
    plain = Engine(files["split"], EngineConfig(n_ctx=256, n_ubatch=32))
    fa = Engine(files["split"], EngineConfig(n_ctx=256, n_ubatch=32, flash_attn=True))
    monkeypatch.setattr(deepseek2.DeepSeek2Model, "decompress_min_tokens", 16)
    dec = Engine(files["split"], EngineConfig(n_ctx=256, n_ubatch=32, flash_attn=True))
    assert (plain.worst_case.path, fa.worst_case.path, dec.worst_case.path) == \
        ("absorbed", "absorbed-fa", "decompress-fa")
    full = plain.eval(toks, all_logits=True)
    assert nmse(full, fa.eval(toks, all_logits=True)) < 1e-6
    assert nmse(full, dec.eval(toks, all_logits=True)) < 1e-6
    for eng in (plain, dec):   # dec: a 20-token decompress-fa prompt, then absorbed-fa steps
        eng.reset()
        eng.eval(toks[:20])
        steps = [eng.eval([t]) for t in toks[20:]]
        assert nmse(full[20:], np.stack(steps)) < 1e-6


def test_quantized_cache_needs_flash_attention(files):
    """A q8_0 MLA cache runs on the flash paths: the CPU equals the reference executor with
    the same cache; against an F32 cache most tokens differ by ~1e-4 NMSE, while a token whose
    expert choice flips (MoE routing is discontinuous) differs a lot, so the median is checked."""
    with pytest.raises(ValueError, match="needs flash attention"):
        Engine(files["split"], EngineConfig(n_ctx=256, type_k="q8_0"))
    q8 = Engine(files["split"], EngineConfig(n_ctx=256, n_ubatch=32, type_k="q8_0",
                                             flash_attn=True))
    assert q8.cache.nbytes == 3 * 256 * (96 // 32) * 34   # 3 layers, rows of 96 values
    toks = list(range(40, 60))
    got = q8.eval(toks, all_logits=True)
    same, _ = reference_logits(q8.model, toks, path="absorbed-fa", n_ctx=256, cache="q8_0")
    exact, _ = reference_logits(q8.model, toks, path="absorbed-fa", n_ctx=256)
    assert nmse(same, got) < 1e-6
    assert np.median([nmse(exact[i], got[i]) for i in range(len(toks))]) < 1e-3


# -- the node budget, bad files, the CLI ------------------------------------------------------

def test_graph_capacity_grows_with_iterations_and_overflow_is_clear(files):
    m = _model(files["split"])
    ctx = Context()
    for path, amb, flash in (("absorbed", 0, False), ("absorbed", 1, False),
                             ("decompress-fa", 1, True), ("absorbed-fa", 0, True)):
        kv = m.new_cache(ctx, 4096, "f16", flash_attn=flash)
        mg = m.build(ctx, kv, 64, 4096, 64, flash, amb, path=path)
        assert mg.graph.n_nodes <= mg.graph.capacity
    from ggraph.graphs.deploy.presets import preset_model

    v3, _ = preset_model("deepseek-v3")    # 61 layers: past the 2048-node floor
    one = v3.graph_capacity(512, 163000, 0)
    assert v3.graph_capacity(512, 163000, 2048) == one + 61 * 14 * 18   # 19 groups, not 1
    kv = m.new_cache(ctx, 4096, "f16")
    with pytest.raises(GraphCapacityError, match="graph capacity of 300 nodes exceeded"):
        m.build(ctx, kv, 64, 4096, 64, False, 1, capacity=300)


def test_bad_files(tmp_path):
    p = write_tiny_deepseek2(tmp_path / "a.gguf", skip=("blk.1.attn_k_b.weight",))
    with pytest.raises(GGUFError, match="layer 1 has neither 'blk.1.attn_kv_b.weight'"):
        _model(p)
    p = write_tiny_deepseek2(tmp_path / "b.gguf", skip=("blk.2.ffn_up_exps.weight",))
    with pytest.raises(GGUFError, match="'blk.2.ffn_up_exps.weight' is missing"):
        _model(p)


def test_ggraph_run_cli(files, capsys):
    from ggraph.cli import main

    assert main(["run", files["split"], "-p", "the", "-n", "3", "-c", "256"]) == 0
    err = capsys.readouterr().err   # llama.cpp's order: memory lines at load, on stderr
    assert "V: none (MLA" in err and "graph nodes" in err


LLAMA_CPP_VARIANTS = [None, "yarn without log multiplier",
                      "softmax gating, no groups, no bias, no norm"]


@pytest.mark.parametrize("variant", LLAMA_CPP_VARIANTS)
def test_llama_cpp_logits(tmp_path, variant):
    """F32 weights and caches: ggraph's logits against llama.cpp's (NMSE < 1e-4; measured
    about 3e-13 for the reference executor and 1e-12 for the CPU backend)."""
    cmp = compare_module()
    toks, path = llama_cpp_case(cmp, tmp_path, variant)
    if live() is not None:
        ref, _ = cmp.llama_cpp_logits(path, toks, n_gen=0)
    else:  # recorded by scripts/record_llama_cpp.py from the same file
        ref = array(recorded("deepseek2_tiny", path, exact=True, case=str(variant))["logits"])
    assert cmp.nmse(ref, cmp.ggraph_logits(path, toks, backend="reference")) < 1e-4
    if variant is None:
        assert cmp.nmse(ref, cmp.ggraph_logits(path, toks, path_name="absorbed-fa")) < 1e-4


def compare_module():
    """benchmarks/compare_deepseek2_llama_cpp.py (it imports llama_cpp only when it runs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "cmp_ds2", ROOT / "benchmarks" /
        "compare_deepseek2_llama_cpp.py")
    cmp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cmp)
    return cmp


def llama_cpp_case(cmp, tmp_path, variant) -> tuple[list[int], str]:
    """The tokens and the tiny file (written to `tmp_path`) of one variant."""
    toks = [int(x) for x in np.random.default_rng(5).integers(3, 250, 16)]
    cfg = TinyDeepSeek2() if variant is None else cmp.variants()[variant]
    return toks, str(write_tiny_deepseek2(tmp_path / "t.gguf", cfg))
