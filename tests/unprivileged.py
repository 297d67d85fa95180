"""Running a child process as ``nobody`` (root reads every file whatever its mode, so the tests of
unreadable and read-only folders run their reader as an unprivileged user)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

NOBODY_ID = 65534
NOBODY = ["setpriv", f"--reuid={NOBODY_ID}", f"--regid={NOBODY_ID}", "--clear-groups"]


@functools.cache
def can_run_as_nobody() -> bool:
    """Root with ``setpriv``, and ``nobody`` can import tensorlens with this Python: a checkout in a
    private folder (``mktemp -d`` makes it 0700) is out of its reach, and every test would fail
    with "No module named tensorlens" instead of testing anything."""
    if sys.platform == "win32" or os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    probe = subprocess.run([*NOBODY, sys.executable, "-c", "import tensorlens"], capture_output=True, timeout=120)
    return probe.returncode == 0


def as_nobody(argv: list[str]) -> list[str]:
    return [*NOBODY, *argv]
