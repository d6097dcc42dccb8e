"""Shared fixtures. Tests run on the CPU through LLVM; tests marked ``gpu`` need a CUDA device and are
skipped (with the reason) without one; tests marked ``slow`` run only with ``-m slow``."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest

os.environ.setdefault("TVM_NUM_THREADS", "2")
# Compiled references (autosched.task.reference_cache) go to a folder of this test session, not the user's.
os.environ.setdefault("AUTOSCHED_CACHE", tempfile.mkdtemp(prefix="autosched-test-cache-"))


def _has_cuda() -> bool:
    try:
        import tvm

        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - no TVM CUDA runtime means no GPU for our purposes
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tvm.cuda(0) does not exist here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
