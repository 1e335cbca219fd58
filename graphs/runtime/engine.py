"""Running a model: load, reserve the compute buffer on the worst-case graph, then evaluate
ubatches and generate tokens greedily, with memory figures in llama.cpp's wording.

The worst case is what llama.cpp reserves: n_tokens = min(n_ctx, n_ubatch), n_kv = n_ctx and
every token an output. Later graphs attend to the first n_kv cells (the used cells rounded up
to KV_PAD) and are placed into the reserved offsets; a decode graph is reused while its n_kv
holds, so a generated token costs one pass over bound kernel calls.

The KV cache is whatever the architecture's `new_cache` gives (one cache, or llama.cpp's iswa
pair for sliding-window models), with cells for n_seq_max sequences; the engine uses only what
every cache offers (place, n_kv, the sequence operations, k/v, summary_lines:
graphs/models/kv_cache.py). `decode(batch)` evaluates a batch of tokens of any sequences
(graphs/models/batch.py), as llama_decode; `eval` and `generate` are sequence 0 on top of
it. A model whose tokenizer ggraph cannot build yet still loads and runs on token ids;
`Engine.tokenizer` raises the tokenizer's error.

Before anything is allocated the KV cache and compute buffer are compared with the memory
available (ggraph/plan/host_memory.py); before every evaluation one fstat checks that the mapped
file did not change (a truncated mapping would be SIGBUS). When generation fills the context,
`make_room` shifts it as llama-cli does (keep n_keep tokens, discard half of the rest: seq_rm
and seq_add, then the K-shift re-ropes the moved cells: kv_cache.shift_graph), or generation
stops cleanly.

This file owns the model side (graphs, the KV cache's sequence, thread turns); the settings
(EngineConfig) are engine_config.py's, and the devices are one Runner (backends/runner.py): a
Session on one backend or a MultiSession over several, chosen once by engine_config's
`new_runner` and used the same way after that.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Iterator, Protocol

import numpy as np

from ggraph.plan.alloc import Plan
from ggraph.backends import registry
from ggraph.backends.observe import Observer
from ggraph.backends.runner import ComputeBuffer, MemoryFigures, ModelMemory, Runner
from ggraph.plan.host_memory import check_buffers
from ggraph.ir.tensor import Context

from ggraph.graphs.models.arch import KShift, build_model, supports
from ggraph.graphs.gguf.gguf_file import GGUFError, load_gguf, lock_memory
from ggraph.graphs.models.batch import Batch, UBatch, check_tokens, prepare
from ggraph.graphs.models.lora_gguf import WeightFiles, load_loras
from ggraph.graphs.models.kv_cache import (UNIFIED, StreamRange, copy_graph, shift_graph,
                                           stream_size, worst_ubatch)
from ggraph.graphs.models.model_graph import ModelGraph
from ggraph.graphs.runtime.memory_words import memory_lines
# EngineConfig is imported from here too (most callers do)
from ggraph.graphs.runtime.engine_config import EngineConfig, Timings, new_runner
from ggraph.graphs.deploy.placement import place_tensors
from ggraph.graphs.gguf.tensor_check import check_tensors
from ggraph.graphs.tokenizers.tokenizer import Tokenizer


class NoKVSlot(RuntimeError):
    """The KV cache has too few free cells for a ubatch (llama_decode's return code 1); the
    cache is as it was before the batch."""


class TokenSampler(Protocol):
    """What Engine.generate needs of a sampler (graphs/runtime/sampling.py's Sampler is one)."""

    def sample(self, logits: np.ndarray) -> int:
        """The next token (accepted into the sampler's history)."""
        ...

    def accept_many(self, tokens: Iterable[int]) -> None:
        ...


class Engine:
    def __init__(self, path: str, config: EngineConfig | None = None,
                 progress: bool = False) -> None:
        cfg = self.cfg = config or EngineConfig()
        # threads may share an Engine: eval, reset and each step of generate hold the lock,
        # so callers take turns; _kv_epoch counts changes of the KV cache, which generate
        # checks between its tokens
        self.lock = threading.RLock()
        self._kv_epoch = 0
        self.file = load_gguf(path, progress=progress, mmap=cfg.use_mmap)
        # what loading had to say without failing (llama.cpp's warnings), for the caller
        self.load_warnings: list[str] = []
        if cfg.use_mlock and (warning := lock_memory(self.file)):
            self.load_warnings.append(warning)
        if cfg.check_tensors:
            check_tensors(self.file)
        self.model = build_model(self.file)
        if cfg.loras:
            self.model.set_loras(load_loras(cfg.loras, self.file.arch, cfg.devices))
        hp = self.model.hp
        if cfg.n_ctx <= 0 or cfg.n_ubatch <= 0:
            raise ValueError("context and ubatch sizes must be positive")
        if cfg.n_ctx > hp.n_ctx_train:
            raise ValueError(f"context {cfg.n_ctx} is larger than the model's training context "
                             f"{hp.n_ctx_train} ({path})")
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_error: GGUFError | None = None
        try:
            self._tokenizer = Tokenizer(self.file.metadata, path)
        except GGUFError as e:
            # a vocabulary type ggraph does not build yet (the message says "not supported")
            # leaves the model usable on token ids; a broken vocabulary still fails the load
            if "not supported" not in str(e):
                raise
            self._tokenizer_error = e
        self.ctx = Context("engine")
        # a sliding-window cache is sized from the ubatch (llama.cpp: n_swa + n_ubatch)
        self.cache = self.model.new_cache(
            self.ctx, stream_size(cfg.n_ctx, cfg.n_seq_max, cfg.kv_unified), cfg.type_k,
            cfg.type_v, cfg.flash_attn, n_ubatch=cfg.n_ubatch, swa_full=cfg.swa_full,
            n_seq_max=cfg.n_seq_max, unified=cfg.kv_unified)
        kw: dict[str, Any] = {}
        host = registry.kind(cfg.backend).threads   # the CPU backend: threads, packed weights
        if host and cfg.n_threads:
            kw["n_threads"] = cfg.n_threads
        if host and not cfg.adaptive_threads:
            kw["adaptive"] = False
        if host:   # packed copies read from the file, not its mapping (adapters: own bytes)
            kw["weights"] = WeightFiles(self.file) if self.model.loras else self.file
        if cfg.ggml_exact:
            if not host:
                raise ValueError("ggml_exact reproduces ggml's CPU arithmetic: CPU backend only")
            kw["ggml_exact"] = True
        # one runner, one device or many: the rest of the Engine never asks which
        self.runner, self.layers = new_runner(cfg, hp.n_layer, kw, self.file)
        self.timings = Timings()
        self.stop_reason = "n_predict"  # why the last generate() ended (see generate)
        self.compiled = 0  # numba functions the warmup compiled (not found in numba's cache)
        self._graphs: dict[tuple[int, int, int, StreamRange], ModelGraph] = {}
        # the worst case's compute buffer per device (the host last)
        self.reserve_plans = self.reserve()
        self.check_host_memory()
        self.warmup_s = self.warmup() if cfg.warmup else 0.0

    @property
    def tokenizer(self) -> Tokenizer:
        """The GGUF's tokenizer; for a vocabulary ggraph cannot build yet, its load error."""
        if self._tokenizer is None:
            assert self._tokenizer_error is not None
            raise GGUFError(f"{self._tokenizer_error} (the model itself loaded: evaluate "
                            f"token ids with Engine.eval)")
        return self._tokenizer

    @property
    def eos(self) -> int | None:
        """The end-of-sequence id: the tokenizer's, or the GGUF key without a tokenizer."""
        if self._tokenizer is not None:
            return self._tokenizer.eos
        v = self.file.metadata.get("tokenizer.ggml.eos_token_id")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    @property
    def eog(self) -> frozenset[int]:
        """The ids that end generation (llama.cpp's EOG set: eos, eot, eom and the end-of-turn
        tokens found by text); just the EOS id without a tokenizer."""
        if self._tokenizer is not None:
            return self._tokenizer.eog_ids
        return frozenset() if self.eos is None else frozenset([self.eos])

    @property
    def reserve_plan(self) -> Plan:
        """The host's compute buffer Plan: the only one without devices."""
        return self.reserve_plans[-1].plan

    @property
    def session(self) -> Runner:
        """The runner (its older name; benchmarks and tests read its placement and plans)."""
        return self.runner

    @property
    def device_names(self) -> list[str]:
        return self.runner.names

    def _place(self, graph: Any) -> None:
        """Put the weights and cache tensors of a new graph on their layer's device; a tensor
        keeps its first device (decode's derived weights are placed by name on theirs)."""
        placed = self.runner.placement
        for t, d in place_tensors(graph.leafs, self.layers).items():
            if t not in placed:
                self.runner.place(t, d)

    # -- memory -------------------------------------------------------------------------------
    @property
    def n_ctx_seq(self) -> int:
        """The positions one sequence can hold: the context, or its stream's share of it."""
        return self.cache.size

    def build(self, n_tokens: int, n_kv: int, n_outputs: int,
              streams: StreamRange = UNIFIED) -> ModelGraph:
        key = (n_tokens, n_kv, n_outputs, streams)
        mg = self._graphs.pop(key, None)
        if mg is None:
            mg = self.model.build(self.ctx, self.cache, n_tokens, n_kv, n_outputs,
                                  self.cfg.flash_attn, self.cfg.amb_mib, streams=streams)
            self._place(mg.graph)
        self._graphs[key] = mg  # most recent last; a few kept (prompt and decode alternate)
        while len(self._graphs) > 4:
            self._graphs.pop(next(iter(self._graphs)))
        return mg

    def reserve(self) -> list[ComputeBuffer]:
        """Build the worst-case graph and size every device's compute buffer on it (with a
        stream per sequence: a ubatch of every stream, as llama.cpp reserves)."""
        n, streams = worst_ubatch(self.cfg.n_ctx, self.cfg.n_ubatch, self.cache.n_stream)
        if self.cfg.reserve_outputs not in ("all", "last"):
            raise ValueError(f"reserve_outputs must be 'all' or 'last', got "
                             f"{self.cfg.reserve_outputs!r}")
        n_out = n if self.cfg.reserve_outputs == "all" else 1
        mg = self.model.build(self.ctx, self.cache, n, self.cache.size, n_out,
                              self.cfg.flash_attn, self.cfg.amb_mib, streams=streams)
        self.worst_case = mg
        self._place(mg.graph)
        return self.runner.reserve(mg.graph)

    def load_notes(self) -> list[str]:
        """What loading has to say on stderr, terminal or not: llama.cpp's warnings, and the
        kernels the warmup compiled (a first run's load time is mostly that)."""
        notes = list(self.load_warnings)
        if self.compiled:
            notes.append(f"load: compiled {self.compiled} kernels in {self.warmup_s:.1f} s "
                         f"(numba caches them for later runs)")
        return notes

    def check_host_memory(self) -> None:
        """Compare what the host will allocate (its share of the KV cache, then its compute
        buffer) with the memory available, before either is allocated: a one-line
        HostMemoryError naming the buffer and the sizes, never numpy's MemoryError."""
        host = len(self.runner.names) - 1
        if self.runner.names[host] != "CPU":   # one device that is not the host (cuda)
            return
        placed = self.runner.placement
        kv = sum(t.nbytes for t in self.cache.k + self.cache.v if placed.get(t, 0) == host)
        check_buffers([("KV cache", kv), ("compute", self.reserve_plans[-1].size)])

    def memory_figures(self) -> MemoryFigures:
        """The runner's memory for the worst case, per device and buffer (bytes)."""
        return self.runner.memory_figures(ModelMemory(
            graph=self.worst_case.graph, mapped_bytes=self.file.tensor_bytes,
            kv=frozenset(self.cache.k + self.cache.v), layers=self.layers))

    def memory_lines(self) -> list[str]:
        """llama.cpp's memory lines for the worst case, per device (memory_words.py), with
        the cache's own summary lines."""
        return memory_lines(self.memory_figures(), self.cache.summary_lines())

    # -- evaluation ---------------------------------------------------------------------------
    def decode(self, batch: Batch, observe: Observer | None = None) -> np.ndarray:
        """Evaluate a batch of tokens of any sequences (llama_decode): the logits of the
        tokens whose flag is set, one row each in batch order. The batch is checked first
        (graphs/models/batch.py: a bad one changes nothing); a pending K-shift runs; then each
        ubatch (n_ubatch tokens in order, or equal shares of consecutive sequences with a
        cache stream per sequence) takes cells (NoKVSlot when they run out) and runs. On any
        error the cache is as it was before the batch. `observe`: each ubatch's graph runs
        observed (backends/observe.py: ggml's eval callback; not the K-shift's)."""
        with self.lock:
            ub_all = prepare(batch, self.model.hp.n_vocab, self.cfg.n_seq_max, self.cache)
            self.file.check_unchanged()  # one fstat: a truncated mapping would be SIGBUS
            self.apply_k_shift()
            self._kv_epoch += 1
            snap = self.cache.snapshot()
            out, places = [], []
            try:
                for ub in self.cache.split(ub_all, self.cfg.n_ubatch):
                    logits = self._run_ubatch(ub, observe)
                    if logits is not None:
                        out.append(logits)
                        places.append(ub.places[ub.out_rows])
            except BaseException:
                self.cache.restore(snap)
                raise
            if not out:
                return np.zeros((0, self.model.hp.n_vocab), np.float32)
            # one ubatch (every decode step): its rows as read, not concatenated into a copy
            rows = out[0] if len(out) == 1 else np.concatenate(out)
            where = places[0] if len(places) == 1 else np.concatenate(places)
            if where.size == 1:   # a decode step's one row
                return rows
            order = np.argsort(where, kind="stable")  # back in batch order
            return rows if np.all(order[1:] > order[:-1]) else rows[order]

    def _run_ubatch(self, ub: UBatch, observe: Observer | None = None) -> np.ndarray | None:
        """Place and run one ubatch; its wanted rows of logits (None when none is wanted:
        a runner with remote stages then overlaps the next ubatch with this one)."""
        slots = self.cache.place(ub)
        if slots is None:
            cells = self.cache.size * self.cache.n_stream
            raise NoKVSlot(f"no room in the KV cache for a ubatch of {len(ub)} tokens "
                           f"({self.cache.n_free()} of {cells} cells free, "
                           f"{self.cfg.n_seq_max} sequences): free cells with seq_rm, or make "
                           f"the context larger (-c)")
        rows = ub.out_rows if ub.out.any() else np.array([len(ub) - 1], np.int32)
        mg = self.build(len(ub), self.cache.n_kv(), len(rows), self.cache.streams_of(ub))
        self.runner.run(mg.graph, self.model.ubatch_inputs(mg, self.cache, ub, slots),
                        observe=observe)
        if not ub.out.any():
            return None
        return self.runner.read(mg.logits).reshape(len(rows), -1)

    def eval(self, tokens: list[int], all_logits: bool = False, n_past: int | None = None,
             observe: Observer | None = None) -> np.ndarray:
        """Append tokens to sequence 0; logits of the last token (or of every token).

        With `n_past`, the sequence is first cut back to its first n_past tokens (llama.cpp's
        seq_rm), so `eval(tokens, n_past=0)` is self-contained: its result does not depend on
        what other callers evaluated before. Calls from several threads take turns."""
        with self.lock:
            # checked before the cut: a bad list leaves the sequence as it was
            toks = check_tokens(tokens, self.model.hp.n_vocab)
            if n_past is not None:
                self.truncate(n_past)
            if self.cache.n_used + len(toks) > self.n_ctx_seq:
                raise ValueError(f"{self.cache.n_used + len(toks)} tokens exceed the context "
                                 f"of {self.n_ctx_seq}")
            wanted = np.ones(len(toks), bool) if all_logits else None
            logits = self.decode(Batch(toks, logits=wanted), observe)
            return logits if all_logits else logits[-1]

    def truncate(self, n_past: int) -> None:
        """Cut sequence 0 back to its first n_past tokens (llama.cpp's seq_rm(0, n_past, -1)).
        A sliding-window cache refuses (ValueError) once it no longer holds the window before
        n_past; the sequence is then unchanged."""
        with self.lock:
            if not 0 <= n_past <= self.cache.n_used:
                raise ValueError(f"n_past={n_past}: the sequence holds "
                                 f"{self.cache.n_used} tokens")
            self.cache.check_cut(0, int(n_past))
            self.cache.seq_rm(0, int(n_past), -1)
            self._kv_epoch += 1

    # -- sequences (llama.cpp's llama_memory_seq_*; ranges [p0, p1), negative = open) --------
    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> None:
        with self.lock:
            self.cache.seq_rm(s, p0, p1)
            self._kv_epoch += 1

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        with self.lock:
            self.cache.seq_cp(src, dst, p0, p1)
            self._kv_epoch += 1

    def seq_keep(self, s: int) -> None:
        with self.lock:
            self.cache.seq_keep(s)
            self._kv_epoch += 1

    def seq_add(self, s: int, p0: int, p1: int, delta: int) -> None:
        """Move positions [p0, p1) of sequence s by delta; the next decode re-ropes their
        cached K (the K-shift). A model that cannot re-rope refuses."""
        with self.lock:
            self._check_can_shift()
            self.cache.seq_add(s, p0, p1, delta)
            self._kv_epoch += 1

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        with self.lock:
            self._check_can_shift()
            self.cache.seq_div(s, p0, p1, d)
            self._kv_epoch += 1

    def seq_pos_min(self, s: int) -> int:
        return self.cache.seq_pos_min(s)

    def seq_pos_max(self, s: int) -> int:
        return self.cache.seq_pos_max(s)

    def _check_can_shift(self) -> None:
        if not self.can_shift:
            raise ValueError(f"positions cannot move: ggraph's {self.file.arch} builder "
                             f"cannot re-rope its cached K")

    def apply_k_shift(self) -> None:
        """Bring the cache's rows up to date at the start of a decode, as llama.cpp's update
        does: first the whole-stream copies of seq_cp across streams, then the K-shift
        (re-rope the cached K of cells whose positions moved)."""
        with self.lock:
            copies = copy_graph(self.cache.stream_copies())
            if copies is not None:
                self._run_cache_graph(copies, {})
            self.cache.reset_copies()
            moves = self.cache.k_shifts()
            if not moves:
                return
            built = shift_graph(self.ctx, moves, self.model.shift_k)
            if built is not None:
                self._run_cache_graph(*built)
            self.cache.reset_shift()

    def _run_cache_graph(self, graph: Any, values: dict) -> None:
        """Run a graph that rewrites cache rows in place (stream copies, the K-shift); if it
        fails, half-rewritten rows hold no sequence, so the cache is emptied."""
        self._place(graph)
        try:
            self.runner.run(graph, values)
        except BaseException:
            self.reset()
            raise

    def warmup(self) -> float:
        """Evaluate two decode tokens (the mat-vec paths; the decode graph's second run lays
        its calls out for the CPU's native loop, backends/cpu/native_loop.py) and a
        prompt-sized batch (the mat-mat and blockwise attention paths), each from an empty
        cache, then empty it; the seconds it took. Kernels compile here on the first run (`compiled` counts them); the
        timings do not count it. The decode step goes first: its graph already holds nearly
        every kernel the model needs (a product of each packed weight type, the attention),
        which then compile together, spread over the cores (backends/cpu/compile_ahead.py:
        Qwen2.5 1.5B's decode graph alone lacked 3 kernels of 12-16 s each, Zen 4)."""
        from ggraph.backends.compiles import counting

        with self.lock, counting() as compiles:
            t0 = time.perf_counter()
            tok = self.eos if self.eos is not None else 0
            n = max(1, min(16, self.cfg.n_ubatch, self.n_ctx_seq - 1))
            self.eval([tok], n_past=0)
            if self.n_ctx_seq > 2:
                self.eval([tok])
            if n > 1:
                self.reset()
                self.eval([tok] * n, n_past=0)
            self.reset()
        self.compiled = compiles.count
        return time.perf_counter() - t0

    def reset(self) -> None:
        with self.lock:
            self.cache.clear()
            self._kv_epoch += 1

    @property
    def can_shift(self) -> bool:
        """Whether the model can re-rope its cached K (the KShift capability)."""
        return supports(type(self.model), KShift)

    def shift_context(self, n_keep: int, n_discard: int) -> None:
        """llama-cli's context shift on sequence 0: positions n_keep..n_keep+n_discard-1
        leave the cache and the later ones move down by n_discard (llama.cpp's seq_rm +
        seq_add), their K re-roped by -n_discard (the K-shift, run now)."""
        with self.lock:
            if not self.can_shift:
                raise ValueError(f"the context cannot shift: ggraph's {self.file.arch} builder "
                                 f"cannot re-rope its cached K")
            n = self.cache.n_used
            if not 0 <= n_keep <= n_keep + n_discard <= n:
                raise ValueError(f"cannot discard positions {n_keep}..{n_keep + n_discard - 1} "
                                 f"of a sequence of {n} tokens")
            self.cache.seq_rm(0, n_keep, n_keep + n_discard)
            self.cache.seq_add(0, n_keep + n_discard, -1, -n_discard)
            self._kv_epoch += 1
            self.apply_k_shift()

    def make_room(self, n: int, n_keep: int | None) -> bool:
        """Room for n more tokens as llama-cli makes it (n_used + n < n_ctx): shift while
        the context would fill, keeping the first n_keep tokens and discarding half of the
        rest (n_discard = (n_used - n_keep) // 2); False when it stays full (no n_keep, a
        model that cannot shift, or nothing left to discard)."""
        with self.lock:
            while self.cache.n_used + n >= self.n_ctx_seq:
                if n_keep is None or not self.can_shift:
                    return False
                n_discard = (self.cache.n_used - min(n_keep, self.cache.n_used)) // 2
                if n_discard <= 0:
                    return False
                self.shift_context(min(n_keep, self.cache.n_used), n_discard)
            return True

    def generate(self, prompt: list[int], n_predict: int, stop_at_eos: bool = True,
                 sampler: TokenSampler | None = None, n_keep: int | None = None,
                 observe: Observer | None = None) -> Iterator[int]:
        """Decoding: yields each new token, continuing the current sequence. Greedy without a
        sampler; with one (graphs/runtime/sampling.py's Sampler), the prompt's tokens are accepted
        into its history first, as llama-cli does, and each token is its `sample(logits)`.

        When the next token would fill the context (llama-cli's n_past + 1 >= n_ctx), the
        context shifts when `n_keep` is given and the model can (shift_context: the first
        n_keep tokens stay, half of the rest goes), else generation stops. `stop_reason`
        then says why it ended: "n_predict", "eog" or "context full".

        Other callers may use the Engine between tokens, but if one changes the KV cache
        (eval, reset) the next step raises RuntimeError instead of continuing on a cache that
        no longer holds this sequence. `observe` watches every graph it runs (eval's)."""
        self.stop_reason = "n_predict"
        with self.lock:
            t0 = time.perf_counter()
            logits = self.eval(prompt, observe=observe)
            epoch = self._kv_epoch
            self.timings.prompt_tokens += len(prompt)
            self.timings.prompt_s += time.perf_counter() - t0
        if sampler is not None:
            sampler.accept_many(prompt)
        for i in range(n_predict):
            tok = int(np.argmax(logits)) if sampler is None else int(sampler.sample(logits))
            yield tok
            if stop_at_eos and tok in self.eog:
                self.stop_reason = "eog"
                return
            with self.lock:
                if self._kv_epoch != epoch:
                    raise RuntimeError(f"generate: the KV cache was changed by another eval() "
                                       f"or reset() after generated token {i + 1}; this "
                                       f"sequence is gone (use one Engine per concurrent "
                                       f"generation)")
                if not self.make_room(1, n_keep):
                    self.stop_reason = "context full"
                    return
                t0 = time.perf_counter()
                logits = self.eval([tok], observe=observe)
                epoch = self._kv_epoch
                self.timings.gen_tokens += 1
                self.timings.gen_s += time.perf_counter() - t0
