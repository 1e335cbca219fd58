"""A torch twin of a llama-family GGUF model (llama; qwen2 / qwen3 as well) with LoRA adapters,
to time one LoRA training step in torch beside ggraph's on the same model, tokens and adapters.

The GGUF is read with ggraph's own reader (graphs/gguf/gguf_file.py), its weights looked up by
ggraph's builder (graphs/models/arch.py build_model: the same names, the tied output, the
hyperparameters in `model.hp`) and every weight dequantized to float32 with ggraph's decoders
(ggraph/codecs/buffers.py `read`), so the twin multiplies by exactly the values ggraph does.
The forward pass is llama.cpp's graph in float32: RMSNorm with the file's eps, Q/K/V projections
(+ biases where the architecture has them), per-head Q/K norms (qwen3), rope (NORMAL: adjacent
pairs x[2i], x[2i+1], for llama; NEOX: halves, for qwen2/3) with theta_i = pos * freq_scale *
base^(-2i/n_rot) over the first n_rot dims, causal GQA attention (query head h reads K/V head
h // (n_head / n_head_kv), as ggml's mul_mat broadcasts) with scale 1/sqrt(head_dim), the output
projection, SwiGLU FFN, the final norm and the output matrix (token_embd when the file has no
output.weight). Base weights are frozen (requires_grad False).

LoRA, as ggraph's graphs/models/lora.py (and llama.cpp, and PEFT) apply it: per adapted weight W
(ggml ne [n_in, n_out], numpy (n_out, n_in)) a is (r, n_in) and b is (n_out, r) -- ggraph's
adapter tensors in numpy order, PEFT's lora_A / lora_B layout -- and y = W x + (alpha / r) *
b (a x). The initial values are ggraph's (graphs/train/lora.py): a uniform in +-1/sqrt(n_in), b
zero; `set_lora` takes any others (e.g. the values a ggraph trainer starts from).

    import lora_torch                      # after sys.path.insert(0, <benchmarks>)
    tm = lora_torch.load_llama(path, targets=("attn_q", "attn_v"), rank=8, alpha=16.0)
    tm.set_lora({name: (a, b), ...})       # numpy a (r, n_in), b (n_out, r)
    opt = lora_torch.make_optimizer(tm, lr=1e-4)
    loss = lora_torch.train_step(tm, opt, tokens, labels)
    s = lora_torch.time_steps(tm, windows, labels, n_steps=4, threads=2)

Run as a script it checks the twin's logits against ggraph's Engine on the same tokens (max
absolute difference, KL divergence of the softmaxes) and prints torch's seconds per training
step:

    python benchmarks/lora_torch.py [-m MODEL.gguf] [-n 128 256] [-t 1 2] [--steps 3]
        [--ggml-rounding]

The Engine is run with GGRAPH_EXACT_ACTIVATIONS=1 (f32 activations in the mat-muls) and an F32
KV cache unless --ggml-rounding, which keeps ggml's rounding of activations to the weights'
vec_dot_type (Q8_1 for Q4_1) and an F16 cache: the twin computes in plain float32, so only the
first setting isolates the two implementations from ggml's quantized arithmetic.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_MODEL = os.path.join(os.path.expanduser("~"), ".cache", "ggraph",
                             "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_TARGETS = ("attn_q", "attn_v")


# -- weights ----------------------------------------------------------------------------------

def dequantize(t: Any) -> np.ndarray:
    """A GGUF weight's values as float32 numpy, ggml ne [n0, n1] -> shape (n1, n0) (vectors
    stay 1-D), decoded by ggraph's own codecs."""
    from ggraph.codecs.buffers import read

    v = read(np.asarray(t.data), 0, t).astype(np.float32, copy=False)
    ne = [n for n in t.ne]
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return np.ascontiguousarray(v.reshape(tuple(reversed(ne))))


def _frozen(values: np.ndarray) -> nn.Parameter:
    return nn.Parameter(torch.from_numpy(np.ascontiguousarray(values, np.float32)),
                        requires_grad=False)


class LoraLinear(nn.Module):
    """y = x W^T (+ bias) + scale * (x a^T) b^T with W frozen; a, b trainable once added."""

    def __init__(self, name: str, weight: np.ndarray, bias: np.ndarray | None = None) -> None:
        super().__init__()
        self.name = name
        self.weight = _frozen(weight)
        self.bias = _frozen(bias) if bias is not None else None
        self.lora_a: nn.Parameter | None = None
        self.lora_b: nn.Parameter | None = None
        self.scale = 0.0

    @property
    def n_in(self) -> int:
        return self.weight.shape[1]

    @property
    def n_out(self) -> int:
        return self.weight.shape[0]

    def add_lora(self, rank: int, alpha: float, rng: np.random.Generator) -> None:
        """Fresh rank-`rank` pair as ggraph initializes it; scale alpha / rank (1 without
        alpha, as llama.cpp's get_scale)."""
        a = rng.uniform(-1, 1, (rank, self.n_in)) / np.sqrt(self.n_in)
        self.lora_a = nn.Parameter(torch.from_numpy(a.astype(np.float32)))
        self.lora_b = nn.Parameter(torch.zeros(self.n_out, rank))
        self.scale = alpha / rank if alpha else 1.0

    def set_lora(self, a: np.ndarray, b: np.ndarray) -> None:
        if self.lora_a is None or self.lora_b is None:
            raise KeyError(f"{self.name} has no LoRA pair (not among the targets)")
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if a.shape != tuple(self.lora_a.shape) or b.shape != tuple(self.lora_b.shape):
            raise ValueError(f"{self.name}: LoRA a {a.shape} / b {b.shape}, expected "
                             f"{tuple(self.lora_a.shape)} / {tuple(self.lora_b.shape)}")
        with torch.no_grad():
            self.lora_a.copy_(torch.from_numpy(a))
            self.lora_b.copy_(torch.from_numpy(b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora_a is not None and self.scale:
            y = y + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)
        return y


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Layer(nn.Module):
    def __init__(self, prefix: str, L: Mapping[str, Any]) -> None:
        super().__init__()

        def lin(key: str) -> LoraLinear:
            b = L.get(key + "_b")
            return LoraLinear(L[key].name, dequantize(L[key]),
                              None if b is None else dequantize(b))

        self.attn_norm = _frozen(dequantize(L["attn_norm"]))
        self.attn_q, self.attn_k, self.attn_v = lin("attn_q"), lin("attn_k"), lin("attn_v")
        self.attn_output = lin("attn_output")
        self.q_norm = _frozen(dequantize(L["attn_q_norm"])) if L.get("attn_q_norm") is not None \
            else None
        self.k_norm = _frozen(dequantize(L["attn_k_norm"])) if L.get("attn_k_norm") is not None \
            else None
        self.ffn_norm = _frozen(dequantize(L["ffn_norm"]))
        self.ffn_gate, self.ffn_up, self.ffn_down = lin("ffn_gate"), lin("ffn_up"), lin("ffn_down")


class TorchLlama(nn.Module):
    """The twin. `hp`: ggraph's hyperparameters (model.hp of build_model); `neox`: the rope
    mode (False: NORMAL, llama's)."""

    def __init__(self, arch_name: str, hp: Any, neox: bool, w: Mapping[str, Any]) -> None:
        super().__init__()
        self.arch_name, self.hp, self.neox = arch_name, hp, neox
        self.n_head, self.n_head_kv, self.head_dim = hp.n_head, hp.n_head_kv, hp.head_dim
        self.n_rot, self.eps = hp.n_rot, float(hp.rms_eps)
        self.freq_base, self.freq_scale = float(hp.rope_freq_base), float(hp.freq_scale)
        self.token_embd = _frozen(dequantize(w["token_embd"]))
        tied = w["output"] is w["token_embd"]
        self.layers = nn.ModuleList(Layer(f"blk.{il}", L) for il, L in enumerate(w["layers"]))
        self.output_norm = _frozen(dequantize(w["output_norm"]))
        ob = w.get("output_b")
        self.output = LoraLinear(w["output"].name,
                                 self.token_embd.detach().numpy() if tied
                                 else dequantize(w["output"]),
                                 None if ob is None else dequantize(ob))
        if tied:   # one tensor, as the file has it
            self.output.weight = self.token_embd
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- LoRA -------------------------------------------------------------------------------
    def linears(self) -> dict[str, LoraLinear]:
        """Every matrix of the layers by its GGUF name (blk.N.attn_q.weight ...)."""
        out = {}
        for layer in self.layers:
            for m in (layer.attn_q, layer.attn_k, layer.attn_v, layer.attn_output,
                      layer.ffn_gate, layer.ffn_up, layer.ffn_down):
                out[m.name] = m
        return out

    def add_lora(self, targets: Sequence[str] = DEFAULT_TARGETS, rank: int = 8,
                 alpha: float = 16.0, seed: int = 0) -> list[str]:
        """Adapters on every layer's `targets` (short names such as attn_q, or full names);
        returns the adapted weights' names."""
        rng = np.random.default_rng(seed)
        names = [n for n in self.linears()
                 if any(n == t or n.endswith(f".{t}.weight") for t in targets)]
        if not names:
            raise ValueError(f"LoRA targets {list(targets)} match no weight")
        lin = self.linears()
        for n in names:
            lin[n].add_lora(rank, alpha, rng)
        return names

    def lora_modules(self) -> dict[str, LoraLinear]:
        return {n: m for n, m in self.linears().items() if m.lora_a is not None}

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.lora_modules().values() for p in (m.lora_a, m.lora_b)]

    def set_lora(self, values: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """{base weight name: (a (r, n_in), b (n_out, r))} into the adapters."""
        lin = self.lora_modules()
        for name, (a, b) in values.items():
            if name not in lin:
                raise KeyError(f"{name}: no LoRA pair here (adapted: {len(lin)} weights, e.g. "
                               f"{next(iter(lin), None)})")
            lin[name].set_lora(a, b)

    def lora_values(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return {n: (m.lora_a.detach().numpy().copy(), m.lora_b.detach().numpy().copy())
                for n, m in self.lora_modules().items()}

    # -- forward ----------------------------------------------------------------------------
    def rope_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (n, n_rot / 2) for positions 0..n-1 (float64 angles, as ggraph's
        rope_cache, then float32)."""
        if n not in self._rope:
            i = np.arange(self.n_rot // 2, dtype=np.float64)
            theta = (np.arange(n, dtype=np.float64)[:, None] * self.freq_scale
                     * self.freq_base ** (-2.0 * i / self.n_rot))
            self._rope[n] = (torch.from_numpy(np.cos(theta).astype(np.float32)),
                             torch.from_numpy(np.sin(theta).astype(np.float32)))
        return self._rope[n]

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, heads, head_dim) rotated by position (0..T-1) over its first n_rot dims."""
        cos, sin = self.rope_tables(x.shape[1])
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        r, rest = x[..., :self.n_rot], x[..., self.n_rot:]
        half = self.n_rot // 2
        if self.neox:
            x0, x1 = r[..., :half], r[..., half:]
            out = torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1)
        else:
            x0, x1 = r[..., 0::2], r[..., 1::2]
            out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], -1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, n_vocab) of tokens (B, T) or (T,) at positions 0..T-1."""
        if tokens.dim() == 1:
            tokens = tokens[None]
        B, T = tokens.shape
        hd, eps = self.head_dim, self.eps
        x = F.embedding(tokens, self.token_embd)
        for L in self.layers:
            h = rms_norm(x, L.attn_norm, eps)
            q = L.attn_q(h).view(B, T, self.n_head, hd)
            k = L.attn_k(h).view(B, T, self.n_head_kv, hd)
            v = L.attn_v(h).view(B, T, self.n_head_kv, hd)
            if L.q_norm is not None:
                q = rms_norm(q, L.q_norm, eps)
            if L.k_norm is not None:
                k = rms_norm(k, L.k_norm, eps)
            q, k = self.rope(q), self.rope(k)
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                scale=1.0 / math.sqrt(hd), enable_gqa=self.n_head != self.n_head_kv)
            x = x + L.attn_output(att.transpose(1, 2).reshape(B, T, self.n_head * hd))
            h = rms_norm(x, L.ffn_norm, eps)
            x = x + L.ffn_down(F.silu(L.ffn_gate(h)) * L.ffn_up(h))
        return self.output(rms_norm(x, self.output_norm, eps))


def load_llama(path: str, targets: Sequence[str] = DEFAULT_TARGETS, rank: int = 8,
               alpha: float = 16.0, seed: int = 0) -> TorchLlama:
    """The twin of the GGUF at `path` (architectures llama, qwen2, qwen3), with LoRA pairs on
    `targets` (empty: none) initialized as ggraph does; scale alpha / rank."""
    from ggraph.graphs.gguf.gguf_file import load_gguf
    from ggraph.graphs.models.arch import build_model
    from ggraph.ops.rope import RopeMode

    gguf = load_gguf(path)
    model = build_model(gguf)
    spec = getattr(model, "spec", None)
    if spec is None or not hasattr(model, "w"):
        raise ValueError(f"{path}: architecture {gguf.arch!r} is not a dense llama-like "
                         f"decoder (llama, qwen2, qwen3)")
    tm = TorchLlama(gguf.arch, model.hp, spec.rope_mode == RopeMode.NEOX, model.w)
    for p in tm.parameters():
        p.requires_grad_(False)
    if targets:
        tm.add_lora(targets, rank, alpha, seed)
    return tm


# -- training -----------------------------------------------------------------------------------

def make_optimizer(model: TorchLlama, lr: float = 1e-4, wd: float = 0.0) -> torch.optim.AdamW:
    """AdamW over the LoRA parameters only, with ggml-opt's betas and eps."""
    return torch.optim.AdamW(model.lora_parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                             weight_decay=wd)


def train_step(model: TorchLlama, opt: torch.optim.Optimizer, tokens: Any, labels: Any
               ) -> float:
    """One step on one window (T,) (or a batch (B, T)): cross-entropy of every position's
    logits against its label, the mean; backward; the optimizer's update. Returns the loss."""
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def time_steps(model: TorchLlama, windows: Any, labels: Any, n_steps: int, threads: int,
               lr: float = 1e-4, warmup: int = 1, restore: bool = True) -> float:
    """Seconds per training step: a fresh AdamW over the LoRA parameters, `warmup` untimed
    steps, then n_steps steps, one window of `windows` (N, T) per step in turn (labels (N, T)),
    on `threads` torch threads. With `restore` the adapters get their values back afterwards
    (the steps train them). The thread count stays set to `threads`."""
    windows, labels = np.atleast_2d(np.asarray(windows)), np.atleast_2d(np.asarray(labels))
    torch.set_num_threads(int(threads))
    saved = model.lora_values() if restore else None
    opt = make_optimizer(model, lr)
    i = 0
    for _ in range(warmup):
        train_step(model, opt, windows[i % len(windows)], labels[i % len(labels)])
        i += 1
    t0 = time.perf_counter()
    for _ in range(n_steps):
        train_step(model, opt, windows[i % len(windows)], labels[i % len(labels)])
        i += 1
    dt = (time.perf_counter() - t0) / max(1, n_steps)
    if saved is not None:
        model.set_lora(saved)
    return dt


# -- the check ---------------------------------------------------------------------------------

def logits_agreement(ref: np.ndarray, got: np.ndarray) -> tuple[float, float, float]:
    """(max |ref - got|, mean KL(softmax(ref) || softmax(got)) per position, max KL)."""
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    lp = ref - ref.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = got - got.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return float(np.abs(ref - got).max()), float(kl.mean()), float(kl.max())


def _prompt_tokens(eng: Any, n: int) -> list[int]:
    text = ("The quick brown fox jumps over the lazy dog. In the beginning was the word, and "
            "the word was with the compiler. ") * 64
    toks = list(eng.tokenizer.encode(text, add_bos=False))
    return toks[:n]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=DEFAULT_MODEL)
    ap.add_argument("-n", "--tokens", type=int, nargs="+", default=[128, 256],
                    help="window lengths of the timed training steps")
    ap.add_argument("-t", "--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--check-tokens", type=int, default=32,
                    help="prompt length of the logits check")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per setting")
    ap.add_argument("--ggml-rounding", action="store_true",
                    help="run the Engine with ggml's activation rounding and an F16 KV cache")
    args = ap.parse_args()
    if not args.ggml_rounding:
        os.environ["GGRAPH_EXACT_ACTIVATIONS"] = "1"   # read when the CPU kernels load

    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    t0 = time.perf_counter()
    tm = load_llama(args.model)
    print(f"twin of {os.path.basename(args.model)} ({tm.arch_name}, {len(tm.layers)} layers, "
          f"{len(tm.lora_modules())} LoRA pairs, rope {'NEOX' if tm.neox else 'NORMAL'}) "
          f"loaded in {time.perf_counter() - t0:.1f} s")
    n_check = args.check_tokens
    kv = "f16" if args.ggml_rounding else "f32"
    eng = Engine(args.model, EngineConfig(n_ctx=max(256, n_check), type_k=kv, type_v=kv))
    from ggraph.backends.cpu import kernels as CK
    toks = _prompt_tokens(eng, max(n_check, max(args.tokens) + 1))
    prompt = toks[:n_check]

    # a random nonzero adapter in both, so the check covers the LoRA path too
    rng = np.random.default_rng(1)
    values = {n: (rng.uniform(-1, 1, m.lora_a.shape).astype(np.float32) / np.sqrt(m.n_in),
                  rng.normal(0, 0.02, m.lora_b.shape).astype(np.float32))
              for n, m in tm.lora_modules().items()}
    ref = np.asarray(eng.eval(prompt, all_logits=True, n_past=0))
    with torch.no_grad():
        got = tm(torch.tensor(prompt)).numpy()[0]
    mx, kl, klmax = logits_agreement(ref, got)
    print(f"logits vs ggraph's Engine ({n_check} tokens, activations "
          f"{'rounded as ggml' if CK.ROUND_ACTIVATIONS else 'f32'}, KV {kv}), no adapter: "
          f"max |diff| {mx:.3g}, KL mean {kl:.3g} max {klmax:.3g}")
    del eng
    mx_l, got_l = _lora_check(args.model, tm, values, prompt, kv)
    print(f"  with a random adapter (scale {next(iter(tm.lora_modules().values())).scale}, "
          f"moving the logits by up to {np.abs(got_l - got).max():.3g}): "
          f"max |diff| {mx_l[0]:.3g}, KL mean {mx_l[1]:.3g} max {mx_l[2]:.3g}")

    tm.set_lora({n: (a, np.zeros_like(b)) for n, (a, b) in values.items()})
    base = os.path.basename(args.model)
    for n in args.tokens:
        x = np.array([toks[:n]], np.int64)
        y = np.array([toks[1:n + 1]], np.int64)
        for t in args.threads:
            s = time_steps(tm, x, y, args.steps, t)
            print(f"torch LoRA step, {base}, {n} tokens, {t} thread(s): {s:.3f} s/step, "
                  f"{n / s:.0f} tokens/s")


def _lora_check(path: str, tm: TorchLlama, values: Mapping[str, tuple[np.ndarray, np.ndarray]],
                prompt: list[int], kv: str
                ) -> tuple[tuple[float, float, float], np.ndarray]:
    """Both with the same nonzero adapter: ggraph's Engine loading it as llama.cpp's adapter
    GGUF (graphs/models/lora_gguf.py, --lora), the twin through set_lora. Returns the
    agreement and the twin's logits."""
    import tempfile

    from ggraph.graphs.models.lora_gguf import write_lora_adapter
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    first = next(iter(tm.lora_modules().values()))
    alpha = first.scale * first.lora_a.shape[0]
    with tempfile.TemporaryDirectory() as d:
        ad = os.path.join(d, "adapter.gguf")
        write_lora_adapter(ad, tm.arch_name, alpha, values)
        eng = Engine(path, EngineConfig(n_ctx=max(256, len(prompt)), type_k=kv, type_v=kv,
                                        loras=((ad, 1.0),)))
        ref = np.asarray(eng.eval(prompt, all_logits=True, n_past=0))
        del eng
    tm.set_lora(values)
    with torch.no_grad():
        got = tm(torch.tensor(prompt)).numpy()[0]
    return logits_agreement(ref, got), got


if __name__ == "__main__":
    main()
