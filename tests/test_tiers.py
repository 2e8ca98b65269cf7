"""The fast tier (`pytest -m "not slow"`) keeps a case of every test module but the few listed as slow-only
in tests/conftest.py (SLOW_ONLY), so that a quick run still touches every part of the package."""

from pathlib import Path

import pytest

from tests.conftest import SLOW_ONLY

ROOT = Path(__file__).resolve().parents[1]


def test_slow_only_modules_exist():
    assert all((ROOT / path).is_file() for path in SLOW_ONLY), sorted(p for p in SLOW_ONLY if not (ROOT / p).is_file())


def test_every_module_keeps_a_fast_case(request, tier_modules):
    """In a run that deselects by marker (the fast tier; not one narrowed by -k), every collected module but the
    slow-only ones has a selected case."""
    config = request.config
    if not config.option.markexpr or config.option.keyword or not tier_modules or not tier_modules["deselected"]:
        pytest.skip("not a marker-selected run: nothing was left out by a marker")
    lost = sorted(tier_modules["deselected"] - tier_modules["kept"] - SLOW_ONLY)
    assert not lost, f"test modules with every case in the slow tier (keep one fast, or list it in SLOW_ONLY): {lost}"
