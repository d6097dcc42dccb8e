"""The import graph matches the folders: search_spaces/, database/ and examples/ are autosched.search_spaces,
autosched.database and autosched.examples in an editable install, in a built wheel and in a plain checkout
on PYTHONPATH (the GPU machine), and nothing else of the checkout imports under autosched."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from autosched import _checkout

REPO = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter with every installed copy of autosched out of the way (setuptools' editable
# finder dropped, site-packages' autosched shadowed by the first sys.path entry), then import through it.
PROBE = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path.insert(0, sys.argv[1])
import autosched.database.store, autosched.search_spaces.generated.rows, autosched.examples
for module in (autosched.database.store, autosched.search_spaces.generated.rows, autosched.examples):
    print(module.__file__)
for name in ("autosched.tests", "autosched.benchmarks"):
    try:
        __import__(name)
        print("importable:", name)
    except ImportError:
        pass
print("llama-7b-layers" in autosched.examples.MODELS)
"""


def _probe(root: Path, cwd: Path) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(root)], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_package_dirs_match_pyproject():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {k: v for k, v in table["package-dir"].items() if k != "autosched"}
    assert mapped == _checkout.PACKAGE_DIRS
    assert set(mapped) <= set(table["packages"])


def test_plain_checkout_on_the_path_imports_the_same_folders(tmp_path):
    files = _probe(REPO, tmp_path)
    assert files[:3] == [str(REPO / "database" / "store.py"), str(REPO / "search_spaces" / "generated" / "rows.py"),
                         str(REPO / "examples" / "__init__.py")]
    assert not any(line.startswith("importable") for line in files), files
    assert files[-1] == "True"


@pytest.mark.slow
def test_a_built_wheel_holds_the_packages_and_imports_them(tmp_path):
    """The non-editable install: the wheel maps the folders into autosched/ and works without the checkout."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    wheel = next(tmp_path.glob("autosched-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ("autosched/examples/llama.py", "autosched/search_spaces/generated/rows.py", "autosched/database/store.py",
                 "autosched/database/alembic.ini", "autosched/database/migrations/versions/0001_initial_schema.py"):
        assert path in names, path
    assert not any(n.startswith(("tests/", "autosched/tests/", "benchmarks/")) for n in names)
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    files = _probe(unpacked, tmp_path)
    assert files[0] == str(unpacked / "autosched" / "database" / "store.py")
    assert files[2] == str(unpacked / "autosched" / "examples" / "__init__.py")
