"""The device registry: every kind of device ggraph runs graphs on, resolved in one place.

A kind has a name in device lists (`cpu`, `cuda`), the label llama.cpp prints for its devices
(CPU, CUDA0), ggml's buffer alignment for it (the allocator pads every tensor to it: 32 bytes
on the CPU, 128 on CUDA), whether its devices have ordinals (`cuda:1`), and the module and
class of its backend, imported only when one is made (CUDA and Ray are optional). A device
reference adds the ordinal and, for a pipeline stage on a Ray actor (`ray:cpu`,
`ray:cuda@NODE`), the node. `get_backend` (ggraph.backends), the Ray stages, the engine and
the planners all ask this module; none of them compares kind names.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from .errors import BackendUnavailableError

__all__ = ["DeviceKind", "DeviceRef", "KINDS", "NAMES", "kind", "alignment", "parse_device",
           "make_backend", "kernel_table", "device_forms", "BackendUnavailableError"]


@dataclass(frozen=True)
class DeviceKind:
    name: str        # in device lists and -dev: cpu, cuda
    label: str       # llama.cpp's device name prefix: CPU, CUDA (CUDA0, CUDA1, ...)
    alignment: int   # ggml's buffer alignment for the kind's buffers
    indexed: bool    # devices have ordinals (cuda:N); each is listed at most once
    gpus: int        # GPUs one device holds (what a Ray stage of the kind reserves)
    threads: bool    # runs on the host's threads: takes n_threads, adaptive, weights
    module: str      # the backend's module (relative to ggraph.backends) and class
    cls: str
    kernels: str     # the module holding its kernel table KERNELS

    def backend_class(self) -> Any:
        return getattr(importlib.import_module(self.module, __package__), self.cls)

    def device_name(self, number: int) -> str:
        """llama.cpp's name for device `number` of this kind: CUDA0, CPU1."""
        return f"{self.label}{number}"


KINDS: dict[str, DeviceKind] = {
    "cpu": DeviceKind("cpu", "CPU", 32, False, 0, True, ".cpu", "CPUBackend", ".cpu.kernels"),
    "cuda": DeviceKind("cuda", "CUDA", 128, True, 1, False, ".cuda", "CUDABackend",
                       ".cuda.kernels"),
}
NAMES = tuple(KINDS)
REMOTE = "ray"   # the prefix of a pipeline stage on a Ray actor: ray:cpu, ray:cuda@NODE
# the host's handle on such a stage (loaded as the kinds' backends are, when one is made)
REMOTE_BACKEND = (".ray_stages", "RemoteBackend")


def kind(name: str) -> DeviceKind:
    """The kind called `name` (case and spaces ignored); an unknown name is an error listing
    the known ones."""
    k = KINDS.get(name.strip().lower())
    if k is None:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(NAMES)}")
    return k


def alignment(name: str) -> int:
    """ggml's buffer alignment for devices of kind `name`."""
    return kind(name).alignment


@dataclass(frozen=True)
class DeviceRef:
    kind: DeviceKind
    index: int | None = None   # the ordinal of an indexed kind (cuda:1), None: not given
    remote: bool = False       # a pipeline stage on a Ray actor
    node: str | None = None    # the stage's node address (ray:cuda@10.0.0.2)

    def __post_init__(self) -> None:
        if self.index is not None and not self.kind.indexed:
            raise ValueError(f"device {self.kind.name}:{self.index}: {self.kind.name} devices "
                             f"have no ordinals")

    @property
    def spec(self) -> str:
        """The entry as a device list writes it."""
        base = self.kind.name + (f":{self.index}" if self.index is not None else "")
        return f"{REMOTE}:{base}" + (f"@{self.node}" if self.node else "") if self.remote \
            else base


def parse_device(text: str) -> DeviceRef | None:
    """One device list entry -> its reference: `cpu`, `cuda`, `cuda:N`, `ray:cpu`,
    `ray:cuda@NODE`; None when the entry names no device kind (a size, for planning)."""
    t = text.strip().lower()
    names = "|".join(re.escape(n) for n in KINDS)
    m = re.fullmatch(rf"{REMOTE}\s*:\s*({names})\s*(?:@\s*([\w.:-]+))?", t)
    if m:
        return DeviceRef(KINDS[m.group(1)], remote=True, node=m.group(2))
    m = re.fullmatch(rf"({names})(?:\s*:\s*(\d{{1,9}}))?", t)
    if not m:
        return None
    return DeviceRef(KINDS[m.group(1)], int(m.group(2)) if m.group(2) is not None else None)


def device_forms() -> str:
    """How a device list may name devices, for messages: cpu, cuda, cuda:N, ray:cpu, ..."""
    local = ", ".join(k.name + (f", {k.name}:N" if k.indexed else "") for k in KINDS.values())
    return (f"{local}, or a remote stage {REMOTE}:KIND[@NODE] "
            f"({', '.join(f'{REMOTE}:{k}' for k in KINDS)})")


def kernel_table(ref: DeviceRef | str) -> Any:
    """The kernel table (OpKind -> kernel) of a kind: which nodes its devices may run."""
    k = ref.kind if isinstance(ref, DeviceRef) else kind(ref)
    return importlib.import_module(k.kernels, __package__).KERNELS


def make_backend(ref: DeviceRef | str, **kw: Any) -> Any:
    """A backend for `ref` (a DeviceRef or a kind's name): an indexed kind opens device
    `index`, a remote reference gives the host's handle on a Ray stage (ray_stages, imported
    only here: pip install ggraph[distributed]). BackendUnavailableError where the machine
    cannot run the kind (no CUDA driver or GPU)."""
    if isinstance(ref, str):
        parsed = parse_device(ref)
        ref = parsed if parsed is not None else DeviceRef(kind(ref))   # kind(): the error
    if ref.remote:
        remote = getattr(importlib.import_module(REMOTE_BACKEND[0], __package__),
                         REMOTE_BACKEND[1])
        return remote(ref.kind.name, ref.node)
    if ref.index is not None:
        kw = {**kw, "device": ref.index}
    return ref.kind.backend_class()(**kw)
