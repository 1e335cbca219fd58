"""Many sequences in one KV cache: `Engine.decode` of batches that mix sequences, and the
sequence operations (graphs/models/kv_cells.py through the engine).

Isolation: prompts evaluated together in one batch give each prompt's logits evaluated
alone, on tiny llama (f16 cache; q8_0 K/V with flash attention; split attention), tiny Gemma
3 past its sliding window, and the real SmolLM2 and Gemma 3; so do decode steps of several
sequences in one batch. Nothing leaks: a sequence's logits do not move by one bit when the
other sequences' tokens change. The sequence operations give the logits of evaluating the
resulting sequences afresh.
"""
from __future__ import annotations

import numpy as np
import pytest

from ggraph.check.conformance import nmse
from ggraph.graphs.gguf.fetch import default_model, fetch_model
from ggraph.graphs.models.batch import Batch
from ggraph.graphs.runtime.engine import Engine, EngineConfig, NoKVSlot
from ggraph.graphs.testing.tiny import write_tiny_gguf
from ggraph.graphs.testing.tiny_gemma3 import write_tiny_gguf as write_tiny_gemma3

PROMPTS = [[3 + (i * 7 + j) % 50 for i in range(n)] for j, n in enumerate((9, 23, 4, 40))]


def alone(eng: Engine, prompts: list[list[int]]) -> list[np.ndarray]:
    return [eng.eval(p, all_logits=True, n_past=0) for p in prompts]


def together(eng: Engine, prompts: list[list[int]]) -> list[np.ndarray]:
    eng.reset()
    logits = eng.decode(Batch.of_sequences(prompts, all_logits=True))
    bounds = np.cumsum([0] + [len(p) for p in prompts])
    return [logits[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def check_isolated(eng: Engine, prompts: list[list[int]], tol: float) -> None:
    ref = alone(eng, prompts)
    got = together(eng, prompts)
    for s, (a, b) in enumerate(zip(ref, got)):
        assert a.shape == b.shape
        assert nmse(a, b) < tol, f"sequence {s}: nmse {nmse(a, b):.2e}"
    # with the other sequences' tokens changed (same lengths: the same shapes, so the same
    # kernels), a sequence's logits do not move by one bit: nothing leaks between sequences,
    # however loose `tol` has to be for the kernels' own paths
    n_vocab = eng.model.hp.n_vocab
    for keep in (0, 1):
        other = [p if s % 2 == keep else [(t + 1) % n_vocab for t in p]
                 for s, p in enumerate(prompts)]
        for s, b in enumerate(together(eng, other)):
            if s % 2 == keep:
                assert np.array_equal(b, got[s]), f"sequence {s} moved with the others' tokens"
    # the prompts again, for the decode step below to continue
    assert all(np.array_equal(b, g) for b, g in zip(together(eng, prompts), got))
    # then one decode step of every sequence, in one batch, against each alone
    nxt = [int(np.argmax(g[-1])) for g in got]
    step = eng.decode(Batch(nxt, seq_ids=[(s,) for s in range(len(prompts))],
                            logits=[True] * len(prompts)))
    for s, p in enumerate(prompts):
        one = eng.eval(p + [nxt[s]], all_logits=True, n_past=0)[-1] if s == 0 else None
        if one is not None:
            assert nmse(one, step[0]) < tol
    for s in range(1, len(prompts)):
        assert eng.seq_pos_max(s) == len(prompts[s])


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
@pytest.mark.parametrize("cfg", [dict(), dict(type_k="q8_0", type_v="q8_0", flash_attn=True),
                                 dict(amb_mib=1, n_ubatch=16)],
                         ids=["f16", "q8_0-fa", "amb-ubatch16"])
def test_sequences_in_one_batch_are_isolated_llama(tiny_models, cfg, unified):
    """One unified cache, or a stream per sequence (split_equal ubatches, attention per
    stream)."""
    # heads of 32 values: a q8_0 cache's blocks must divide the head
    p = tiny_models.made(write_tiny_gguf, "llama", n_embd=128, n_ff=160)
    eng = Engine(p, EngineConfig(n_ctx=256, n_seq_max=4, kv_unified=unified, **cfg))
    assert eng.cache.n_stream == (1 if unified else 4)
    check_isolated(eng, PROMPTS, 1e-6)   # the kernels differ by batch width only


@pytest.mark.parametrize("cfg", [dict(), dict(type_k="q8_0", type_v="q8_0", flash_attn=True)],
                         ids=["f16", "q8_0-fa"])
def test_seq_cp_across_streams_copies_the_rows(tiny_models, cfg):
    """With a stream per sequence, seq_cp copies the source stream's rows (a quantized cache's
    blocks as they are) before the next decode: both sequences then continue alike, bit for
    bit; a partial copy is refused in one line, as llama.cpp asserts."""
    p = tiny_models.made(write_tiny_gguf, "llama", n_embd=128, n_ff=160)
    eng = Engine(p, EngineConfig(n_ctx=512, n_seq_max=2, kv_unified=False, **cfg))
    eng.decode(Batch(PROMPTS[3]))
    with pytest.raises(ValueError, match=r"seq_cp\(0, 1, 3, 9\): with a stream per sequence"):
        eng.seq_cp(0, 1, 3, 9)
    eng.seq_cp(0, 1)
    out = eng.decode(Batch([7, 7], seq_ids=[(0,), (1,)], logits=[True, True]))
    assert np.array_equal(out[0], out[1])
    assert eng.seq_pos_max(1) == len(PROMPTS[3]) and not eng.cache.stream_copies()
    alone = eng.eval(PROMPTS[3] + [7], n_past=0)
    assert nmse(alone, out[1]) < 1e-6


@pytest.mark.parametrize("arch,groups", [("llama", 2), ("deepseek2", 4)])
def test_split_attention_over_streams(tiny_models, tmp_path, arch, groups):
    """-amb 1 over a ubatch of 4 streams of 128 tokens (K*Q of 4 MiB for llama's 4 heads, 8
    MiB for DeepSeek2's 8 MLA heads: split into head groups, each group's [hd, tokens, heads,
    streams] result copied into its heads): the logits of unsplit attention, bit for bit."""
    from ggraph.graphs.testing.tiny_deepseek2 import TinyDeepSeek2, write_tiny_deepseek2

    p = tiny_models.made(write_tiny_gguf, "llama", n_embd=128, n_ff=160) if arch == "llama" \
        else str(write_tiny_deepseek2(tmp_path / "ds.gguf", TinyDeepSeek2()))
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 60, 150)] for _ in range(4)]
    out = []
    for amb in (0, 1):
        eng = Engine(p, EngineConfig(n_ctx=2048, n_seq_max=4, kv_unified=False, amb_mib=amb))
        out.append(eng.decode(Batch.of_sequences(prompts, all_logits=True)))
        mg = next(iter(eng._graphs.values()))   # the first ubatch's: 4 x 128 tokens
        split = [n.name for n in mg.graph.nodes if n.name.startswith("kqv_split-0-s")
                 and "copy" not in n.name]
        assert len(split) == (groups if amb else 0)
    assert np.array_equal(out[0], out[1])


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
@pytest.mark.parametrize("fa", [False, True])
def test_sequences_in_one_batch_are_isolated_gemma3_past_the_window(tiny_models, fa, unified):
    """A window of 16 and prompts of up to 40 tokens: each sequence's sliding-window cells
    are reused once outside its own window, never another's."""
    p = tiny_models.made(write_tiny_gemma3, n_swa=16)
    eng = Engine(p, EngineConfig(n_ctx=512, n_ubatch=32, n_seq_max=4, flash_attn=fa,
                                 kv_unified=unified))
    check_isolated(eng, PROMPTS, 1e-6)
    if unified:   # (a stream's ring is at least 256 cells: no 40-token prompt wraps it)
        assert eng.cache.swa.cells.used < eng.cache.base.cells.used   # reused cells


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
@pytest.mark.parametrize("cfg", [dict(), dict(flash_attn=True), dict(amb_mib=1)],
                         ids=["absorbed", "absorbed-fa", "absorbed-amb"])
def test_sequences_in_one_batch_are_isolated_deepseek2_mla(tmp_path, cfg, unified):
    """DeepSeek2's MLA cache (one latent row per token, V a view of it) with several
    sequences, unified or a stream each; with flash attention a ubatch of 128 tokens or more
    takes the decompress path in one stream, and absorbed-fa with a stream each."""
    from ggraph.graphs.testing.tiny_deepseek2 import TinyDeepSeek2, write_tiny_deepseek2

    p = str(write_tiny_deepseek2(tmp_path / "ds.gguf", TinyDeepSeek2()))
    eng = Engine(p, EngineConfig(n_ctx=512, n_seq_max=4, kv_unified=unified, **cfg))
    check_isolated(eng, PROMPTS, 1e-6)


def kernel_spread(eng: Engine, prompts: list[list[int]]) -> float:
    """How far the product kernels' own paths differ on rows like the prompts': the prompts
    concatenated (>= 16 tokens) take the integer GEMM, one token at a time the mat-vec; the
    largest nmse between the two over any prompt's range of rows (3e-4..3e-3 on SmolLM2 Q4_1
    and Gemma 3, measured; prompts under 16 tokens agree bit for bit). Per range, not over
    all rows: a short prompt's nmse strays further from the mean than all rows' together
    (Gemma 3's 12-token "1, 2, 3, 4," row is 3.1e-3 from its lone run on AMD Zen 4, against
    1.4e-3 over all 43 rows)."""
    eng.reset()
    whole = eng.eval(sum(prompts, []), all_logits=True)
    eng.reset()
    steps = np.stack([eng.eval([t]) for t in sum(prompts, [])])
    eng.reset()
    ends = np.cumsum([0] + [len(p) for p in prompts])
    return max(nmse(whole[a:b], steps[a:b]) for a, b in zip(ends[:-1], ends[1:]))


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_sequences_in_one_batch_are_isolated_real_models(model):
    """~38 tokens of 4 prompts in one batch take the GEMM where each prompt alone (5-15
    tokens) takes the mat-vec path: the difference must stay within that spread, and no
    sequence's logits may move with the others' tokens. Gemma 3 270M runs through its iswa
    cache, its window of 512 not reached (the tiny Gemma 3 above passes its window)."""
    path = str(default_model()) if model == "smollm2" else str(fetch_model("gemma3"))
    eng = Engine(path, EngineConfig(n_ctx=512, n_seq_max=4))
    tok = eng.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):\n    ",
             "Once upon a time, in a small village by the sea, there lived", "1, 2, 3, 4,"]
    prompts = [tok.encode(t) for t in texts]
    spread = kernel_spread(eng, prompts)
    assert 0 < spread < 1e-2
    check_isolated(eng, prompts, 2 * spread)


def test_shared_prefix_copy_rm_keep(tiny):
    """seq_cp shares a prefix (stored once); each sequence then continues alone, and seq_rm /
    seq_keep leave the others' logits as a fresh evaluation gives them."""
    eng = Engine(tiny, EngineConfig(n_ctx=128, n_seq_max=3))
    prefix, a, b = PROMPTS[3][:20], [5, 6, 7], [8, 9]
    eng.decode(Batch(prefix))
    eng.seq_cp(0, 1)
    eng.seq_cp(0, 2)
    assert eng.cache.cells.used == 20
    out = eng.decode(Batch(a + b, seq_ids=[(1,)] * 3 + [(2,)] * 2,
                           logits=[False, False, True, False, True]))
    ref = alone(eng, [prefix + a, prefix + b])
    assert nmse(ref[0][-1], out[0]) < 1e-6 and nmse(ref[1][-1], out[1]) < 1e-6
    # the same through fresh state: rm of a tail, then keep one sequence
    eng.reset()
    eng.decode(Batch(prefix))
    eng.seq_cp(0, 1)
    eng.decode(Batch(a, seq_ids=[(1,)] * 3))
    eng.seq_rm(1, 21, -1)                      # sequence 1 keeps prefix + a[:1]
    assert eng.seq_pos_max(1) == 20
    out = eng.decode(Batch([9], seq_ids=[(1,)]))
    assert nmse(alone(eng, [prefix + [5, 9]])[0][-1], out[0]) < 1e-6
    eng.reset()
    eng.decode(Batch(prefix))
    eng.seq_cp(0, 1)
    eng.decode(Batch(b, seq_ids=[(1,)] * 2))
    eng.seq_keep(1)
    assert eng.seq_pos_max(0) == -1 and eng.cache.cells.used == 22
    out = eng.decode(Batch([4], seq_ids=[(1,)]))
    assert nmse(alone(eng, [prefix + b + [4]])[0][-1], out[0]) < 1e-6


@pytest.mark.parametrize("fa", [False, True])
def test_seq_add_moves_one_sequence_and_not_the_other(tmp_path, fa):
    """Positions of sequence 1 move down (seq_rm + seq_add, the K-shift at the next decode)
    while sequence 0 stays: with one layer each gives a fresh evaluation's logits, up to the
    f16 rounding of the re-roped K."""
    from ggraph.graphs.testing.tiny import TinyDense, write_tiny_llama

    p = str(write_tiny_llama(tmp_path / "l.gguf", TinyDense(n_layer=1)))
    eng = Engine(p, EngineConfig(n_ctx=128, n_seq_max=2, flash_attn=fa))
    s0, s1 = PROMPTS[1], PROMPTS[3]
    eng.decode(Batch.of_sequences([s0, s1]))
    eng.seq_rm(1, 4, 14)
    eng.seq_add(1, 14, -1, -10)
    assert eng.seq_pos_max(1) == len(s1) - 11
    out = eng.decode(Batch([5, 5], seq_ids=[(0,), (1,)], logits=[True, True]))
    ref = []
    for prompt in (s0, s1[:4] + s1[14:]):   # the last token alone, as a decode step too
        eng.eval(prompt, n_past=0)
        ref.append(eng.eval([5]))
    assert np.abs(out[0] - ref[0]).max() < 1e-5 * np.abs(ref[0]).max()
    assert np.abs(out[1] - ref[1]).max() < 2e-2 * np.abs(ref[1]).max()


def test_no_room_leaves_the_cache_as_it_was(tiny):
    eng = Engine(tiny, EngineConfig(n_ctx=32, n_ubatch=8, n_seq_max=2))
    eng.decode(Batch(list(range(3, 23))))
    before = eng.cache.cells.snapshot()
    with pytest.raises(NoKVSlot, match=r"for a ubatch of 8 tokens \(4 of 32 cells free"):
        eng.decode(Batch(list(range(3, 19)), seq_ids=[(1,)] * 16))   # 8 fit, 8 more do not
    assert all(np.array_equal(x, y) for x, y in zip(eng.cache.cells.snapshot()[:3], before[:3]))
    with pytest.raises(ValueError, match="positions must continue at 20"):
        eng.decode(Batch([3], pos=[25]))
    with pytest.raises(ValueError, match=r"invalid seq_id\[0\] = 2"):
        eng.decode(Batch([3], seq_ids=[(2,)]))


def test_memory_line_names_the_sequences_and_streams(tiny):
    """llama.cpp's "n_seq_max/n_stream", and its cells per stream: -c 1024 -np 4 gives each
    sequence pad256(1024 / 4) = 256 cells without --kv-unified."""
    eng = Engine(tiny, EngineConfig(n_ctx=1024, n_seq_max=4))
    assert " 4/1 seqs" in eng.cache.summary() and "  1024 cells" in eng.cache.summary()
    eng = Engine(tiny, EngineConfig(n_ctx=1024, n_seq_max=4, kv_unified=False))
    assert " 4/4 seqs" in eng.cache.summary() and "   256 cells" in eng.cache.summary()
    assert eng.n_ctx_seq == 256 and eng.cache.k[0].ne[1] == 1024


# -- against llama.cpp: the same batches and sequence operations through its low-level API --
N_CTX_SCRIPT = 512


def seq_ops_script(prefix: list[int], a: list[int], b: list[int], unified: bool = True
                   ) -> list[tuple]:
    """Three sequences sharing a prefix, decoded together; then seq_rm, seq_add (a shift
    with the K-shift), seq_keep, each followed by a decode step; then two new sequences in
    one batch beside the kept one. With a stream per sequence (not unified) the copies copy
    streams, and seq_keep leaves the other streams alone (as llama.cpp's): sequences 0 and 1
    are removed before they start again."""
    n = len(prefix)
    again = [] if unified else [("rm", 0, -1, -1), ("rm", 1, -1, -1)]
    return [
        ("decode", prefix, [(0,)] * n, list(range(n)), [0] * (n - 1) + [1]),
        ("cp", 0, 1, -1, -1), ("cp", 0, 2, -1, -1),
        ("decode", a + b, [(1,)] * len(a) + [(2,)] * len(b),
         list(range(n, n + len(a))) + list(range(n, n + len(b))),
         [0] * (len(a) - 1) + [1] + [0] * (len(b) - 1) + [1]),
        ("rm", 1, n + 1, -1),
        ("decode", [a[-1]], [(1,)], [n + 1], [1]),
        ("rm", 2, 2, 6), ("add", 2, 6, -1, -4),
        ("decode", [b[0]], [(2,)], [n + len(b) - 4], [1]),
        ("keep", 2),
        ("decode", [b[-1]], [(2,)], [n + len(b) - 3], [1]),
        *again,
        ("decode", a + b, [(0,)] * len(a) + [(1,)] * len(b),
         list(range(len(a))) + list(range(len(b))),
         [0] * (len(a) - 1) + [1] + [0] * (len(b) - 1) + [1]),
    ]


def ggraph_script(eng: Engine, script: list[tuple]) -> list[np.ndarray]:
    out = []
    for step in script:
        op, args = step[0], step[1:]
        if op == "decode":
            toks, seqs, pos, flags = args
            out.extend(eng.decode(Batch(toks, pos, seqs, [bool(f) for f in flags])))
        else:
            {"rm": eng.seq_rm, "cp": eng.seq_cp, "keep": eng.seq_keep,
             "add": eng.seq_add}[op](*args)
    return out


def text_script(path: str, unified: bool = True) -> list[tuple]:
    from ggraph.graphs.gguf.gguf_reader import read_header
    from ggraph.graphs.tokenizers.tokenizer import Tokenizer

    tok = Tokenizer(read_header(path).metadata, path).encode
    return seq_ops_script(tok("You are a helpful assistant. Answer briefly and"),
                          tok(" with a poem about"), tok(" in French:"), unified)


# each script with one unified cache, and (name_streams) with a stream per sequence
SCRIPTS = ("smollm2", "gemma3", "gemma3_tiny", "smollm2_streams", "gemma3_tiny_streams")


def script_for(name: str, tiny_models) -> tuple[str, list[tuple]]:
    """SmolLM2 and Gemma 3 270M (its iswa cache) on text; tiny Gemma 3 (a window of 16) on
    sequences that pass its window."""
    unified = not name.endswith("_streams")
    name = name.removesuffix("_streams")
    if name == "gemma3_tiny":
        return (tiny_models.made(write_tiny_gemma3, n_swa=16),
                seq_ops_script(PROMPTS[3][:30], PROMPTS[1][:12], PROMPTS[0], unified))
    path = str(default_model()) if name == "smollm2" else str(fetch_model("gemma3"))
    return path, text_script(path, unified)


# bit for bit with ggml_exact; checked by size when recorded
REAL = ("smollm2", "gemma3", "smollm2_streams")


@pytest.mark.parametrize("name", SCRIPTS)
def test_batches_and_sequence_operations_match_llama_cpp_bit_for_bit(tiny_models, name):
    """Batches of several sequences, copy, remove, keep and shift give llama.cpp's logits
    with ggml_exact (its low-level API on the same model and script; recorded where
    llama-cpp-python is absent: then within 1e-6, another machine's SIMD may round
    differently): bit for bit on SmolLM2 and Gemma 3 270M (its sliding-window cache too); on
    tiny Gemma 3 (f32 weights, where ggml_exact agrees with llama.cpp to nmse ~1e-8 on one
    sequence's prompt alone) within 1e-7."""
    from llama_cpp_ref import array, live, llama_cpp_script, recorded

    path, script = script_for(name, tiny_models)
    unified = not name.endswith("_streams")
    eng = Engine(path, EngineConfig(n_ctx=N_CTX_SCRIPT, n_seq_max=3, ggml_exact=True,
                                    kv_unified=unified))
    got = ggraph_script(eng, script)
    llama_cpp = live()
    if llama_cpp is not None:
        ref = llama_cpp_script(llama_cpp, path, script, N_CTX_SCRIPT, 3, unified=unified)
        assert len(got) == len(ref)
        for i, (g, r) in enumerate(zip(got, ref)):
            if name in REAL:
                assert np.array_equal(g, r), f"output {i}: nmse {nmse(r, g):.2e}"
            else:
                assert nmse(r, g) < 1e-7, f"output {i}: nmse {nmse(r, g):.2e}"
        return
    rec = recorded(f"seq_ops_{name}", path, exact=name not in REAL)
    assert rec["script"] == plain(script)
    ref = [array(r) for r in rec["logits"]]   # every stride-th logit: the files stay small
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        g = g[::rec["stride"]]
        assert nmse(r, g) < 1e-6, f"output {i}: nmse {nmse(r, g):.2e}"


def plain(x):
    """A script as JSON keeps it (tuples become lists)."""
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def test_parallel_generation_is_each_sequence_alone(tiny):
    """graphs/runtime/parallel.py: greedy, each sequence's tokens are its own generate()'s;
    a sequence that runs out of cells stops with "context full"; too many is refused."""
    from ggraph.graphs.runtime.parallel import generate_parallel

    eng = Engine(tiny, EngineConfig(n_ctx=64, n_seq_max=3))
    prompts = [PROMPTS[0][:5], PROMPTS[1][:3], PROMPTS[2]]
    res = generate_parallel(eng, prompts, 6, stop_at_eos=False)
    for p, r in zip(prompts, res):
        eng.reset()
        assert r.tokens == list(eng.generate(p, 6, stop_at_eos=False))
        assert r.stop == "n_predict"
    full = generate_parallel(eng, prompts, 100, stop_at_eos=False)
    assert {r.stop for r in full} == {"context full"}
    assert sum(len(p) + len(r.tokens) for p, r in zip(prompts, full)) <= 64 + 3
    with pytest.raises(ValueError, match="4 sequences do not fit a cache of 3"):
        generate_parallel(eng, prompts + [prompts[0]], 2)
