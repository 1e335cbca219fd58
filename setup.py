"""Package discovery for ggraph's layout: the top-level folders backends/, ops/, graphs/ and
tools/ install as ggraph.backends, ggraph.ops, ggraph.graphs and ggraph.tools, and every
subpackage below them (backends/cpu, backends/cuda, ...) is found, not listed, so a wheel ships
them all. Everything else about the project is in pyproject.toml."""
from setuptools import find_packages, setup

ROOTS = {"ggraph": "ggraph", "ggraph.ops": "ops", "ggraph.backends": "backends",
         "ggraph.graphs": "graphs", "ggraph.tools": "tools"}

packages = [p for root, folder in ROOTS.items()
            for p in [root] + [f"{root}.{sub}" for sub in find_packages(folder)]]
setup(packages=packages, package_dir=ROOTS)
