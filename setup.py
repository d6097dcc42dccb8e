"""The package list and package-dir mapping, computed: pyproject.toml holds everything else.

search_spaces/, database/ and examples/ sit at the top of the repository but install as
autosched.search_spaces, autosched.database and autosched.examples (autosched/_checkout.py holds the table,
which a plain checkout on PYTHONPATH also uses). setuptools' own package discovery cannot rename a folder,
so the packages are found here: every folder with an __init__.py under autosched/ and under the three.
"""

import importlib.util
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
# Loaded by path: importing the autosched package would import TVM, which a build environment may lack.
_spec = importlib.util.spec_from_file_location("_autosched_checkout", ROOT / "autosched" / "_checkout.py")
_checkout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_checkout)

package_dir, packages = _checkout.package_layout(ROOT)
setup(package_dir=package_dir, packages=packages)
