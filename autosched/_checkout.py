"""Running from a plain checkout: the repository root on ``PYTHONPATH`` and nothing installed, as on the
GPU machine (``PYTHONPATH=<repo> python3 -m autosched ...``).

``setup.py`` installs the top-level folders ``search_spaces/``, ``database/`` and ``examples/`` as
``autosched.search_spaces``, ``autosched.database`` and ``autosched.examples`` (setuptools' package-dir),
so an install, editable or not, needs nothing from here. In a plain checkout those three names would not
exist; :func:`install` adds a finder that maps exactly them to the same folders, as setuptools' editable
finder does. Nothing else in the checkout (``tests/``, ``benchmarks/``) becomes importable under
``autosched``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

# The one table of the mapping: setup.py builds the wheel's package-dir and package list from it.
PACKAGE_DIRS = {
    "autosched.search_spaces": "search_spaces",
    "autosched.database": "database",
    "autosched.examples": "examples",
}


def package_layout(root: Path) -> tuple[dict[str, str], list[str]]:
    """setuptools' ``package_dir`` and ``packages`` for the checkout at ``root``: ``autosched`` and the folders of
    :data:`PACKAGE_DIRS`, each with every folder under it that is a package (an ``__init__.py``) or holds kernel
    sources (``*.cuh``, ``*.cu``, shipped as package data), so that a new folder needs no line anywhere."""
    package_dir = {"autosched": "autosched", **PACKAGE_DIRS}
    packages = []
    for name, folder in package_dir.items():
        base = root / folder
        found = {p.parent for pattern in ("__init__.py", "*.cuh", "*.cu") for p in base.rglob(pattern)}
        for path in sorted(found):
            sub = path.relative_to(base).parts
            if "__pycache__" not in sub:
                packages.append(".".join((name, *sub)))
    return package_dir, packages


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the packages of :data:`PACKAGE_DIRS` in the checkout at ``root``; their submodules are then
    found the ordinary way, through each package's ``__path__``."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = PACKAGE_DIRS.get(fullname)
        if folder is None:
            return None
        init = self.root / folder / "__init__.py"
        if not init.exists():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def install() -> None:
    """Add the finder if this ``autosched`` is a checkout's (its parent has ``pyproject.toml``). It goes first:
    the three folders are those beside the ``autosched`` that was imported, also where an editable install of
    another checkout (a second git worktree, say) has a finder of its own mapping them to that checkout."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").exists():
        return
    if not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder(root))
