"""Fixtures shared by the test modules (the device setup is the repository's conftest.py)."""

from __future__ import annotations

import re

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


_SHARED = re.compile(r"@pytest\.fixture\([^)]*scope=[\"'](module|class|package)")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n``: the tests of a module that defines a module-scoped fixture go to one
    worker, so the fixture is built once; every other test is scheduled alone, in collection
    order.  xdist's ``load`` sent chunks of consecutive tests wherever a worker was free, and
    each worker that got a module's tests built its fixtures: test_program_memory's three
    compiled GPT steps twice in one CI run (22 s and 24 s of setup); test_report's GPT run
    twice in a run of four such files (13 of their 152 CPU s); and near the end of the run,
    where the chunks are two tests, any module's fixtures twice.  (xdist's own ``--dist
    loadgroup`` would do this from markers, but it renames the test ids through an attribute
    pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for
    from xdist.scheduler import LoadScopeScheduling

    grouped: dict[str, bool] = {}

    def shares_fixtures(path: str) -> bool:
        if path not in grouped:
            try:
                text = (config.rootpath / path).read_text()
            except OSError:
                text = ""
            grouped[path] = path.startswith("tests/") and bool(_SHARED.search(text))
        return grouped[path]

    class ByModuleFixture(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if shares_fixtures(path) else nodeid

    config.option.loadscopereorder = False  # collection order: no module's tests jump ahead
    return ByModuleFixture(config, log)
