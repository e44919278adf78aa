"""Headless Chromium for report tests: the page's DOM after its scripts ran, console output,
and screenshots.

Chromium comes from the system packages (Debian: ``apt-get install -y chromium``; ``make test``
installs it when missing).  Under CI (``CI`` set) and under ``make test``
(``JAXPAR_REQUIRE_BROWSER=1``) a missing browser fails the tests that need it; elsewhere they
are skipped with that instruction.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--enable-logging=stderr", "--v=0")
_CONSOLE = re.compile(r":CONSOLE[:(]\d*\)?\]? ?(.*)")


def chromium() -> str:
    """The browser's path; fails under CI, skips elsewhere, when there is none."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    message = ("Chromium is not installed: apt-get install -y chromium (make test installs it "
               "when missing)")
    if os.environ.get("CI") or os.environ.get("JAXPAR_REQUIRE_BROWSER"):
        pytest.fail(message)
    pytest.skip(message)
    raise AssertionError  # unreachable


@dataclasses.dataclass(frozen=True)
class Page:
    dom: str
    console: tuple[str, ...]  # every console message the page printed
    stderr: str


def load(path: str, *, budget_ms: int = 8000, timeout: float = 180.0) -> Page:
    """Opens ``path`` and returns the DOM once its scripts ran (``--dump-dom``)."""
    proc = _run([f"--virtual-time-budget={budget_ms}", "--dump-dom",
                 "file://" + os.path.abspath(path)], timeout)
    console = tuple(m.group(1) for line in proc.stderr.splitlines()
                    if (m := _CONSOLE.search(line)))
    return Page(proc.stdout, console, proc.stderr)


def screenshot(path: str, png: str, *, width: int = 1300, height: int = 2600,
               timeout: float = 180.0) -> None:
    """Writes a PNG of the page as a browser window of the given size shows it."""
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    _run([f"--window-size={width},{height}", "--virtual-time-budget=4000",
          f"--screenshot={os.path.abspath(png)}", "file://" + os.path.abspath(path)], timeout)
    assert os.path.getsize(png) > 10_000, "the screenshot is (nearly) empty"


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    exe = chromium()
    with tempfile.TemporaryDirectory(prefix="jaxpar-chromium-") as profile:
        return subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout, check=False)
