"""Speculative decoding (graphs/runtime/speculative.py): greedy output equals the target's own
greedy output whatever the draft proposes (a perfect draft, a useless one, a draft that is
right every other token), the acceptance figures add up, sampling keeps going with the
target's sampler, and an incompatible draft is refused in one line."""
from __future__ import annotations

import numpy as np
import pytest

from ggraph.graphs.gguf.fetch import default_model, fetch_model
from ggraph.graphs.models.batch import Batch
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.graphs.runtime.sampling import Sampler, SamplerParams
from ggraph.graphs.runtime.speculative import SpecParams, Speculator, draft_probability

N = 40


@pytest.fixture(scope="module")
def target():
    return Engine(str(default_model()), EngineConfig(n_ctx=256))


@pytest.fixture(scope="module")
def prompt(target):
    return target.tokenizer.encode("def quicksort(arr):\n    if len(arr) <= 1:\n")


@pytest.fixture(scope="module")
def greedy(target, prompt):
    target.reset()
    return list(target.generate(prompt, N, stop_at_eos=False))


class ScriptedDraft:
    """A draft 'model' with the target's vocabulary whose next-token choice is given by a
    function of the tokens so far: it decodes nothing real."""

    def __init__(self, target: Engine, choose) -> None:
        self.tokenizer = target.tokenizer
        self.choose = choose
        self.tokens: list[int] = []
        self.n_vocab = target.model.hp.n_vocab

    def reset(self) -> None:
        self.tokens = []

    def seq_rm(self, s: int, p0: int, p1: int) -> None:
        del self.tokens[p0:]

    def decode(self, batch: Batch) -> np.ndarray:
        assert list(batch.pos) == list(range(len(self.tokens), len(self.tokens) +
                                             len(batch.tokens))), "the draft's positions"
        self.tokens += [int(t) for t in batch.tokens]
        logits = np.zeros((1, self.n_vocab), np.float32)
        logits[0, self.choose(self.tokens)] = 20.0
        return logits


@pytest.mark.parametrize("kind", ["perfect", "useless", "half"])
def test_greedy_output_is_the_targets_whatever_the_draft(target, prompt, greedy, kind):
    truth = prompt + greedy

    def choose(toks: list[int]) -> int:
        n = len(toks)
        right = truth[n] if n < len(truth) else 0
        if kind == "perfect" or (kind == "half" and n % 2 == 0):
            return right
        return (right + 1) % 1000

    spec = Speculator(target, ScriptedDraft(target, choose), SpecParams(n_max=4))
    out = list(spec.generate(prompt, N, stop_at_eos=False))
    assert out == greedy
    st = spec.stats
    assert st.n_predict == N and st.n_accept == sum(st.accepted_per_round)
    assert st.n_predict == st.n_accept + st.n_rounds      # one target token per round
    if kind == "perfect":
        assert st.accept_pct == 100.0 and st.n_rounds <= -(-N // 5) + 1
    elif kind == "useless":
        assert st.n_accept == 0 and st.n_rounds == N
    else:
        assert 0 < st.n_accept < st.n_drafted


def test_the_real_draft_model_and_llama_cpp_s_summary(target, prompt, greedy):
    """SmolLM2 drafting for itself with a q8_0 cache: most drafts accepted."""
    draft = Engine(str(default_model()), EngineConfig(n_ctx=256, type_k="q8_0",
                                                      type_v="q8_0", flash_attn=True))
    spec = Speculator(target, draft, SpecParams(n_max=3))
    assert list(spec.generate(prompt, N, stop_at_eos=False)) == greedy
    assert spec.stats.accept_pct > 50   # 78% measured: its q8_0 cache flips close calls
    lines = spec.stats.lines(3)
    assert lines[0] == "n_draft   = 3" and lines[-1].startswith("accept    = ")


def test_p_min_and_n_min_shorten_or_drop_drafts(target, prompt, greedy):
    spec = Speculator(target, ScriptedDraft(target, lambda t: 5), SpecParams(n_max=4, n_min=5))
    assert list(spec.generate(prompt, 8, stop_at_eos=False)) == greedy[:8]
    assert spec.stats.n_drafted == 0          # every draft shorter than n_min: dropped
    # the scripted logits give the pick a probability of ~1, above any p_min below 1
    assert draft_probability(np.array([0.0, 3.0, 3.0, 1.0]))[0] == 1
    assert draft_probability(np.zeros(50))[1] == pytest.approx(0.1)


def test_sampling_follows_the_targets_sampler(target, prompt):
    """With a sampler every emitted token is the target sampler's draw: the same seed gives
    the same text with a perfect draft as with no draft at all."""
    params = SamplerParams(temp=0.8, seed=7)
    target.reset()
    alone = list(target.generate(prompt, 20, stop_at_eos=False, sampler=Sampler(params)))
    truth = prompt + alone
    draft = ScriptedDraft(target, lambda t: truth[len(t)] if len(t) < len(truth) else 0)
    spec = Speculator(target, draft, SpecParams(n_max=3))
    assert list(spec.generate(prompt, 20, Sampler(params), stop_at_eos=False)) == alone
    assert spec.stats.n_accept > 0


def test_incompatible_draft_and_bad_settings(target):
    qwen = Engine(str(fetch_model("qwen2.5-coder-0.5b")), EngineConfig(n_ctx=64))
    with pytest.raises(ValueError, match="cannot speculate for the target: the BOS tokens differ"):
        Speculator(target, qwen)
    with pytest.raises(ValueError, match="--draft-p-min must be in"):
        SpecParams(p_min=2.0)
