"""Continuous batching: one thread runs the model for every client, a token boundary at a
time, as llama-server's update_slots does.

The KV cache holds `n_seq_max` sequences; slot i generates into sequence i. Each step the
scheduler
1. frees the slots whose client left (`Choice.cancel`: within one token);
2. gives waiting choices free slots: the slot whose cached tokens share the longest start
   with the prompt (else the least recently used), and, with a unified cache, the longest
   start any slot holds, shared by seq_cp instead of evaluated again (graphs/serving/prefix.py),
   or, when a slot still reading its prompt shares a longer start, that start once it is read;
3. builds one batch: the last sampled token of every generating slot (with a draft model,
   followed by the slot's draft, graphs/serving/drafting.py), then prompt tokens of
   the slots still reading theirs, at most `n_batch` in all and at most `prefill_chunk` while
   others are generating, so a long new prompt does not stall their tokens for long;
4. decodes it (on a full cache: drop the drafts, then idle slots' cached sequences, least
   recently used first, then take fewer prompt tokens, then end the slot holding the most
   cells with "length"), samples each slot's next token (and, while the draws equal its
   draft, the next ones) and hands it to the choice's `emit` callback.

Everything a client sees arrives through `emit` as `Event`s, called on the scheduler's
thread: the HTTP side posts them to its own event loop. A failure while decoding ends the
choices in that batch with an error event and the server goes on (the engine restores the
cache when a decode fails).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ggraph.graphs.models.batch import Batch
from ggraph.graphs.runtime.engine import NoKVSlot
from ggraph.graphs.runtime.sampling import Sampler
from ggraph.graphs.serving.drafting import Drafter
from ggraph.graphs.serving.metrics import Metrics
from ggraph.graphs.serving.prefix import PrefixIndex, common_prefix
from ggraph.graphs.serving.requests import RequestError
from ggraph.graphs.serving.textout import TextOut


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Event:
    """What a choice's client receives: "token" (text that is now safe to send; may be
    empty while a character or a stop string is incomplete), "done" (finish reason and
    counts) or "error"."""
    kind: str
    text: str = ""
    token: int = -1
    logprob: TokenLogprob | None = None
    finish: str | None = None
    error: RequestError | None = None


@dataclass
class Choice:
    """One sequence to generate (a request with n choices makes n of them)."""
    prompt: list[int]
    max_tokens: int                   # already capped by the context
    sampler: Sampler
    emit: Callable[[Event], None]
    stops: tuple[str, ...] = ()
    logprobs: int = 0                 # alternatives per token (0 with want_logprobs: chosen only)
    want_logprobs: bool = False
    cache_prompt: bool = True
    index: int = 0
    # filled in by the scheduler
    slot: int = -1
    n_cached: int = 0                 # prompt tokens reused from the cache
    n_generated: int = 0
    finish: str | None = None
    stopped_by: str | None = None
    t_queued: float = field(default_factory=time.perf_counter)
    t_started: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0
    _cancelled: bool = False

    def cancel(self) -> None:
        """The client left: the slot is freed at the next token boundary."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled


@dataclass
class Slot:
    id: int
    choice: Choice | None = None
    n_prompt: int = 0                 # prompt tokens of the choice in the cache
    pending: int | None = None        # sampled, evaluated at the next step
    out: TextOut | None = None
    last_used: float = 0.0
    # (slot, n): the first n prompt tokens come from that slot once it has evaluated them
    wait_for: tuple[int, int] | None = None

    @property
    def prefilling(self) -> bool:
        return self.choice is not None and self.n_prompt < len(self.choice.prompt)


@dataclass(frozen=True)
class SchedulerConfig:
    n_batch: int = 2048               # tokens one decode may take (llama-server's -b)
    prefill_chunk: int = 256          # prompt tokens a step while other slots generate
    max_queue: int = 64               # choices waiting for a slot before 503
    cross_slot_prefix: bool = True    # share a prefix another slot holds (unified cache)
    # wait for a slot still reading a prompt that shares at least this many more tokens
    min_shared_wait: int = 16


class Scheduler:
    def __init__(self, engine: Any, config: SchedulerConfig | None = None,
                 drafter: Drafter | None = None) -> None:
        self.engine = engine
        self.drafter = drafter
        self.cfg = config or SchedulerConfig()
        if self.cfg.n_batch < 1 or self.cfg.prefill_chunk < 1 or self.cfg.max_queue < 0:
            raise ValueError("n_batch and prefill_chunk must be at least 1, max_queue >= 0")
        n = engine.cfg.n_seq_max
        self.slots = [Slot(i) for i in range(n)]
        self.index = PrefixIndex(n)
        self.unified = engine.cache.n_stream == 1
        self.n_ctx_slot = engine.n_ctx_seq
        self.eog = engine.eog
        self.metrics = Metrics()
        self.queue: deque[Choice] = deque()
        self.cv = threading.Condition()
        self.accepting = True
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ggraph-scheduler", daemon=True)
        self._thread.start()

    # -- the client side (any thread) ---------------------------------------------------------
    def submit(self, choices: list[Choice]) -> None:
        """Queue a request's choices, all or none: 503 when the queue is full or the server
        is shutting down."""
        with self.cv:
            if not self.accepting:
                self.metrics.add(requests_rejected_total=1)
                raise RequestError("the server is shutting down", status=503,
                                   type="unavailable_error", code="shutting_down")
            free = sum(s.choice is None for s in self.slots)
            if len(self.queue) + len(choices) - free > self.cfg.max_queue:
                self.metrics.add(requests_rejected_total=1)
                raise RequestError(f"the server is busy ({len(self.queue)} choices waiting "
                                   f"for {len(self.slots)} slots); retry later", status=503,
                                   type="unavailable_error", code="queue_full",
                                   headers={"Retry-After": "1"})
            self.queue.extend(choices)
            self.metrics.add(requests_total=1)
            self.cv.notify()

    def wake(self) -> None:
        with self.cv:
            self.cv.notify()

    def drain(self, timeout: float | None = None) -> bool:
        """Stop accepting, let queued and running choices finish, stop the thread; True when
        everything finished within `timeout`."""
        with self.cv:
            self.accepting = False
            self.cv.notify()
        end = None if timeout is None else time.monotonic() + timeout
        while self.busy():
            if end is not None and time.monotonic() > end:
                break
            time.sleep(0.01)
        done = not self.busy()
        with self.cv:
            self._stop = True
            self.cv.notify()
        self._thread.join(timeout=5.0)
        return done

    def busy(self) -> bool:
        return bool(self.queue) or any(s.choice is not None for s in self.slots)

    def slots_info(self) -> list[dict[str, Any]]:
        """GET /slots: each slot's state, as llama-server's fields where it has them."""
        out = []
        for s in self.slots:
            c = s.choice
            out.append({"id": s.id, "n_ctx": self.n_ctx_slot,
                        "speculative": self.drafter is not None,
                        "is_processing": c is not None,
                        "state": "idle" if c is None else "prompt" if s.prefilling else
                        "generating",
                        "n_cached_tokens": self.index.held(s.id),
                        "n_prompt_tokens": len(c.prompt) if c else 0,
                        "n_decoded": c.n_generated if c else 0,
                        "next_token": {"has_next_token": c is not None and c.finish is None,
                                       "n_remain": (c.max_tokens - c.n_generated) if c else 0}})
        return out

    def gauges(self) -> dict[str, tuple[float, str]]:
        cache = self.engine.cache
        cells = cache.size * cache.n_stream
        busy = sum(s.choice is not None for s in self.slots)
        return {"requests_processing": (busy, "Slots busy."),
                "requests_deferred": (len(self.queue), "Choices waiting for a slot."),
                "requests_queued": (len(self.queue), "Choices waiting for a slot."),
                "kv_cache_cells_used": (cells - cache.n_free(), "KV cache cells in use."),
                "kv_cache_cells_total": (cells, "KV cache cells."),
                "kv_cache_usage_ratio": ((cells - cache.n_free()) / max(cells, 1),
                                         "KV cache cells in use over all cells.")}

    def counters(self) -> dict[str, tuple[float, str]]:
        """llama-server's speculative counters (zero without a draft model)."""
        d = self.drafter
        return {"spec_decode_num_drafts_total": (d.n_drafts if d else 0, "Drafts proposed."),
                "spec_decode_num_draft_tokens_total": (d.n_drafted if d else 0,
                                                       "Draft tokens proposed."),
                "spec_decode_num_accepted_tokens_total": (d.n_accepted if d else 0,
                                                          "Draft tokens accepted.")}

    # -- the scheduler thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self._stop and not self.queue and \
                        all(s.choice is None for s in self.slots):
                    self.cv.wait()
                if self._stop:
                    self._abort_all("the server stopped")
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not end the server
                self._fail_running(e)

    def step(self) -> None:
        """One token boundary: free, admit, batch, decode, sample."""
        now = time.perf_counter()
        for s in self.slots:
            if s.choice is not None and s.choice.cancelled:
                self._end(s, "cancelled", now)
        self._admit()
        self._resolve_waits()
        budget = self.cfg.n_batch
        drafts = self._drafts()
        while True:
            plan = self._plan(budget, drafts)
            if plan is None:
                return
            batch, rows, n_prompt = plan
            try:
                logits = self.engine.decode(batch)
            except NoKVSlot:
                if drafts:     # first the drafts go: they are only an optimisation
                    drafts = {}
                    continue
                budget = self._make_room(budget, n_prompt)
                continue
            break
        self.metrics.add(n_decode_total=1)
        with self.metrics.lock:
            self.metrics.n_tokens_max = max(self.metrics.n_tokens_max, len(batch.tokens))
        self._consume(batch, rows, logits)

    def _admit(self) -> None:
        while True:
            with self.cv:
                free = [s for s in self.slots if s.choice is None]
                if not self.queue or not free:
                    return
                c = self.queue.popleft()
            self._start(c, free)

    def _start(self, c: Choice, free: list[Slot]) -> None:
        """Put choice c into one of the free slots, reusing the longest cached start."""
        ids = [s.id for s in free]
        own = self.index.match(c.prompt, ids) if c.cache_prompt else [0] * len(self.slots)
        best = max(ids, key=lambda i: (own[i], -self.slots[i].last_used))
        if own[best] == 0:   # nothing to reuse: the least recently used slot
            best = min(ids, key=lambda i: self.slots[i].last_used)
        slot = self.slots[best]
        # at least the prompt's last token is evaluated, for its logits
        limit = len(c.prompt) - 1
        keep = min(own[best], limit)
        src = None
        if c.cache_prompt and self.unified and self.cfg.cross_slot_prefix:
            allm = self.index.match(c.prompt)
            other = max(range(len(self.slots)), key=lambda i: allm[i])
            if other != best and min(allm[other], limit) > keep:
                src, keep = other, min(allm[other], limit)
        eng = self.engine
        try:
            if src is not None:
                self._copy_start(src, best, c.prompt, keep)
            else:
                eng.cache.check_cut(best, keep)
                eng.seq_rm(best, keep, -1)
                self.index.cut(best, keep)
        except ValueError:   # a sliding window no longer holds that start: evaluate it all
            eng.seq_rm(best, -1, -1)
            self.index.cut(best, 0)
            keep = 0
        c.slot, c.n_cached, c.t_started = best, keep, time.perf_counter()
        c.sampler.accept_many(c.prompt)   # the penalties see the prompt, as llama-cli's
        slot.choice, slot.n_prompt, slot.pending = c, keep, None
        slot.wait_for = self._wait_target(c, best, keep, limit)
        slot.out = TextOut(eng.tokenizer, c.stops)
        slot.last_used = time.perf_counter()
        self.metrics.add(prompt_tokens_cached_total=keep)

    def _wait_target(self, c: Choice, sid: int, keep: int, limit: int
                     ) -> tuple[int, int] | None:
        """A slot still reading a prompt that starts with more of c's than any cache holds
        (requests with one long system prompt arriving together; the n choices of one
        request): c waits for those tokens instead of evaluating them again."""
        if not (c.cache_prompt and self.unified and self.cfg.cross_slot_prefix):
            return None
        best: tuple[int, int] | None = None
        mine = np.asarray(c.prompt, np.int32)
        for o in self.slots:
            if o.id == sid or not o.prefilling or o.wait_for is not None:
                continue
            assert o.choice is not None
            n = min(common_prefix(mine, np.asarray(o.choice.prompt, np.int32)), limit)
            if n - keep >= self.cfg.min_shared_wait and (best is None or n > best[1]):
                best = (o.id, n)
        return best

    def _copy_start(self, src: int, dst: int, prompt: list[int], n: int) -> None:
        """Slot dst's sequence becomes the first n tokens of `prompt`, shared from slot src's
        cells by seq_cp; ValueError (nothing changed) where src's sliding window no longer
        holds them."""
        self.engine.cache.check_cut(src, n)
        self.engine.seq_rm(dst, -1, -1)
        self.engine.seq_cp(src, dst, 0, n)
        self.index.set(dst, prompt[:n])

    def _resolve_waits(self) -> None:
        """Waiting slots whose source has evaluated the shared tokens (or stopped reading)
        take what it holds of them by seq_cp, then read the rest themselves."""
        for s in self.slots:
            if s.wait_for is None or s.choice is None:
                s.wait_for = None
                continue
            o, n = s.wait_for
            src = self.slots[o]
            held = min(common_prefix(np.asarray(s.choice.prompt[:n], np.int32),
                                     self.index.tokens[o]), n)
            if held < n and src.prefilling and src.wait_for is None:
                continue          # still coming
            s.wait_for = None
            if held <= s.n_prompt:
                continue
            try:
                self._copy_start(o, s.id, s.choice.prompt, held)
            except ValueError:
                continue
            self.metrics.add(prompt_tokens_cached_total=held - s.n_prompt)
            s.choice.n_cached = held
            s.n_prompt = held

    def _plan(self, budget: int, drafts: dict[int, list[int]]
              ) -> tuple[Batch, list[tuple[Slot, bool, list[int]]], int] | None:
        """The step's batch: tokens, positions, sequences, logits flags; per group of logits
        rows its slot, whether it ends a prompt, and the draft it checks (a generating slot's
        last token and its draft each give a row). None when nothing is to run."""
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[tuple[int, ...]] = []
        want: list[bool] = []
        rows: list[tuple[Slot, bool, list[int]]] = []
        for s in self.slots:
            if s.choice is not None and s.pending is not None:
                d = drafts.get(s.id, [])
                p0 = self.index.held(s.id)
                toks.extend([s.pending, *d])
                pos.extend(range(p0, p0 + 1 + len(d)))
                seqs.extend([(s.id,)] * (1 + len(d)))
                want.extend([True] * (1 + len(d)))
                rows.append((s, False, d))
        room = budget - len(toks)
        if toks:
            room = min(room, self.cfg.prefill_chunk)
        n_prompt = 0
        for s in sorted((s for s in self.slots if s.prefilling and s.wait_for is None),
                        key=lambda s: s.choice.t_queued):   # type: ignore[union-attr]
            if room <= 0:
                break
            c = s.choice
            assert c is not None
            k = min(room, len(c.prompt) - s.n_prompt)
            p0 = self.index.held(s.id)
            toks.extend(c.prompt[s.n_prompt:s.n_prompt + k])
            pos.extend(range(p0, p0 + k))
            seqs.extend([(s.id,)] * k)
            last = s.n_prompt + k == len(c.prompt)
            want.extend([False] * (k - 1) + [last])
            if last:
                rows.append((s, True, []))
            room -= k
            n_prompt += k
        if not toks:
            return None
        return Batch(toks, pos, seqs, want), rows, n_prompt

    def _drafts(self) -> dict[int, list[int]]:
        """With a draft model: each generating slot's draft, as long as its context and
        max_tokens leave room for."""
        if self.drafter is None:
            return {}
        wants = {}
        for s in self.slots:
            c = s.choice
            if c is None or s.pending is None:
                continue
            held = self.index.held(s.id)
            n = min(self.n_ctx_slot - held - 2, c.max_tokens - c.n_generated - 1)
            if n > 0:
                wants[s.id] = ([*self.index.tokens[s.id].tolist(), s.pending], n)
        return self.drafter.propose(wants)

    def _make_room(self, budget: int, n_prompt: int) -> int:
        """After NoKVSlot: free an idle slot's cells (least recently used), else take fewer
        prompt tokens, else end the generating slot that holds the most cells."""
        idle = [s for s in self.slots if s.choice is None and self.index.held(s.id) > 0]
        if idle:
            s = min(idle, key=lambda s: s.last_used)
            self.engine.seq_rm(s.id, -1, -1)
            self.index.cut(s.id, 0)
            return budget
        if n_prompt > 1:
            return max(1, budget - (n_prompt + 1) // 2)
        busy = [s for s in self.slots if s.choice is not None]
        if not busy:
            raise RuntimeError("the KV cache is full with no sequence in it")
        s = max(busy, key=lambda s: self.index.held(s.id))
        self._end(s, "length", time.perf_counter())
        return budget

    def _consume(self, batch: Batch, rows: list[tuple[Slot, bool, list[int]]],
                 logits: np.ndarray) -> None:
        now = time.perf_counter()
        # the evaluated tokens now sit in each slot's sequence (a slot's are consecutive)
        per: dict[int, list[int]] = {}
        for tok, ids in zip(batch.tokens, batch.seq_ids or ()):
            per.setdefault(ids[0], []).append(int(tok))
        n_prompt = 0
        base: dict[int, int] = {}
        for sid, toks in per.items():
            s = self.slots[sid]
            base[sid] = self.index.held(sid)
            self.index.append(sid, toks)
            if s.pending is not None:     # a generating slot's token (and its draft)
                s.pending = None
            else:
                s.n_prompt += len(toks)
                n_prompt += len(toks)
        self.metrics.add(prompt_tokens_total=n_prompt)
        row = 0
        for s, ends_prompt, draft in rows:
            n_rows = 1 + len(draft)
            c = s.choice
            if c is not None and ends_prompt:
                self.metrics.add(prompt_seconds_total=now - c.t_started)
            if c is not None:
                first = self.index.held(s.id) if ends_prompt else base[s.id] + 1
                kept = self._take(s, logits[row:row + n_rows], draft, now, first)
                if draft:
                    # the rejected part of the draft leaves the cache
                    cut = base[s.id] + 1 + kept
                    if cut < self.index.held(s.id):
                        self.engine.seq_rm(s.id, cut, -1)
                        self.index.cut(s.id, cut)
                    if self.drafter is not None:
                        self.drafter.accepted(kept)
            row += n_rows

    def _take(self, s: Slot, logits: np.ndarray, draft: list[int], now: float,
              pos: int) -> int:
        """Sample the slot's next tokens from its rows: the first, and while it equals the
        draft token of its row, the next (the target's own draw each time, so the text is the
        one without a draft). `pos`: where the first sampled token would go in the cache.
        Returns the draft tokens kept."""
        for i in range(len(draft) + 1):
            tok = self._next_token(s, logits[i], now, pos + i)
            if tok is None:            # the choice ended
                return i
            if i < len(draft) and tok == draft[i]:
                continue               # already in the cache: go on to its row
            s.pending = tok
            return i
        return len(draft)

    def _next_token(self, s: Slot, logits: np.ndarray, now: float, pos: int) -> int | None:
        """Sample and hand out one token; None when the choice ends with it."""
        c = s.choice
        assert c is not None and s.out is not None
        tok = int(c.sampler.sample(logits))
        if c.n_generated == 0:
            c.t_first = now
        else:
            self.metrics.add(tokens_predicted_seconds_total=now - s.last_used)
        s.last_used = now
        c.n_generated += 1
        self.metrics.add(tokens_predicted_total=1)
        lp = _logprob(logits, tok, c.logprobs) if c.want_logprobs else None
        if tok in self.eog:
            self._end(s, "stop", now)
            return None
        text = s.out.add(tok)
        c.emit(Event("token", text=text, token=tok, logprob=lp))
        if s.out.stopped_by is not None:
            c.stopped_by = s.out.stopped_by
            self._end(s, "stop", now)
            return None
        if c.n_generated >= c.max_tokens or pos + 1 >= self.n_ctx_slot:
            self._end(s, "length", now)
            return None
        return tok

    def _end(self, s: Slot, why: str, now: float) -> None:
        c = s.choice
        if c is None:
            return
        c.finish, c.t_done = why, now
        rest = s.out.finish() if s.out is not None and why != "cancelled" else ""
        s.choice, s.pending, s.out, s.last_used, s.wait_for = None, None, None, now, None
        if why != "cancelled":
            if rest:
                c.emit(Event("token", text=rest))
            c.emit(Event("done", finish=why))

    def _fail_running(self, e: Exception) -> None:
        err = RequestError(f"generation failed: {type(e).__name__}: {e}", status=500,
                           type="server_error", code="internal_error")
        for s in self.slots:
            c = s.choice
            if c is not None:
                s.choice, s.pending, s.out, s.wait_for = None, None, None, None
                self.engine.seq_rm(s.id, -1, -1)
                self.index.cut(s.id, 0)
                c.finish = "error"
                c.emit(Event("error", error=err))

    def _abort_all(self, why: str) -> None:
        err = RequestError(why, status=503, type="unavailable_error", code="shutting_down")
        for c in list(self.queue) + [s.choice for s in self.slots if s.choice is not None]:
            c.finish = "error"
            c.emit(Event("error", error=err))
        self.queue.clear()
        for s in self.slots:
            s.choice = None


def _logprob(logits: np.ndarray, tok: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability under the model's distribution, and the `top`
    most likely tokens with theirs."""
    x = logits.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    alts: tuple[tuple[int, float], ...] = ()
    if top > 0:
        idx = np.argpartition(-x, min(top, x.size - 1))[:top]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        alts = tuple((int(i), float(x[i] - lse)) for i in idx)
    return TokenLogprob(tok, float(x[tok] - lse), alts)
