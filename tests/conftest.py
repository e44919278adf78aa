"""Fixtures shared by the test modules (the device setup is the repository's conftest.py)."""

from __future__ import annotations

import pytest

import jaxpar
from jaxpar._src.executable_cache import flush


@pytest.fixture
def cache_dir(tmp_path):
    """A fresh ``jaxpar.config.plan_cache_dir`` for one test (restored after)."""
    before = jaxpar.config.plan_cache_dir
    jaxpar.config.update("plan_cache_dir", str(tmp_path / "plans"))
    yield tmp_path / "plans"
    flush()  # executables still being written (in the background) go to this test's directory
    jaxpar.config.update("plan_cache_dir", before)
