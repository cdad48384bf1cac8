"""Shared fixtures: GPU tests skip cleanly on machines without a CUDA device."""

import pytest


def _have_gpu() -> bool:
    try:
        import tvm  # pylint: disable=import-outside-toplevel

        return bool(tvm.cuda(0).exist)
    except Exception:  # pylint: disable=broad-except
        return False


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
