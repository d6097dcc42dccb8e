"""Rules the test suite keeps: no test passes or fails by how fast or how loaded the machine is."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

# A time or a load, by the names an operand reads: a clock, an interval, a latency, a machine's load, or a
# constant that bounds one of them.
TIMING = re.compile(r"perf_counter|monotonic|^time$|elapsed|seconds|wall|latenc|median|_ms$|_us$|^load|_load$"
                    r"|^start$|deadline|^COLD_CALL_SLACK$|^LOAD_WARNING$|^SLOW_CUTOFF$", re.I)
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _names(node: ast.AST):
    """The names an expression reads (variables, attributes, string keys); not inside ``len(...)`` (a count)
    nor in a computed index (``scores[np.isinf(latency)]`` reads scores)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len":
        return
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    if isinstance(node, ast.Subscript):
        yield from _names(node.value)
        if isinstance(node.slice, ast.Constant):
            yield from _names(node.slice)
        return
    for child in ast.iter_child_nodes(node):
        yield from _names(child)


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, (str, bool)) and node.value == 0


def timing_assertions(text: str) -> list[tuple[int, str]]:
    """The ``assert`` statements of ``text`` that order a time or a load against a threshold: (line, source).
    A comparison with 0 (a time is positive, a load is not negative) says nothing about speed and passes."""
    found = []
    for statement in ast.walk(ast.parse(text)):
        if not isinstance(statement, ast.Assert):
            continue
        for compare in ast.walk(statement.test):
            if not isinstance(compare, ast.Compare):
                continue
            operands = [compare.left, *compare.comparators]
            if any(isinstance(op, ORDERING) and not (_is_zero(a) or _is_zero(b))
                   and any(TIMING.search(name) for side in (a, b) for name in _names(side))
                   for op, a, b in zip(compare.ops, operands, operands[1:])):
                found.append((statement.lineno, ast.get_source_segment(text, statement.test)))
                break
    return found


def test_the_scanner_finds_timing_assertions():
    flagged = timing_assertions(textwrap.dedent('''    assert time.perf_counter() - start < 2.5
    assert load is not None and load > 0.5  # the hogs had every core to share with us
    assert elapsed <= 30, "too slow"
    assert run["latency_ms"] < 1.25 * estimate
    assert res.run_seconds > COLD_CALL_SLACK
    assert best["load_pct"] > 100 * LOAD_WARNING
    assert time.monotonic() < deadline, "timed out"
    assert len(loads) == 2 and all(load is not None and load > LOAD_WARNING for load in loads)
    assert cut.ok and len(cut.latencies) == 3 and min(cut.latencies) > fast.median / 100
    assert (time.perf_counter()
            - start) < 30
'''))
    assert len(flagged) == 10, flagged
    assert not timing_assertions(textwrap.dedent('''    assert res.build_seconds > 0 and res.ok
    assert out["latency_us"] > 0 and out["trials"] == 8
    assert len(latencies) == 5 and all(t > 0 for t in latencies)
    assert best["load_pct"] == pytest.approx(90)
    assert 0 < kept < 4000
    assert x.shape[0] >= 2
    assert shown["point"] == out["best_point"] and len(shown["latencies"]) >= 1
    assert len(rows) <= 16 and all(r["trials"] >= 1 and r["latency_us"] for r in rows)
    assert scores[np.isinf(latency)].mean() < scores[np.isfinite(latency)].mean()
    assert len(ok) >= 6 and all(r.result.build_seconds > 0 and r.result.rel_error is not None for r in ok)
'''))


def test_no_test_compares_a_measured_time_with_a_threshold():
    """Comparisons of measured times belong in benchmarks/ (read by a person, on a machine chosen for it);
    tests inject clocks and timings (e.g. tests/test_measure.py's cutoff test, test_new_user.py's time
    budget) so that a loaded CI machine cannot fail them."""
    found = []
    for path in sorted(TESTS.glob("*.py")):
        found += [f"{path.name}:{number}: {line}" for number, line in timing_assertions(path.read_text())]
    assert not found, "timing assertions (inject a clock or timings, or move the comparison to benchmarks/):\n" \
        + "\n".join(found)


def test_gpu_tests_report_a_test_that_passed_only_when_re_run_as_flaky(tmp_path):
    """benchmarks/gpu_tests.sh re-runs failed tests; its report tells a flaky test (failed, then passed) from
    a failure (failed twice, or not reached by the re-run), for pytest-xdist's lines and plain ones."""
    import subprocess

    first, rerun = tmp_path / "first.log", tmp_path / "rerun.log"
    first.write_text("[gw0] [ 10%] PASSED tests/test_a.py::test_ok\n"
                     "[gw1] [ 20%] FAILED tests/test_a.py::test_flaky[x-1]\n"
                     "FAILED tests/test_a.py::test_flaky[x-1] - RuntimeError: CUDA out of memory\n"
                     "FAILED tests/test_a.py::test_broken - AssertionError: wrong\n"
                     "FAILED tests/test_a.py::test_cut - AssertionError\n"
                     "FAILED tests/test_b.py::test_plain - AssertionError\n")
    rerun.write_text("[gw0] [ 50%] PASSED tests/test_a.py::test_flaky[x-1]\n"
                     "[gw1] [ 75%] FAILED tests/test_a.py::test_broken\n"
                     "tests/test_b.py::test_plain PASSED                 [100%]\n"
                     "FAILED tests/test_a.py::test_broken - AssertionError: wrong\n")
    script = TESTS.parent / "benchmarks" / "_rerun_report.sh"
    out = subprocess.run(["bash", str(script), str(first), str(rerun)], capture_output=True, text=True, check=True).stdout
    assert "FLAKY: tests/test_a.py::test_flaky[x-1]" in out and "FLAKY: tests/test_b.py::test_plain" in out
    assert "FAILED: tests/test_a.py::test_broken" in out and "NOT RE-RUN: tests/test_a.py::test_cut" in out
    assert "4 failed at first, 2 flaky, 2 not passing" in out
    assert "_rerun_report.sh" in (TESTS.parent / "benchmarks" / "gpu_tests.sh").read_text()


def test_a_fast_case_its_test_no_longer_has_stops_the_run():
    from .conftest import FAST_CASES, _check_fast_cases

    name, kept = next((n, ids) for n, ids in FAST_CASES.items() if ids)
    _check_fast_cases({name: set(kept) | {"another-case"}})  # every kept case present: fine
    with pytest.raises(pytest.UsageError, match=name):
        _check_fast_cases({name: set(sorted(kept)[1:]) | {"another-case"}})
