"""Health at a glance of Hugging Face Trainer runs: a tiny GPT-2 from a config (no downloads)
trained twice from the same seed and data, once at a learning rate 100 times larger. The report
gives each its health card (the loss the callback recorded is read by the loss rules), and "What
differs" ranks the tensors: nothing before the first update (step 0 reads the same weights and
batch), the ranking the same as ``rank_runs`` reads from the stores."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import pytest
import torch

from tensorlens.analysis.compare import rank_runs
from tensorlens.reports import build_report, load_run
from tensorlens.reports.health import run_health

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from tensorlens.integrations.transformers import TensorLensCallback  # noqa: E402

try:
    from .test_health import _cards
except ImportError:
    from test_health import _cards

VOCAB, SEQ = 50, 8


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integrations"))
from tiny_tokens import Tokens  # noqa: E402


def train(tmp_path: Any, name: str, lr: float) -> str:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ))
    args = TrainingArguments(
        output_dir=str(tmp_path / name), run_name=name, per_device_train_batch_size=4, max_steps=8, logging_steps=1,
        learning_rate=lr, lr_scheduler_type="constant", report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, seed=0,
    )
    callback = TensorLensCallback(save_interval=1)
    Trainer(model=model, args=args, train_dataset=Tokens(32, 1, VOCAB, SEQ), callbacks=[callback]).train()
    return callback.run_dir


def test_two_gpt2_runs_under_the_hf_trainer_in_the_report(tmp_path: Any) -> None:
    base, fast = train(tmp_path, "base", 1e-3), train(tmp_path, "fast", 1e-1)
    for path in (base, fast):
        health = run_health(load_run(path))
        assert health.first_nonfinite is None and not {"ExplodingTensor", "NonFiniteGradient"} & {
            r.rule for r in health.fired}
        assert "LossNotDecreasing" in health.rules and all(n.rule != "LossNotDecreasing" for n in health.not_evaluated)
    ranked = rank_runs(base, fast)
    assert ranked and min(d.step for d in ranked) >= 1  # the first optimizer step is where they part
    page = build_report([base, fast]).html
    assert list(_cards(page)) == ["base", "fast"]
    section = page[page.index('id="differences"'):page.index('id="overview"')]
    rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td><td>([^<]*)</td><td>(\d+)</td>", section)
    assert [(r[1], int(r[3])) for r in rows] == [(d.tensor, d.step) for d in ranked]
