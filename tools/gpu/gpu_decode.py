"""Decode speed of `ggraph gpu-check` (tools/gpu_check.py): tokens/s of a llama with
SmolLM2-135M's shapes (30 layers, hidden 576, 9 heads over 3 KV heads of 64, FFN 1536, vocab
49152, tied output) and random weights made on the device, at a few context lengths, with the
kernel launches one token costs.

How the weights get there without an upload: the model is the registered llama builder
(graphs/models/archs/llama.py) over a GGUFModel whose tensors have no data and buffer "model", as
`ggraph plan`'s presets build graphs without weights. A Session gives such a tensor device
memory of its own (zeroed) the first time a graph uses it; `fill_weights` then writes every
weight in place with one grid-stride kernel per tensor: hashed random bytes, except the block
header of each quant block, which it sets to a fixed scale (and min, for Q4_1) sized so a row
times a unit vector stays near 1. So scales are finite by construction, the 150 MB of weights
never cross PCIe, and filling them takes milliseconds. The KV cache is zeros and is not
prefilled: a decode step at context n sets the cache's used cells to n and attends to them,
which costs what real keys would.

`--tiny` (the simulator) runs a 1-layer model of the same structure: hidden 64, 2 heads over
one KV head of 32, vocab 64.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import GGMLType


@dataclass(frozen=True)
class DecodeShape:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int = 8192
    rope_freq_base: float = 100000.0

    def metadata(self) -> dict[str, Any]:
        """The GGUF keys a converter would write for these shapes."""
        a = "llama"
        return {"general.architecture": a, f"{a}.block_count": self.n_layer,
                f"{a}.embedding_length": self.n_embd, f"{a}.context_length": self.n_ctx_train,
                f"{a}.feed_forward_length": self.n_ff, f"{a}.attention.head_count": self.n_head,
                f"{a}.attention.head_count_kv": self.n_head_kv,
                f"{a}.rope.freq_base": self.rope_freq_base,
                f"{a}.attention.layer_norm_rms_epsilon": 1e-5, f"{a}.vocab_size": self.n_vocab}


SMOLLM2_135M = DecodeShape("smollm2-135m", 30, 576, 9, 3, 1536, 49152)
TINY = DecodeShape("tiny", 1, 64, 2, 1, 64, 64, n_ctx_train=512)


def random_model(shape: DecodeShape, weight_type: GGMLType) -> tuple[Any, list[Tensor]]:
    """(the llama builder over data-less weights of these shapes, its weight tensors):
    matrices in weight_type, norms in F32, the output tied to the embedding."""
    from ggraph.graphs.models.arch import model_class
    from ggraph.graphs.gguf.gguf_file import GGUFModel

    class DeviceWeights(GGUFModel):
        """Weights that exist only as tensors with buffer "model": the Session allocates
        them on the device; no optional tensor (biases, an untied output) exists."""

        def find(self, name: str, ne: tuple[int, ...], optional: bool) -> Tensor | None:
            if optional:
                return None
            t = self.tensors.get(name)
            if t is None:
                typ = weight_type if len(ne) > 1 else GGMLType.F32
                t = self.tensors[name] = self.ctx.new_tensor(typ, ne, name=name)
                t.buffer = "model"
                self.tensor_bytes += t.nbytes
            self.used.add(name)
            return t

    path = f"random:{shape.name}"
    gguf = DeviceWeights(path, shape.metadata(), {}, Context(path), 0, 0, 0)
    model = model_class("llama", path)(gguf)
    return model, list(gguf.tensors.values())


def block_header(t: Tensor) -> tuple[np.ndarray, int]:
    """(the fixed leading bytes of every block of t, the block's size in bytes): Q8_0's f16
    scale d, Q4_1's d and min m, F32's 1.0 (norm weights: the whole tensor). d makes a
    weight's standard deviation 1/sqrt(row length): uniform int8 has std 73.9, uniform
    nibbles 4.61."""
    k = t.ne[0]
    if t.type == GGMLType.Q8_0:
        d = 1.0 / (73.9 * math.sqrt(k))
        return np.array([d], np.float16).view(np.uint8), t.type.type_size
    if t.type == GGMLType.Q4_1:
        d = 1.0 / (4.61 * math.sqrt(k))
        return np.array([d, -7.5 * d], np.float16).view(np.uint8), t.type.type_size
    if t.type == GGMLType.F32:
        return np.array([1.0], np.float32).view(np.uint8), 4
    raise ValueError(f"no random fill for {t.type} weights ({t.describe()}); use q8_0 or q4_1")


cuda: Any = None  # numba.cuda, set by fill_weights: `ggraph` imports every tool at start,
#                   and no command but this one should pay for importing numba


def _k_fill(buf, head, ts, seed):  # noqa: ANN001 - a CUDA kernel
    """buf[i] = head[i % ts] inside each block's header, else a hashed random byte."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    nh = head.size
    while i < buf.size:
        pos = i % ts
        if pos < nh:
            buf[i] = head[pos]
        else:
            x = (np.int64(i) * 2654435761 + seed) & 0xFFFFFFFF
            x ^= x >> 16
            x = (x * 73244475) & 0xFFFFFFFF
            x ^= x >> 16
            buf[i] = np.uint8(x & 0xFF)
        i += stride


_FILL: list[Any] = []


def fill_weights(session: Any, weights: list[Tensor], seed: int = 1) -> float:
    """Give every weight its device memory in `session` and fill it in place (see the module
    docstring); the seconds it took."""
    global cuda
    from numba import cuda
    from ggraph.backends.cuda import runtime as R, templates as K

    if not _FILL:  # compiled at its first launch, when `cuda` above is bound
        _FILL.append(R.kernel_decorator()(_k_fill))
    t0 = time.perf_counter()
    for i, t in enumerate(weights):
        buf, off = session.storage(t)  # allocates the tensor's (zeroed) device memory
        if off or buf.nbytes < t.nbytes:
            raise RuntimeError(f"{t.describe()}: expected its own device buffer")
        head, ts = block_header(t)
        R.launch(_FILL[0], R.blocks_for(t.nbytes, K.EW_NT), K.EW_NT, buf, R.upload_bytes(head),
                 np.int64(ts), np.int64(seed * 1000003 + i))
    R.synchronize()
    return time.perf_counter() - t0


def decode_speed(backend: Any, tiny: bool, weight_type: str = "q8_0",
                 contexts: tuple[int, ...] | None = None, steps: int | None = None,
                 flash: tuple[bool, ...] = (False, True)) -> dict[str, Any]:
    """Tokens/s of greedy decode steps (one token per graph run, the logits read back each
    step as a generator would) at each context length, with and without flash attention;
    per-step GPU time by CUDA events where they carry time; kernel launches per token (the
    Session's bound calls, one launch each: a fused group is one kernel) beside the graph's
    nodes."""
    from ggraph.graphs.models.kv_cache import KV_PAD
    from ggraph.tools.gpu.gpu_perf import CudaEvent, backend_stream, on_device

    shape = TINY if tiny else SMOLLM2_135M
    contexts = contexts or ((8,) if tiny else (128, 1024, 4096))
    steps = steps or (1 if tiny else 32)
    pad = 32 if tiny else KV_PAD  # llama.cpp's 256 cells would be most of the simulator's time
    wt = GGMLType.parse(weight_type)
    t0 = time.perf_counter()
    model, weights = random_model(shape, wt)
    n_ctx = min(shape.n_ctx_train, -(-(max(contexts) + steps + 1) // pad) * pad)
    session = backend.session()
    with on_device(backend):  # the fill kernels queue on the backend's stream
        fill_s = fill_weights(session, weights)
    stream = backend_stream(backend)
    out: dict[str, Any] = {"model": f"llama, {shape.name} shapes, random {wt} weights made on "
                           f"the device", "shape": shape.__dict__, "weight_type": str(wt),
                           "weight_bytes": sum(t.nbytes for t in weights),
                           "fill_seconds": fill_s, "n_ctx": n_ctx, "rows": []}
    ctx = Context("decode")
    rng = np.random.default_rng(0)
    for fa in flash:
        cache = model.new_cache(ctx, n_ctx, "f16", "f16", fa)
        for n_past in contexts:
            n_kv = min(n_ctx, -(-(n_past + steps + 1) // pad) * pad)
            mg = model.build(ctx, cache, 1, n_kv, 1, fa, 0)
            row: dict[str, Any] = {"context": n_past, "flash_attn": fa, "n_kv": n_kv}
            try:
                tok = int(rng.integers(shape.n_vocab))
                wall, gpu, finite = [], [], True
                for step in range(steps + 1):  # step 0 compiles, plans and binds: not timed
                    pos = n_past + step
                    inputs = model.batch_inputs(mg, cache, np.array([tok], np.int32), pos,
                                                np.array([0]))
                    e0, e1 = CudaEvent(stream), CudaEvent(stream)
                    t1 = time.perf_counter()
                    e0.record()
                    session.run(mg.graph, inputs)
                    e1.record()
                    logits = session.read(mg.logits).reshape(-1)  # waits for the GPU
                    dt = time.perf_counter() - t1
                    e1.synchronize()
                    ms = e0.elapsed_time(e1)
                    finite = finite and bool(np.isfinite(logits).all())
                    tok = int(np.argmax(logits))
                    if step:
                        wall.append(dt)
                        gpu.append(ms / 1e3 if ms is not None and ms >= 0 else None)
                per = float(np.median(wall))
                row.update(tok_s=1.0 / per, ms_per_token=per * 1e3,
                           gpu_ms_per_token=None if None in gpu else float(np.median(gpu)) * 1e3,
                           launches_per_token=len(session.bound_calls or ()),
                           replay=_replay_mode(session.bound_calls),
                           nodes_per_token=len(mg.graph.nodes), steps=steps,
                           logits_finite=finite)
            except Exception as e:  # one configuration failing must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            out["rows"].append(row)
    out["seconds"] = time.perf_counter() - t0
    return out


def _replay_mode(calls: Any) -> str:
    """How the session ran its steps (backends/cuda/replay.py): one captured CUDA graph per
    token, or launch by launch (and why)."""
    if getattr(calls, "exec", None) is not None:
        return "CUDA graph"
    why = getattr(calls, "why_not", "")
    return "launch by launch" + (f" ({why})" if why and why != "off" else "")


def decode_lines(d: dict[str, Any]) -> list[str]:
    """The decode section as printed."""
    lines = [f"  {d['model']}: {d['weight_bytes'] / 2**20:.2f} MiB filled in "
             f"{d['fill_seconds'] * 1e3:.0f} ms"]
    for r in d["rows"]:
        fa = "on " if r["flash_attn"] else "off"
        head = f"  context {r['context']:5d} (n_kv {r['n_kv']}), flash {fa}:"
        if "error" in r:
            lines.append(f"{head} ERROR {r['error']}")
            continue
        gpu = (f", GPU {r['gpu_ms_per_token']:.2f} ms/token by events"
               if r["gpu_ms_per_token"] is not None else ", no event timing (simulator)")
        lines.append(f"{head} {r['tok_s']:8.1f} tok/s ({r['ms_per_token']:.2f} ms/token{gpu}), "
                     f"{r['launches_per_token']} launches/token ({r['nodes_per_token']} nodes, "
                     f"{r.get('replay', '?')})"
                     + ("" if r["logits_finite"] else ", NON-FINITE logits"))
    return lines
