"""Where a model's layers live: llama.cpp's `-ngl` / `--tensor-split` rules, device lists,
and the device of every weight and cache tensor.

llama.cpp (llama_model::load_tensors) keeps the input layer (token embedding) on the CPU,
offloads the last `n_gpu_layers` of the n_layer + 1 layers (the output layer counts as one)
and gives GPU layer i (counted from the first offloaded one) to the first device whose
cumulative, normalized split point exceeds i / n_offloaded. Without a tensor split the shares
follow each device's memory. A layer's KV cache lives with the layer.
"""
from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from ggraph.backends import registry
from ggraph.backends.registry import DeviceRef
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import MIB

GIB = 1 << 30

# a virtual device (a size in --devices, for planning) is planned as a CUDA device: ggml's CUDA
# alignment, named CUDA0, CUDA1, ...
VIRTUAL = registry.KINDS["cuda"]

_UNITS = {"gib": GIB, "gb": 10**9, "mib": MIB, "mb": 10**6, "kib": 1024, "b": 1}


@dataclass(frozen=True)
class Device:
    name: str            # CUDA0, CUDA1, ... or CPU
    kind: str            # "cuda", "cpu", "virtual", or a remote stage "ray:cpu" / "ray:cuda"
    memory: int | None   # bytes, None = not limited / unknown
    index: int = 0       # the CUDA ordinal the backend opens (cuda:1 -> 1); 0 otherwise
    node: str | None = None  # a remote stage's node address (ray:cpu@10.0.0.2)
    ref: DeviceRef | None = None  # the device the backends make (None: a virtual device)


def parse_size(text: str) -> int:
    """'24GiB', '24 GB', '512MiB', '1024' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m:
        raise ValueError(f"cannot read the size {text!r}; write e.g. 24GiB, 80GB or 512MiB")
    unit = m.group(2).lower() or "b"
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {m.group(2)!r} in {text!r}; use GiB, GB, MiB, MB")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"the size {text!r} is too large")
    return int(value)


def device_count(spec: str, max_devices: int | None, flag: str = "--devices") -> None:
    """Refuse a device list of more than max_devices devices before any is made: a model
    cannot use more pipeline stages than it has layers (its n_layer + 1, the output layer
    counting as one), and `100000000x1GiB` would otherwise build a hundred million."""
    if max_devices is None:
        return
    total = 0
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*[xX].*", part)
        total += int(m.group(1)) if m and len(m.group(1)) <= 18 else (1 if not m else 10**18)
    if total > max_devices:
        shown = f"{total}" if total < 10**18 else "more than 10^18"
        raise ValueError(f"{flag} {spec[:60]!r}: {shown} devices for a model that can use at "
                         f"most {max_devices} (its layers and its output layer; more stages "
                         f"than layers leave some empty)")


def parse_devices(spec: str, max_devices: int | None = None,
                  flag: str = "--devices") -> list[Device]:
    """Virtual devices: '15x24GiB', '2x24GiB,1x80GiB', '24GiB,24GiB'; or backends:
    'cuda', 'cuda,cuda' (GPUs 0 and 1, in order), 'cuda:1' (GPU 1), 'cpu' (a second CPU
    backend standing in for a device). A GPU listed twice is refused: its two backends
    would share one device's memory while the planner counted it twice. More than
    `max_devices` devices (a model's n_layer + 1) are refused before any is made."""
    device_count(spec, max_devices, flag)
    out: list[Device] = []
    counts: dict[str, int] = {}
    used: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise ValueError(f"empty entry in the device list {spec!r}")
        m = re.fullmatch(r"(\d+)\s*[xX]\s*(.+)", part)
        if m and len(m.group(1)) > 18:   # int() of a 10^6-digit count takes seconds
            raise ValueError(f"device count {m.group(1)[:20]}... is too large in the device "
                             f"list entry {part[:40]!r}")
        n, what = (int(m.group(1)), m.group(2)) if m else (1, part)
        if n <= 0:
            raise ValueError(f"device count must be positive in {part!r}")
        try:
            ref = registry.parse_device(what)
        except ValueError as e:
            raise ValueError(f"device list entry {part!r}: {e}") from None
        if ref is not None and ref.remote:  # remote stages (backends/ray_stages.py), any number
            for _ in range(n):
                i = counts.get("STAGE", 0)
                counts["STAGE"] = i + 1
                out.append(Device(f"STAGE{i}", f"{registry.REMOTE}:{ref.kind.name}", None, 0,
                                  ref.node, ref))
            continue
        mem = None
        if ref is None:
            try:
                mem = parse_size(what)
            except ValueError as e:
                raise ValueError(f"device list entry {part!r}: {e}; a device is a size "
                                 f"(24GiB), a count and a size (15x24GiB), "
                                 f"{registry.device_forms()}") from None
            if mem <= 0:
                raise ValueError(f"device memory must be positive in {part!r}")
        elif ref.index is not None and n != 1:
            raise ValueError(f"device list entry {part!r}: {ref.spec} names one device; list "
                             f"several as {ref.kind.name}:0,{ref.kind.name}:1")
        kind = ref.kind if ref is not None else VIRTUAL
        for _ in range(n):
            i = counts.get(kind.label, 0)
            counts[kind.label] = i + 1
            index = 0
            if ref is not None and kind.indexed:  # plain `cuda` takes the lowest not yet listed
                index = ref.index if ref.index is not None else min(set(range(len(used) + 1))
                                                                    - used)
                if index in used:
                    raise ValueError(f"device list {spec!r} names {kind.label} {index} twice")
                used.add(index)
                name = kind.device_name(index)
            else:  # a second CPU is CPU1 (the host is CPU); virtual devices count from 0
                name = kind.device_name(i + (1 if ref is not None else 0))
            out.append(Device(name, kind.name if ref is not None else "virtual", mem, index,
                              None, ref if ref is None else
                              registry.DeviceRef(kind, index if kind.indexed else None)))
    return out


def parse_split(text: str | None) -> list[float] | None:
    if text is None or text == "":
        return None
    try:
        vals = [float(x) for x in re.split(r"[,/]", text)]
    except ValueError:
        raise ValueError(f"cannot read --tensor-split {text!r}: give numbers separated by "
                         f"commas, e.g. 3,1") from None
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"--tensor-split {text!r}: shares must be finite numbers (no inf "
                         f"or nan), e.g. 3,1")
    if any(v < 0 for v in vals) or not any(v > 0 for v in vals):
        raise ValueError(f"--tensor-split {text!r}: shares must be >= 0 and not all 0")
    if not math.isfinite(sum(vals)):
        raise ValueError(f"--tensor-split {text!r}: the shares are too large to add up; "
                         f"give relative shares such as 3,1")
    return vals


@dataclass(frozen=True)
class LayerMap:
    """Device index per layer; `input` and `output` layers too. The host is len(devices)."""
    layers: tuple[int, ...]
    input: int
    output: int
    n_devices: int       # offload devices; index n_devices is the host (CPU)

    def count(self, device: int) -> int:
        return sum(1 for d in self.layers if d == device)


def layer_map(n_layer: int, n_devices: int, n_gpu_layers: int = -1,
              tensor_split: Sequence[float] | None = None,
              memory: Sequence[int | None] | None = None) -> LayerMap:
    """llama.cpp's placement. n_gpu_layers < 0 offloads everything (as -ngl 999)."""
    host = n_devices
    if tensor_split is not None and len(tensor_split) != n_devices:
        raise ValueError(f"--tensor-split has {len(tensor_split)} values for {n_devices} "
                         f"device{'s' if n_devices != 1 else ''}: give one share per device")
    if n_devices == 0:
        return LayerMap(tuple([host] * n_layer), host, host, 0)
    ngl = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    if tensor_split is not None:
        shares = list(tensor_split)
    elif memory is not None and all(m for m in memory):
        shares = [float(m) for m in memory]        # llama.cpp: by free memory
    else:
        shares = [1.0] * n_devices
    total, points = 0.0, []
    for s in shares:
        total += s
        points.append(total)
    points = [p / total for p in points]
    i_gpu_start = max(n_layer - ngl, 0)
    act = min(ngl, n_layer + 1)

    def dev(il: int) -> int:
        if il < i_gpu_start or il - i_gpu_start >= act:
            return host
        return min(bisect.bisect_right(points, (il - i_gpu_start) / act), n_devices - 1)

    return LayerMap(tuple(dev(il) for il in range(n_layer)), host, dev(n_layer), n_devices)


_LAYER_RE = re.compile(r"^blk\.(\d+)\.|^cache_[kv]_l(\d+)$")
_OUTPUT_NAMES = ("output.weight", "output_norm.weight")


def tensor_layer(name: str) -> int | str | None:
    """The layer index of a GGUF weight or cache tensor by its name, 'input', 'output', or
    None for anything else (graph inputs)."""
    m = _LAYER_RE.match(name)
    if m:
        return int(m.group(1) or m.group(2))
    if name == "token_embd.weight":
        return "input"
    if name in _OUTPUT_NAMES:
        return "output"
    return None


def place_tensors(tensors: Iterable[Tensor], lm: LayerMap) -> dict[Tensor, int]:
    """Device of every weight / cache tensor among `tensors` (pre-allocated leafs)."""
    out: dict[Tensor, int] = {}
    for t in tensors:
        if t.op is not None or t.view_src is not None or not t.is_preallocated:
            continue
        where = tensor_layer(t.name)
        if where is None:
            continue
        if where == "input":
            out[t] = lm.input
        elif where == "output":
            out[t] = lm.output
        else:
            if where >= len(lm.layers):
                raise ValueError(f"tensor {t.name!r} belongs to layer {where}, the model has "
                                 f"{len(lm.layers)}")
            out[t] = lm.layers[where]
    return out
