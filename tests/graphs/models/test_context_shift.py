"""The context shift of a full context (llama-cli's: keep n_keep tokens, discard half of the
rest, re-rope the cached K by the position delta): the cells' seq_rm and seq_add, the K-shift
(graphs/models/kv_cache.py's shift_graph), the engine's shift_context / make_room, and
generation that goes on past n_ctx.

With one layer, a token's K and V depend only on the token and its position, so a shifted
cache must give the logits of a fresh evaluation of the kept tokens, up to the f16 rounding
of the re-roped K: that is checked for llama (V transposed and not) and for Gemma 3's
sliding-window ring (its cells against a fresh evaluation's), once with a ring that has
wrapped.
"""
from __future__ import annotations

import numpy as np
import pytest

from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.graphs.testing.tiny import TinyDense, write_tiny_llama
from ggraph.graphs.testing.tiny_gemma3 import write_tiny_gguf as write_tiny_gemma3


def shifted_and_fresh(path: str, toks: list[int], n_keep: int, n_discard: int,
                      **cfg) -> tuple[np.ndarray, np.ndarray]:
    """Logits of one more token after shifting, and after evaluating the kept tokens."""
    eng = Engine(path, EngineConfig(**cfg))
    eng.eval(toks, n_past=0)
    eng.shift_context(n_keep, n_discard)
    assert eng.cache.n_used == len(toks) - n_discard
    shifted = eng.eval([5])
    kept = toks[:n_keep] + toks[n_keep + n_discard:]
    return shifted, eng.eval(kept + [5], n_past=0)


@pytest.mark.parametrize("fa", [False, True])
def test_shift_equals_fresh_evaluation_llama(tmp_path, fa):
    p = str(write_tiny_llama(tmp_path / "l.gguf", TinyDense(n_layer=1)))
    toks = [3 + (i * 7) % 40 for i in range(40)]
    a, b = shifted_and_fresh(p, toks, 4, 18, n_ctx=64, n_ubatch=16, flash_attn=fa)
    assert np.abs(a - b).max() < 2e-2 * np.abs(b).max()
    # without the re-rope the logits differ by far more: the check can fail
    eng = Engine(p, EngineConfig(n_ctx=64, n_ubatch=16, flash_attn=fa))
    eng.eval(toks, n_past=0)
    eng.cache.seq_rm(0, 4, 22)        # positions moved, K not re-roped: the bookkeeping alone
    eng.cache.seq_add(0, 22, -1, -18)
    eng.cache.reset_shift()
    assert np.abs(eng.eval([5]) - b).max() > 10 * np.abs(a - b).max()


def ring_layer0(path: str, toks: list[int], shift: tuple[int, int] | None, **cfg
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer 0's K and V ring rows (numpy order: one row per cell) and each cell's position,
    after evaluating toks and shifting, or after evaluating toks alone."""
    eng = Engine(path, EngineConfig(**cfg))
    eng.eval(toks, n_past=0)
    if shift:
        eng.shift_context(*shift)
    k, v = eng.cache.k[0], eng.cache.v[0]
    rows = {t: eng.runner.read(t).reshape(t.ne[1], t.ne[0]) for t in (k, v)}
    return rows[k], rows[v].T if eng.cache.v_trans else rows[v], eng.cache.swa.cells.pos


@pytest.mark.parametrize("n_ctx,n_tok,n_keep,n_discard", [(64, 48, 2, 23),
                                                          (512, 300, 4, 148)])  # wrapped ring
@pytest.mark.parametrize("fa", [False, True])
def test_shift_of_the_sliding_window_ring(tmp_path, n_ctx, n_tok, n_keep, n_discard, fa):
    """Gemma 3's first layer slides: its K and V depend on the token and its position only,
    so after a shift the cell holding each position of the last window holds what evaluating
    the kept tokens puts at that position (positions move in place, so the cells differ).
    With n_ctx 512 and a window of 16 the ring has 256 cells and has wrapped."""
    p = write_tiny_gemma3(tmp_path / "g.gguf", n_layer=2, swa_pattern=[True, False])
    toks = [3 + (i * 5) % 40 for i in range(n_tok)]
    kept = toks[:n_keep] + toks[n_keep + n_discard:]
    cfg = dict(n_ctx=n_ctx, n_ubatch=16, flash_attn=fa)
    k, v, pos = ring_layer0(p, toks, (n_keep, n_discard), **cfg)
    k_ref, v_ref, pos_ref = ring_layer0(p, kept, None, **cfg)
    n = len(kept)
    window = np.arange(n - 16, n)
    assert np.isin(window, pos).all() and np.isin(window, pos_ref).all()  # the window is there
    at = [int(np.flatnonzero(pos == q)[0]) for q in window]
    at_ref = [int(np.flatnonzero(pos_ref == q)[0]) for q in window]
    assert np.abs(v[at] - v_ref[at_ref]).max() < 1e-2 * np.abs(v_ref).max()   # V kept
    assert np.abs(k[at] - k_ref[at_ref]).max() < 1e-2 * np.abs(k_ref).max()   # K re-roped


def test_generation_goes_on_past_the_context(tiny):
    p = str(tiny)
    eng = Engine(p, EngineConfig(n_ctx=32, n_ubatch=8))
    out = list(eng.generate([1, 3, 4, 5], 100, stop_at_eos=False, n_keep=1))
    assert len(out) == 100 and eng.stop_reason == "n_predict"
    assert eng.cache.n_used < 32
    eng.reset()
    out = list(eng.generate([1, 3, 4, 5], 100, stop_at_eos=False))   # no shift: stops cleanly
    assert eng.stop_reason == "context full" and len(out) == 32 - 4
    assert eng.cache.n_used == 31


def test_discard_bounds_and_models_that_cannot_shift(tiny, tmp_path):
    from ggraph.graphs.testing.tiny_deepseek2 import write_tiny_deepseek2

    eng = Engine(str(tiny), EngineConfig(n_ctx=32))
    eng.eval([3, 4, 5])
    with pytest.raises(ValueError, match="cannot discard positions 2..4 of a sequence of 3"):
        eng.shift_context(2, 3)
    ds = Engine(write_tiny_deepseek2(tmp_path / "d.gguf"), EngineConfig(n_ctx=32))
    ds.eval([3, 4, 5])
    with pytest.raises(ValueError, match="cannot re-rope its cached K"):
        ds.shift_context(1, 1)
    assert not ds.make_room(40, n_keep=1)   # generation then stops: "context full"
