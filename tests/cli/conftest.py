"""Fixtures for the CLI tests: a small run, one with every statistic, one whose names hold
terminal control sequences (see cli_runs.py)."""

from __future__ import annotations

import pytest
from cli_runs import HOSTILE_NAMES, write_store

from tensorlens.stats.registry import STATISTICS


@pytest.fixture
def small_run(tmp_path) -> str:
    return write_store(str(tmp_path / "runs" / "small"), ["gradients/a.weight", "weights/a.weight"],
                       ("min", "max", "mean", "std", "l2", "nan_count", "inf_count"))


@pytest.fixture
def wide_run(tmp_path) -> str:
    """Every statistic tensorlens knows (27), for two tensors."""
    return write_store(str(tmp_path / "runs" / "wide"), ["gradients/encoder.layers.0.attention.q_proj.weight",
                                                         "weights/b"], tuple(STATISTICS))


@pytest.fixture
def hostile_run(tmp_path) -> str:
    return write_store(str(tmp_path / "runs" / "hostile"), HOSTILE_NAMES, ("l2", "max", "l2\x1b[2J"))
