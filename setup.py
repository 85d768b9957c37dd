"""The wheel's package list, found rather than written down: every folder with an ``__init__.py``
under raysim/, methods/ (imported as raysim.methods) and tuning/ (raysim.tuning), so a new
subpackage cannot be left out of an installed raysim (``raysim.methods.lib`` once was). The
data folders configs/ and examples/ ship as raysim.configs and raysim.examples. Everything else
about the package is in pyproject.toml (its ``package-dir`` maps these names to the folders).
"""
from setuptools import find_packages, setup

CODE = {"raysim": "raysim", "raysim.methods": "methods", "raysim.tuning": "tuning"}
DATA = ("raysim.configs", "raysim.examples")  # files only, no __init__.py: read by path


def packages() -> list[str]:
    found = []
    for name, folder in CODE.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return found + list(DATA)


setup(packages=packages())
