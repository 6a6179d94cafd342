"""Native kernel tests: every kernel against a torch reference, at every ISA tier
this machine can run (the ``kern`` fixture is parametrized over supported_isas())."""

from __future__ import annotations

import pytest

from cpud import native

TIERS = native.supported_isas()


def pytest_collection_modifyitems(config, items):
    if native.available():
        return
    skip = pytest.mark.skip(reason=f"native kernels not built: {native.load_error()}")
    for item in items:
        if "tests/native/" in str(item.fspath).replace("\\", "/") and "fallback" not in item.name:
            item.add_marker(skip)


@pytest.fixture(params=TIERS)
def kern(request) -> native.Kernels:
    return native.Kernels(request.param)
