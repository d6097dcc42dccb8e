"""Shared fixtures. Tests run on the CPU through LLVM; tests marked ``gpu`` need a CUDA device and are
skipped (with the reason) without one; tests marked ``slow`` run only with ``-m slow``."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TVM_NUM_THREADS", "2")


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
