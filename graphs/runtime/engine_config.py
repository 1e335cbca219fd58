"""The settings an Engine is made with (`EngineConfig`: llama.cpp's context parameters under
their ggraph names), its prompt and generation timings (`Timings`), and `new_runner`, which
turns the settings into the Runner that runs the model's graphs (backends/runner.py): a
Session on one backend, or a MultiSession over several devices and the host CPU."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ggraph import config
from ggraph.backends import registry
from ggraph.backends.runner import Runner
from ggraph.plan.alloc import GraphAllocator
from ggraph.graphs.gguf.gguf_file import load_gguf
from ggraph.graphs.deploy.placement import LayerMap, layer_map, parse_devices


@dataclass
class EngineConfig:
    n_ctx: int = 4096
    n_ubatch: int = 512
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    amb_mib: int = 0
    # a sliding-window cache of n_ctx cells instead of n_swa + n_ubatch (llama.cpp's
    # --swa-full): more memory, every position's K/V kept
    swa_full: bool = False
    # sequences the KV cache holds (llama.cpp's -np / n_seq_max), in one unified stream of
    # n_ctx cells (--kv-unified), or a stream each of pad256(n_ctx / n_seq_max) cells
    n_seq_max: int = 1
    kv_unified: bool = True
    backend: str = "cpu"
    strategy: str = "default"
    n_threads: int | None = None
    # the CPU's thread governor (backends/cpu/threads.py) may run a graph on fewer threads
    # when that is faster, as on a busy machine; False runs exactly n_threads (benchmarks)
    adaptive_threads: bool = True
    # outputs in the worst-case graph: "all" tokens as llama.cpp reserves, or only the "last"
    # (what generation needs; the logits of a 512-token ubatch alone are 96 MiB for SmolLM2)
    reserve_outputs: str = "all"
    # several devices (graphs/deploy/placement.py): offload devices such as "cuda" or "cuda,cuda"
    # ("cpu" stands in for a device with a second CPU backend); the host CPU is always added.
    # Layers are placed with llama.cpp's -ngl / --tensor-split rules.
    # compute as ggml's CPU does, bit for bit (backends/cpu/ggml_exact.py; slower)
    ggml_exact: bool = False
    devices: str = ""
    n_gpu_layers: int = -1
    tensor_split: tuple[float, ...] | None = None
    # scan the weights for inf/NaN at load (llama.cpp's --check-tensors); on by default where
    # GGRAPH_CHECK_TENSORS=1 (the test suite)
    check_tensors: bool = field(
        default_factory=config.check_tensors)
    # remote stages (devices "ray:cpu", backends/ray_stages.py): seconds to wait on a stage
    # before calling it lost, whether a prompt's ubatches overlap across stages, and whether
    # to send weights through Ray's object store even to stages that have the GGUF file
    stage_timeout: float = 60.0
    pipeline: bool = True
    ship_weights: bool = False
    # map the weights from the file (llama.cpp's default), or read them into memory (False:
    # --no-mmap); lock them in RAM (--mlock)
    use_mmap: bool = True
    use_mlock: bool = False
    # run a short prompt and a decode step at load, then clear the cache (llama.cpp's warmup):
    # numba compiles the kernels there on the first run, so load time carries the compilation
    # and the prompt and generation timings do not
    warmup: bool = False
    # LoRA adapters, (path, user scale) each: --lora / --lora-scaled (graphs/models/lora.py)
    loras: tuple[tuple[str, float], ...] = ()


@dataclass
class Timings:
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0

    def line(self) -> str:
        pp = self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0
        tg = self.gen_tokens / self.gen_s if self.gen_s else 0.0
        return (f"prompt: {self.prompt_tokens} tokens in {self.prompt_s:.2f} s ({pp:.2f} "
                f"tokens/s), generation: {self.gen_tokens} tokens in {self.gen_s:.2f} s "
                f"({tg:.2f} tokens/s)")


def new_runner(cfg: EngineConfig, n_layer: int, host_kw: dict[str, Any],
               file: Any = None) -> tuple[Runner, LayerMap]:
    """The runner for `cfg` and where the model's layers go: a Session on one backend, or,
    with devices, a MultiSession over the devices and the host CPU (the host last). The one
    place that tells the two apart; everything after talks to the Runner interface."""
    from ggraph.backends import get_backend
    from ggraph.backends.multi import MultiSession

    if not cfg.devices:
        backend = get_backend(cfg.backend, **host_kw)
        allocator = GraphAllocator(alignment=backend.buffers.alignment, strategy=cfg.strategy,
                                   name=cfg.backend.upper())
        # no offload devices: every layer on the host, device 0
        return backend.session(allocator=allocator), layer_map(n_layer, 0)
    if not registry.kind(cfg.backend).threads:
        raise ValueError(f"with --devices the host is the CPU and the devices are "
                         f"listed there; got backend {cfg.backend!r} as well")
    devs = parse_devices(cfg.devices, n_layer + 1)
    if any(d.ref is None for d in devs):
        raise ValueError(f"--devices {cfg.devices!r}: running needs backends (cuda, cpu); "
                         f"sizes such as 24GiB describe virtual devices for `ggraph plan`")
    layers = layer_map(n_layer, len(devs), cfg.n_gpu_layers, cfg.tensor_split)
    names = [d.name for d in devs] + ["CPU"]
    # each GPU its own backend (its context, stream and memory), a remote stage its handle
    backends = [registry.make_backend(d.ref) for d in devs] + [get_backend("cpu", **host_kw)]
    if any(d.ref.remote for d in devs):
        # remote stages: Ray is imported only here (pip install ggraph[distributed])
        from ggraph.backends.ray_stages import RayMultiSession

        return RayMultiSession(backends, names,
                               file.path, set(file.tensors.values()), load_gguf, cfg.strategy,
                               cfg.stage_timeout, cfg.pipeline, cfg.ship_weights,
                               host_kw.get("n_threads")), layers
    return MultiSession(backends, names=names, strategy=cfg.strategy), layers
