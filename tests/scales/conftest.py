"""Every scales test must leave torch as it found it: no torch function mode, compiled code not forced eager."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    yield
    assert torch.overrides._get_current_function_mode() is None, "a torch function mode was left active"
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and hasattr(eval_frame, "_stance"):
        assert eval_frame._stance.stance == "default", f"compiler stance left at {eval_frame._stance}"
