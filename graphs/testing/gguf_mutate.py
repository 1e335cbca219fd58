"""Structured GGUF mutations: files that parse, but whose content says something hostile or
inconsistent, and inputs and events that a model meets after loading.

Where graphs/testing/gguf_fuzz.py damages bytes, each mutator here changes one thing a converter,
a user or another process could get wrong, through graphs/gguf/gguf_edit.py's parts:

- `hparam`: a hyperparameter key (the architecture's, or one it ignores) set to an edge value,
  a value of another GGUF type, a per-layer array, or removed;
- `special`: a special token id (bos, eos, eot, eom, unk, sep, pad, mask, fim_*) out of range,
  negative or of the wrong type, or a tokenizer flag (add_bos ...) of the wrong type;
- `template`: a hostile chat template (graphs/testing/gguf_mutate_inputs.py's list: huge output,
  loops, raising, undefined names, sandbox escapes, non-strings);
- `vocab`: tokens, scores, token types and merges of mismatched lengths, empty, duplicated,
  huge or of the wrong type, merges of missing tokens, unknown tokenizer models;
- `tensors`: a record's shape, type, offset or name changed, tensors dropped, added,
  duplicated or swapped, the alignment changed, NaN written into data;
- `shapes`: a fresh tiny model at odd but valid sizes (consistent keys and tensors);
- `bytes`: one of gguf_fuzz's byte mutants (bit flips, edge values, truncation, ...);
- `huge`: the unchanged file given huge inputs (long prompts, words of a million characters,
  huge -n, token ids out of range);
- `config`: the unchanged file under edge EngineConfig values (n_ctx 1, cache types, ...);
- `after_load`: the file truncated, extended, rewritten or replaced after the Engine loaded
  it, before or between evaluations.

A `Mutation` is the mutant's bytes (None: the base file) and `run`, a JSON-able dict of what
the case does beyond the setting (graphs/testing/fuzz_cases.py reads it). Each is drawn from an
rng, so (seed, case) names it for a reproducer.
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, Callable

import numpy as np

from ggraph.graphs.gguf.gguf_edit import KV, GGUFParts, TensorRecord
from ggraph.graphs.testing.gguf_mutate_inputs import HUGE_TEXTS, TEMPLATES
from ggraph.graphs.gguf.gguf_reader import ValueType as VT
from ggraph.graphs.tokenizers.special_tokens import KEYS as SPECIAL_KEYS

_T = "tokenizer.ggml."
_INTS = (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64)
_FLOAT_HINTS = ("eps", "base", "factor", "scale", "softcapping", "mul", "beta", "alpha")


@dataclass
class Mutation:
    kind: str                      # the mutator
    what: str                      # what it changed, for the report
    data: bytes | None = None      # the mutant file; None: the base file unchanged
    run: dict[str, Any] = field(default_factory=dict)   # what the case does (fuzz_cases)
    prompts: tuple[str, ...] = ()  # the prompt kinds it means something with (empty: any)


@dataclass
class Base:
    """A file the mutants start from, read once."""
    name: str
    path: str
    parts: GGUFParts
    writer: Callable[[str, np.random.Generator], str] | None = None   # `shapes`: a new model

    @cached_property
    def raw(self) -> bytes:
        return self.parts.to_bytes()

    @cached_property
    def layout(self) -> Any:
        from ggraph.graphs.testing.gguf_fuzz import byte_layout

        return byte_layout(self.raw)

    @property
    def arch(self) -> str:
        return self.parts.arch

    @property
    def n_vocab(self) -> int:
        kv = self.parts.get(_T + "tokens")
        return len(kv.value) if kv is not None else 0

    @property
    def n_layer(self) -> int:
        kv = self.parts.get(f"{self.arch}.block_count")
        return int(kv.value) if kv is not None else 1


def _pick(rng: np.random.Generator, items: Any) -> Any:
    items = list(items)
    return items[int(rng.integers(len(items)))]


def _arch_keys(arch: str) -> list[str]:
    """The keys the architecture's hyperparameters are read from (its hparams dataclass)."""
    from ggraph.graphs.models.arch import model_class

    try:
        cls = model_class(arch).hparams_class
    except ValueError:
        return []
    return [f.metadata["gguf"].format(arch=arch) for f in fields(cls) if "gguf" in f.metadata]


def _int_values(old: int, n_layer: int) -> list[tuple[Any, VT, VT | None]]:
    vals = [0, 1, 2, 3, -1, old - 1, old + 1, old * 2, max(old // 2, 1), old * 3 + 1,
            2**31 - 1, 2**31, 2**32 - 1, 2**32 + old, 2**63 - 1, 10**12]
    out: list[tuple[Any, VT, VT | None]] = [
        (v, VT.INT64 if v < 0 or v >= 2**32 else VT.UINT32, None) for v in vals]
    out += [(float(old), VT.FLOAT32, None), (old & 0xFF, VT.UINT8, None), (True, VT.BOOL, None),
            (str(old), VT.STRING, None), (old, VT.INT64, None), (-old, VT.INT32, None),
            ([old] * n_layer, VT.ARRAY, VT.UINT32), ([old] * (n_layer + 1), VT.ARRAY, VT.UINT32),
            ([old] + [old + 1] * (n_layer - 1), VT.ARRAY, VT.INT32), ([], VT.ARRAY, VT.UINT32),
            ([str(old)], VT.ARRAY, VT.STRING)]
    return out


def _float_values(old: float, n_layer: int) -> list[tuple[Any, VT, VT | None]]:
    vals = [0.0, -0.0, 1e-45, 1e-30, 1e-12, 0.5, 1.0, 2.0, old * 2, old / 2, -old, 1e30,
            3.4e38, math.nan, math.inf, -math.inf]
    out: list[tuple[Any, VT, VT | None]] = [(v, VT.FLOAT32, None) for v in vals]
    out += [(1e300, VT.FLOAT64, None), (old, VT.FLOAT64, None), (int(old), VT.UINT32, None),
            ("1e-5", VT.STRING, None), ([old] * n_layer, VT.ARRAY, VT.FLOAT32),
            ([old, old * 2] * n_layer, VT.ARRAY, VT.FLOAT32), (False, VT.BOOL, None)]
    return out


def _value_for(rng: np.random.Generator, kv: KV | None, key: str, n_layer: int
               ) -> tuple[Any, VT, VT | None]:
    if kv is not None and kv.type == VT.STRING:
        return _pick(rng, [("", VT.STRING, None), ("yarn", VT.STRING, None),
                           ("bogus", VT.STRING, None), ("x" * 5000, VT.STRING, None),
                           (1, VT.UINT32, None), (["linear"], VT.ARRAY, VT.STRING)])
    if kv is not None and kv.type == VT.BOOL:
        return _pick(rng, [(not kv.value, VT.BOOL, None), (2, VT.UINT8, None),
                           ("true", VT.STRING, None), ([True] * n_layer, VT.ARRAY, VT.BOOL)])
    old = kv.value if kv is not None else None
    if isinstance(old, list):
        return _pick(rng, [(old[:-1], kv.type, kv.element), (old + old[:1], kv.type, kv.element),
                           ([], kv.type, kv.element), (old[:1][0] if old else 0, VT.UINT32,
                                                       None),
                           ([2**31] * len(old), VT.ARRAY, VT.UINT32)])
    floaty = isinstance(old, float) or (old is None and any(h in key for h in _FLOAT_HINTS))
    if floaty:
        return _pick(rng, _float_values(float(old) if old is not None else 1.0, n_layer))
    return _pick(rng, _int_values(int(old) if old is not None else 4, n_layer))


def m_hparam(base: Base, rng: np.random.Generator) -> Mutation:
    p = base.parts.copy()
    arch = base.arch
    present = [kv.key for kv in p.kvs if kv.key.startswith(arch + ".")]
    known = _arch_keys(arch) + [f"{arch}.attention.sliding_window",
                                f"{arch}.attention.sliding_window_pattern",
                                f"{arch}.rope.scaling.factor", f"{arch}.rope.scaling.type",
                                f"{arch}.final_logit_softcapping", f"{arch}.expert_count",
                                "general.architecture", "general.alignment", "general.name"]
    key = _pick(rng, present) if rng.random() < 0.7 or not known else _pick(rng, known)
    kv = p.get(key)
    r = rng.random()
    if key == "general.architecture":
        v = _pick(rng, ["", "bogus", "llama", "qwen2", "qwen3", "gemma3", "deepseek2", "gpt2",
                        "LLAMA", "llama\x00"])
        p.set(key, v, VT.STRING)
        what = f"{key} = {v!r}"
    elif r < 0.1 and kv is not None:
        p.drop(key)
        what = f"{key} removed"
    elif r < 0.15 and kv is not None:
        p.kvs.append(KV(key, kv.value, kv.type, kv.element))
        what = f"{key} written twice"
    else:
        v, vt, et = _value_for(rng, kv, key, base.n_layer)
        p.set(key, v, vt, et)
        what = f"{key} = {_short(v)} ({vt.name}{'/' + et.name if et is not None else ''})"
    return Mutation("hparam", what, p.to_bytes())


def m_special(base: Base, rng: np.random.Generator) -> Mutation:
    p = base.parts.copy()
    n = base.n_vocab
    if rng.random() < 0.25:
        key = _T + _pick(rng, ["add_bos_token", "add_eos_token", "add_space_prefix",
                               "add_sep_token", "remove_extra_whitespaces"])
        v, vt = _pick(rng, [(True, VT.BOOL), (False, VT.BOOL), (1, VT.UINT8),
                            ("true", VT.STRING), ([True], VT.ARRAY)])
        p.set(key, v, vt, VT.BOOL if vt == VT.ARRAY else None)
        return Mutation("special", f"{key} = {v!r} ({vt.name})", p.to_bytes(),
                        prompts=())
    key = _T + _pick(rng, [k for _, k in SPECIAL_KEYS])
    v, vt, et = _pick(rng, [
        (-1, VT.INT32, None), (n, VT.UINT32, None), (n + 1, VT.UINT32, None),
        (n - 1, VT.UINT32, None), (0, VT.UINT32, None), (int(rng.integers(n)), VT.UINT32, None),
        (2**32 - 1, VT.UINT32, None), (2**63, VT.UINT64, None), (-2**31, VT.INT32, None),
        ("2", VT.STRING, None), (2.0, VT.FLOAT32, None), (True, VT.BOOL, None),
        ([1, 2], VT.ARRAY, VT.UINT32), (n - 1, VT.INT64, None)])
    p.set(key, v, vt, et)
    return Mutation("special", f"{key} = {_short(v)} ({vt.name})", p.to_bytes())


def m_template(base: Base, rng: np.random.Generator) -> Mutation:
    p = base.parts.copy()
    name, source = _pick(rng, TEMPLATES)
    key = "tokenizer.chat_template"
    if isinstance(source, tuple):          # a value that is not a string
        v, vt, et = source
        p.set(key, v, vt, et)
    else:
        p.set(key, source, VT.STRING)
    return Mutation("template", f"chat template: {name}", p.to_bytes(), prompts=("chat", "cnv"))


def m_vocab(base: Base, rng: np.random.Generator) -> Mutation:
    p = base.parts.copy()
    tokens = list(p.get(_T + "tokens").value)   # type: ignore[union-attr]
    n = len(tokens)
    i, j = int(rng.integers(n)), int(rng.integers(n))
    merges = p.get(_T + "merges")
    spm = p.get(_T + "model") is not None and p.get(_T + "model").value == "llama"  # type: ignore
    choice = _pick(rng, ["short", "long", "empty", "dup", "huge", "weird", "tokens_type",
                         "types", "types_len", "scores", "merges" if merges else "scores",
                         "model", "pre", "vocab_size"])
    what = choice
    if choice == "short":
        k = _pick(rng, [n - 1, n // 2, 1, 0])
        p.set(_T + "tokens", tokens[:k], VT.ARRAY, VT.STRING)
        what = f"tokens cut to {k} of {n}"
    elif choice == "long":
        k = _pick(rng, [1, 2, n])
        p.set(_T + "tokens", tokens + [f"<extra_{x}>" for x in range(k)], VT.ARRAY, VT.STRING)
        what = f"{k} tokens added to {n} (embedding unchanged)"
    elif choice in ("empty", "dup", "huge", "weird"):
        new = {"empty": "", "dup": tokens[j],
               "huge": _pick(rng, ["a" * (1 << 20), "\u2581" * 50000, "<|im_start|>" * 10000]),
               "weird": _pick(rng, ["\x00", "\n", " ", "<0xZZ>", "<0x100>", "<0x>", "\u2581",
                                    "\u200b", "<s>", "<|im_end|>", "</s>", "<unk>",
                                    "<end_of_turn>", "<|endoftext|>", "\ufffd", "\U0001F600"])
               }[choice]
        tokens[i] = new
        p.set(_T + "tokens", tokens, VT.ARRAY, VT.STRING)
        what = f"token {i} = {_short(new)}"
    elif choice == "tokens_type":
        v, vt, et = _pick(rng, [(list(range(n)), VT.ARRAY, VT.INT32), ("tokens", VT.STRING, None),
                                ([0] * n, VT.ARRAY, VT.UINT8)])
        p.set(_T + "tokens", v, vt, et)
        what = f"tokens as {vt.name}{'/' + et.name if et else ''}"
    elif choice in ("types", "types_len"):
        kv = p.get(_T + "token_type")
        types = list(kv.value) if kv is not None else [1] * n
        if choice == "types_len":
            types = _pick(rng, [types[:-1], types + [1], []])
            what = f"token_type of {len(types)} for {n} tokens"
        else:
            v = _pick(rng, [0, 1, 2, 3, 4, 5, 6, 7, 255, -1])
            if rng.random() < 0.5:
                types = [v] * n
                what = f"every token_type = {v}"
            else:
                types[i] = v
                what = f"token_type[{i}] = {v}"
        p.set(_T + "token_type", types, VT.ARRAY, VT.INT32)
    elif choice == "scores":
        kv = p.get(_T + "scores")
        scores = list(kv.value) if kv is not None else [0.0] * n
        v, vt, et = _pick(rng, [
            (scores[:-1], VT.ARRAY, VT.FLOAT32), (scores + [0.0], VT.ARRAY, VT.FLOAT32),
            ([math.nan] * n, VT.ARRAY, VT.FLOAT32), ([math.inf] * n, VT.ARRAY, VT.FLOAT32),
            ([-math.inf] * n, VT.ARRAY, VT.FLOAT32), ([3e38] * n, VT.ARRAY, VT.FLOAT32),
            ([0] * n, VT.ARRAY, VT.INT32), (["0"] * n, VT.ARRAY, VT.STRING),
            (1.0, VT.FLOAT32, None), (list(rng.normal(size=n)), VT.ARRAY, VT.FLOAT32)])
        p.set(_T + "scores", v, vt, et)
        what = f"scores = {_short(v)} ({vt.name}{'/' + et.name if et else ''})"
    elif choice == "merges":
        old = list(merges.value)   # type: ignore[union-attr]
        v, vt, et = _pick(rng, [
            (old + ["q z"], VT.ARRAY, VT.STRING), (old + ["qz qz"], VT.ARRAY, VT.STRING),
            (old + ["abc"], VT.ARRAY, VT.STRING), (old + ["a  b"], VT.ARRAY, VT.STRING),
            (old + [""], VT.ARRAY, VT.STRING), (old + [" "], VT.ARRAY, VT.STRING),
            (old + ["a b c"], VT.ARRAY, VT.STRING), (old * 2, VT.ARRAY, VT.STRING),
            (old + ["t h"] * 100000, VT.ARRAY, VT.STRING), ([], VT.ARRAY, VT.STRING),
            ([1, 2], VT.ARRAY, VT.INT32), ("t h", VT.STRING, None), (None, None, None)])
        if v is None:
            p.drop(_T + "merges")
            what = "merges removed"
        else:
            p.set(_T + "merges", v, vt, et)
            what = f"merges = {_short(v)}"
    elif choice == "model":
        v = _pick(rng, ["bert", "", "none", "rwkv", "t5", "no_vocab", "gpt2" if spm else "llama",
                        7])
        p.set(_T + "model", v, VT.STRING if isinstance(v, str) else VT.UINT32)
        what = f"tokenizer.ggml.model = {v!r}"
    elif choice == "pre":
        v = _pick(rng, ["qwen2", "llama-bpe", "smollm", "gpt-4o", "deepseek-v3", "bogus", "",
                        "tekken", "default", "gemma4", 3])
        p.set(_T + "pre", v, VT.STRING if isinstance(v, str) else VT.UINT32)
        what = f"tokenizer.ggml.pre = {v!r}"
    else:
        v = _pick(rng, [n - 1, n + 1, 0, 2**32 - 1, 1])
        p.set(f"{base.arch}.vocab_size", v, VT.UINT32)
        what = f"vocab_size = {v} for {n} tokens"
    return Mutation("vocab", what, p.to_bytes())


# ggml type ids a tensor may be switched to (known, partly unsupported, and unknown)
_TYPES = [0, 1, 2, 3, 6, 7, 8, 10, 12, 14, 16, 20, 23, 24, 26, 27, 28, 30, 34, 39, 99]


def m_tensors(base: Base, rng: np.random.Generator) -> Mutation:
    p = base.parts.copy()
    ts = p.tensors
    k = int(rng.integers(len(ts)))
    t = ts[k]
    choice = _pick(rng, ["shape", "shape_header", "type", "offset", "drop", "extra",
                         "duplicate", "swap", "name", "ndims", "alignment", "nan"])
    what = f"{choice} {t.name}"
    relayout = True
    if choice in ("shape", "shape_header"):
        ne = list(t.ne)
        ne = _pick(rng, [[ne[0] + 32] + ne[1:], [max(ne[0] - 32, 0)] + ne[1:], ne[::-1],
                         ne + [1], ne[:-1] or [1], [ne[0] * 2] + ne[1:], [0] + ne[1:],
                         ne[:1] + [0] * (len(ne) - 1), [ne[0], 2**31] + ne[2:],
                         ne[:1] + [x + 1 for x in ne[1:]], ne + [2]])
        t.ne = tuple(ne)
        relayout = choice == "shape"
        what += f" ne -> {ne}"
    elif choice == "type":
        t.type_id = _pick(rng, _TYPES)
        what += f" type -> {t.type_id}"
    elif choice == "offset":
        other = ts[int(rng.integers(len(ts)))]
        t.offset = _pick(rng, [t.offset + 1, t.offset + p.alignment, max(t.offset - p.alignment,
                                                                          0),
                               other.offset, len(p.data), len(p.data) - p.alignment, 2**63,
                               2**64 - 1, 2**64 - p.alignment])
        relayout = False
        what += f" offset -> {t.offset}"
    elif choice == "drop":
        del ts[k]
    elif choice == "extra":
        name = _pick(rng, [f"blk.{base.n_layer}.attn_q.weight", "foo.weight", "output.weight",
                           t.name.replace(".weight", ".bias"), "rope_freqs.weight"])
        ts.append(TensorRecord(name, t.ne, t.type_id, 0))
        what = f"extra tensor {name} like {t.name}"
        p.relayout({name: p.tensor_bytes(t)})
        relayout = False
    elif choice == "duplicate":
        ts.append(TensorRecord(t.name, t.ne, t.type_id, 0))
    elif choice == "swap":
        same = [u for u in ts if u.ne == t.ne and u.type_id == t.type_id and u is not t]
        if same:
            u = _pick(rng, same)
            t.name, u.name = u.name, t.name
            what = f"swap {t.name} and {u.name}"
    elif choice == "name":
        t.name = _pick(rng, ["", "x" * 70, t.name + "\x00", t.name.upper(), "blk.-1." + t.name])
        what = f"tensor {k} renamed {t.name[:40]!r}"
    elif choice == "ndims":
        t.ne = _pick(rng, [(), tuple(t.ne) + (1,) * (5 - len(t.ne))])
        relayout = False
        what += f" ne -> {list(t.ne)}"
    elif choice == "alignment":
        v, vt = _pick(rng, [(1, VT.UINT32), (8, VT.UINT32), (64, VT.UINT32), (4096, VT.UINT32),
                            (0, VT.UINT32), (3, VT.UINT32), (2**31, VT.UINT32),
                            (32, VT.INT32), (32, VT.UINT64)])
        p.set("general.alignment", v, vt)
        if vt == VT.UINT32 and v > 0 and not v & (v - 1) and v <= 4096:
            p.alignment = v
        what = f"general.alignment = {v} ({vt.name})"
    else:  # nan
        raw = bytearray(p.tensor_bytes(t))
        pattern = _pick(rng, [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x7e", b"\x00\x7c",
                              b"\xff\xff"])
        if raw:
            at = int(rng.integers(max(len(raw) - len(pattern), 1)))
            raw[at:at + len(pattern)] = pattern[:len(raw) - at]
        relayout = False
        p.relayout({t.name: bytes(raw)})
        what += f" bytes {pattern.hex()} written"
    if relayout:
        p.relayout()
    return Mutation("tensors", what, p.to_bytes())


def m_shapes(base: Base, rng: np.random.Generator) -> Mutation:
    """A new tiny model of the base's architecture at odd, valid sizes."""
    if base.writer is None:
        return m_hparam(base, rng)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "shapes.gguf")
        what = base.writer(path, rng)
        with open(path, "rb") as f:
            return Mutation("shapes", what, f.read())


def m_bytes(base: Base, rng: np.random.Generator) -> Mutation:
    from ggraph.graphs.testing.gguf_fuzz import KINDS, byte_mutant

    m = byte_mutant(base.raw, rng, _pick(rng, KINDS), base.layout)
    return Mutation("bytes", f"{m.kind}: {m.what}", m.data)


def m_huge(base: Base, rng: np.random.Generator) -> Mutation:
    n = base.n_vocab
    choice = _pick(rng, ["text", "text", "ids", "n_predict", "n_predict_shift", "n_past"])
    if choice == "text":
        name, recipe = _pick(rng, HUGE_TEXTS)
        return Mutation("huge", f"prompt: {name}", run={"text": recipe})
    if choice == "ids":
        ids = _pick(rng, [[n], [-1], [2**31], [2**63 - 1], [], [0.5], [[1, 2]], [1] * 100000,
                          [n - 1] * 3])
        return Mutation("huge", f"token ids {_short(ids)}", run={"ids": ids})
    if choice == "n_predict":
        return Mutation("huge", "-n 1000000000 without a context shift",
                        run={"n_predict": 10**9, "n_keep": None})
    if choice == "n_predict_shift":
        keep = _pick(rng, [0, 1, 4, 10**6])
        return Mutation("huge", f"-n 1000000000 shifting the context (--keep {keep}), stopped "
                        f"after 3 contexts", run={"n_predict": 10**9, "n_keep": keep,
                                                  "max_gen_ctx": 3})
    v = _pick(rng, [-1, 10**9, 2**63])
    return Mutation("huge", f"eval(n_past={v})", run={"n_past": v})


def m_config(base: Base, rng: np.random.Generator) -> Mutation:
    k, v = _pick(rng, [("n_ctx", 1), ("n_ctx", 2), ("n_ctx", 5), ("n_ctx", 0), ("n_ctx", -1),
                       ("n_ctx", 10**9), ("n_ctx", 2**40), ("n_ubatch", 1), ("n_ubatch", 3),
                       ("n_ubatch", 10**9), ("n_ubatch", 0), ("type_k", "q8_0"),
                       ("type_v", "q8_0"), ("type_k", "q4_0"), ("type_k", "f32"),
                       ("type_k", "bogus"), ("type_v", "bf16"), ("amb_mib", 1),
                       ("amb_mib", -5), ("n_threads", 0), ("n_threads", -1), ("n_threads", 3),
                       ("n_threads", 64), ("reserve_outputs", "last"),
                       ("reserve_outputs", "none"), ("strategy", "ggml"),
                       ("strategy", "bogus"), ("ggml_exact", True), ("warmup", True)])
    return Mutation("config", f"EngineConfig({k}={v!r})", run={"config": {k: v}})


def m_after_load(base: Base, rng: np.random.Generator) -> Mutation:
    size = len(base.raw)
    when = _pick(rng, ["load", "prompt"])   # right after loading, or between prompt and tokens
    action, arg = _pick(rng, [("truncate", 0), ("truncate", 24), ("truncate", size // 2),
                              ("truncate", size - 1), ("truncate", int(rng.integers(size))),
                              ("append", 1), ("append", 4096), ("zero_tail", 4096),
                              ("touch", 0), ("poke_keep_mtime", int(rng.integers(size))),
                              ("replace", 0), ("unlink", 0), ("truncate_restore", size // 2)])
    return Mutation("after_load", f"{action}({arg}) after the {when}",
                    run={"after_load": {"action": action, "arg": arg, "when": when}})


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


MUTATORS: dict[str, tuple[Callable[[Base, np.random.Generator], Mutation], float]] = {
    "hparam": (m_hparam, 0.17), "special": (m_special, 0.09), "template": (m_template, 0.13),
    "vocab": (m_vocab, 0.12), "tensors": (m_tensors, 0.13), "shapes": (m_shapes, 0.07),
    "bytes": (m_bytes, 0.07), "huge": (m_huge, 0.08), "config": (m_config, 0.07),
    "after_load": (m_after_load, 0.07),
}


def mutate(base: Base, rng: np.random.Generator, kinds: tuple[str, ...] | None = None,
           turn: int | None = None) -> Mutation:
    """One mutation of base, its kind drawn by MUTATORS' weights (among `kinds`), or, given
    a turn, the turn-th kind in MUTATORS' order (every kind as often: a short run still
    meets each)."""
    names = [k for k in MUTATORS if kinds is None or k in kinds]
    w = np.array([MUTATORS[k][1] for k in names])
    kind = names[int(rng.choice(len(names), p=w / w.sum()))] if turn is None else \
        names[turn % len(names)]
    return MUTATORS[kind][0](base, rng)
