"""The GPU tests' explicit points, built without a GPU.

Most tests in test_gpu_run.py hand hand-picked points of the Hopper spaces to a measurer, and CI, which has
no GPU, skips them all. When a space gains a knob or tightens a check, those points can go stale without
anything failing here. These tests run the same test functions with a measurer that only builds: every point
must be a valid point of its space and compile (TVM's code generation for sm_90a, then nvcc). A point that
builds may still compute a wrong answer; only the GPU run (`pytest -m gpu`) shows that.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from autosched.measure._worker import build_candidate
from autosched.target import parse_target

from . import test_gpu_run
from .test_gpu_spaces import needs_nvcc

pytestmark = needs_nvcc


class BuildOnlyMeasurer:
    """Builds each point as the GPU measurer would (``build_candidate``) and answers with the build's result,
    whose ``ok``, ``error_kind`` and ``error_msg`` are what the GPU tests read."""

    def __init__(self, target, folder):
        self.target, self.folder, self.built = target, folder, 0

    def measure(self, spec, points):
        results = []
        for point in points:
            self.built += 1
            results.append(build_candidate(spec, self.target, point, str(self.folder / f"kernel{self.built}.so")))
        return results


def _explicit_point_tests():
    """(id, test function, keyword arguments) of every test in test_gpu_run.py that takes its points from the
    ``measurers`` fixture alone (parametrized tests once per parameter set); the sampled-points test is left
    out (test_gpu_spaces.py builds those points already)."""
    cases = []
    for name, fn in inspect.getmembers(test_gpu_run, inspect.isfunction):
        params = set(inspect.signature(fn).parameters)
        if not name.startswith("test_") or "measurers" not in params or name.startswith("test_sampled"):
            continue
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        if not marks:
            cases.append((name, fn, {}))
            continue
        names = [n.strip() for n in marks[0].args[0].split(",")]
        for values in marks[0].args[1]:
            values = values if isinstance(values, tuple) else (values,)
            cases.append((f"{name}[{'-'.join(map(str, values))}]", fn, dict(zip(names, values))))
    return cases


CASES = _explicit_point_tests()


def test_the_gpu_suite_has_explicit_point_tests_to_check():
    assert len(CASES) >= 10, [c[0] for c in CASES]


@pytest.mark.parametrize("name,fn,kwargs", CASES, ids=[c[0] for c in CASES])
def test_explicit_gpu_test_points_are_valid_and_build(name, fn, kwargs, tmp_path):
    base = parse_target("cuda:sm_90", require_device=False)
    made = {}

    def measurers(arch):
        if arch not in made:
            target = dataclasses.replace(base, arch=arch)
            made[arch] = (target, BuildOnlyMeasurer(target, tmp_path))
        return made[arch]

    fn(measurers=measurers, **kwargs)
    assert sum(m.built for _, m in made.values()) > 0, f"{name} built no point"
