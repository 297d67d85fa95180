"""A Hugging Face ``Trainer`` DDP run on CPU (two gloo processes) for ``test_transformers.py``.

Usage: ``python transformers_ddp.py OUT_DIR`` with ``torchrun``'s environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); the test starts both ranks.
Each rank trains the same tiny GPT-2 on its half of every batch with gradient accumulation,
clipping and evaluation, and saves what a plain torch capture saw, independent of tensorlens:
its own accumulated gradient of every optimizer step (read by gradient hooks before DDP
averages it) and the outputs of one module on every evaluation batch
(``OUT_DIR/rank<r>.pt``), with the run folder and the backends of its callback.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from tiny_tokens import Tokens  # this script's folder is on sys.path
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from tensorlens.integrations.transformers import TensorLensCallback

VOCAB, SEQ = 50, 8
WATCHED = "transformer.h.0.mlp.c_fc"  # whose eval outputs are captured by the reference hook


class Reference(TrainerCallback):
    """Each optimizer step's local accumulated gradients (the last micro-batch's hook wins) and
    every eval output of ``WATCHED``, captured with plain torch hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.gradients: dict[int, dict[str, torch.Tensor]] = {}
        self.eval_outputs: list[torch.Tensor] = []
        self.step = 0
        for name, param in model.named_parameters():
            param.register_post_accumulate_grad_hook(self._grad_hook(name))
        model.get_submodule(WATCHED).register_forward_hook(self._output_hook)

    def _grad_hook(self, name: str):  # noqa: ANN202
        def hook(param: torch.Tensor) -> None:
            self.gradients.setdefault(self.step, {})[name] = param.grad.detach().double().clone()

        return hook

    def _output_hook(self, module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        if not module.training:
            self.eval_outputs.append(output.detach().double().clone())

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.step = state.global_step + 1  # the global step this optimizer step reaches


def main(out: str) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ))
    reference = Reference(model)
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=4, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2, max_grad_norm=0.05, logging_steps=2,
        report_to=[], use_cpu=True, ddp_backend="gloo", save_strategy="no", disable_tqdm=True, seed=0,
        ddp_find_unused_parameters=False,
    )
    callback = TensorLensCallback(save_interval=1, activations=True, out_dir=os.path.join(out, "run"))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(32, 1, VOCAB, SEQ), eval_dataset=Tokens(8, 2, VOCAB, SEQ),
                      callbacks=[reference, callback])
    trainer.train()
    rank = torch.distributed.get_rank()
    torch.save({"gradients": reference.gradients, "eval_outputs": reference.eval_outputs}, os.path.join(out, f"rank{rank}.pt"))
    recorder = callback.recorder
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({
            "world_size": torch.distributed.get_world_size(), "run_dir": recorder.run_dir,
            "backends": [b.name for b in recorder.backends], "global_step": trainer.state.global_step,
            # what the Trainer logged (the same on every rank: it gathers the loss across ranks)
            "losses": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e},
            "eval_losses": {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e},
        }, f)


if __name__ == "__main__":
    main(sys.argv[1])
