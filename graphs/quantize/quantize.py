"""`quantize_model`: a GGUF in, a GGUF of another file type out — llama-quantize's file, byte for
byte.

Owns the driver: read the input's header, choose every tensor's type (graphs/quantize/mix.py),
write the output through the shared GGUF writer with llama-quantize's layout, and stream the
tensors one at a time: each is read from the mapped input, converted to float32 rows (the input
may be F32, F16, BF16 or any type ggraph decodes), quantized in chunks of rows over threads, and
written, so memory stays near one tensor. What makes the bytes llama-quantize's:

- metadata: the input's entries in their order, less split.* and the two keys re-set at the
  end (gguf_set_val removes a key and appends it): general.quantization_version = 2, then
  general.file_type; with an imatrix, quantize.imatrix.file, .dataset, .entries_count and
  .chunks_count after them, as llama-quantize's kv overrides;
- tensors in llama.cpp's order (layer number, then name), each with ggml_n_dims dimensions
  (trailing 1s dropped) and its data padded to 32 bytes;
- the quantized bytes are ggml_quantize_chunk's (backends/cpu/quantize_rows.py), which works row
  by row, so neither the chunking nor the thread count changes them.

The importance matrix (`Imatrix`) holds llama-quantize's per-tensor weights: sums divided by
counts (graphs/quantize/imatrix_file.py reads both file formats into it).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ggraph.codecs import quants
from ggraph.ir.types import GGMLType
from ggraph.graphs.gguf.gguf_reader import GGUFError, read_header, type_name
from ggraph.graphs.gguf.gguf_writer import GGUFWriter, TensorSpec

from .mix import FTYPES, MixError, MixOptions, TensorChoice, choose_types, ggml_dims

QUANTIZATION_VERSION = 2          # GGML_QNT_VERSION
_ALIGN = 32                       # GGUF_DEFAULT_ALIGNMENT: llama-quantize pads every tensor so
_CHUNK_ELEMENTS = 32 * 512        # llama-quantize's smallest chunk of work (rows: at least one)
_SLAB_BYTES = 256 << 20           # float rows converted at a time (bounds memory per tensor)
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass
class Imatrix:
    """Importance weights per tensor name (ne[0] * experts floats: llama-quantize's
    sums / counts), and where they came from (written into the quantized file)."""
    values: dict[str, np.ndarray]
    file: str = ""
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0


@dataclass(frozen=True)
class QuantizeOptions:
    mix: MixOptions = MixOptions()
    imatrix: Imatrix | None = None
    allow_requantize: bool = False
    dry_run: bool = False
    threads: int = 0                       # 0: all cores


@dataclass(frozen=True)
class QuantizeReport:
    choices: list[TensorChoice]
    size_in: int                           # bytes of tensor data, before and after
    size_out: int
    n_elements: int
    file_size: int                         # of the output (as it is, or would be, written)
    n_fallback: int
    requires_imatrix: bool                 # a dry run: the real one needs an imatrix

    def per_type(self) -> dict[str, tuple[int, int]]:
        """Output type -> (tensors, bytes)."""
        out: dict[str, tuple[int, int]] = {}
        for c in self.choices:
            n, b = out.get(c.new_type, (0, 0))
            out[c.new_type] = (n + 1, b + _nbytes(c.ne, c.new_type))
        return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))


def _tid(name: str) -> int:
    from gguf.constants import GGMLQuantizationType

    return int(GGMLQuantizationType[name])


def _nbytes(ne: tuple[int, ...], tname: str) -> int:
    t = GGMLType[tname]
    n = 1
    for x in ne[1:]:
        n *= x
    return n * (ne[0] // t.block_size) * t.type_size


def _imatrix_for(c: TensorChoice, im: Imatrix | None, say: Callable[[str], None]
                 ) -> np.ndarray | None:
    if im is None:
        return None
    v = im.values.get(c.name)
    if v is None:
        say(f"\n====== quantize: did not find weights for {c.name}")
        return None
    experts = c.ne[2] if len(c.ne) > 2 else 1
    if v.size != c.ne[0] * experts:
        msg = (f"imatrix size {v.size} is different from tensor size {c.ne[0] * experts} for "
               f"{c.name}")
        if c.category == "token_embd":   # llama.cpp: always mismatched there; quantized without
            say(f"\n====== quantize: {msg}")
            return None
        raise MixError(msg)
    return np.ascontiguousarray(v, dtype=np.float32)


def _check_imatrix(im: Imatrix) -> None:
    for name, v in im.values.items():
        bad = np.flatnonzero(~np.isfinite(v))
        if bad.size:
            raise MixError(f"imatrix entry {name!r}: value {int(bad[0])} is {v[bad[0]]} "
                           f"(not finite)")


class _Converter:
    """One tensor's float rows -> its new type's bytes, rows split over threads."""

    def __init__(self, threads: int) -> None:
        self.threads = threads if threads > 0 else (os.cpu_count() or 1)
        self.pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        from ggraph.backends.cpu.quantize_rows import quantize_rows
        self.quantize_rows = quantize_rows

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def floats(self, src: GGMLType, raw: np.ndarray, ne0: int) -> np.ndarray:
        """Rows of type `src` as float32, the rows split over the threads (numpy's decoders
        release the GIL in their array operations)."""
        n = raw.shape[0]
        if self.pool is None or n < 2 * self.threads:
            return quants.dequantize(src, raw, ne0)
        out = np.empty((n, ne0), np.float32)
        cuts = np.linspace(0, n, self.threads + 1).astype(int)

        def run(i: int) -> None:
            out[cuts[i]:cuts[i + 1]] = quants.dequantize(src, raw[cuts[i]:cuts[i + 1]], ne0)

        list(self.pool.map(run, range(self.threads)))
        return out

    def rows(self, tname: str, x: np.ndarray, imatrix: np.ndarray | None,
             experts_rows: int, first_row: int) -> np.ndarray:
        """x (rows, n) float32, rows first_row.. of the tensor -> (rows, row bytes) uint8.
        An imatrix holds n weights per expert (ne[2] of them): row r uses slice
        r // experts_rows, and no chunk crosses an expert (as llama.cpp's)."""
        if tname in _FLOAT_TYPES:
            return quants.quantize(GGMLType[tname], x)
        n = x.shape[1]
        t = GGMLType[tname]
        out = np.empty((x.shape[0], n // t.block_size * t.type_size), np.uint8)
        per_chunk = max(1, _CHUNK_ELEMENTS // n)
        jobs = []
        r = 0
        while r < x.shape[0]:
            e = (first_row + r) // experts_rows
            stop = min(x.shape[0], r + per_chunk, (e + 1) * experts_rows - first_row)
            w = None if imatrix is None else imatrix[e * n:(e + 1) * n]
            jobs.append((r, stop, w))
            r = stop

        def run(job: tuple[int, int, np.ndarray | None]) -> None:
            a, b, w = job
            self.quantize_rows(tname, x[a:b], w, out[a:b])

        if self.pool is None or len(jobs) == 1:
            for j in jobs:
                run(j)
        else:
            list(self.pool.map(run, jobs))
        return out


def quantize_model(src: str | os.PathLike, dst: str | os.PathLike | None,
                   opts: QuantizeOptions, say: Callable[[str], None] = lambda s: None
                   ) -> QuantizeReport:
    """Quantize `src` into `dst` (None with a dry run). `say` gets llama-quantize's per-tensor
    lines as they happen."""
    src = os.fspath(src)
    hdr = read_header(src)
    mix = opts.mix
    im = opts.imatrix
    if im is not None:
        _check_imatrix(im)
        if not mix.has_imatrix:
            mix = MixOptions(**{**mix.__dict__, "has_imatrix": True})
    infos = {t.name: t for t in hdr.tensors}
    table = [(t.name, t.ne, type_name(t.type_id)) for t in hdr.tensors]
    choices = choose_types(table, hdr.metadata, mix)
    for c in choices:
        if c.quantize and c.src_type not in GGMLType.__members__:
            raise MixError(f"tensor {c.name!r} is {c.src_type}: ggraph cannot decode that "
                           f"type, so it can copy the tensor as it is but not convert it to "
                           f"{c.new_type}")
        if c.quantize and c.src_type not in _FLOAT_TYPES and c.new_type not in _FLOAT_TYPES \
                and not opts.allow_requantize and not opts.dry_run:
            raise MixError(f"tensor {c.name!r} is {c.src_type} already: requantizing it to "
                           f"{c.new_type} loses quality (quantize from an F32/F16 copy, "
                           f"or pass --allow-requantize)")
        if c.quantize and c.requires_imatrix and im is None and not opts.dry_run:
            raise MixError(f"tensor {c.name!r}: {mix.ftype} needs an importance matrix for "
                           f"its {c.new_type} tensors (--imatrix FILE)")
    w = GGUFWriter(dst if dst is not None else os.devnull, None, alignment=_ALIGN)
    for k, v in hdr.metadata.items():
        if k in _SPLIT_KEYS or k in ("general.quantization_version", "general.file_type"):
            continue
        kt = hdr.kv_types[k]
        w.add(k, v, kt.type, kt.element)
    w.add_u32("general.quantization_version", QUANTIZATION_VERSION)
    w.add_u32("general.file_type", FTYPES[mix.ftype][0])
    if im is not None and im.values:
        # llama-quantize's kv overrides: strings cut to 127 bytes, counts as u32
        w.add_str("quantize.imatrix.file", im.file.encode()[:127].decode(errors="ignore"))
        if im.datasets:
            w.add_str("quantize.imatrix.dataset",
                      im.datasets[0].encode()[:127].decode(errors="ignore"))
        w.add_u32("quantize.imatrix.entries_count", len(im.values))
        if im.chunk_count > 0:
            w.add_u32("quantize.imatrix.chunks_count", im.chunk_count)
    by_spec: dict[str, TensorChoice] = {}
    for c in choices:
        w.add_tensor(c.name, ggml_dims(c.ne), _tid(c.new_type))
        by_spec[c.name] = c
    n_elements = sum(int(np.prod(c.ne, dtype=np.int64)) for c in choices)
    size_in = sum(infos[c.name].nbytes for c in choices)
    size_out = sum(s.nbytes for s in w.tensors)
    report = QuantizeReport(choices, size_in, size_out, n_elements, w.file_size(),
                            sum(c.fallback for c in choices),
                            any(c.requires_imatrix and c.quantize for c in choices))
    n = len(choices)
    index = {c.name: i for i, c in enumerate(choices)}
    if opts.dry_run:
        for i, c in enumerate(choices):
            say(_line(i, n, c, infos[c.name].nbytes, _nbytes(c.ne, c.new_type), dry=True))
        return report
    data = np.frombuffer(hdr.mm, np.uint8)
    conv = _Converter(opts.threads)
    lock = threading.Lock()

    def source(spec: TensorSpec) -> np.ndarray:
        c = by_spec[spec.name]
        info = infos[c.name]
        raw = data[hdr.data_offset + info.offset:hdr.data_offset + info.offset + info.nbytes]
        if not c.quantize:
            say(_line(index[c.name], n, c, info.nbytes, info.nbytes, dry=False))
            return raw
        weights = _imatrix_for(c, im, say)
        out = _convert(conv, c, raw, weights)
        bad = quants.first_nonfinite(GGMLType[c.new_type], out)
        if bad >= 0:
            raise GGUFError(f"tensor {c.name!r}: quantizing to {c.new_type} gave a non-finite "
                            f"value at block {bad} (is the input finite?)")
        with lock:
            say(_line(index[c.name], n, c, info.nbytes, out.nbytes, dry=False))
        return out

    try:
        w.write(source=source)
    finally:
        conv.close()
    return report


def _convert(conv: _Converter, c: TensorChoice, raw: np.ndarray, weights: np.ndarray | None
             ) -> np.ndarray:
    """The tensor's bytes in its new type, converted a slab of float rows at a time."""
    src = GGMLType[c.src_type]
    ne0 = c.ne[0]
    rows = int(np.prod(c.ne[1:], dtype=np.int64)) if len(c.ne) > 1 else 1
    raw = raw.reshape(rows, ne0 // src.block_size * src.type_size)
    experts_rows = max(1, c.ne[1]) if len(c.ne) > 1 else 1
    slab = max(1, _SLAB_BYTES // (ne0 * 4))
    parts = []
    for a in range(0, rows, slab):
        b = min(rows, a + slab)
        x = raw[a:b].view(np.float32) if c.src_type == "F32" else \
            conv.floats(src, raw[a:b], ne0)
        bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
        if bad.size:
            raise GGUFError(f"tensor {c.name!r}: row {a + int(bad[0])} holds a value that is "
                            f"not finite")
        parts.append(conv.rows(c.new_type, np.ascontiguousarray(x), weights, experts_rows, a))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _mib(n: int) -> str:
    return f"{n / 1024 / 1024:8.2f} MiB"


def _line(i: int, n: int, c: TensorChoice, before: int, after: int, dry: bool) -> str:
    """llama-quantize's per-tensor line."""
    shape = ", ".join(f"{x:5d}" for x in (tuple(c.ne) + (1,) * 4)[:4])
    head = f"[{i + 1:4d}/{n:4d}] {c.name:<36s} - [{shape}], type = {c.src_type.lower():>6s}, "
    if not c.quantize:
        return head + f"size = {before / 1024 / 1024:8.3f} MiB"
    conv = "" if dry else f"converting to {c.new_type.lower()} .. "
    tail = f" ({c.new_type.lower()})" if dry else ""
    return head + conv + f"size = {_mib(before)} -> {_mib(after)}{tail}"


def describe(report: QuantizeReport) -> list[str]:
    """The summary lines: sizes before and after, bits per weight, the per-type table."""
    bpw = lambda b: b * 8.0 / max(1, report.n_elements)  # noqa: E731
    lines = [f"model size  = {_mib(report.size_in)} ({bpw(report.size_in):.2f} BPW)",
             f"quant size  = {_mib(report.size_out)} ({bpw(report.size_out):.2f} BPW)",
             f"file size   = {report.file_size} bytes ({_mib(report.file_size)})"]
    for t, (k, b) in report.per_type().items():
        lines.append(f"  {t:<7s} {k:4d} tensors {_mib(b)}")
    if report.n_fallback:
        lines.append(f"WARNING: {report.n_fallback} of {len(report.choices)} tensor(s) "
                     f"required fallback quantization")
    if report.requires_imatrix:
        lines.append("WARNING: dry run completed successfully, but actually completing this "
                     "quantization will require an imatrix!")
    return lines
