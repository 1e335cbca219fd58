"""graphs.sampling: each step against distributions worked out by hand from its definition on
tiny vocabularies, the chain's order, seeding, the statistics of dist, invalid parameters, and
each step and the whole seeded chain against llama.cpp's own samplers applied to the same raw
logits (live where llama-cpp-python is installed, else as scripts/record_llama_cpp.py recorded
them in tests/data/llama_cpp/sampling.json)."""
import ctypes
import hashlib
import math

import numpy as np
import pytest
from llama_cpp_ref import array, live, recorded

from ggraph.graphs.runtime.sampling import (Candidates, SamplerParams, Sampler, StdMT19937,
                                    samplers_from_chars)

OFF = dict(top_k=0, top_p=1.0, min_p=0.0, temp=1.0, seed=7)  # every filter off


def only(**kw) -> Sampler:
    """A sampler with only the given settings on (the rest of the default chain off)."""
    return Sampler(SamplerParams(**{**OFF, **kw}))


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def kept(s: Sampler, logits, history=()) -> list[int]:
    s.accept_many(history)
    return s.candidates(np.asarray(logits, dtype=np.float32)).ids.tolist()


# --- each step alone -----------------------------------------------------------------------

def test_top_k_keeps_the_k_largest_sorted():
    lg = [1.0, 5.0, 3.0, 4.0, 2.0]
    assert kept(only(top_k=2), lg) == [1, 3]
    assert kept(only(top_k=9), lg) == [1, 3, 2, 4, 0]   # k > n: all, sorted
    assert kept(only(top_k=0), lg) == [0, 1, 2, 3, 4]   # off: untouched order
    assert kept(only(top_k=-3), lg) == [0, 1, 2, 3, 4]  # negative is off, as in llama.cpp


def test_top_p_smallest_prefix_reaching_p():
    lg = logits_of([0.1, 0.4, 0.2, 0.3])  # sorted: id1 .4, id3 .3, id2 .2, id0 .1
    assert kept(only(top_p=0.3), lg) == [1]
    assert kept(only(top_p=0.65), lg) == [1, 3]          # .4 < .65 <= .7
    assert kept(only(top_p=0.75), lg) == [1, 3, 2]       # .7 < .75 <= .9
    assert kept(only(top_p=0.3, min_keep=3), lg) == [1, 3, 2]
    c = only(top_p=0.65).candidates(lg)                   # probs: softmax before the cut
    np.testing.assert_allclose(c.probs, [0.4, 0.3], rtol=1e-6)


def test_top_p_large_unsorted_vocab_takes_the_slow_path_correctly():
    # > 1024 candidates, unsorted: llama.cpp tries the top 256 first; a flat tail needs more.
    lg = np.zeros(3000, dtype=np.float32)
    lg[:10] = 3.0
    ids = kept(only(top_p=0.5), lg)
    p_top, p_rest = math.exp(3) / (10 * math.exp(3) + 2990), 1 / (10 * math.exp(3) + 2990)
    need = 10 + math.ceil((0.5 - 10 * p_top) / p_rest)
    assert len(ids) in (need, need + 1)  # float32 cumulative sum at the boundary
    assert ids[:10] == list(range(10))


def test_min_p_relative_to_the_top_probability():
    probs = [0.06, 0.5, 0.04, 0.3, 0.1]
    lg = logits_of(probs)
    # threshold 0.15 * 0.5 = 0.075: keeps .5, .3, .1 in their original (unsorted) order
    assert kept(only(min_p=0.15), lg) == [1, 3, 4]
    # min_keep 4 > 3 survivors: llama.cpp falls back to the sorted cut, keeping the top 4
    assert kept(only(min_p=0.15, min_keep=4), lg) == [1, 3, 4, 0]
    assert kept(only(min_p=1.0), lg) == [1]


def test_typical_keeps_the_tokens_nearest_the_entropy():
    probs = [0.5, 0.25, 0.125, 0.125]
    ent = -sum(p * math.log(p) for p in probs)            # 1.75 ln 2
    score = [abs(-math.log(p) - ent) for p in probs]      # id1 .17 < id0 .52 < id2 = id3 .87
    assert sorted(range(4), key=score.__getitem__)[:2] == [1, 0]
    lg = logits_of(probs)
    assert kept(only(typ_p=0.2), lg) == [1]               # .25 > .2
    assert kept(only(typ_p=0.5), lg) == [1, 0]            # .25 <= .5 < .75
    assert kept(only(typ_p=0.2, min_keep=2), lg) == [1, 0]


def test_temperature_scales_logits():
    lg = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    c = only(temp=0.5).candidates(lg)
    np.testing.assert_array_equal(c.logits, lg / np.float32(0.5))
    assert c.ids.tolist() == [0, 1, 2]  # nothing cut


def test_dynamic_temperature_from_entropy():
    probs = [0.75, 0.25]
    lg = logits_of(probs)
    h = -sum(p * math.log(p) for p in probs)
    t = 0.5 + (1.5 - 0.5) * (h / math.log(2)) ** 1.0     # temp 1 +- 0.5, exponent 1
    c = only(dynatemp_range=0.5).candidates(lg)
    np.testing.assert_allclose(c.logits, np.array(lg, dtype=np.float64) / t, rtol=1e-5)


def test_typical_survives_underflowing_probabilities():
    lg = np.array([0.0, -0.5, -1.0, -200.0, -np.inf], dtype=np.float32)  # p(3) = p(4) = 0
    # p = .507 .307 .186 0 0, entropy 1.020; |-log p - H| = .34 .16 .66 inf inf
    assert kept(only(typ_p=0.5), lg) == [1, 0]             # .307 <= .5 < .814


def test_temp_zero_is_argmax():
    rng = np.random.default_rng(3)
    for seed in range(5):
        s = Sampler(SamplerParams(temp=0.0, seed=seed))
        for _ in range(20):
            lg = rng.normal(size=300).astype(np.float32)
            assert s.sample(lg) == int(np.argmax(lg))


def test_penalties_on_a_history():
    lg = np.array([1.0, -1.0, 2.0, -0.5, 0.5], dtype=np.float32)
    s = only(penalty_repeat=2.0, penalty_freq=0.1, penalty_present=0.5, penalty_last_n=64)
    s.accept_many([2, 2, 3])
    c = s.candidates(lg)
    # id2 (seen twice, positive): 2/2 - (2*0.1 + 0.5); id3 (once, negative): -0.5*2 - (0.1 + 0.5)
    np.testing.assert_allclose(c.logits, [1.0, -1.0, 0.3, -1.6, 0.5], rtol=1e-6)
    # a window of 2 sees only [2, 3]: id2 once
    s2 = only(penalty_repeat=2.0, penalty_freq=0.1, penalty_present=0.5, penalty_last_n=2)
    s2.accept_many([2, 2, 3])
    np.testing.assert_allclose(s2.candidates(lg).logits[2], 1.0 - 0.6, rtol=1e-6)
    s2.reset()
    np.testing.assert_array_equal(s2.candidates(lg).logits, lg)
    # 0 = off; -1 = the whole history
    assert "penalties" not in only(penalty_repeat=2.0, penalty_last_n=0).describe()
    s3 = only(penalty_freq=1.0, penalty_last_n=-1)
    s3.accept_many([4] * 100)
    assert s3.candidates(lg).logits[4] == pytest.approx(0.5 - 100)


def test_sample_accepts_the_drawn_token_unless_told_not_to():
    lg = np.array([0.0, 5.0, 0.0], dtype=np.float32)
    s = only(temp=0.0, penalty_present=10.0)
    assert s.sample(lg, accept=False) == 1 and s.sample(lg) == 1  # nothing accepted yet
    assert s.sample(lg) == 0       # id1 is now present: 5 - 10 < 0


def test_xtc_drops_top_choices_but_the_last():
    lg = logits_of([0.5, 0.3, 0.15, 0.05])  # above 0.1: ids 0, 1, 2 -> keep from id2 on
    assert kept(only(xtc_probability=1.0, xtc_threshold=0.1), lg) == [2, 3]
    assert kept(only(xtc_probability=1.0, xtc_threshold=0.1, min_keep=3), lg) == [0, 1, 2, 3]


def test_top_n_sigma():
    lg = np.array([0.0, 1.0, 2.0, 3.0, 10.0], dtype=np.float32)
    std = math.sqrt(sum((x - 3.2) ** 2 for x in lg) / 5)   # 3.544
    c = only(top_n_sigma=1.0).candidates(lg)
    assert np.isfinite(c.logits).tolist() == [x >= 10 - std for x in lg]
    assert np.isfinite(only(top_n_sigma=3.0).candidates(lg).logits).all()


# --- the chain ------------------------------------------------------------------------------

def test_chain_order_matters():
    lg = logits_of([0.5, 0.3, 0.2])
    k_then_p = only(top_k=2, top_p=0.6, samplers=samplers_from_chars("kp"))
    p_then_k = only(top_k=2, top_p=0.6, samplers=samplers_from_chars("pk"))
    assert kept(k_then_p, lg) == [0]      # top-p renormalizes over 2: .625 >= .6
    assert kept(p_then_k, lg) == [0, 1]   # top-p over 3: .5 < .6 <= .8
    assert Sampler().describe() == "top-k -> top-p -> min-p -> temp-ext -> dist"


def test_default_params_match_llama_cpp():
    p = SamplerParams()
    assert (p.temp, p.top_k, p.top_p, p.min_p, p.typ_p) == (0.8, 40, 0.95, 0.05, 1.0)
    assert (p.penalty_repeat, p.penalty_last_n, p.penalty_freq, p.penalty_present) == \
        (1.0, 64, 0.0, 0.0)
    assert p.seed == 0xFFFFFFFF and samplers_from_chars("edskypmxt") == p.samplers


def test_same_seed_same_tokens_different_seed_different_tokens():
    lg = np.linspace(0, 2, 50).astype(np.float32)
    def draw(seed: int) -> list[int]:
        s = Sampler(SamplerParams(seed=seed))
        return [s.sample(lg) for _ in range(200)]

    assert draw(42) == draw(42)
    assert draw(42) != draw(43)
    s = Sampler(SamplerParams(seed=5))
    first = [s.sample(lg) for _ in range(50)]
    s.reset()
    assert [s.sample(lg) for _ in range(50)] == first
    rnd = Sampler()                                  # LLAMA_DEFAULT_SEED: a random seed ...
    again = Sampler(SamplerParams(seed=rnd.seed))    # ... that can be replayed
    assert [rnd.sample(lg) for _ in range(30)] == [again.sample(lg) for _ in range(30)]


def test_mt19937_matches_the_standard_sequence():
    # The C++ standard fixes the 10000th output of std::mt19937 default-seeded (5489).
    rng = StdMT19937(5489)
    assert int(rng.bitgen.random_raw(10000)[-1]) == 4123659995


def test_dist_frequencies_match_softmax():
    lg = np.array([0.0, 1.0, 2.0, -1.0, 0.5, 1.5], dtype=np.float32)
    p = np.exp(lg.astype(np.float64))
    p /= p.sum()
    n = 20000
    s = only(seed=123)
    counts = np.bincount([s.sample(lg) for _ in range(n)], minlength=lg.size)
    sigma = np.sqrt(n * p * (1 - p))
    assert (np.abs(counts - n * p) < 5 * sigma).all(), (counts, n * p)


# --- invalid parameters and inputs ----------------------------------------------------------

@pytest.mark.parametrize("kw, flag", [
    (dict(top_p=0.0), "--top-p"), (dict(top_p=1.5), "--top-p"),
    (dict(min_p=-0.1), "--min-p"), (dict(min_p=1.1), "--min-p"),
    (dict(temp=float("nan")), "--temp"), (dict(penalty_last_n=-2), "--repeat-last-n"),
    (dict(min_keep=-1), "--min-keep"), (dict(typ_p=2.0), "--typical"),
    (dict(penalty_repeat=0.0), "--repeat-penalty"), (dict(seed=-1), "--seed"),
    (dict(top_k=2.5), "--top-k"), (dict(samplers=("top_k", "nucleus")), "--samplers"),
    (dict(dry_multiplier=0.8), "--dry-multiplier"), (dict(mirostat=2), "--mirostat"),
])
def test_invalid_params_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        SamplerParams(**kw)


def test_invalid_logits():
    s = Sampler(SamplerParams(seed=1))
    with pytest.raises(ValueError, match="NaN"):
        s.sample(np.array([0.0, np.nan], dtype=np.float32))
    with pytest.raises(ValueError, match=r"\+inf at ids \[1\]"):
        s.sample(np.array([0.0, np.inf], dtype=np.float32))
    with pytest.raises(ValueError, match="1-D"):
        s.sample(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="-inf"):
        s.sample(np.full(4, -np.inf, dtype=np.float32))
    with pytest.raises(ValueError, match="--sampler-seq"):
        samplers_from_chars("kq")


def test_large_vocab_keeps_top_k():
    """A Gemma-sized vocabulary goes through the default chain (its speed is a benchmark's
    business, not a test's): what is left is top_k's 40 best at most, and the draw is one."""
    lg = np.random.default_rng(0).normal(size=262144).astype(np.float32) * 3
    s = Sampler(SamplerParams(seed=1, penalty_repeat=1.1))
    s.accept_many(range(64))
    left = s.candidates(lg)
    assert 1 <= len(left.ids) <= 40
    assert set(left.ids.tolist()) <= set(np.argsort(-lg)[:40 + 64].tolist())
    assert s.sample(lg) in set(left.ids.tolist())


# --- against llama.cpp's own samplers -------------------------------------------------------

TD = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


def lcpp_apply(L, smpl, logits: np.ndarray):
    """llama_sampler_apply on a llama_token_data_array of the raw logits: (kept ids, logits,
    probs, selected index)."""
    buf = np.zeros(logits.size, TD)
    buf["id"] = np.arange(logits.size)
    buf["logit"] = logits
    cur = L.llama_token_data_array(data=buf.ctypes.data_as(L.llama_token_data_p),
                                   size=logits.size, selected=-1, sorted=False)
    L.llama_sampler_apply(smpl, ctypes.byref(cur))
    off = (ctypes.cast(cur.data, ctypes.c_void_p).value - buf.ctypes.data) // TD.itemsize
    out = buf[off:off + cur.size]  # XTC moves the data pointer forward
    return out["id"].copy(), out["logit"].copy(), out["p"].copy(), cur.selected


def lcpp_chain(L, p: SamplerParams, n_vocab: int, dist: bool = True):
    """llama.cpp's common chain for `p` (common_sampler_init without grammar/logit bias)."""
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    make = {
        "penalties": lambda: L.llama_sampler_init_penalties(
            n_vocab, p.penalty_last_n, p.penalty_repeat, p.penalty_freq, p.penalty_present),
        "top_n_sigma": lambda: L.llama_sampler_init_top_n_sigma(p.top_n_sigma),
        "top_k": lambda: L.llama_sampler_init_top_k(p.top_k),
        "typ_p": lambda: L.llama_sampler_init_typical(p.typ_p, p.min_keep),
        "top_p": lambda: L.llama_sampler_init_top_p(p.top_p, p.min_keep),
        "min_p": lambda: L.llama_sampler_init_min_p(p.min_p, p.min_keep),
        "xtc": lambda: L.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold,
                                                p.min_keep, p.seed),
        "temperature": lambda: L.llama_sampler_init_temp_ext(p.temp, p.dynatemp_range,
                                                             p.dynatemp_exponent),
    }
    for name in p.samplers:
        if name != "dry":  # off (dry_multiplier 0): llama.cpp adds an empty sampler
            L.llama_sampler_chain_add(chain, make[name]())
    if dist:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(p.seed))
    return chain


STEP_CASES = [
    dict(top_k=5), dict(top_k=200), dict(top_p=0.9), dict(top_p=0.5, min_keep=20),
    dict(min_p=0.1), dict(min_p=0.3, min_keep=50), dict(typ_p=0.7), dict(typ_p=0.3, min_keep=9),
    dict(temp=0.7), dict(temp=0.0), dict(dynatemp_range=0.4, dynatemp_exponent=1.3),
    dict(top_n_sigma=1.5), dict(xtc_probability=1.0, xtc_threshold=0.02),
    dict(penalty_repeat=1.3, penalty_freq=0.2, penalty_present=0.4, penalty_last_n=16),
    # penalties on an already cut, sorted set (ids no longer their own positions)
    dict(top_k=30, penalty_repeat=1.5, penalty_last_n=40, top_p=0.9,
         samplers=samplers_from_chars("kep")),
]


STEP_SIZES = [64, 3000, 20000]


def case_id(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items())


def step_inputs(n: int):
    """The history and the 4 trials' raw logits a step case of vocabulary size `n` runs on."""
    rng = np.random.default_rng(n)
    hist = rng.integers(0, n, 40).tolist()
    hist[20:] = hist[:20]  # repeats, so counts reach 2
    return hist, [(rng.normal(size=n) * (1 + trial)).astype(np.float32) for trial in range(4)]


def lcpp_step(L, p: SamplerParams, n: int, hist: list[int], lg: np.ndarray):
    """llama.cpp's chain for `p` (no dist) after `hist`, applied to `lg`."""
    chain = lcpp_chain(L, p, n, dist=False)
    for t in hist:
        L.llama_sampler_accept(chain, t)
    ids, logits, probs, _ = lcpp_apply(L, chain, lg)
    L.llama_sampler_free(chain)
    return ids, logits, probs


@pytest.mark.parametrize("n", STEP_SIZES)
@pytest.mark.parametrize("kw", STEP_CASES, ids=case_id)
def test_each_step_matches_llama_cpp(kw, n):
    L = live()
    p = SamplerParams(**{**OFF, "seed": 11, **kw})
    hist, trials = step_inputs(n)
    if L is None:
        rec = recorded("sampling")["steps"][f"{case_id(kw)}|n={n}"]
    for trial, lg in enumerate(trials):
        s = Sampler(p)
        s.accept_many(hist)
        c = s.candidates(lg)
        if L is not None:
            assert_same_candidates(c, *lcpp_step(L, p, n, hist, lg))
        elif "ids" in rec[trial]:
            assert_same_candidates(c, *(array(rec[trial][k]) for k in ("ids", "logits", "probs")))
        else:  # too many kept to record: the set and its logits (bit-equal) by digest
            assert kept_digest(c.ids, c.logits) == rec[trial]["digest"]


def kept_digest(ids: np.ndarray, logits: np.ndarray) -> dict:
    """The kept set and its logits, in id order: their count and sha256."""
    order = np.argsort(ids, kind="stable")
    data = (np.asarray(ids, "<i4")[order].tobytes() +
            np.asarray(logits, "<f4")[order].tobytes())
    return {"n_kept": int(ids.size), "sha256": hashlib.sha256(data).hexdigest()}


def assert_same_candidates(c: Candidates, ids, logits, probs) -> None:
    """The same kept set, logits bit-equal, probs to 2 float32 ulp (glibc's expf is not always
    correctly rounded), the same order except neighbours swapped where their sort keys tie
    (std::sort is unstable; ties here keep index order)."""
    assert sorted(c.ids.tolist()) == sorted(ids.tolist())
    swapped = np.flatnonzero(c.ids != ids)
    assert swapped.size <= max(2, ids.size // 50), f"order differs at {swapped[:10]}"
    where = {t: i for i, t in enumerate(ids.tolist())}
    assert all(abs(where[int(c.ids[i])] - i) <= 2 for i in swapped)
    back = np.array([where[t] for t in c.ids.tolist()], dtype=np.int64)
    np.testing.assert_array_equal(c.logits, logits[back])
    if c.probs is not None:
        np.testing.assert_allclose(c.probs, probs[back], rtol=2.4e-7, atol=0)


CHAIN_CASES = [dict(), dict(penalty_repeat=1.2, penalty_present=0.3, top_k=0),
               dict(top_k=0, top_p=0.8, temp=1.3), dict(temp=0.0),
               dict(typ_p=0.9, xtc_probability=0.5, dynatemp_range=0.3)]


def chain_inputs() -> list[np.ndarray]:
    """The 60 raw logit vectors (vocabulary 2000) the seeded chains draw from."""
    rng = np.random.default_rng(9)
    return [(rng.normal(size=2000) * 2.5).astype(np.float32) for _ in range(60)]


def lcpp_draws(L, p: SamplerParams, inputs: list[np.ndarray]) -> list[int]:
    """The tokens llama.cpp's seeded chain for `p` draws from `inputs`, each accepted."""
    chain = lcpp_chain(L, p, inputs[0].size)
    theirs = []
    for lg in inputs:
        ids, _, _, sel = lcpp_apply(L, chain, lg)
        theirs.append(int(ids[sel]))
        L.llama_sampler_accept(chain, theirs[-1])
    L.llama_sampler_free(chain)
    return theirs


@pytest.mark.parametrize("kw", CHAIN_CASES)
def test_seeded_chain_draws_llama_cpp_tokens(kw):
    L = live()
    p = SamplerParams(**{"seed": 2024, **kw})
    inputs = chain_inputs()
    theirs = (lcpp_draws(L, p, inputs) if L is not None
              else recorded("sampling")["chains"][case_id(kw)])
    s = Sampler(p)
    ours = [s.sample(lg) for lg in inputs]
    assert ours == theirs
