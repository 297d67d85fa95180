"""`tl.setup()` raises the soft open-file limit to the hard one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import tensorlens as tl

resource = pytest.importorskip("resource")


def test_setup_raises_the_soft_limit_in_a_child_process() -> None:
    script = textwrap.dedent(
        """
        import resource, tensorlens as tl
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        old, new = tl.setup()
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        print(old, new, now, hard)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    old, new, now, hard = map(int, out)
    assert old == 256
    assert new == now
    expected = hard if hard != resource.RLIM_INFINITY else now
    assert now == (min(expected, 10240) if sys.platform == "darwin" else expected)


def test_setup_is_idempotent() -> None:
    first = tl.setup()
    second = tl.setup()
    assert second[0] == second[1] == first[1]
