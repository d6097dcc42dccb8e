"""Rules the test suite keeps: no test passes or fails by how fast or how loaded the machine is; and rules
the code keeps: imports go one way, down the layers ARCHITECTURE.md draws, and an import inside a function
defers a heavy package on purpose."""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from autosched._checkout import PACKAGE_DIRS

TESTS = Path(__file__).parent
REPO = TESTS.parent

# A time or a load, by the names an operand reads: a clock, an interval, a latency, a machine's load, or a
# constant that bounds one of them.
TIMING = re.compile(r"perf_counter|monotonic|^time$|elapsed|seconds|wall|latenc|median|_ms$|_us$|^loads?$|^load_|_load$"
                    r"|^start$|deadline|^COLD_CALL_SLACK$|^LOAD_WARNING$|^SLOW_CUTOFF$", re.I)
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


# Calls whose result is a time where an argument is: a value passed to any other call (a command's options,
# a parser's input) does not make its result one.
REDUCERS = {"min", "max", "sum", "sorted", "median", "mean", "abs", "float", "round", "list", "tuple"}


def _names(node: ast.AST, value: bool = False):
    """The names an expression reads (variables, attributes, string keys); not inside ``len(...)`` (a count)
    nor in a computed index (``scores[np.isinf(latency)]`` reads scores). With ``value``, what a value is
    computed from, for :func:`_tainted`: a call's arguments only where the call is a reducer (``min(times)``),
    and a function's own name only where it takes no arguments (``perf_counter()``, not ``json.loads(text)``);
    what it is called on always (``run().median``)."""
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name == "len" and isinstance(func, ast.Name):
            return
        if value:
            if isinstance(func, ast.Attribute):
                yield from _names(func.value, value)
            if not node.args and not node.keywords and name:  # a getter reads what it names: perf_counter()
                yield name
            if name in REDUCERS:
                for arg in (*node.args, *(k.value for k in node.keywords)):
                    yield from _names(arg, value)
            return
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    if isinstance(node, ast.Subscript) and not value:
        yield from _names(node.value)
        if isinstance(node.slice, ast.Constant):
            yield from _names(node.slice)
        return
    for child in ast.iter_child_nodes(node):
        yield from _names(child, value)


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, (str, bool)) and node.value == 0


def _is_timing(name: str, tainted: set[str]) -> bool:
    return bool(TIMING.search(name)) or name in tainted


def _own_nodes(scope: ast.AST):
    """The nodes of ``scope``'s body, not those of the functions defined in it (each is a scope of its own)."""
    for child in ast.iter_child_nodes(scope):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _own_nodes(child)


def _tainted(nodes: list[ast.AST], inherited: set[str]) -> set[str]:
    """The names a scope assigns from a time or a load (``best = min(t[0] for t in timed)`` where ``timed``
    holds medians), through any chain of assignments."""
    tainted = set(inherited)
    assignments = []
    for node in nodes:
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            assignments.append(([n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)], node.value))
        elif isinstance(node, (ast.For, ast.comprehension)):
            assignments.append(([n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)], node.iter))
    while True:
        grown = {name for targets, value in assignments
                 if any(_is_timing(n, tainted) for n in _names(value, value=True)) for name in targets} - tainted
        if not grown:
            return tainted
        tainted |= grown


def timing_assertions(text: str) -> list[tuple[int, str]]:
    """The ``assert`` statements of ``text`` that order a time or a load against a threshold: (line, source),
    whether the time is read where it is compared or through names assigned from it. A comparison with 0
    (a time is positive, a load is not negative) says nothing about speed and passes."""
    found = []

    def scan(scope: ast.AST, inherited: set[str]) -> None:
        nodes = list(_own_nodes(scope))
        tainted = _tainted(nodes, inherited)
        for statement in nodes:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                scan(statement, tainted)
            if not isinstance(statement, ast.Assert):
                continue
            for compare in ast.walk(statement.test):
                if not isinstance(compare, ast.Compare):
                    continue
                operands = [compare.left, *compare.comparators]
                if any(isinstance(op, ORDERING) and not (_is_zero(a) or _is_zero(b))
                       and any(_is_timing(name, tainted) for side in (a, b) for name in _names(side))
                       for op, a, b in zip(compare.ops, operands, operands[1:])):
                    found.append((statement.lineno, ast.get_source_segment(text, statement.test)))
                    break

    scan(ast.parse(text), set())
    return sorted(found)


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
    def test_two_runs():
        timed = [[measure(p)[0].median for p in (a, b)] for _ in range(3)]
        local_best, remote_best = (min(t[i] for t in timed) for i in (0, 1))
        assert 1 / 1.5 < remote_best / local_best < 1.5
'''))
    assert len(flagged) == 11, flagged
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
    def test_points():
        best = min(records, key=lambda r: r.median)
        assert len(best.point) > 1 and sum(r.ok for r in records) >= 12
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
    """benchmarks/gpu_tests.sh re-runs the tests that failed and those its time limit cut off (no outcome in
    the log: a run cut off prints no summary); its report tells a flaky test (failed, then passed) from a
    failure (failed twice, or not reached by the re-run) and from one that was only cut off, for
    pytest-xdist's lines and plain ones."""
    import subprocess

    first, rerun, expected = tmp_path / "first.log", tmp_path / "rerun.log", tmp_path / "expected.txt"
    first.write_text("tests/test_a.py::test_cut\n"  # started, never finished
                     "[gw0] [ 10%] PASSED tests/test_a.py::test_ok\n"
                     "[gw1] [ 20%] FAILED tests/test_a.py::test_flaky[x-1]\n"
                     "[gw1] [ 30%] FAILED tests/test_a.py::test_broken\n"
                     "[gw0] [ 40%] ERROR tests/test_a.py::test_lost\n"
                     "tests/test_b.py::test_plain FAILED                 [ 50%]\n"
                     "FAILED tests/test_a.py::test_broken - AssertionError: wrong\n")
    expected.write_text("".join(f"tests/test_{t}\n" for t in (
        "a.py::test_ok", "a.py::test_flaky[x-1]", "a.py::test_broken", "a.py::test_cut", "a.py::test_lost",
        "b.py::test_plain", "b.py::test_never_started")))
    rerun.write_text("[gw0] [ 50%] PASSED tests/test_a.py::test_flaky[x-1]\n"
                     "[gw1] [ 75%] FAILED tests/test_a.py::test_broken\n"
                     "[gw1] [ 80%] PASSED tests/test_a.py::test_cut\n"
                     "tests/test_b.py::test_plain PASSED                 [100%]\n"
                     "FAILED tests/test_a.py::test_broken - AssertionError: wrong\n")
    bench = TESTS.parent / "benchmarks"

    def run(script: str, *args) -> str:
        return subprocess.run(["bash", str(bench / script), *map(str, args)], capture_output=True, text=True,
                              check=True).stdout

    outcomes = run("_outcomes.sh", first, expected)
    assert sorted(outcomes.split("\n")) == sorted([
        "", "tests/test_a.py::test_ok PASSED", "tests/test_a.py::test_flaky[x-1] FAILED",
        "tests/test_a.py::test_broken FAILED", "tests/test_a.py::test_lost ERROR", "tests/test_b.py::test_plain FAILED",
        "tests/test_a.py::test_cut UNFINISHED", "tests/test_b.py::test_never_started UNFINISHED"])
    (tmp_path / "outcomes.txt").write_text(outcomes)
    to_rerun = run("_outcomes.sh", "--to-rerun", tmp_path / "outcomes.txt").split()[::2]
    assert sorted(to_rerun) == sorted(f"tests/test_{t}" for t in (
        "a.py::test_flaky[x-1]", "a.py::test_broken", "a.py::test_lost", "b.py::test_plain", "a.py::test_cut",
        "b.py::test_never_started"))
    out = run("_rerun_report.sh", tmp_path / "outcomes.txt", rerun)
    assert "FLAKY: tests/test_a.py::test_flaky[x-1]" in out and "FLAKY: tests/test_b.py::test_plain" in out
    assert "UNFINISHED, then PASSED: tests/test_a.py::test_cut" in out
    assert "FAILED: tests/test_a.py::test_broken" in out and "NOT RE-RUN: tests/test_a.py::test_lost" in out
    assert "NOT RE-RUN: tests/test_b.py::test_never_started" in out
    assert "6 re-run, 1 unfinished then passed, 2 flaky, 3 not passing" in out
    script = (bench / "gpu_tests.sh").read_text()
    assert "_outcomes.sh" in script and "_rerun_report.sh" in script


def test_a_fast_case_its_test_no_longer_has_stops_the_run():
    from .conftest import FAST_CASES, _check_fast_cases

    name, kept = next((n, ids) for n, ids in FAST_CASES.items() if ids)
    _check_fast_cases({name: set(kept) | {"another-case"}})  # every kept case present: fine
    with pytest.raises(pytest.UsageError, match=name):
        _check_fast_cases({name: set(sorted(kept)[1:]) | {"another-case"}})


def test_the_longest_tests_start_first_and_each_is_a_slow_or_gpu_test():
    """LONGEST_FIRST names tests that exist (a renamed one would quietly start last again) and that are not in
    the fast tier; the sort puts their files first and them first in their files, the rest as collected."""
    from types import SimpleNamespace

    from .conftest import LONGEST_FIRST, longest_first

    tiers = {"pytest.mark.slow", "pytest.mark.gpu"}
    marked = {}  # test function: whether it, or its module's ``pytestmark``, puts it in the slow or GPU tier
    for path in TESTS.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        module_tier = any(isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "pytestmark"
                          and tiers & {ast.unparse(n) for n in ast.walk(node.value)} for node in tree.body)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                marks = {ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list}
                marked[node.name] = module_tier or bool(marks & tiers)
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [name for name in LONGEST_FIRST if name not in marked] == []
    assert [name for name in LONGEST_FIRST if not marked[name]] == []
    first, fourth = LONGEST_FIRST[0], LONGEST_FIRST[3]
    items = [SimpleNamespace(nodeid=f"{path}::{name}", name=name, originalname=name.split("[")[0]) for path, name in (
        ("a.py", "test_a"), ("b.py", f"{fourth}[x]"), ("b.py", "test_b"), ("c.py", "test_c"), ("d.py", first),
        ("d.py", "test_d"), ("b.py", f"{fourth}[y]"))]
    longest_first(items)
    assert [i.nodeid for i in items] == [f"d.py::{first}", "d.py::test_d", f"b.py::{fourth}[x]", f"b.py::{fourth}[y]",
                                         "b.py::test_b", "a.py::test_a", "c.py::test_c"]


@pytest.mark.slow
def test_the_gpu_test_shards_split_the_gpu_tests_between_them():
    """benchmarks/_gpu_shard.sh I/N: every GPU test in exactly one of N shards, the shards within one test of
    each other's size, and a bad I/N refused in one line."""
    import subprocess

    script = str(TESTS.parent / "benchmarks" / "_gpu_shard.sh")

    def shard(spec: str) -> list[str]:
        return subprocess.run(["bash", script, spec], capture_output=True, text=True, check=True,
                              cwd=TESTS.parent).stdout.split()

    whole, halves = shard("1/1"), [shard("1/2"), shard("2/2")]
    assert len(whole) > 50 and sorted(halves[0] + halves[1]) == sorted(whole)
    assert abs(len(halves[0]) - len(halves[1])) <= 1 and not set(halves[0]) & set(halves[1])
    bad = subprocess.run(["bash", script, "3/2"], capture_output=True, text=True, cwd=TESTS.parent)
    assert bad.returncode == 2 and "1 <= I <= N" in bad.stderr and not bad.stdout


def _pytest_in(folder, *args: str, cwd, env=None):
    """pytest in two processes on the test files of ``folder`` alone (none of this repository's settings)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pytest", "-n", "2", *args, "-p", "no:cacheprovider", "-c", "/dev/null",
                           "--rootdir", str(folder), str(folder)], capture_output=True, text=True, cwd=cwd, env=env)


def test_the_slow_tiers_groups_run_each_in_one_process(tmp_path):
    """The slow tier (``--dist loadgroup``) keeps the tests of one ``xdist_group`` in one process, so that a
    group's shared build is made once. pytest 9.2 broke that in pytest-xdist (its group travels in the node id,
    which 9.2 no longer lets it rewrite: pytest-xdist issue 1386) without an error: the tests spread over the
    processes and each built the artifacts again. The test extra pins pytest below 9.2 until that is fixed."""
    (tmp_path / "test_grouped.py").write_text(textwrap.dedent("""
        import pytest
        pytestmark = pytest.mark.xdist_group("shared-build")

        @pytest.mark.parametrize("case", range(6))
        def test_grouped(case):
            pass
        """))
    (tmp_path / "test_free.py").write_text("import pytest\n\n@pytest.mark.parametrize('case', range(6))\n"
                                           "def test_free(case):\n    pass\n")
    proc = _pytest_in(tmp_path, "--dist", "loadgroup", "-v", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:]
    workers = set(re.findall(r"\[(gw\d)\][^\n]*PASSED[^\n]*test_grouped", proc.stdout))
    assert len(re.findall(r"PASSED[^\n]*test_grouped", proc.stdout)) == 6 and len(workers) == 1, proc.stdout


def test_a_failures_traceback_is_written_as_it_comes_where_asked(tmp_path):
    """``AUTOSCHED_FAILURE_LOG`` (set by ``benchmarks/gpu_tests.sh``, whose runs a time limit can cut off before
    pytest's summary): each failure's traceback once, from the process that ran it, and nothing for a pass."""
    import os

    (tmp_path / "test_two.py").write_text("def test_fails():\n    assert 1 == 2, 'on purpose'\n\n"
                                          "def test_passes():\n    pass\n")
    log = tmp_path / "failures.log"
    proc = _pytest_in(tmp_path, "-p", "tests.conftest", cwd=TESTS.parent,
                      env={**os.environ, "AUTOSCHED_FAILURE_LOG": str(log)})
    assert proc.returncode == 1, proc.stdout[-2000:]
    text = log.read_text()
    assert text.count("=== ") == 1 and "test_two.py::test_fails (call)" in text and "on purpose" in text, text


# ---- tests never touch the user's files (issue 70) --------------------------------------------------------------
# The commands that read or write a tuning database: run without --db they take $AUTOSCHED_DB or ./autosched.db.
DB_COMMANDS = {"tune", "tune-model", "build", "show", "report", "db"}
RUNNERS = {"cli", "autosched", "start"}  # tests/helpers.py's ways to run a command


def command_runs_without_a_database(text: str) -> list[tuple[int, str]]:
    """The command runs of ``text`` (``cli("build", ...)`` and the like) of a command that takes a database and
    are not given one with ``--db`` in the call itself: (line, source)."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        first = node.args[0] if node.args else None
        if name not in RUNNERS or not isinstance(first, ast.Constant) or first.value not in DB_COMMANDS:
            continue
        if not any(isinstance(a, ast.Constant) and a.value == "--db" for a in node.args):
            found.append((node.lineno, ast.get_source_segment(text, node)))
    return found


def test_the_scanner_finds_command_runs_without_a_database():
    flagged = command_runs_without_a_database(textwrap.dedent('''\
        cli("build", str(root / "hf"), "--generate", "-o", str(out))
        proc = cli("tune", "softmax", "--trials", "2", check=False)
        autosched("build", "hf-llama", *common, "-o", str(out))
        start("db", "stats")
        cli("build", "tiny-llama", "-o", str(out), "--db", str(tmp_path / "t.db"))
        cli("generate", str(art), "--prompt-ids", "1")
        cli(*args, "--db", db)
        '''))
    assert [line for line, _ in flagged] == [1, 2, 3, 4]


def test_every_command_run_in_the_tests_names_its_own_database():
    """A test that builds or tunes without --db read and wrote the user's ./autosched.db (issue 70: a test run
    after the quick start added 16 records to it). tests/conftest.py points $AUTOSCHED_DB at the session's own
    folder as a guard and fails a session that used it; each run names its database."""
    found = []
    for path in sorted(TESTS.glob("*.py")):
        found += [f"{path.name}:{line}: {source}" for line, source in command_runs_without_a_database(path.read_text())]
    assert not found, "command runs without --db (give each its own, under tmp_path):\n" + "\n".join(found)


def test_a_test_run_that_changes_the_working_directory_or_uses_the_default_database_fails(tmp_path):
    """tests/conftest.py fails a session whose tests left a file in the working directory, changed one there (a
    user's ./autosched.db) or used the default tuning database, naming each; the session's own folder (the
    default database, compiled references) is removed when it ends."""
    import os
    import subprocess
    import sys

    suite, work, temp = tmp_path / "suite", tmp_path / "work", tmp_path / "tmp"
    for folder in (suite, work, temp):
        folder.mkdir()
    (work / "autosched.db").write_bytes(b"the user's records")
    (suite / "test_careless.py").write_text(textwrap.dedent('''\
        import os

        def test_writes_here():
            with open("left-behind.txt", "w") as f:
                f.write("x")

        def test_writes_the_users_database():
            with open("autosched.db", "ab") as f:
                f.write(b"and a test's")

        def test_forgets_its_database():
            with open(os.environ["AUTOSCHED_DB"], "w") as f:
                f.write("x")
        '''))
    from .conftest import SESSION_ENV

    env = {k: v for k, v in os.environ.items() if k != SESSION_ENV}  # a session of its own, as a new run has
    env.update(PYTHONPATH=os.pathsep.join([str(TESTS.parent), env.get("PYTHONPATH", "")]), TMPDIR=str(temp))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "-c", "/dev/null", "--rootdir", str(suite), str(suite)], capture_output=True, text=True,
                          cwd=work, env=env)
    said = " ".join(proc.stdout.split())
    assert proc.returncode == 1 and "3 passed" in said, proc.stdout[-3000:]
    assert f"the tests changed the working directory {work} (added left-behind.txt; changed autosched.db)" in said, said
    assert "a test used the default tuning database" in said and "give each command its own --db" in said, said
    assert not list(temp.glob("autosched-test-session-*"))


# ---- imports: one direction, down the layers ----------------------------------------------------------
# autosched's layers, lowest first (ARCHITECTURE.md draws them): a module imports modules of its own layer and
# of those below, never of one above. A name is a module or package under ``autosched.`` ("__init__": the
# package itself); a module belongs to the longest name that is it or a package above it, so ``database.cli``
# (the ``autosched db`` command) is a command while the rest of ``database`` is not.
LAYERS = (
    ("base", ("__init__", "_checkout", "errors", "records", "correctness", "buckets", "tvm_adapter")),
    ("target", ("fastmath", "target", "cuda_tools")),
    ("definitions", ("workloads", "examples")),
    ("spaces", ("search_spaces",)),
    ("task", ("task",)),
    ("measure", ("measure", "cost_model")),
    ("database", ("database", "validate")),
    ("search", ("warm_start", "search", "tuner")),
    ("artifact", ("artifact",)),
    # the generation runtime, with TVM's runtime alone: model, scheduler, sampler, request, speculative, barrier, ...
    ("generation runtime", ("generation",)),
    ("pipeline", ("pipeline",)),
    ("generation build", ("generation.build", "generation.checkpoint", "generation.decoder", "generation.blocks",
                          "generation.linear",
                          "generation.attention",
                          "generation.cpu_paged_prefill", "generation.quantize", "generation.prequantized",
                          "generation.gptq", "generation.awq", "generation.fp8")),
    ("serve", ("serve",)),
    ("commands", ("cli", "database.cli", "output", "report", "show", "runmodel", "__main__")),
)
LAYER_OF = {name: level for level, (_, names) in enumerate(LAYERS) for name in names}
# Imports up the layers that stay, each with its reason.
UPWARD = {
    ("__init__", "generation"): "autosched.Generator and its kin: a PEP 562 re-export, imported on first use of "
                                "the name; the package itself runs before any of its modules, so it is the base",
}

# Third-party packages slow enough to import that a module imports them inside the functions that use them,
# so that ``autosched --help``, and every import of a module that does not need them, does without
# (``python -X importtime -m autosched --help`` shows what an import costs).
HEAVY = {"tvm", "tvm_ffi", "torch", "transformers", "safetensors", "xgboost", "matplotlib", "numpy", "ml_dtypes",
         "sqlalchemy", "alembic", "rich", "psutil", "cloudpickle", "fastapi", "starlette", "uvicorn", "pydantic",
         "prometheus_client", "openai", "xgrammar"}
# How a module that defers them says so: one comment line at its top naming them.
DEFERRED = re.compile(r"^# Deferred imports: (.*)$", re.M)
# Modules that other work in flight edits; their imports inside functions are moved when it lands.
PENDING = {
    "autosched/artifact.py", "autosched/cli/__init__.py", "autosched/cli/common.py", "autosched/cli/evaluate.py",
    "autosched/cli/generate.py", "autosched/cli/model.py", "autosched/cli/tools.py", "autosched/cli/tune.py",
    "autosched/generation/build.py", "autosched/generation/generator.py", "autosched/generation/model.py",
    "autosched/generation/sampler.py",
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module imported (for ``from m import name``: ``m.name`` where that is a module, else ``m``)
    line: int
    in_function: bool


def source_modules() -> dict[str, Path]:
    """Every module of autosched by its dotted name: ``autosched/`` and the folders installed under it
    (``autosched/_checkout.py``'s table)."""
    found = {}
    for name, folder in {"autosched": "autosched", **PACKAGE_DIRS}.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            found[".".join((name, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return found


def module_imports(module: str, path: Path, modules) -> list[Import]:
    """What ``module`` imports when it runs, at its top and inside its functions; not what an ``if
    TYPE_CHECKING:`` block imports (for the type checker only)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend(Import(module, alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - child.level + 1], *([child.module] if child.module else [])])
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append(Import(module, sub if sub in modules else base, child.lineno, in_function))
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


def unit(module: str) -> str | None:
    """The name of :data:`LAYERS` that ``module`` belongs to (None: not ours, or in no layer)."""
    if module != "autosched" and not module.startswith("autosched."):
        return None
    parts = (module.removeprefix("autosched").lstrip(".") or "__init__").split(".")
    return next((name for n in range(len(parts), 0, -1) if (name := ".".join(parts[:n])) in LAYER_OF), None)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


@pytest.fixture(scope="module")
def imports() -> tuple[dict[str, Path], list[Import]]:
    modules = source_modules()
    return modules, [i for module, path in modules.items() for i in module_imports(module, path, modules)]


def _where(imp: Import, modules) -> str:
    return f"{modules[imp.module].relative_to(REPO)}:{imp.line} imports {imp.target}"


def test_every_module_has_a_layer_and_none_imports_a_layer_above_its_own(imports):
    modules, found = imports
    assert [m for m in modules if unit(m) is None] == [], "give each new package or module its place in LAYERS"
    upward = [f"{_where(i, modules)} ({LAYERS[LAYER_OF[unit(i.module)]][0]} -> {LAYERS[LAYER_OF[unit(i.target)]][0]})"
              for i in found if unit(i.target) and LAYER_OF[unit(i.target)] > LAYER_OF[unit(i.module)]
              and (unit(i.module), unit(i.target)) not in UPWARD]
    assert upward == [], "imports up the layers (move what both need down, or the importer up):\n" + "\n".join(upward)
    used = {(unit(i.module), unit(i.target)) for i in found}
    assert set(UPWARD) <= used, "an allowed upward import that is gone: drop it from UPWARD"


def test_no_import_cycle_among_packages_or_modules(imports):
    """Counted with the imports inside functions: a cycle is a cycle whenever its imports run."""
    modules, found = imports
    packages: dict[str, set[str]] = {}
    among_modules: dict[str, set[str]] = {}
    for i in found:
        if unit(i.target) and (unit(i.module), unit(i.target)) not in UPWARD:
            packages.setdefault(unit(i.module), set()).add(unit(i.target))
            if i.target in modules and i.target != i.module:
                among_modules.setdefault(i.module, set()).add(i.target)
    assert cycles(packages) == [], f"packages that import each other: {cycles(packages)}"
    assert cycles(among_modules) == [], f"modules that import each other: {cycles(among_modules)}"


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}) == [["a", "b", "c"]]
    assert unit("autosched.database.cli") == "database.cli" and unit("autosched.database.store") == "database"
    assert unit("autosched") == "__init__" and unit("tvm.relax") is None


def heavy_at_import(modules, found: list[Import]) -> dict[str, set[str]]:
    """The heavy packages that importing each module brings in, through its and its packages' top-level imports
    (to a fixed point: a package's ``__init__`` and its modules import each other)."""
    needs: dict[str, set[str]] = {module: set() for module in modules}  # ours it imports, its packages included
    heavy: dict[str, set[str]] = {module: set() for module in modules}
    for i in found:
        if i.in_function:
            continue
        parts = i.target.split(".")
        if parts[0] != "autosched":
            heavy[i.module] |= {parts[0]} & HEAVY
        else:
            needs[i.module] |= {".".join(parts[:n]) for n in range(1, len(parts) + 1)} & set(modules)
    for module in modules:
        parts = module.split(".")
        needs[module] |= {".".join(parts[:n]) for n in range(1, len(parts))} & set(modules)
    changed = True
    while changed:
        changed = False
        for module, targets in needs.items():
            more = set().union(*(heavy[t] for t in targets)) - heavy[module] if targets else set()
            if more:
                heavy[module] |= more
                changed = True
    return heavy


def test_an_import_inside_a_function_defers_a_heavy_package_and_its_module_says_so(imports):
    """Every other import sits at the top of its module. A module that defers says which packages it defers in
    one comment line at its top (``# Deferred imports: tvm, torch``); one of autosched's own modules is heavy
    where its own top-level imports bring a heavy package in."""
    modules, found = imports
    heavy = heavy_at_import(modules, found)
    problems: dict[str, list[str]] = {}
    for i in found:
        if not i.in_function or (unit(i.module), unit(i.target)) in UPWARD:  # up the layers: only ever on use
            continue
        root = i.target.split(".")[0]
        brings = heavy.get(i.target, set()) if root == "autosched" else {root} & HEAVY
        path = str(modules[i.module].relative_to(REPO))
        named = set(re.findall(r"[\w.]+", " ".join(DEFERRED.findall(modules[i.module].read_text()))))
        if not brings:
            problems.setdefault(path, []).append(f"{_where(i, modules)}: a light import, at the top of the module")
        elif not brings & named:
            problems.setdefault(path, []).append(f"{_where(i, modules)}: name one of {sorted(brings)} in the "
                                                 "module's '# Deferred imports:' line")
    assert sorted(set(problems) - PENDING) == [], "\n".join(p for path in sorted(set(problems) - PENDING)
                                                            for p in problems[path])
    assert sorted(PENDING - set(problems)) == [], "these keep the rule now: drop them from PENDING"


# ---- ARCHITECTURE.md's map: every module, and only modules that are ---------------------------------------------


def architecture_map() -> dict[str, list[str]]:
    """ARCHITECTURE.md's "Modules" section: each folder heading's bullets (one folder may have two headings)."""
    text = (REPO / "ARCHITECTURE.md").read_text()
    body = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    sections: dict[str, list[str]] = {}
    for chunk in body.split("\n### ")[1:]:
        folder = re.match(r"`([^`]+)`", chunk).group(1)
        bullets = re.split(r"\n- ", "\n" + chunk.split("\n", 1)[1].strip())[1:]
        sections.setdefault(folder, []).extend(bullets)
    return sections


def _modules_in(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}


def test_architecture_md_names_every_module_in_its_folder_and_no_module_that_is_not_there():
    sections = architecture_map()
    covered = set()
    problems = []
    for folder, bullets in sections.items():
        where = REPO / folder
        covered.add(where)
        named = set()
        for bullet in bullets:
            lead = re.match(r"((?:`[^`]+`(?:, )?)+) —", bullet)
            assert lead, f"ARCHITECTURE.md, {folder}: a bullet that does not start with `module` —: {bullet[:60]}"
            for name in re.findall(r"`([^`]+)`", lead.group(1)):
                named.add(name)
                if name.endswith("/"):  # a subfolder: its modules named in its bullet
                    sub = where / name
                    covered.add(sub)
                    inside = set(re.findall(r"`([\w]+)`", bullet))
                    problems += [f"{folder}{name}{m}.py is not in its bullet" for m in sorted(_modules_in(sub) - inside)]
                    problems += [f"{folder}{name} is not a folder"] if not sub.is_dir() else []
                elif not (where / f"{name}.py").is_file():
                    problems.append(f"{folder}{name}.py is named but does not exist")
        problems += [f"{folder}{m}.py is not named" for m in sorted(_modules_in(where) - named)]
    for root in ("autosched", *PACKAGE_DIRS.values()):
        for folder in {p.parent for p in (REPO / root).rglob("*.py")}:
            if folder not in covered and folder.name != "versions":
                problems.append(f"{folder.relative_to(REPO)}/ has no heading or bullet")
    assert problems == [], "ARCHITECTURE.md's module map:\n" + "\n".join(problems)


def test_architecture_md_where_to_add_things_names_files_and_folders_that_exist():
    text = (REPO / "ARCHITECTURE.md").read_text()
    table = text.split("\n## Where to add things\n", 1)[1]
    paths = {p for p in re.findall(r"`([\w./-]+/[\w./-]*)`", table) if "<" not in p}
    assert len(paths) > 10, paths  # the table names its files
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert missing == [], f"ARCHITECTURE.md's 'Where to add things' names paths that are not there: {missing}"
