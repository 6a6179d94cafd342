"""The `slow` marker's module list names real test modules (a renamed module would otherwise
drop out of the slow lane unnoticed and slow the fast one down)."""

from __future__ import annotations

from slow_modules import SLOW_MODULES, TESTS


def test_every_slow_module_exists():
    missing = sorted(m for m in SLOW_MODULES if not (TESTS / m).is_file())
    assert not missing, f"SLOW_MODULES names missing test modules: {missing}"
