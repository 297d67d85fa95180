"""Reading what a child process wrote to a pseudo-terminal, for the tests that run the CLI in one
(escape sequences from stored names, progress bars that show only on a terminal)."""

from __future__ import annotations

import os
import select
import subprocess
import time


def read_terminal(master: int, proc: subprocess.Popen, timeout: float = 120.0) -> bytes:
    """Everything ``proc`` writes to the terminal whose ``master`` end this is, read while it runs
    (a closed terminal's unread output is lost), until it closes the terminal or exits, or for
    ``timeout`` seconds."""
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)
