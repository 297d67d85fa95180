"""Hugging Face Trainer: one callback records gradients, weights and activations of a tiny GPT-2.

The model is built from a config (no download) and trained on random tokens, with gradient
accumulation, gradient clipping and an evaluation every 10 steps. tensorlens writes to the
trackers of ``report_to`` (here W&B, offline, and TensorBoard) and to its local run store.
CPU, well under a minute.

    python examples/hf_trainer.py [OUT_DIR]        # default: examples/output/hf_trainer/
    tensorboard --logdir examples/output/hf_trainer/trainer/runs

``examples/output/`` is ignored by git.
"""

from __future__ import annotations

import math
import os
import sys

os.environ.setdefault("WANDB_MODE", "offline")  # no account needed; `wandb sync` uploads it later
os.environ.setdefault("WANDB_SILENT", "true")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import tensorlens as tl  # noqa: E402
from tensorlens.integrations.transformers import TensorLensCallback  # noqa: E402

DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output", "hf_trainer")


class RandomTokens(torch.utils.data.Dataset):
    """Sequences of random tokens; the model learns their unigram statistics."""

    def __init__(self, n: int, seed: int, vocab: int = 128, length: int = 32) -> None:
        self.x = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main(out_dir: str = DEFAULT_OUT_DIR) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32))
    os.environ.setdefault("WANDB_DIR", out_dir)
    os.makedirs(out_dir, exist_ok=True)
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "trainer"),
        max_steps=30, per_device_train_batch_size=8, gradient_accumulation_steps=2, learning_rate=3e-3,
        max_grad_norm=0.3, eval_strategy="steps", eval_steps=10, per_device_eval_batch_size=8,
        logging_steps=5, report_to=["wandb", "tensorboard"], save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0,
    )
    # One line: every 5th optimizer step, gradients before the Trainer clips them, the clipped
    # ones too, weights, activations (hooks on saved steps only) and their histograms.
    callback = TensorLensCallback(save_interval=5, activations=True, record_clipped_gradients=True)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(512, 1), eval_dataset=RandomTokens(32, 2),
                      callbacks=[callback])
    trainer.train()
    import wandb

    wandb_dir = os.path.dirname(wandb.run.dir) if wandb.run is not None else None
    wandb.finish()

    # Read the run back from the local store.
    run = tl.open_run(callback.recorder.run_dir)
    print(f"run folder: {callback.recorder.run_dir}")
    print(f"sent to: {[b.name for b in callback.recorder.backends]}")
    print(f"saved train steps: {run.steps('train')}  (trainer.state.global_step = {trainer.state.global_step})")
    # The Trainer logs its own gradient norm (before clipping) at the same global steps.
    logged = {entry["step"]: entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry}
    names = [n for n, _ in model.named_parameters() if f"gradients/{n}" in run.tensor_names()]
    for step in run.steps("train"):
        before = math.sqrt(sum(run.tensor(f"gradients/{n}").reduction_value(step, "l2") ** 2 for n in names))
        after = math.sqrt(sum(run.tensor(f"gradients_clipped/{n}").reduction_value(step, "l2") ** 2 for n in names))
        print(f"step {step:3d}  gradient norm {before:.4f} (Trainer's grad_norm {float(logged[step]):.4f})"
              f" -> after clipping {after:.4f}")
    evals = [(k.step, k.mode_step) for k in run.step_keys() if k.mode == tl.ModeKeys.EVAL]
    print(f"eval records (global step, eval step): {evals}")
    mlp = run.tensor("activations/transformer.h.1.mlp.c_fc")
    print(f"activations/transformer.h.1.mlp.c_fc max at eval steps: "
          f"{ {s: round(v, 3) for s, v in mlp.reduction_values('max', mode='eval').items()} }")
    print(f"run metadata: {run.metadata()['model']['parameters']} parameters, "
          f"per module {run.metadata()['model']['parameters_per_module']}, git {run.metadata()['git']['commit']}")
    if wandb_dir:
        print(f"W&B offline run: {wandb_dir}  (upload: wandb sync {wandb_dir})")


if __name__ == "__main__":
    main(*sys.argv[1:2])
