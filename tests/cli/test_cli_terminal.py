"""Names from a run store reach the terminal as visible text, never as control sequences: checked
through a real pseudo-terminal for show, summary, ls and an error message."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
from cli_runs import ENV, HOSTILE_NAMES, write_store
from terminal_io import read_terminal

#: What a terminal acts on rather than shows (newline aside): C0, DEL, C1, bidi overrides and isolates.
ACTIVE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def run_in_pty(*args: str, columns: int = 200) -> tuple[int, str]:
    """``python -m tensorlens ARGS`` with a pseudo-terminal as stdin, stdout and stderr (so the CLI
    sees a terminal, as a user's shell gives it); returns the exit code and everything it printed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "tensorlens", *args], stdin=slave, stdout=slave, stderr=slave,
                            env=ENV, close_fds=True)
    os.close(slave)
    try:
        printed = read_terminal(master, proc)
        code = proc.wait(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    # the terminal's line discipline turns \n into \r\n: that CR is the terminal's, not the CLI's
    return code, printed.decode("utf-8", "replace").replace("\r\n", "\n")


def assert_inert(text: str) -> None:
    found = sorted({f"U+{ord(c):04X}" for c in ACTIVE.findall(text)})
    assert not found, f"control characters reached the terminal: {found}\n{text!r}"


def test_printable_escapes_each_class() -> None:
    from tensorlens.cli.table import cell, format_table, printable

    assert printable("a\x1b]52;c;eA==\x07b") == "a\\x1b]52;c;eA==\\x07b"  # C0: ESC, BEL
    assert printable("x\ry\tz\x00") == "x\\x0dy\\x09z\\x00"
    assert printable("\x7f\x9b\x85") == "\\x7f\\x9b\\x85"  # DEL, C1 CSI, NEL
    assert printable("\u202etxt\u2066\u2069\u200f\u061c") == "\\u202etxt\\u2066\\u2069\\u200f\\u061c"  # bidi
    assert printable("layer\udc80") == "layer\\udc80"  # a lone surrogate (not encodable)
    assert printable("a\nb") == "a\\x0ab" and printable("a\nb", newlines=True) == "a\nb"
    plain = "gradients/enc.layers.0.weight µ Σ 日本 ✓ \\x1b"
    assert printable(plain) == plain  # printable text and a literal backslash are kept as they are
    assert cell("w\x1b[2J") == "w\\x1b[2J"
    assert all(not ACTIVE.search(line) for line in format_table(["t\x1b[1m", "l2"], [["n\x07", 1.0]]))


def test_show_summary_and_errors_through_a_terminal(tmp_path) -> None:
    run = write_store(str(tmp_path / "hostile"), HOSTILE_NAMES, ("l2", "max", "l2\x1b[2J"))
    code, text = run_in_pty("show", run)
    assert code == 0, text
    assert_inert(text)
    assert "\\x1b]52;c;aGVsbG8=\\x07clip" in text and "\\x1b]0;pwned\\x07title" in text and "over\\x0dwrite" in text
    assert "bidi\\u202etxt.exe" in text and "c1\\x9b31mred" in text
    code, text = run_in_pty("show", run, "--wide")  # the hostile statistic name as a column header
    assert code == 0 and "l2\\x1b[2J" in text
    assert_inert(text)
    code, text = run_in_pty("show", run, "^weights/.*title$")  # one tensor over steps: its name in the first line
    assert code == 0 and "\\x1b]0;pwned" in text
    assert_inert(text)
    code, text = run_in_pty("summary", run, "--regex", "clip")
    assert code == 0 and "\\x1b]52;" in text
    assert_inert(text)
    code, text = run_in_pty("export", run, "-o", "-")  # CSV to a screen: escaped (to a pipe it stays data)
    assert code == 0 and "\\x1b]52;c;aGVsbG8=\\x07clip" in text
    assert_inert(text)
    code, text = run_in_pty("show", run, "no\x1b]0;such\x07tensor")  # the argument echoed in the error
    assert code == 1 and text.startswith("Error: ") and text.count("\n") == 1
    assert_inert(text)
    code, text = run_in_pty("show", run, "--mode", "bogus\x1b[2J")  # click's usage error repeats the value
    assert code == 2
    assert_inert(text)


def test_ls_through_a_terminal(tmp_path) -> None:
    runs = tmp_path / "runs"
    write_store(str(runs / "run\x1b]0;title\x07\x1b[2J"), ["weights/a"], ("l2",))
    os.makedirs(runs / "broken\x1b]52;c;eA==\x07")
    os.symlink(str(tmp_path / "nowhere\x1b[2J"), runs / "broken\x1b]52;c;eA==\x07" / "tensorlens.sqlite")
    code, text = run_in_pty("ls", str(runs))
    assert code == 0, text
    assert_inert(text)
    assert "run\\x1b]0;title\\x07\\x1b[2J" in text and "unreadable:" in text


@pytest.mark.parametrize("columns", [60, 100])
def test_show_fits_the_terminal_it_runs_in(tmp_path, columns: int) -> None:
    run = write_store(str(tmp_path / "r"), ["gradients/encoder.layers.0.attention.q_proj.weight"],
                      ("min", "max", "mean", "std", "l2", "nan_count", "inf_count", "l1", "rms", "abs_max", "median"))
    code, text = run_in_pty("show", run, columns=columns)
    assert code == 0
    lines = text.splitlines()
    assert all(len(line) <= columns for line in lines[1:]), lines
    assert "--wide shows all" in " ".join(lines[-4:])
