"""tensorlens with DistributedDataParallel: two CPU processes (gloo), statistics of the whole batch.

Each rank trains on its own half of every batch. With the default ``include_workers="reduce"``
the ranks merge their partial statistics with collectives on the steps that are saved, and rank 0
records statistics of the global batch (activations) and of the replicated model (weights and
gradients, which DDP has already averaged). Run it with::

    python examples/ddp.py [RUN_DIR]      # default: a new temporary folder

It needs no GPU and no tracker account and takes a few seconds.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tensorlens as tl

WORLD_SIZE = 2
STEPS = 20
BATCH = 32  # global batch; each rank takes BATCH // WORLD_SIZE rows


def train(rank: int, world_size: int, port: int, run_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)
    # Every rank creates the hook: "reduce" makes collectives, so all ranks must take part.
    hook = tl.watch(ddp, activations=True, save_interval=5, out_dir=run_dir, backends=["local"])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1234)
    true_weights = torch.randn(8, 1, generator=generator)
    for _ in range(STEPS):
        x = torch.randn(BATCH, 8, generator=generator)
        y = x @ true_weights + 0.1 * torch.randn(BATCH, 1, generator=generator)
        rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
        loss = nn.functional.mse_loss(ddp(x[rows]), y[rows])
        hook.save_scalar("loss", loss)  # a plain scalar is recorded as rank 0's own value
        loss.backward()
        optimizer.step()  # the hook reads weights and (all-reduced) gradients here
        optimizer.zero_grad()
    hook.close()  # on every rank, before the process group goes away
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(run_dir: str | None = None) -> None:
    run_dir = os.path.abspath(run_dir) if run_dir else os.path.join(tempfile.mkdtemp(prefix="tensorlens-ddp-"), "run")
    mp.spawn(train, args=(WORLD_SIZE, _free_port(), run_dir), nprocs=WORLD_SIZE, join=True)

    with tl.open_run(run_dir) as run:
        print(f"run folder: {run_dir}")
        print(f"workers: {run.workers()}  (one merged record per saved step)")
        first = run.tensor("activations/0")
        print(f"steps with activations (save_interval=5): {first.steps()}; the loss, saved by hand: every step")
        for step in first.steps():
            numel = first.reduction_value(step=step, name="numel")
            mean = first.reduction_value(step=step, name="mean")
            dead = run.tensor("activations/1").reduction_value(step=step, name="zero_fraction")
            grad = run.tensor("gradients/0.weight").reduction_value(step=step, name="l2")
            loss = run.tensor("scalars/loss").value(step=step)
            print(
                f"step {step:2d}: activations/0 over {int(numel)} values (both ranks) mean={mean:+.4f}  "
                f"relu zero_fraction={dead:.3f}  |grad fc1|={grad:.4f}  loss(rank 0)={loss:.4f}"
            )


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
