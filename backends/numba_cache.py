"""Where numba keeps ggraph's compiled kernels on disk: under NUMBA_CACHE_DIR, in a folder
named by the kernel's package (`ggraph.backends.cpu`), not by the absolute folder its source
file lies in, as numba's own locator names it.

So a second checkout or install of the same sources (a clean clone in another folder, a wheel
in another virtual environment) loads the machine code the first one compiled, instead of
compiling every kernel again (~15 CPU-minutes on a 2-core Xeon). Nothing stale can load:
numba stamps each cache index with the sha256 of the kernel's source file and starts afresh
where the stamp differs, and every bound kernel's name carries a key over the files and values
it is compiled from (backends/jit.py). Two checkouts of different sources only overwrite each
other's entries for the files that differ.

`install()` (called by backends/__init__.py) puts the locator first in numba's list through
numba's own setting, NUMBA_CACHE_LOCATOR_CLASSES, before any kernel of ggraph is decorated;
functions of other packages fall through to numba's locators, and a list the user set is left
as it is. Child processes inherit the setting (ggraph's workers, which load the same kernels).
"""
from __future__ import annotations

import hashlib
import os

from numba.core import caching, config

ENV = "NUMBA_CACHE_LOCATOR_CLASSES"
# numba's own locators, in its order (numba/core/caching.py), after ours
NUMBA_LOCATORS = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator",
                  "IPythonCacheLocator", "ZipCacheLocator")


class PackageCacheLocator(caching.UserProvidedCacheLocator):
    """NUMBA_CACHE_DIR/<package>_<sha1 of the package name> for a function of a ggraph module
    (None for any other, which numba's locators then place)."""

    def __init__(self, py_func, py_file) -> None:
        super().__init__(py_func, py_file)
        package = py_func.__module__.rpartition(".")[0]
        digest = hashlib.sha1(package.encode()).hexdigest()
        self._cache_path = os.path.join(config.CACHE_DIR,
                                        f"{package.rpartition('.')[2]}_{digest}")

    @classmethod
    def from_function(cls, py_func, py_file):
        if not (getattr(py_func, "__module__", None) or "").startswith("ggraph."):
            return None
        return super().from_function(py_func, py_file)


def install() -> bool:
    """Put PackageCacheLocator first in numba's locators (False where the user chose them).
    Set in the environment too: numba's compiler reloads its settings from the environment
    whenever a NUMBA_* variable changes, which would drop a value set on config alone."""
    user = os.environ.get(ENV, "")
    if user and "PackageCacheLocator" not in user:
        return False
    names = [n for n in NUMBA_LOCATORS if hasattr(caching, n)]
    os.environ[ENV] = config.CACHE_LOCATOR_CLASSES = ",".join(
        [f"{__name__}.PackageCacheLocator", *names])
    return True
