"""Where numba caches ggraph's kernels (backends/numba_cache.py): by package, so that another
checkout of the same sources finds them, with the source's content as the stamp."""
from __future__ import annotations

import os
import shutil

from numba.core import caching, config

from ggraph.backends import numba_cache as N


def _function(module: str):
    def f():
        return 1
    f.__module__ = module
    return f


def test_two_checkouts_of_one_file_share_a_folder_and_stamp(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path / "cache"))
    src = N.__file__
    a, b = tmp_path / "a" / "numba_cache.py", tmp_path / "b" / "numba_cache.py"
    for p in (a, b):
        p.parent.mkdir()
        shutil.copy(src, p)
    f = _function("ggraph.backends.numba_cache")
    la, lb = (N.PackageCacheLocator.from_function(f, str(p)) for p in (a, b))
    assert la.get_cache_path() == lb.get_cache_path()
    assert la.get_cache_path().startswith(str(tmp_path / "cache" / "backends_"))
    assert la.get_source_stamp() == lb.get_source_stamp()
    # numba's own locator puts the two copies apart
    na, nb = (caching.UserProvidedCacheLocator.from_function(f, str(p)) for p in (a, b))
    assert na.get_cache_path() != nb.get_cache_path()
    # a changed source has another stamp: its old entries are not loaded
    b.write_text(b.read_text() + "\n# changed\n")
    lb = N.PackageCacheLocator.from_function(f, str(b))
    assert la.get_source_stamp() != lb.get_source_stamp()


def test_other_packages_fall_through_to_numbas_locators(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    assert N.PackageCacheLocator.from_function(_function("mypkg.kernels"), N.__file__) is None


def test_installed_first_unless_the_user_chose_the_locators(monkeypatch):
    ours = "ggraph.backends.numba_cache.PackageCacheLocator"
    # in the environment as well: numba's compiler reloads its settings from there whenever a
    # NUMBA_* variable changes (a test setting one did, and the suite fell back to numba's)
    assert os.environ[N.ENV].split(",")[0] == ours
    monkeypatch.setenv("NUMBA_OPT", "2")
    config.reload_config()
    assert config.CACHE_LOCATOR_CLASSES.split(",")[0] == ours
    assert "UserProvidedCacheLocator" in config.CACHE_LOCATOR_CLASSES
    monkeypatch.setenv(N.ENV, "UserWideCacheLocator")
    monkeypatch.setattr(config, "CACHE_LOCATOR_CLASSES", "UserWideCacheLocator")
    assert N.install() is False and config.CACHE_LOCATOR_CLASSES == "UserWideCacheLocator"
