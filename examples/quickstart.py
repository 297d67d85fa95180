"""Quickstart: watch a small model on synthetic data (CPU, a few seconds), then read the run back.

    python examples/quickstart.py
"""

from __future__ import annotations

import torch
from torch import nn

import tensorlens as tl


def main(steps: int = 300) -> str:
    tl.setup()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    teacher = torch.randn(32, 10)

    # One line: weights, biases, gradients and the loss every 50 steps, plus activations.
    with tl.watch(model, loss_fn, save_interval=50, activations=True) as hook:
        for _ in range(steps):
            x = torch.randn(64, 32)
            y = (x @ teacher).argmax(dim=1)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    run = tl.open_run(hook.run_dir)
    print(f"run folder: {hook.run_dir}")
    print(f"saved steps: {run.steps()}")
    print(f"gradient tensors: {run.tensor_names(collection='gradients')}")
    grad = run.tensor("gradients/0.weight")
    for step in run.steps():
        counts, edges = grad.histogram(step=step)
        print(
            f"step {step:4d}  loss {run.tensor('losses/crossentropyloss').value(step):.3f}  "
            f"grad l2 {grad.reduction_value(step, 'l2'):.4f}  grad max|x| {grad.reduction_value(step, 'max', abs=True):.4f}  "
            f"relu dead fraction {run.tensor('activations/1').reduction_value(step, 'zero_fraction'):.2f}  "
            f"histogram peak bin [{edges[counts.argmax()]:.4f}, {edges[counts.argmax() + 1]:.4f})"
        )
    return hook.run_dir


if __name__ == "__main__":
    main()
