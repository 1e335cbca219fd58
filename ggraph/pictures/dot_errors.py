"""The errors of ggraph's pictures (ggraph.pictures.dot re-exports them): a picture that cannot be
drawn as asked, and a missing Graphviz."""
from __future__ import annotations

from pathlib import Path


class DotError(ValueError):
    """A picture that cannot be drawn as asked (bad filter, too large, unknown format)."""


class UnknownLayerError(DotError):
    """A layer filter names a layer the graph does not have."""


class GraphTooLargeError(DotError):
    """Too many tensors to draw readably; the message names a filter that works."""


class DotNotInstalledError(RuntimeError):
    """Graphviz's `dot` program is missing; `dot_path` holds the DOT source written anyway."""

    def __init__(self, message: str, dot_path: Path | None = None) -> None:
        super().__init__(message)
        self.dot_path = dot_path


__all__ = ["DotError", "DotNotInstalledError", "GraphTooLargeError", "UnknownLayerError"]
