"""The continuous-batching scheduler (graphs/serving/scheduler.py) on SmolLM2: choices run
together give each one's text alone, prompts reuse what any slot holds, a cancelled choice
frees its slot, a full queue refuses, and a full cache evicts idle slots, then ends a choice
with "length"."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ggraph.graphs.gguf.fetch import resolve_model
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.graphs.runtime.sampling import Sampler, SamplerParams
from ggraph.graphs.serving.requests import RequestError
from ggraph.graphs.serving.scheduler import Choice, Scheduler, SchedulerConfig

GREEDY = SamplerParams(temp=0.0)


class Run:
    """A choice and what it emitted."""

    def __init__(self, prompt, n, sampling=GREEDY, stops=(), cache_prompt=True):
        self.text, self.tokens, self.finish = [], [], None
        self.done = threading.Event()
        self.choice = Choice(list(prompt), n, Sampler(sampling), self.emit, stops,
                             cache_prompt=cache_prompt)
        self.started = threading.Event()

    def emit(self, ev):
        if ev.kind == "token":
            self.text.append(ev.text)
            if ev.token >= 0:
                self.tokens.append(ev.token)
            self.started.set()
        else:
            self.finish = ev.finish if ev.kind == "done" else ev.error
            self.done.set()

    def wait(self, s=120.0):
        assert self.done.wait(s), "the choice did not finish"
        return "".join(self.text)


@pytest.fixture(scope="module")
def engine():
    return Engine(resolve_model("default"), EngineConfig(n_ctx=1024, n_seq_max=3,
                                                         n_threads=2, flash_attn=True))


@pytest.fixture
def sched(engine):
    engine.reset()
    s = Scheduler(engine, SchedulerConfig(max_queue=4))
    yield s
    assert s.drain(30.0)


def chat(engine, text):
    return engine.tokenizer.encode(engine.tokenizer.chat(text))


def alone(engine, prompt, n, clear=0.3):
    """Greedy tokens of the prompt alone, up to the first step whose top-2 margin is under
    `clear` (where rounding may pick either: the texts are compared only where it is clear)."""
    engine.reset()
    out, logits = [], engine.eval(list(prompt))
    for _ in range(n):
        top = np.sort(logits)[-2:]
        t = int(np.argmax(logits))
        if top[1] - top[0] < clear or t in engine.eog:
            break
        out.append(t)
        logits = engine.eval([t])
    engine.reset()
    return out


def test_choices_together_give_each_ones_text_alone(engine, sched):
    prompts = [chat(engine, q) for q in ("What is 2+2?", "Name a color.", "Say hello.")]
    runs = [Run(p, 12, cache_prompt=False) for p in prompts]
    sched.submit([r.choice for r in runs])
    for r in runs:
        r.wait()
    got = [r.tokens for r in runs]
    assert sched.drain(30.0)
    want = [alone(engine, p, 12) for p in prompts]
    assert sum(map(len, want)) >= 6
    assert [g[:len(w)] for g, w in zip(got, want)] == want


def test_prefix_reuse_own_slot_and_across_slots(engine, sched):
    p = chat(engine, "What is the capital of France?")
    first = Run(p, 6)
    sched.submit([first.choice])
    a = first.wait()
    again = Run(p, 6)
    sched.submit([again.choice])
    assert again.wait() == a and again.choice.n_cached == len(p) - 1   # all but the last
    # a prompt that shares the chat template's system prompt with what slot holds
    q = chat(engine, "What is the capital of Spain?")
    shared = next(i for i, (x, y) in enumerate(zip(p, q)) if x != y)
    other = Run(q, 6)
    sched.submit([other.choice])
    text = other.wait()
    assert other.choice.n_cached == shared
    cold = Run(q, 6, cache_prompt=False)
    sched.submit([cold.choice])
    assert cold.wait() == text and cold.choice.n_cached == 0


def test_a_busy_slots_prefix_is_shared(engine, sched):
    long_gen = Run(chat(engine, "Write a long story about a dragon."), 200)
    sched.submit([long_gen.choice])
    assert long_gen.started.wait(60)
    q = chat(engine, "Write a long story about a dragon and a knight.")
    shared = next(i for i, (x, y) in enumerate(zip(long_gen.choice.prompt, q)) if x != y)
    r = Run(q, 4)
    sched.submit([r.choice])
    r.wait()
    assert r.choice.slot != long_gen.choice.slot and r.choice.n_cached == shared
    long_gen.choice.cancel()
    sched.wake()


def test_cancel_frees_the_slot_within_a_token(engine):
    engine.reset()
    sched = Scheduler(engine, SchedulerConfig(max_queue=8))
    runs = [Run(chat(engine, f"Count from {i} to 500."), 400) for i in range(3)]
    sched.submit([r.choice for r in runs])
    for r in runs:
        assert r.started.wait(60)
    waiting = Run(chat(engine, "Say hi."), 2)
    sched.submit([waiting.choice])
    assert sched.slots_info()[0]["is_processing"] and not waiting.done.is_set()
    runs[0].choice.cancel()
    sched.wake()
    waiting.wait(30)
    n = runs[0].choice.n_generated
    assert not runs[0].done.is_set()   # a cancelled choice gets no more events
    assert runs[1].choice.n_generated < 400
    for r in runs[1:]:
        r.choice.cancel()
    assert sched.drain(30.0)
    assert runs[0].choice.n_generated == n and runs[0].choice.finish == "cancelled"


def test_full_queue_refuses_with_503(engine):
    engine.reset()
    sched = Scheduler(engine, SchedulerConfig(max_queue=2))
    runs = [Run(chat(engine, "Count to 300."), 300) for _ in range(3)]
    sched.submit([r.choice for r in runs])     # 3 slots
    for r in runs:
        assert r.started.wait(60)
    sched.submit([Run([1, 2], 1).choice, Run([1, 2], 1).choice])   # 2 wait
    with pytest.raises(RequestError) as e:
        sched.submit([Run([1, 2], 1).choice])
    assert e.value.status == 503 and e.value.headers["Retry-After"]
    for r in runs:
        r.choice.cancel()
    assert sched.drain(60.0)
    with pytest.raises(RequestError) as e:
        sched.submit([Run([1, 2], 1).choice])
    assert e.value.status == 503 and e.value.code == "shutting_down"


def test_full_cache_evicts_idle_slots_then_ends_with_length():
    eng = Engine(resolve_model("default"), EngineConfig(n_ctx=256, n_seq_max=2, n_threads=2))
    sched = Scheduler(eng, SchedulerConfig(cross_slot_prefix=False))
    tok = eng.tokenizer
    a = Run(tok.encode("alpha " * 100), 2, cache_prompt=False)
    sched.submit([a.choice])
    a.wait()
    assert sched.slots_info()[a.choice.slot]["n_cached_tokens"] > 100
    # the other slot needs more cells than are free: the idle slot's cells go
    b = Run(tok.encode("beta " * 200), 4, cache_prompt=False)
    sched.submit([b.choice])
    b.wait()
    assert b.finish == "length" and b.choice.n_generated == 4
    assert sched.slots_info()[a.choice.slot]["n_cached_tokens"] == 0
    # two generating slots that fill the cache: one ends with "length", the other goes on
    c = Run(tok.encode("gamma " * 100), 200, SamplerParams(temp=1.0, seed=1),
            cache_prompt=False)
    d = Run(tok.encode("delta " * 100), 200, SamplerParams(temp=1.0, seed=2),
            cache_prompt=False)
    sched.submit([c.choice, d.choice])
    c.wait()
    d.wait()
    assert {c.finish, d.finish} == {"length"}
    # the first to end held the most cells when the cache filled; the other went on into
    # its cells once they were free
    assert max(c.choice.n_generated, d.choice.n_generated) > 256 - 2 * 101
    e = Run(tok.encode("epsilon"), 2)
    sched.submit([e.choice])
    e.wait()
    assert e.finish == "length" and sched.drain(30.0)


def test_prompts_arriving_together_share_their_common_start(engine, sched):
    """The second waits for the first to evaluate the shared system prompt, then copies it;
    its text is the one it gets without sharing."""
    system = "You are a careful assistant who answers in one short sentence. " * 6
    tok = engine.tokenizer

    def prompt(q):
        return tok.encode(tok.render([{"role": "system", "content": system},
                                      {"role": "user", "content": q}]))
    p, q = prompt("Name a fruit."), prompt("Name a tree.")
    shared = next(i for i, (x, y) in enumerate(zip(p, q)) if x != y)
    assert shared > 60
    a, b = Run(p, 4), Run(q, 4)
    sched.submit([a.choice, b.choice])
    a.wait()
    text = b.wait()
    assert a.choice.n_cached == 0 and b.choice.n_cached == shared
    cold = Run(q, 4, cache_prompt=False)
    sched.submit([cold.choice])
    assert cold.wait() == text


def test_a_failing_step_ends_its_choices_with_an_error_and_the_next_runs(engine, sched,
                                                                         monkeypatch):
    real = engine.decode
    calls = []

    def broken(batch):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a kernel failed")
        return real(batch)
    monkeypatch.setattr(engine, "decode", broken)
    a = Run(chat(engine, "Say hi."), 4)
    sched.submit([a.choice])
    a.wait()
    assert isinstance(a.finish, RequestError) and a.finish.status == 500
    assert "a kernel failed" in a.finish.message
    b = Run(chat(engine, "Say hi."), 4)
    sched.submit([b.choice])
    b.wait()
    assert b.finish in ("stop", "length") and b.tokens


def test_drafts_keep_the_text_and_are_accepted(engine, sched):
    """With a draft model (here the same model: every clear draft token is kept), the slots
    check their drafts in the decode batch; the greedy text is the one without drafts."""
    from ggraph.graphs.runtime.speculative import SpecParams
    from ggraph.graphs.serving.drafting import Drafter

    prompts = [chat(engine, q) for q in ("What is 2+2?", "Name three colors.")]
    plain = [Run(p, 16, cache_prompt=False) for p in prompts]
    sched.submit([r.choice for r in plain])
    for r in plain:
        r.wait()
    assert sched.drain(30.0)
    engine.reset()
    draft = Engine(resolve_model("default"), EngineConfig(n_ctx=1024, n_seq_max=3,
                                                          n_threads=2, flash_attn=True))
    drafter = Drafter.for_target(engine, draft, SpecParams(n_max=4))
    spec = Scheduler(engine, SchedulerConfig(), drafter)
    runs = [Run(p, 16, cache_prompt=False) for p in prompts]
    spec.submit([r.choice for r in runs])
    for r in runs:
        r.wait()
    assert spec.drain(30.0)
    for a, b, p in zip(plain, runs, prompts):
        want = alone(engine, p, 16)
        assert a.tokens[:len(want)] == want and b.tokens[:len(want)] == want
        assert b.finish == a.finish and len(b.tokens) == len(a.tokens)
    assert drafter.n_drafted >= 8 and drafter.n_accepted >= drafter.n_drafted // 2
    assert spec.slots_info()[0]["speculative"]
