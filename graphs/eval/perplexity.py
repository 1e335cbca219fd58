"""Perplexity over a text as llama.cpp's llama-perplexity measures it, and the log-probability
file its --kl-divergence-base writes.

Method (tools/perplexity/perplexity.cpp, perplexity()): the text is tokenized as llama.cpp does
(BOS first where the model adds one) and cut into n_chunk = len // n_ctx chunks of n_ctx tokens
(the tail is dropped; fewer than 2*n_ctx tokens is an error). Each chunk is evaluated from an
empty KV cache with its first token replaced by BOS when the model adds one; only the second
half is scored: the logits at positions first = n_ctx/2 .. n_ctx-2 predict the tokens at
first+1 .. n_ctx-1, so each chunk adds n_ctx - 1 - first negative log-likelihoods. PPL =
exp(mean NLL); its error is ppl * sqrt((E[NLL^2] - E[NLL]^2) / (count - 1)).

Base file (--kl-divergence-base; byte for byte llama.cpp's layout, so files move between the
two): "_logits_", int32 n_ctx, int32 n_vocab, int32 n_chunk, n_chunk*n_ctx int32 tokens (the
text's tokens, BOS not substituted), then per chunk n_ctx - 1 - first rows of nv = 2*ceil(
n_vocab/2) + 4 uint16: the first four hold two float32 (scale, min_log_prob), then one uint16
per vocabulary entry: log p = scale * q + min_log_prob, over the 16 nats below the row's
largest logit (anything lower stores 0). All little-endian, as on the x86/ARM machines llama.cpp
writes them on.

Several chunks in one batch, as llama.cpp: n_seq = n_batch / n_ctx chunks (at least one) are
evaluated together, chunk j of a pass as sequence j of one batch (graphs/models/batch.py), each
attending to its own cells only, so the scores are those of one chunk at a time. Only the rows
from position `first` on are computed (llama.cpp's need_logits). One difference: the sequences
share one unified cache of n_seq * n_ctx cells, where llama-perplexity gives each its own
stream (the scores are the same either way).

The KL-divergence statistics that compare logits with such a file live in
graphs/eval/kl_divergence.py. Log-softmax here is float64; the file's quantization repeats
llama.cpp's float32 arithmetic.
"""
from __future__ import annotations

import io
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Iterator

import numpy as np

from ggraph.graphs.models.batch import Batch
from ggraph.graphs.models.kv_cells import MAX_SEQ

BASE_MAGIC = b"_logits_"
# rows of log-softmax at a time: 64 rows of a 49k vocabulary are 25 MiB of float64
ROW_BLOCK = 64


class TooFewTokens(ValueError):
    """The text is shorter than two contexts (llama.cpp's condition and words)."""


@dataclass(frozen=True)
class Chunking:
    """How a token sequence is cut: n_chunk chunks of n_ctx tokens, the first token of each
    replaced by `bos` when the model adds one (None: kept)."""
    n_ctx: int
    n_chunk: int
    bos: int | None = None

    @property
    def first(self) -> int:
        """The first scored position: the model always has half a context before it."""
        return self.n_ctx // 2

    @property
    def n_scored(self) -> int:
        """Tokens scored per chunk (the last position has no next token)."""
        return self.n_ctx - 1 - self.first

    def chunk(self, tokens: np.ndarray | list[int], i: int) -> list[int]:
        """The tokens evaluated for chunk i, BOS in front where the model adds one."""
        toks = [int(t) for t in tokens[i * self.n_ctx:(i + 1) * self.n_ctx]]
        if len(toks) != self.n_ctx:
            raise ValueError(f"chunk {i} needs tokens {i * self.n_ctx}..{(i + 1) * self.n_ctx}"
                             f" but the sequence holds {len(tokens)}")
        if self.bos is not None:
            toks[0] = self.bos
        return toks

    def targets(self, tokens: np.ndarray | list[int], i: int) -> np.ndarray:
        """The tokens that chunk i's scored logits predict (the original text's tokens)."""
        start = i * self.n_ctx + self.first + 1
        return np.asarray(tokens[start:(i + 1) * self.n_ctx], dtype=np.int64)


def plan_chunks(n_tokens: int, n_ctx: int, n_chunks: int = -1, bos: int | None = None
                ) -> Chunking:
    """llama.cpp's chunking of n_tokens: all whole chunks, or at most n_chunks (< 0: all)."""
    if n_ctx < 4:  # a chunk must score at least one token
        raise ValueError(f"-c/--ctx-size must be >= 4 for perplexity, got {n_ctx}")
    if n_tokens < 2 * n_ctx:
        raise TooFewTokens(f"you need at least {2 * n_ctx} tokens to evaluate perplexity with "
                           f"a context of {n_ctx}; the data file you provided tokenizes to "
                           f"only {n_tokens} tokens")
    n_max = n_tokens // n_ctx
    return Chunking(n_ctx, n_max if n_chunks < 0 else min(n_chunks, n_max), bos)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (max subtracted first, as llama.cpp does)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) for each row of logits, float64, a few rows at a time."""
    targets = np.asarray(targets, dtype=np.int64)
    if logits.ndim != 2 or logits.shape[0] != targets.shape[0]:
        raise ValueError(f"token_nll: logits of shape {logits.shape} for {targets.shape[0]} "
                         f"targets")
    out = np.empty(len(targets), dtype=np.float64)
    for s in range(0, len(targets), ROW_BLOCK):
        lp = log_softmax(logits[s:s + ROW_BLOCK])
        out[s:s + ROW_BLOCK] = -lp[np.arange(len(lp)), targets[s:s + ROW_BLOCK]]
    return out


@dataclass
class PplStats:
    """Running sums of NLL and NLL^2, as llama-perplexity keeps them."""
    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0
    values: list[np.ndarray] = field(default_factory=list)  # per chunk, for callers' tables

    def add(self, nll: np.ndarray) -> None:
        nll = np.asarray(nll, dtype=np.float64)
        self.nll += float(nll.sum())
        self.nll2 += float((nll * nll).sum())
        self.count += int(nll.size)
        self.values.append(nll)

    @property
    def ppl(self) -> float:
        return float(np.exp(self.nll / self.count)) if self.count else float("nan")

    @property
    def error(self) -> float:
        """PPL's uncertainty: ppl * the standard error of the mean NLL (NaN where llama.cpp
        prints "Unexpected negative standard deviation")."""
        if self.count < 2:
            return float("nan")
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return float(np.sqrt(var / (self.count - 1)) * self.ppl) if var > 0 else float("nan")


# -- the base file --------------------------------------------------------------------------
def row_width(n_vocab: int) -> int:
    """uint16 entries per stored row: 4 for (scale, min) and the vocabulary rounded to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def quantize_log_probs(logits: np.ndarray) -> np.ndarray:
    """llama.cpp's stored uint16 rows (row_width each) for float32 logits, in its float32
    arithmetic (numpy's float32 exp may differ from C's expf in the last bit, which can move
    a row's min_log_prob by one ulp)."""
    lg = np.ascontiguousarray(logits, dtype=np.float32)
    n, n_vocab = lg.shape
    out = np.zeros((n, row_width(n_vocab)), dtype=np.uint16)
    for s in range(0, n, ROW_BLOCK):
        x = lg[s:s + ROW_BLOCK]
        mx = x.max(axis=1)
        mn = np.maximum(x.min(axis=1), mx - np.float32(16))
        # llama.cpp: expf per entry, summed in double, log in double, stored as float
        sum_exp = np.exp(x - mx[:, None]).astype(np.float64).sum(axis=1)
        lse = np.log(sum_exp).astype(np.float32)
        min_log_prob = (mn - mx) - lse
        scale = (mx - mn) / np.float32(65535)
        head = np.stack([scale, min_log_prob], axis=1).astype("<f4")
        out[s:s + ROW_BLOCK, :4] = head.view("<u2")
        with np.errstate(divide="ignore"):
            inv = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        q = np.rint(inv[:, None] * (x - mn[:, None]))  # nearest, ties to even (FPU default)
        q = np.where(x > mn[:, None], q, 0)
        out[s:s + ROW_BLOCK, 4:4 + n_vocab] = q.astype(np.uint16)
    return out


def dequantize_log_probs(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """The float32 log-probabilities that stored rows stand for (scale * q + min)."""
    rows = np.ascontiguousarray(rows, dtype=np.uint16)
    head = rows[:, :4].copy().view("<f4")
    return head[:, :1] * rows[:, 4:4 + n_vocab].astype(np.float32) + head[:, 1:2]


class BaseWriter:
    """Writes a base file: the header at open, then each chunk's scored rows in order."""

    def __init__(self, path: str | os.PathLike, chunking: Chunking, n_vocab: int,
                 tokens: np.ndarray | list[int]) -> None:
        self.path = os.fspath(path)
        self.chunking = chunking
        self.n_vocab = n_vocab
        toks = np.asarray(tokens[:chunking.n_chunk * chunking.n_ctx], dtype="<i4")
        self.f: BinaryIO = open(self.path, "wb")
        self.f.write(BASE_MAGIC + struct.pack("<iii", chunking.n_ctx, n_vocab,
                                              chunking.n_chunk))
        self.f.write(toks.tobytes())
        self.written = 0

    def write_chunk(self, logits: np.ndarray) -> np.ndarray:
        """Store one chunk's scored logits (n_scored rows); returns the stored uint16 rows."""
        n = self.chunking.n_scored
        if logits.shape != (n, self.n_vocab):
            raise ValueError(f"{self.path}: a chunk stores {n} rows of {self.n_vocab} logits, "
                             f"got shape {logits.shape}")
        rows = quantize_log_probs(logits)
        self.f.write(rows.astype("<u2").tobytes())
        self.written += 1
        return rows

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> BaseWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class BaseFile:
    """A base file's header and tokens; chunk rows are read on demand."""
    path: str
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray
    data_offset: int

    @property
    def chunking(self) -> Chunking:
        return Chunking(self.n_ctx, self.n_chunk)

    @classmethod
    def read(cls, path: str | os.PathLike) -> BaseFile:
        path = os.fspath(path)
        with open(path, "rb") as f:
            if f.read(8) != BASE_MAGIC:
                raise ValueError(f"{path} does not look like a file containing "
                                 f"log-probabilities (no _logits_ header)")
            head = f.read(12)
            if len(head) != 12:
                raise ValueError(f"{path}: failed reading n_ctx, n_vocab, n_chunk")
            n_ctx, n_vocab, n_chunk = struct.unpack("<iii", head)
            if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
                raise ValueError(f"{path}: bad header n_ctx={n_ctx} n_vocab={n_vocab} "
                                 f"n_chunk={n_chunk}")
            tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype="<i4")
            if tokens.size != n_ctx * n_chunk:
                raise ValueError(f"{path}: failed reading evaluation tokens ({n_ctx * n_chunk}"
                                 f" expected, {tokens.size} present)")
            if tokens.min() < 0 or tokens.max() >= n_vocab:
                raise ValueError(f"{path}: token ids outside [0, {n_vocab})")
        bf = cls(path, n_ctx, n_vocab, n_chunk, tokens.astype(np.int64), 20 + 4 * tokens.size)
        size = os.path.getsize(path)
        need = bf.data_offset + n_chunk * bf.chunk_bytes
        if size < need:
            raise ValueError(f"{path}: {size} bytes, but {n_chunk} chunks of log-probabilities "
                             f"need {need} (a truncated file?)")
        return bf

    @property
    def chunk_bytes(self) -> int:
        return self.chunking.n_scored * row_width(self.n_vocab) * 2

    def chunk_rows(self, i: int) -> np.ndarray:
        """Chunk i's stored uint16 rows, shape (n_scored, row_width)."""
        if not 0 <= i < self.n_chunk:
            raise IndexError(f"{self.path}: chunk {i} of {self.n_chunk}")
        with open(self.path, "rb") as f:
            f.seek(self.data_offset + i * self.chunk_bytes)
            raw = f.read(self.chunk_bytes)
        if len(raw) != self.chunk_bytes:
            raise ValueError(f"{self.path}: failed reading log-probs for chunk {i}")
        return np.frombuffer(raw, dtype="<u2").reshape(self.chunking.n_scored, -1)


# -- the run --------------------------------------------------------------------------------
# the tokens of up to n_seq chunks -> each chunk's logits from position `first` on
# (n_ctx - first rows of n_vocab; the last row predicts nothing and is not scored)
Evaluate = Callable[[list[list[int]]], list[np.ndarray]]


def seq_count(n_batch: int, n_ctx: int) -> int:
    """Chunks per pass: llama-perplexity's n_seq = max(1, n_batch / n_ctx), at most the
    sequences a cache holds (llama.cpp's LLAMA_MAX_SEQ)."""
    n_seq = max(1, n_batch // n_ctx)
    if n_seq > MAX_SEQ:
        raise ValueError(f"-b {n_batch} / -c {n_ctx} makes {n_seq} chunks a pass, but a batch "
                         f"holds at most {MAX_SEQ} sequences: lower -b or raise -c")
    return n_seq


def engine_evaluate(engine: Any, first: int) -> Evaluate:
    """An Engine evaluating chunks from an empty KV cache, chunk j of a call as sequence j of
    one batch (the engine must hold as many sequences and n_ctx cells per chunk); only the
    rows from position `first` on are asked for."""
    def evaluate(chunks: list[list[int]]) -> list[np.ndarray]:
        if not chunks:
            return []
        n = len(chunks[0])
        if any(len(c) != n for c in chunks):
            raise ValueError(f"chunks of different lengths: {sorted({len(c) for c in chunks})}")
        engine.reset()
        pos = np.tile(np.arange(n, dtype=np.int32), len(chunks))
        batch = Batch([t for c in chunks for t in c], pos,
                      [(j,) for j in range(len(chunks)) for _ in range(n)], pos >= first)
        rows = engine.decode(batch)
        per = n - first
        return [rows[j * per:(j + 1) * per] for j in range(len(chunks))]
    return evaluate


def run_eta(seconds: float, n_chunk: int, n_seq: int) -> int:
    """The whole run's time from one pass's, as llama.cpp's ETA: t * n_chunk / n_seq."""
    return int(seconds * n_chunk / n_seq)


@dataclass
class ChunkDone:
    """What the progress callback gets after each chunk."""
    index: int          # 0-based
    n_chunk: int
    seconds: float      # this chunk's pass (n_seq chunks evaluated together)
    stats: PplStats     # running totals after it
    logits: np.ndarray  # the chunk's scored rows (n_scored, n_vocab), float32
    n_seq: int = 1      # chunks per pass

    @property
    def eta_seconds(self) -> int:
        return run_eta(self.seconds, self.n_chunk, self.n_seq)


def chunk_passes(evaluate: Evaluate, tokens: np.ndarray | list[int], chunking: Chunking,
                 n_seq: int = 1) -> Iterator[tuple[int, np.ndarray, float]]:
    """Every chunk evaluated, n_seq at a time, in order: (its index, its scored rows
    (n_scored, n_vocab), its pass's seconds). An evaluator that returns another count of
    results or rows of another shape is an error naming the chunk."""
    if n_seq < 1:
        raise ValueError(f"n_seq must be at least 1, got {n_seq}")
    n_scored, n_rows = chunking.n_scored, chunking.n_ctx - chunking.first
    for i0 in range(0, chunking.n_chunk, n_seq):
        ids = range(i0, min(i0 + n_seq, chunking.n_chunk))
        t0 = time.perf_counter()
        outs = evaluate([chunking.chunk(tokens, i) for i in ids])
        dt = time.perf_counter() - t0
        if len(outs) != len(ids):
            raise ValueError(f"chunks {ids[0]}..{ids[-1]}: the evaluator returned "
                             f"{len(outs)} results for {len(ids)} chunks")
        for i, logits in zip(ids, outs):
            logits = np.asarray(logits)
            if logits.ndim != 2 or logits.shape[0] != n_rows:
                raise ValueError(f"chunk {i}: the evaluator returned logits of shape "
                                 f"{logits.shape}, expected ({n_rows}, n_vocab)")
            yield i, logits[:n_scored], dt


def run_perplexity(evaluate: Evaluate, tokens: np.ndarray | list[int], chunking: Chunking,
                   on_chunk: Callable[[ChunkDone], None] | None = None,
                   base: BaseWriter | None = None, n_seq: int = 1) -> PplStats:
    """Evaluate every chunk, n_seq at a time, and score its second half; with `base`, store
    the scored rows. on_chunk is called after each chunk (printing, progress bars,
    benchmarks' logits)."""
    stats = PplStats()
    for i, scored, dt in chunk_passes(evaluate, tokens, chunking, n_seq):
        stats.add(token_nll(scored, chunking.targets(tokens, i)))
        if base is not None:
            base.write_chunk(scored)
        if on_chunk is not None:
            on_chunk(ChunkDone(i, chunking.n_chunk, dt, stats, scored, n_seq))
    return stats


def read_text(path: str | os.PathLike) -> str:
    """A text file as llama.cpp's -f reads it: bytes as UTF-8 (invalid bytes as U+FFFD),
    one trailing newline dropped."""
    with io.open(path, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    return text[:-1] if text.endswith("\n") else text
