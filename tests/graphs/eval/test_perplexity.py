"""`ggraph perplexity` and graphs/eval/perplexity.py, graphs/eval/kl_divergence.py: llama-perplexity's
chunking, PPL and its error against a direct numpy computation from a tiny random model's
logits; the base file written and read back (statistics of a file against its own logits);
the KL-divergence statistics on a hand-computed case; the command's errors."""
from __future__ import annotations

import re

import struct

import numpy as np
import pytest

from ggraph.cli import main
from ggraph.graphs.eval.kl_divergence import (KldStats, mean_and_uncertainty, median, percentile,
                                         token_kld)
from ggraph.graphs.eval.perplexity import (BaseFile, BaseWriter, Chunking, TooFewTokens,
                                      dequantize_log_probs, engine_evaluate, plan_chunks,
                                      quantize_log_probs, row_width, run_perplexity)

N_CTX = 16
# byte-level text: every character is a token or two for the tiny vocabulary
TEXT = ("the quick brown fox jumps over the lazy dog; then the cat thinks that the thing "
        "there is theirs. ") * 4



@pytest.fixture(scope="module")
def engine(tiny):
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    return Engine(tiny, EngineConfig(n_ctx=N_CTX, n_ubatch=8))


def numpy_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
    return lse - x[np.arange(len(x)), targets]


# -- chunking -----------------------------------------------------------------------------

def test_chunking_as_llama_cpp():
    c = plan_chunks(100, N_CTX)
    assert (c.n_chunk, c.first, c.n_scored) == (100 // N_CTX, N_CTX // 2, N_CTX - 1 - N_CTX // 2)
    assert plan_chunks(100, N_CTX, n_chunks=2).n_chunk == 2
    assert plan_chunks(100, N_CTX, n_chunks=50).n_chunk == 6
    toks = list(range(100, 200))
    c = Chunking(N_CTX, 3, bos=7)
    ch = c.chunk(toks, 1)
    assert ch[0] == 7 and ch[1:] == toks[N_CTX + 1:2 * N_CTX]
    # the targets are the text's tokens, never the BOS
    assert c.targets(toks, 1).tolist() == toks[N_CTX + N_CTX // 2 + 1:2 * N_CTX]
    assert Chunking(N_CTX, 3).chunk(toks, 0) == toks[:N_CTX]


def test_too_few_tokens_in_llama_cpp_words():
    with pytest.raises(TooFewTokens, match="you need at least 32 tokens to evaluate perplexity "
                                           "with a context of 16.*only 31 tokens"):
        plan_chunks(31, N_CTX)
    assert plan_chunks(32, N_CTX).n_chunk == 2


# -- PPL and its error --------------------------------------------------------------------

def test_ppl_and_error_match_numpy(engine):
    tokens = engine.tokenizer.encode(TEXT, special=False)
    c = plan_chunks(len(tokens), N_CTX, bos=1)  # BOS substituted, as for a model that adds it
    seen = []
    stats = run_perplexity(engine_evaluate(engine, c.first), tokens, c,
                           on_chunk=lambda d: seen.append((d.index, d.stats.count)))
    assert seen == [(i, (i + 1) * c.n_scored) for i in range(c.n_chunk)]
    nll = []
    for i in range(c.n_chunk):  # directly: evaluate, slice, log-softmax in numpy
        chunk = [1] + tokens[i * N_CTX + 1:(i + 1) * N_CTX]
        lg = engine.eval(chunk, all_logits=True, n_past=0)
        tgt = np.asarray(tokens[i * N_CTX + N_CTX // 2 + 1:(i + 1) * N_CTX])
        nll.append(numpy_nll(lg[N_CTX // 2:N_CTX - 1], tgt))
    v = np.concatenate(nll)
    assert stats.count == v.size == c.n_chunk * (N_CTX - 1 - N_CTX // 2)
    ppl = np.exp(v.mean())
    err = ppl * np.sqrt((np.mean(v * v) - v.mean() ** 2) / (v.size - 1))
    assert stats.ppl == pytest.approx(ppl, rel=1e-9)
    assert stats.error == pytest.approx(err, rel=1e-6)
    assert np.isfinite(stats.ppl) and stats.ppl > 1 and stats.error > 0


def test_several_chunks_in_one_batch_score_as_one_at_a_time(tiny, engine):
    """llama-perplexity's n_seq: 4 chunks as 4 sequences of one batch (ubatches mixing them)
    give each chunk's rows of one chunk at a time, within the spread of products of other
    widths (as tests/graphs/runtime/test_sequences.py), and so the same statistics."""
    from ggraph.check.conformance import nmse
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    tokens = engine.tokenizer.encode(TEXT, special=False)
    c = plan_chunks(len(tokens), N_CTX, bos=1)
    assert c.n_chunk >= 6                  # a last pass of fewer than n_seq chunks, too
    one, seen = [], []
    alone = run_perplexity(engine_evaluate(engine, c.first), tokens, c,
                           on_chunk=lambda d: one.append(d.logits))
    four = Engine(tiny, EngineConfig(n_ctx=4 * N_CTX, n_ubatch=24, n_seq_max=4))
    batched = run_perplexity(engine_evaluate(four, c.first), tokens, c, n_seq=4,
                             on_chunk=lambda d: seen.append((d.index, d.n_seq, d.logits)))
    assert [(i, n) for i, n, _ in seen] == [(i, 4) for i in range(c.n_chunk)]
    for a, (_, _, b) in zip(one, seen):
        assert a.shape == b.shape and nmse(a, b) < 1e-6
    # (a random model's PPL of ~2e6 magnifies the products' rounding: 7e-6 relative here)
    assert batched.ppl == pytest.approx(alone.ppl, rel=1e-4)
    assert batched.error == pytest.approx(alone.error, rel=1e-4)
    with pytest.raises(ValueError, match="n_seq must be at least 1"):
        run_perplexity(engine_evaluate(four, c.first), tokens, c, n_seq=0)


# -- the base file ------------------------------------------------------------------------

def test_base_file_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    n_vocab, c = 301, Chunking(N_CTX, 3)  # odd vocabulary: rows carry one pad entry
    tokens = rng.integers(0, n_vocab, size=c.n_chunk * N_CTX + 5)
    logits = [rng.normal(0, 3, size=(c.n_scored, n_vocab)).astype(np.float32)
              for _ in range(c.n_chunk)]
    path = tmp_path / "base.kld"
    with BaseWriter(path, c, n_vocab, tokens) as w:
        for lg in logits:
            w.write_chunk(lg)
    raw = path.read_bytes()
    nv = row_width(n_vocab)
    assert nv == 306 and raw[:8] == b"_logits_"
    assert struct.unpack("<iii", raw[8:20]) == (N_CTX, n_vocab, c.n_chunk)
    assert len(raw) == 20 + 4 * c.n_chunk * N_CTX + 2 * c.n_chunk * c.n_scored * nv
    bf = BaseFile.read(path)
    assert (bf.n_ctx, bf.n_vocab, bf.n_chunk) == (N_CTX, n_vocab, c.n_chunk)
    assert bf.tokens.tolist() == tokens[:c.n_chunk * N_CTX].tolist()
    stats = KldStats()
    for i, lg in enumerate(logits):
        rows = bf.chunk_rows(i)
        lp = lg.astype(np.float64) - lg.max(1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(1, keepdims=True))
        back = dequantize_log_probs(rows, n_vocab)
        kept = lp > lp.max(1, keepdims=True) - 16
        scale = rows[:, :4].copy().view("<f4")[:, 0]
        assert np.all(np.abs(back - lp)[kept] <= (scale[:, None] * 0.51 + 1e-6).repeat(
            n_vocab, 1)[kept])
        stats.add(token_kld(lg, rows, c.targets(bf.tokens, i)))
    t = stats.tokens
    # not exactly 0: each stored log-probability is off by up to half a step (16/65535/2),
    # so sum p * (error) is bounded by that half step
    assert np.abs(t.kld).max() < 0.5 * 16 / 65535 * 1.01 and t.same_top.all()
    s = stats.summary()
    assert s.same_top[0] == 1.0 and abs(s.kld[0]) < 1e-5
    assert s.ppl[0] == pytest.approx(s.ppl_base[0], rel=1e-4)
    assert s.cor == pytest.approx(1.0, abs=1e-4)


def test_quantized_row_layout():
    lg = np.array([[0.0, -1.0, -30.0, 2.0]], dtype=np.float32)
    rows = quantize_log_probs(lg)
    scale, min_lp = rows[0, :4].copy().view("<f4")
    lse = np.float32(np.log(np.exp(lg[0] - 2.0).astype(np.float64).sum()))
    assert scale == np.float32(16) / np.float32(65535)     # the range is clipped to 16 nats
    assert min_lp == np.float32(np.float32(-16) - lse)
    assert rows[0, 4 + 3] == 65535 and rows[0, 4 + 2] == 0  # the top and a clipped entry
    assert rows[0, 4 + 0] == np.rint(np.float32(14) / scale)


def test_bad_base_files(tmp_path):
    p = tmp_path / "x.kld"
    p.write_bytes(b"not a logits file")
    with pytest.raises(ValueError, match="does not look like a file containing log-prob"):
        BaseFile.read(p)
    p.write_bytes(b"_logits_" + struct.pack("<iii", 16, 10, 2) + bytes(4 * 32) + bytes(10))
    with pytest.raises(ValueError, match="truncated"):
        BaseFile.read(p)


# -- KL divergence statistics -------------------------------------------------------------

def test_kld_hand_computed():
    p = np.array([0.5, 0.25, 0.25])
    q = np.array([0.25, 0.5, 0.25])
    rows = quantize_log_probs(np.log(p)[None].astype(np.float32))
    t = token_kld(np.log(q)[None].astype(np.float32), rows, np.array([0]))
    # KL(p||q) = 0.5 ln 2 + 0.25 ln 0.5 + 0 = 0.25 ln 2
    assert t.kld[0] == pytest.approx(0.25 * np.log(2), abs=1e-4)
    assert t.nll[0] == pytest.approx(np.log(4), abs=1e-6)
    assert t.nll_base[0] == pytest.approx(np.log(2), abs=1e-4)
    assert t.p_diff[0] == pytest.approx(0.25 - 0.5, abs=1e-4)
    assert not t.same_top[0]  # q's top is 1, p's is 0


def test_kld_skips_entries_below_the_floor():
    # base: one entry at ln p = -20 (stored as the row minimum, -16 from the top and skipped)
    base_logits = np.array([[0.0, -20.0]], dtype=np.float32)
    rows = quantize_log_probs(base_logits)
    q = np.array([[0.0, 0.0]], dtype=np.float32)  # q = (1/2, 1/2)
    t = token_kld(q, rows, np.array([0]))
    p0 = 1 / (1 + np.exp(-20.0))
    assert t.kld[0] == pytest.approx(p0 * (np.log(p0) - np.log(0.5)), abs=1e-4)


def test_summary_helpers():
    v = np.arange(1.0, 13.0)  # 12 values
    m, e = mean_and_uncertainty(v)
    assert m == 6.5 and e == pytest.approx(np.std(v) / np.sqrt(11))
    assert mean_and_uncertainty(v[:10])[1] == 0.0  # llama.cpp: no error for <= 10 values
    assert percentile(v, 0.5) == pytest.approx(6.5) and percentile(v, 1.0) == 12.0
    assert percentile(v, 0.1) == pytest.approx(1 + 0.1 * 11)
    assert median(v) == 6.5 and median(v[:5]) == 3.0


# -- the command --------------------------------------------------------------------------

def test_cli_ppl_then_kl_divergence_against_itself(tiny, engine, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 2 + "\n")
    base = tmp_path / "base.kld"
    # -b 16 -ub 8 -fa off: one chunk a pass in the fixture's engine, so the same bits
    assert main(["perplexity", "-m", tiny, "-f", str(text), "-c", str(N_CTX), "-b", "16",
                 "-ub", "8", "-fa", "off", "--kl-divergence-base", str(base)]) == 0
    out, err = capsys.readouterr()
    assert "n_ctx=16, batch_size=16, n_seq=1" in err
    tokens = engine.tokenizer.encode(TEXT * 2, special=False)
    c = plan_chunks(len(tokens), N_CTX)
    stats = run_perplexity(engine_evaluate(engine, c.first), tokens, c)
    assert f"[{c.n_chunk}]{stats.ppl:.4f}," in out and "[1]" in out
    assert f"Final estimate: PPL = {stats.ppl:.4f} +/- {stats.error:.5f}" in out
    assert BaseFile.read(base).n_chunk == c.n_chunk
    assert main(["perplexity", "-m", tiny, "--kl-divergence-base", str(base), "-b", "16",
                 "-ub", "8", "-fa", "off", "--kl-divergence"]) == 0
    out = capsys.readouterr().out
    assert "Same top p" in out and f"{c.n_chunk:4d}    {stats.ppl:9.4f}" in out
    assert c.n_chunk * c.n_scored >= 100  # enough tokens for llama.cpp's closing report
    # the base file stores log-probabilities in 16-bit steps of 16 nats / 65535: against its
    # own logits a run's KLD is that rounding, within 1e-4 of zero, of either sign
    mean_kld = float(re.search(r"Mean    KLD:\s+(-?[0-9.]+)", out).group(1))
    assert abs(mean_kld) < 1e-4 and "Same top p: 100.000 ±" in out
    assert f"Mean PPL(Q)                   : {stats.ppl:10.6f}" in out


def test_cli_packs_b_over_c_chunks_per_pass(tiny, tmp_path, capsys):
    """-b 64 -c 16: 4 chunks a pass (llama.cpp's n_seq line and ETA), the PPL of one at a
    time, and --kl-divergence against the one-at-a-time base file: KLD within the file's
    rounding and the same top token everywhere."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 2 + "\n")
    base = tmp_path / "base.kld"
    common = ["perplexity", "-m", tiny, "-c", str(N_CTX), "-fa", "off"]
    ppl = []
    for b in ("16", "64"):
        extra = ["--kl-divergence-base", str(base)] if b == "16" else []
        assert main(common + ["-f", str(text), "-b", b] + extra) == 0
        out, err = capsys.readouterr()
        ppl.append(float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1)))
    assert "batch_size=64, n_seq=4" in err and "seconds per pass - ETA" in err
    assert ppl[1] == pytest.approx(ppl[0], rel=1e-4)
    assert main(common + ["-b", "64", "--kl-divergence-base", str(base), "--kl-divergence"]) == 0
    out, err = capsys.readouterr()
    assert "n_seq=4" in err
    mean_kld = float(re.search(r"Mean    KLD:\s+(-?[0-9.]+)", out).group(1))
    assert abs(mean_kld) < 1e-4 and "Same top p: 100.000 ±" in out


@pytest.mark.parametrize("argv, words", [
    (["-f", "/nonexistent/text.txt"], "/nonexistent/text.txt: No such file or directory"),
    (["--kl-divergence"], "--kl-divergence needs --kl-divergence-base"),
    (["-f", "x", "-c", "2"], "-c/--ctx-size must be >= 4"),
    (["-f", "x", "--chunks", "0"], "--chunks must be >= 1"),
    (["-f", "x", "-c", "4", "-b", "2048"], "-b 2048 / -c 4 makes 512 chunks a pass, but a batch "
                                           "holds at most 256 sequences"),
])
def test_cli_errors(tiny, capsys, argv, words):
    assert main(["perplexity", "-m", tiny] + argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"ggraph perplexity: error: " in err and words in err


def test_cli_text_too_short(tiny, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("the cat")
    assert main(["perplexity", "-m", tiny, "-f", str(text), "-c", str(N_CTX)]) == 1
    err = capsys.readouterr().err
    assert "you need at least 32 tokens to evaluate perplexity with a context of 16" in err


def test_progress_bar_only_on_a_terminal():
    import io

    from ggraph.tools.perplexity import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    bar = Progress(out=io.StringIO(), err=err)  # stdout piped: the bar has its own line
    bar.draw(2, 4, 10.0)
    bar.clear()
    assert "[##########..........] 2/4 ETA 10 s" in err.getvalue()
    assert err.getvalue().endswith("\r\033[K")
    quiet = io.StringIO()
    Progress(out=Tty(), err=quiet).draw(1, 4, 1.0)
    assert quiet.getvalue() == ""
