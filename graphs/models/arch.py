"""Architectures: the interface every model builder implements, its optional capabilities,
and the registry that finds a builder by `general.architecture`.

A builder is an `Architecture` subclass decorated with `@register_arch(name)` in a module of
the `graphs/models/archs/` package. The registry imports every module of that package (pkgutil) when
a name is looked up, so adding an architecture is adding one module: nothing lists the
architectures, and nobody imports a builder "to register" it. An unknown name is an error
listing the known ones.

Capabilities beyond building are interfaces a builder also subclasses, so the class declares
them and callers test them with `supports(cls, capability)`: `MLAPlanner` is what `ggraph
plan` (graphs/deploy/presets.py) needs to plan MLA attention without weights, `KShift` what the
engine's context shift needs to re-rope cached K.
"""
from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence, TypeVar

import numpy as np

from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import GGMLType

from ggraph.graphs.gguf.gguf_file import GGUFError, GGUFModel
from ggraph.graphs.models.batch import UBatch
from ggraph.graphs.models.lora import LoraAdapter, check_loras
from ggraph.graphs.models.kv_cache import UNIFIED, Slots, StreamRange
from ggraph.graphs.models.model_graph import ModelGraph, ubatch_values
from ggraph.graphs.models.hparams import read_hparams
from ggraph.graphs.models.tensor_names import TensorNames, expect_tensor, vocab_size

if TYPE_CHECKING:
    from ggraph.graphs.models.mla import MLAShape


class Architecture(ABC):
    """What the engine, `ggraph run`, `ggraph dot` and `ggraph plan` use of a builder.

    A subclass sets `hparams_class` (a dataclass read with hparams.read_hparams) and `tensors`
    (its TensorNames), and its `__init__` looks up every weight it uses through `weight` /
    `optional_weight` (GGUFModel.check_all_used refuses a file with tensors left over).
    """
    arch_name: ClassVar[str] = ""          # set by register_arch
    hparams_class: ClassVar[type]
    tensors: ClassVar[TensorNames]
    gguf: GGUFModel
    hp: Any
    # LoRA adapters every graph `build` applies (graphs/models/lora.py); set with set_loras
    loras: tuple[LoraAdapter, ...] = ()

    @abstractmethod
    def __init__(self, gguf: GGUFModel, **overrides: Any) -> None:
        """Read self.hp from gguf's metadata (overrides replace hyperparameters) and look
        up the weights."""

    @abstractmethod
    def new_cache(self, ctx: Context, size: int, type_k: str = "f16", type_v: str = "f16",
                  flash_attn: bool = False, n_ubatch: int = 512, swa_full: bool = False,
                  n_seq_max: int = 1, unified: bool = True) -> Any:
        """The KV cache of `size` cells (pre-allocated leafs in ctx; None without one).
        n_ubatch: the largest ubatch (a sliding-window cache holds n_swa + n_ubatch cells);
        swa_full: a sliding-window cache of all `size` cells (llama.cpp's --swa-full);
        n_seq_max: the sequences its cells can hold (-np); unified: one stream of cells that
        every sequence shares (--kv-unified), else `size` cells per sequence."""

    @abstractmethod
    def graph_capacity(self, n_tokens: int, n_kv: int, amb_mib: int) -> int:
        """Nodes the graph of one ubatch may hold (Graph's capacity)."""

    @abstractmethod
    def build(self, ctx: Context, cache: Any, n_tokens: int, n_kv: int, n_outputs: int,
              flash_attn: bool = False, amb_mib: int = 0,
              streams: StreamRange = UNIFIED) -> ModelGraph[Any]:
        """The graph of one ubatch of n_tokens attending to the first n_kv cache cells, with
        n_outputs rows of logits; with a cache stream per sequence, the tokens come in equal
        shares of `streams` (cache.streams_of(ubatch))."""

    @abstractmethod
    def batch_inputs(self, mg: ModelGraph[Any], cache: Any, tokens: np.ndarray, n_past: int,
                     out_rows: np.ndarray) -> dict[Tensor, np.ndarray]:
        """The values of mg's inputs for tokens at positions n_past.. (rows out_rows out)."""

    def ubatch_inputs(self, mg: ModelGraph[Any], cache: Any, ub: UBatch, slots: Slots
                      ) -> dict[Tensor, np.ndarray]:
        """The values of mg's inputs for a ubatch the cache has placed (any mix of
        sequences; model_graph.ubatch_values)."""
        return ubatch_values(mg, cache, ub, slots)

    def load_hparams(self, gguf: GGUFModel, overrides: dict[str, Any]) -> Any:
        """Set self.gguf and self.hp (hparams_class read from gguf's metadata, overrides
        replacing keys; n_vocab from the vocabulary or the embedding when the file has no
        vocab_size key) and return hp."""
        self.gguf = gguf
        hp = self.hp = read_hparams(self.hparams_class, gguf.metadata, gguf.arch, gguf.path,
                                    **overrides)
        if hp.n_vocab == 0:
            object.__setattr__(hp, "n_vocab", vocab_size(gguf, self.tensors))
        return hp

    def set_loras(self, adapters: Sequence[LoraAdapter]) -> None:
        """The adapters the next graphs apply (loaded from files, or a trainer's own leafs),
        checked against the model's weights as llama.cpp checks them; () for none. Graphs
        built before keep what they were built with."""
        self.loras = check_loras(adapters, self.gguf.arch, self.gguf.tensors)

    # -- weights, by logical name (graphs/models/tensor_names.py) ------------------------------------
    def weight(self, logical: str, ne: tuple[int, ...], il: int | None = None,
               suffix: str = "weight") -> Tensor:
        """The weight with exactly ne; missing or mis-shaped is an error naming file and
        tensor."""
        t = expect_tensor(self.gguf, self.tensors, logical, ne, il, suffix=suffix)
        assert t is not None
        return t

    def optional_weight(self, logical: str, ne: tuple[int, ...], il: int | None = None,
                        suffix: str = "weight") -> Tensor | None:
        """The weight with exactly ne, None when the file does not have it."""
        return expect_tensor(self.gguf, self.tensors, logical, ne, il, optional=True,
                             suffix=suffix)


class MLAPlanner(ABC):
    """Capability: plan multi-head latent attention without weights (`ggraph plan`).

    The builder's `build` also takes `path=` (force one of graphs/models/mla.py's PATHS) and its
    graphs carry the path taken (ModelGraph.path); presets build it over metadata-only
    weights from `weight_shapes`."""
    decompress_min_tokens: ClassVar[int]

    @abstractmethod
    def mla_shape(self, n_tokens: int, n_kv: int) -> MLAShape:
        """The attention geometry of one ubatch."""

    @abstractmethod
    def attention_path(self, n_tokens: int, n_kv: int, flash: bool,
                       cache_type: GGMLType | str = GGMLType.F16) -> str:
        """The MLA path `build` takes for these sizes."""

    @abstractmethod
    def cache_bytes(self, size: int, type_k: GGMLType | str) -> int:
        """Bytes of a cache of `size` cells in type_k."""

    @classmethod
    @abstractmethod
    def weight_shapes(cls, hp: Any, kv_b: str = "split",
                      tied_output: bool = False) -> dict[str, tuple[int, ...]]:
        """Every weight's GGUF name and ne for hyperparameters hp, as the converter writes
        them."""


class KShift(ABC):
    """Capability: rotate cached K by a position delta as the builder's graph ropes K
    (llama.cpp's K-shift), which the context shift of a full context needs
    (graphs/models/kv_cache.py's shift_graph). A builder without it cannot shift its context:
    generation stops when the context is full."""

    @abstractmethod
    def shift_k(self, layer: int, rows: Tensor, pos: Tensor) -> Tensor:
        """Layer `layer`'s cached K rows [n_embd_k, m] (f32) roped by positions pos (I32
        [m]); rope of a rope adds the angles, so a delta moves the rows to new positions."""


CAPABILITIES: tuple[type, ...] = (MLAPlanner, KShift)


def supports(cls: type, capability: type) -> bool:
    """Whether an architecture class declares a capability (one of CAPABILITIES)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"{capability.__name__} is not a capability; they are "
                         f"{', '.join(c.__name__ for c in CAPABILITIES)}")
    return issubclass(cls, capability)


# -- the registry --------------------------------------------------------------------------------

ARCHITECTURES: dict[str, type[Architecture]] = {}
A = TypeVar("A", bound=type)


def register_arch(name: str) -> Callable[[A], A]:
    """Class decorator: the builder for `general.architecture == name`. The class must
    implement Architecture; a second class under a taken name is an error."""
    def deco(cls: A) -> A:
        if not (isinstance(cls, type) and issubclass(cls, Architecture)):
            raise TypeError(f"architecture {name!r}: {cls!r} is not an Architecture subclass "
                            f"(graphs/models/arch.py)")
        missing = sorted(cls.__abstractmethods__)
        if missing:
            raise TypeError(f"architecture {name!r}: {cls.__name__} does not implement "
                            f"{', '.join(missing)}")
        old = ARCHITECTURES.get(name)
        if old is not None and _qualname(old) != _qualname(cls):
            raise ValueError(f"architecture {name!r} is registered twice: {_qualname(old)} and "
                             f"{_qualname(cls)}")
        cls.arch_name = name
        ARCHITECTURES[name] = cls
        return cls
    return deco


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def discover_architectures() -> dict[str, type[Architecture]]:
    """Import every module of graphs/models/archs/ (importing registers its builders) and return the
    registry; a builder taken out of the registry after its module was imported comes back."""
    from ggraph.graphs.models import archs

    for info in pkgutil.iter_modules(archs.__path__, archs.__name__ + "."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            name = vars(obj).get("arch_name") if isinstance(obj, type) else None
            if name and issubclass(obj, Architecture) and obj.__module__ == module.__name__:
                ARCHITECTURES.setdefault(name, obj)
    return ARCHITECTURES


def model_class(arch: str, path: str = "") -> type[Architecture]:
    """The builder of `general.architecture == arch`; an unknown name is an error naming the
    file and the known architectures."""
    cls = discover_architectures().get(arch)
    if cls is None:
        raise GGUFError(f"{path or 'model'}: unknown architecture {arch!r}; ggraph builds "
                        f"{', '.join(sorted(ARCHITECTURES))}")
    return cls


def architectures_with(capability: type) -> list[str]:
    """The registered architectures that declare `capability`, by name."""
    return sorted(n for n, c in discover_architectures().items() if supports(c, capability))


def build_model(gguf: GGUFModel, **overrides: Any) -> Architecture:
    """The architecture's model over a loaded file, which must hold exactly the tensors that
    model uses."""
    model = model_class(gguf.arch, gguf.path)(gguf, **overrides)
    gguf.check_all_used()
    return model
