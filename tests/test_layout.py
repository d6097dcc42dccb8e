"""The import graph matches the folders: search_spaces/, database/ and examples/ are autosched.search_spaces,
autosched.database and autosched.examples in an editable install, in a built wheel and in a plain checkout
on PYTHONPATH (the GPU machine), and nothing else of the checkout imports under autosched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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


def test_every_package_folder_is_found_for_the_wheel():
    """setup.py finds the packages (nothing lists them by hand), so every folder of Python modules under
    autosched/ and the three mapped folders, and every folder of kernel sources, is in the wheel's list."""
    package_dir, packages = _checkout.package_layout(REPO)
    assert {k: v for k, v in package_dir.items() if k != "autosched"} == _checkout.PACKAGE_DIRS
    assert {"autosched.pipeline", "autosched.measure", "autosched.database.migrations.versions"} <= set(packages)
    expected = set()
    for name, folder in package_dir.items():
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".cuh", ".cu") and "__pycache__" not in path.parts:
                sub = path.parent.relative_to(REPO / folder).parts
                if (folder, *sub) != ("database", "fixtures"):  # the test fixtures' generator, not shipped
                    expected.add(".".join((name, *sub)))
    assert expected <= set(packages), sorted(expected - set(packages))
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert not {"packages", "package-dir"} & set(table), "setup.py computes these; a second copy would override it"


def test_plain_checkout_on_the_path_imports_the_same_folders(tmp_path):
    files = _probe(REPO, tmp_path)
    assert files[:3] == [str(REPO / "database" / "store.py"), str(REPO / "search_spaces" / "generated" / "rows.py"),
                         str(REPO / "examples" / "__init__.py")]
    assert not any(line.startswith("importable") for line in files), files
    assert files[-1] == "True"


# Another checkout's editable install answers for the three names first (its finder is on sys.meta_path from
# startup): the checkout on the path must still get its own folders, beside the autosched it imported.
OTHER_CHECKOUT_PROBE = """
import importlib.abc, importlib.util, sys
other = sys.argv[2]

class OtherCheckout(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "autosched.database":
            return importlib.util.spec_from_file_location(fullname, other + "/__init__.py",
                                                          submodule_search_locations=[other])

sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.meta_path.append(OtherCheckout())
sys.path.insert(0, sys.argv[1])
import autosched.database
print(autosched.database.__file__)
"""


def test_a_checkout_on_the_path_gets_its_own_folders_beside_another_checkouts_editable_install(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "__init__.py").write_text("")
    proc = subprocess.run([sys.executable, "-c", OTHER_CHECKOUT_PROBE, str(REPO), str(tmp_path / "other")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(REPO / "database" / "__init__.py")]


def _zip_listing(wheel: Path) -> set[str]:
    """The wheel's file names as `python3 -m zipfile -l` lists them (the check a person would run)."""
    proc = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(wheel)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {line.split()[0] for line in proc.stdout.splitlines()[1:] if line.strip()}


@pytest.mark.slow
def test_a_wheel_installed_in_a_fresh_environment_builds_a_model(tmp_path):
    """The non-editable install: the wheel holds every package folder of the repository and its kernel sources,
    and, installed into a new environment, `autosched build` works outside the checkout."""
    # Built from a copy of the sources: setuptools builds in the source tree, and a build/ folder left there
    # by an earlier build would carry files that no longer exist into the wheel.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".gpu", ".bench", "build", "dist", "out", "*.egg-info", "__pycache__", "results"))
    dist = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                           str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    wheel = next(dist.glob("autosched-*.whl"))
    names = _zip_listing(wheel)
    folders = {str(Path(n).parent) for n in names}
    _, packages = _checkout.package_layout(REPO)
    for package in packages:
        assert package.replace(".", "/") in folders, package
    for name, folder in _checkout.PACKAGE_DIRS.items():
        for source in [*(REPO / folder).rglob("*.cuh"), *(REPO / folder).rglob("*.cu")]:
            installed = "/".join((*name.split("."), *source.relative_to(REPO / folder).parts))
            assert installed in names, installed
    for path in ("autosched/pipeline/build.py", "autosched/generation/generator.py", "autosched/examples/llama.py",
                 "autosched/search_spaces/generated/rows.py", "autosched/database/alembic.ini",
                 "autosched/database/migrations/versions/0001_initial_schema.py"):
        assert path in names, path
    assert not any(n.startswith(("tests/", "autosched/tests/", "benchmarks/", "autosched/database/fixtures/")) for n in names)

    # A fresh environment; the heavy dependencies (TVM, torch) come from this one, the package only from the wheel.
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)], check=True, timeout=300)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if sys.prefix != sys.base_prefix:  # this interpreter is itself a venv, which --system-site-packages does not reach
        import site as this_site
        (Path(site) / "parent_env.pth").write_text("\n".join(this_site.getsitepackages()) + "\n")
    # Outside the checkout and without PYTHONPATH, where neither pip nor Python can see the checkout's autosched.
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AUTOSCHED_DB")}
    env["TVM_NUM_THREADS"] = "1"
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    where = subprocess.run([str(python), "-c", "import autosched.pipeline, autosched.search_spaces as s; print(s.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(site), where.stdout
    proc = subprocess.run([str(env_dir / "bin" / "autosched"), "build", "tiny-llama", "--tokens", "16", "--db", "t.db",
                           "-o", "out"], cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((work / "out" / "manifest.json").read_text())
    assert (work / "out" / manifest["library"]).exists()


def test_every_relative_import_names_a_module_that_exists():
    """Imports inside functions run only when called: one left pointing at a module's old folder after a move
    (``from .lengths import`` in ``autosched/artifact.py``) fails only in the slow tier's end-to-end runs."""
    import ast
    import importlib
    import importlib.util

    missing = []
    for path in sorted((REPO / "autosched").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        package = parts[:-1]  # a module's package, or an __init__'s own
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = ".".join(package[: len(package) - (node.level - 1)] + ((node.module,) if node.module else ()))
            if importlib.util.find_spec(base) is None:
                missing.append(f"{path.relative_to(REPO)}:{node.lineno} {base}")
            elif node.module is None:
                module = importlib.import_module(base)
                missing += [f"{path.relative_to(REPO)}:{node.lineno} {base}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and importlib.util.find_spec(f"{base}.{a.name}") is None]
    assert not missing, missing
