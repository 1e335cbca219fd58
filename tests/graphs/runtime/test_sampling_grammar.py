"""The sampler with a grammar (graphs/runtime/sampling.py) follows llama.cpp's
common_sampler_sample: a drawn token the grammar allows costs one check and one draw; a refused
one is redrawn from the masked logits with the RNG's next number (so a seed gives llama.cpp's
tokens). The prompt never reaches the grammar; reset restarts it. A fake grammar, no engine."""
from __future__ import annotations

import numpy as np
import pytest

from ggraph.graphs.runtime.sampling import NoTokenAllowed, Sampler, SamplerParams


class OnlyEven:
    """Allows even token ids; counts what the sampler asked."""

    def __init__(self, n: int) -> None:
        self.n, self.masks, self.accepted, self.resets = n, 0, [], 0

    def allows(self, token: int) -> bool:
        return token % 2 == 0

    def mask(self) -> np.ndarray:
        self.masks += 1
        return np.arange(self.n) % 2 == 0

    def accept(self, token: int) -> None:
        assert token % 2 == 0
        self.accepted.append(token)

    def reset(self) -> None:
        self.resets += 1


PARAMS = SamplerParams(seed=11, temp=1.0, top_k=0, top_p=1.0, min_p=0.0)


def test_allowed_draw_costs_no_mask():
    g = OnlyEven(8)
    logits = np.full(8, -20.0, np.float32)
    logits[4] = 10.0
    s = Sampler(PARAMS, grammar=g)
    assert s.sample(logits) == 4 and g.masks == 0 and s.n_resampled == 0
    assert g.accepted == [4]


def test_refused_draw_is_redrawn_from_the_masked_logits_with_the_next_number():
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(0, 2, 16).astype(np.float32)
        g = OnlyEven(16)
        s = Sampler(PARAMS, grammar=g)
        plain = Sampler(PARAMS)
        first = plain.sample(logits, accept=False)
        tok = s.sample(logits)
        assert tok % 2 == 0
        if first % 2 == 0:
            assert tok == first and g.masks == 0
            continue
        assert g.masks == 1 and s.n_resampled == 1
        # llama.cpp: the second draw uses the RNG's next number on the masked logits
        ref = Sampler(PARAMS)
        ref.dist.rng.uniform_double()
        masked = np.where(np.arange(16) % 2 == 0, logits, -np.inf).astype(np.float32)
        assert tok == ref.sample(masked, accept=False)


def test_prompt_is_not_fed_to_the_grammar_and_reset_restarts_it():
    g = OnlyEven(8)
    s = Sampler(PARAMS, grammar=g)
    s.accept_many([1, 3, 5])           # odd: the grammar would refuse them
    assert g.accepted == []
    s.reset()
    assert g.resets == 1
    assert s.describe().startswith("grammar -> ")


def test_padding_rows_and_nothing_allowed():
    g = OnlyEven(6)                    # the vocabulary is shorter than the logits
    logits = np.zeros(8, np.float32)
    logits[7] = 50.0                   # a padding row: never sampled under a grammar
    assert Sampler(PARAMS, grammar=g).sample(logits) in (0, 2, 4)

    class Nothing(OnlyEven):
        def allows(self, token): return False
        def mask(self): return np.zeros(self.n, bool)
    with pytest.raises(NoTokenAllowed):
        Sampler(PARAMS, grammar=Nothing(8)).sample(np.zeros(8, np.float32))


def test_a_grammar_needs_the_vocabulary():
    with pytest.raises(ValueError, match="vocabulary"):
        Sampler(SamplerParams(grammar='root ::= "a"'))
    with pytest.raises(ValueError, match="GBNF text"):
        SamplerParams(grammar=5)


def test_top_k_of_masked_logits_keeps_llama_cpps_order():
    """A grammar's redraw runs top-k over logits that are nearly all -inf (262k on Gemma 3):
    the finite ones first by value, then -inf ties by position, as a full stable sort."""
    from ggraph.graphs.runtime.sampling import Candidates, TopK

    rng = np.random.default_rng(1)
    for n_finite in (1, 3, 39, 40, 500):
        logits = np.full(1 << 18, -np.inf, np.float32)
        logits[rng.choice(logits.size, n_finite, replace=False)] = rng.normal(size=n_finite)
        got = TopK(40).apply(Candidates.from_logits(logits)).ids
        ref = np.lexsort((np.arange(logits.size), -logits))[:40]
        assert np.array_equal(got, ref), n_finite
