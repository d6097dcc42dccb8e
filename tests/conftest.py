"""Shared fixtures. Tests run on the CPU through LLVM; tests marked ``gpu`` need a CUDA device and are
skipped (with the reason) without one; tests marked ``slow`` run only with ``-m slow``."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid

import pytest

os.environ.setdefault("TVM_NUM_THREADS", "2")
# Models built for the CPU at LLVM level 0: the tests check what they compute, not how fast (faster builds).
os.environ.setdefault("AUTOSCHED_CPU_OPT_LEVEL", "0")

# Tests never touch the user's files. A test session has a folder of its own (its xdist workers, started after
# this, inherit it), removed when the session ends, for what would otherwise go to the user's:
# - the default tuning database: a command run without --db reads and writes $AUTOSCHED_DB or ./autosched.db.
#   Every test gives --db (tests/test_suite_rules.py checks it), and a session in which this default was
#   created fails (pytest_sessionfinish), as one that changed the working directory does;
# - compiled references (autosched.task.reference_cache), unless $AUTOSCHED_CACHE names a folder for them;
# - Hypothesis's example database (else ./.hypothesis).
SESSION_ENV = "AUTOSCHED_TEST_SESSION_DIR"
_OWN_SESSION_DIR = not os.environ.get(SESSION_ENV)
if _OWN_SESSION_DIR:
    os.environ[SESSION_ENV] = tempfile.mkdtemp(prefix="autosched-test-session-")
SESSION_DIR = os.environ[SESSION_ENV]
DEFAULT_DB = os.path.join(SESSION_DIR, "default-tuning.db")
os.environ["AUTOSCHED_DB"] = DEFAULT_DB
os.environ.setdefault("AUTOSCHED_CACHE", os.path.join(SESSION_DIR, "cache"))
os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = os.path.join(SESSION_DIR, "hypothesis")


def _has_cuda() -> bool:
    try:
        import tvm

        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - no TVM CUDA runtime means no GPU for our purposes
        return False


# The fast tier (the default run) compiles each space and architecture once: of these parametrised tests,
# whose cases each take an nvcc or TIR compile of seconds, only the cases named here stay in it; every case
# runs in the slow tier. Kept here rather than in the test files so that the test files say what is
# checked and this table how often.
FAST_CASES = {
    "test_sampled_cuda_kernels_compile": {
        "gemm-float16-m=256,n=256,k=128-sm_90", "dequant_gemm-float16-m=1,n=256,k=512-sm_90",
        "fp8_gemm-bfloat16-m=300,n=1001,k=336-sm_90",
        "dequant_gemm-float16-m=1,n=384,k=512-sm_90",  # gemv8 (float8 E4M3 codes)
        "swiglu_gemm-float16-m=3,n=1001,k=1048-sm_90",  # swiglu_gemv
        "rmsnorm-float16-m=8,n=1000-sm_90",
        "moe_gemm-float16-m=2,e=8,n=512,k=256-sm_90", "paged_decode_attention-float16-b=2,h=4,hkv=2,d=64,ctx=200,page=16-sm_90",
    },
    # kv_cache_decode.cuh and kv_cache_prefill.cuh compile in their own tests' fast cases
    "test_each_cuda_file_of_the_templates_compiles_on_its_own": {"common.cuh"},
    "test_paged_decode_body_matches_the_reference_on_the_host": set(),  # kv_cache_decode's host case stays
    "test_kv_cache_decode_body_matches_float64_on_the_host": {"gqa4-d128-split4"},
    "test_kv_cache_decode_compiles_for_sm90a_without_spills": {"32-8-128-float16"},
    "test_kv_cache_prefill_body_matches_float64_on_the_host": {"gqa2-d64-causal"},
    "test_kv_cache_prefill_compiles_for_sm90a_without_spills": {"32-8-128-float16"},
    "test_kv_cache_prefill_paged_body_matches_float64_on_the_host": {"mha-bf16-causal"},
    "test_gemv8_kernel_matches_float64_on_the_host": {"e4m3-fp16-silu-tail-odd-n"},
    "test_swiglu_gemv_kernel_matches_float64_on_the_host": {"m8-bf16-tail-unrolled"},
    "test_grouped_gemm_body_matches_float64_on_the_host": {"empty-experts-k-tail"},
    "test_grouped_gemm_compiles_for_sm90a_without_spills": {"mixtral-gate-up"},
    "test_explicit_gpu_test_points_are_valid_and_build": {
        "test_int4_gemv_on_tensor_cores_is_correct_on_the_gpu",
        "test_overlapped_softmax_attention_is_correct_on_the_gpu[attention-b=1,h=2,hkv=1,s=300,d=64-float16-1]",
        "test_swapped_operands_are_correct_at_shapes_no_tile_divides",
    },
}


# The longest tests of the slow and GPU tiers (a minute or more on two cores; GPU tests among a dozen processes),
# longest first: their files run first, each file's listed tests first in it. xdist hands tests out in
# collection order and each worker holds up to three queued: a long test collected last kept one worker busy for
# minutes after the other had run out of work (and in a GPU call cut off by its time limit, it was the one left
# unfinished). Files stay whole, so that a module's fixtures are made once a process.
LONGEST_FIRST = (
    # GPU tier
    "test_tiny_model_tunes_builds_and_matches_torch_on_the_gpu",
    "test_half_precision_generation_on_the_gpu_matches_transformers",
    "test_a_build_with_programmatic_launch_generates_the_same_tokens_on_the_gpu",
    "test_windowed_prefill_in_chunks_matches_transformers_on_the_gpu",
    "test_half_precision_quantized_logits_on_the_gpu_match_the_float64_model",
    "test_greedy_speculative_decoding_on_the_gpu_gives_the_plain_greedy_tokens",
    "test_tiny_fp16_model_generates_with_our_decode_attention",
    "test_a_transformers_model_matches_torch_on_the_gpu",
    "test_a_mixtral_prefill_chunk_on_grouped_gemms_matches_transformers_on_the_gpu",
    "test_tuning_on_the_gpu_records_the_device",
    "test_tune_model_fp8_on_the_gpu_tunes_the_w8a8_prefill_kernels",
    "test_mixtral_dimensions_in_half_precision_match_transformers_on_the_gpu",
    # slow tier
    "test_the_quick_start_and_using_it_examples_run_as_written",
    "test_eight_tuners_at_once",
    "test_four_tuners_write_one_server_database_at_once",
    "test_a_length_nobody_tuned_is_built_from_the_nearest_tuned_length_and_remembered",
    "test_a_hung_server_loses_only_its_candidate",
    "test_an_fp8_build_for_sm_90_runs_its_prefill_chunks_w8a8_on_fp8_wgmma_and_its_cuda_compiles",
    "test_a_trained_model_keeps_its_perplexity_and_greedy_tokens_when_quantized",
    "test_tune_model_quantize_tunes_the_dequant_gemm_kernels_and_build_applies_them",
    "test_tune_model_build_and_run_from_the_command_line",
    "test_a_transformers_model_tunes_builds_and_matches_torch_on_the_cpu",
    "test_a_tuned_moe_gemm_record_is_applied_by_the_build",
    "test_an_fp8_checkpoint_builds_as_fp8_of_the_same_weights",
    "test_tune_query_show_export_import",
    "test_a_server_killed_mid_run_loses_no_record",
)


def longest_first(items: list) -> None:
    """Sort ``items`` in place: the files holding LONGEST_FIRST's tests first, by their first one in it, and in
    each file its listed tests first, in that order; the rest as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    test_rank = {id(item): rank.get(getattr(item, "originalname", item.name), len(rank)) for item in items}
    path = {id(item): item.nodeid.split("::")[0] for item in items}
    file_rank: dict[str, int] = {}
    for item in items:
        file_rank[path[id(item)]] = min(file_rank.get(path[id(item)], len(rank)), test_rank[id(item)])
    items.sort(key=lambda item: (file_rank[path[id(item)]], test_rank[id(item)]))


@pytest.hookimpl(tryfirst=True)  # before the `-m 'not slow'` of addopts deselects by marker
def pytest_collection_modifyitems(config, items):
    cases: dict[str, set[str]] = {}
    for item in items:
        name = getattr(item, "originalname", item.name)
        kept = FAST_CASES.get(name)
        callspec = getattr(item, "callspec", None)
        if kept is not None and callspec is not None:
            cases.setdefault(name, set()).add(callspec.id)
            if callspec.id not in kept:
                item.add_marker(pytest.mark.slow)
    if not any("::" in str(arg) for arg in config.args):  # whole files collected: every case is there
        _check_fast_cases(cases)
    longest_first(items)
    if not any("gpu" in item.keywords for item in items) or _has_cuda():  # (no TVM import without GPU tests)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tvm.cuda(0) does not exist here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With AUTOSCHED_FAILURE_LOG set, each failure's traceback is appended to that file as it comes: a GPU run cut
    off by its time limit (``benchmarks/gpu_tests.sh``) never prints pytest's summary of failures."""
    path = os.environ.get("AUTOSCHED_FAILURE_LOG")
    # Only the process that ran the test writes: xdist's controller sees each report again, its worker as ``node``.
    if path and report.failed and not hasattr(report, "node"):
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


# What a walk of the working directory leaves out: hidden files and folders (version control, virtual
# environments, pytest's cache, benchmarks/gpu_tests.sh's $OUT, by default .bench/out, which its GPU monitor writes
# during the run), other virtual environments (a folder holding pyvenv.cfg), Python's bytecode, and the folder of
# $AUTOSCHED_FAILURE_LOG.
MAX_WATCHED = 20_000  # a larger working directory (a home folder) is compared at its top level only


def listing(root: str) -> dict[str, tuple]:
    """The files under ``root`` by path, with their size and modification time, and its folders."""
    log = os.environ.get("AUTOSCHED_FAILURE_LOG")
    log_folder = os.path.dirname(os.path.abspath(log)) if log else None

    def watched(folder: str, name: str) -> bool:
        path = os.path.join(folder, name)
        return not (name.startswith(".") or name == "__pycache__" or os.path.exists(os.path.join(path, "pyvenv.cfg"))
                    or os.path.abspath(path) == log_folder)

    def walk(deep: bool) -> dict[str, tuple] | None:
        out: dict[str, tuple] = {}
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if watched(folder, d))
            for name in dirs:
                out[os.path.relpath(os.path.join(folder, name), root) + "/"] = ()
            for name in files:
                path = os.path.join(folder, name)
                if name.startswith(".") or (log and os.path.abspath(path) == os.path.abspath(log)):
                    continue
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
            if not deep:
                break
            if len(out) > MAX_WATCHED:
                return None
        return out

    return walk(deep=True) or walk(deep=False)


def _controller(config) -> bool:
    """Whether this process runs the session (not one of xdist's workers)."""
    return not hasattr(config, "workerinput")


def tracked(root: str) -> set[str]:
    """The files git tracks under ``root`` (none outside a checkout): a person may edit them while the tests run,
    so only their appearing or going counts, not a change."""
    import subprocess

    try:
        proc = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return set()
    return set(proc.stdout.decode(errors="replace").split("\0")) - {""} if proc.returncode == 0 else set()


def pytest_sessionstart(session):
    if _controller(session.config):
        session.config._autosched_cwd = (os.getcwd(), listing(os.getcwd()))


def pytest_sessionfinish(session, exitstatus):
    """A test run leaves the working directory as it found it and never uses the default tuning database: the
    session fails where one did, naming what changed."""
    cwd, before = getattr(session.config, "_autosched_cwd", (None, None))
    if cwd is None:
        return
    after = listing(cwd)
    changes = [f"added {p}" for p in sorted(set(after) - set(before))]
    changes += [f"removed {p}" for p in sorted(set(before) - set(after))]
    edited = tracked(cwd)
    changes += [f"changed {p}" for p in sorted(set(before) & set(after)) if before[p] != after[p] and p not in edited]
    problems = []
    if changes:
        problems.append(f"the tests changed the working directory {cwd} ({'; '.join(changes[:10])}"
                        f"{f'; and {len(changes) - 10} more' if len(changes) > 10 else ''}): a test writes under "
                        "tmp_path")
    if os.path.exists(DEFAULT_DB):
        problems.append(f"a test used the default tuning database ({DEFAULT_DB}, in place of the user's "
                        "./autosched.db): give each command its own --db")
    if not problems:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for problem in problems:
        line = f"tests/conftest.py: {problem}"
        reporter.write_line(line, red=True) if reporter is not None else print(line, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
    if _OWN_SESSION_DIR and _controller(config):
        shutil.rmtree(SESSION_DIR, ignore_errors=True)


def _check_fast_cases(collected: dict[str, set[str]]) -> None:
    """A case named in FAST_CASES that its test no longer has (renamed, removed) would silently leave the
    fast tier without it: stop the run instead."""
    for name, ids in collected.items():
        missing = sorted(FAST_CASES[name] - ids)
        if missing:
            raise pytest.UsageError(f"tests/conftest.py FAST_CASES names cases {name} does not have: {missing}; "
                                    "rename them to existing case ids")


@pytest.fixture(scope="session")
def cpu_target():
    from autosched.target import parse_target

    return parse_target("llvm")


@pytest.fixture(scope="session")
def gpu_target():
    from autosched.target import parse_target

    if not _has_cuda():
        pytest.skip("needs a CUDA GPU")
    return parse_target("cuda")


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "tuning.db"


PG_ENV = "AUTOSCHED_TEST_PG_URL"


def pg_server_url() -> str:
    """The URL of a PostgreSQL server to create test databases in; the test skips, with the reason, without one."""
    url = os.environ.get(PG_ENV)
    if not url:
        pytest.skip(f"needs a PostgreSQL server: ${PG_ENV} is not set (.ci/run and .ci/with-postgres start one)")
    return url


@pytest.fixture
def new_pg_database():
    """Creates fresh, empty PostgreSQL databases (dropped after the test): ``new_pg_database()`` -> URL."""
    import psycopg
    from sqlalchemy.engine import make_url

    server = pg_server_url()
    names: list[str] = []

    def new() -> str:
        names.append(f"autosched_test_{uuid.uuid4().hex[:12]}")
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{names[-1]}"')
        return make_url(server).set(database=names[-1]).render_as_string(hide_password=False)

    yield new
    with psycopg.connect(server, autocommit=True) as conn:
        for name in names:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url(new_pg_database):
    """A fresh, empty PostgreSQL database for one test, by URL."""
    return new_pg_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A new tuning database of each kind: an SQLite file path, and a PostgreSQL URL."""
    if request.param == "sqlite":
        return str(tmp_path / "tuning.db")
    return request.getfixturevalue("pg_url")


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After a GPU test, what it held goes back to the device: its TVM modules and VMs (their pooled
    allocators) once collected, and torch's cached blocks. Many test processes share one GPU
    (benchmarks/gpu_tests.sh), and memory one kept idle is memory another runs out of."""
    yield
    if "gpu" not in request.keywords:
        return
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
