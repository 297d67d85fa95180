"""Real training runs for the health summary, the comparison and the explorer marks: one small MLP
trained three ways from the same seed and data, so that the runs are the same until a fault.

- ``healthy``: trains as it should;
- ``dead``: at ``fault_step`` the bias of the layer before the second ReLU is set very negative
  (what a bad update does): that ReLU outputs zero for every sample from then on, nothing before
  it learns any more (a dead-ReLU collapse);
- ``nan``: at ``fault_step`` one input value is NaN: the loss, every gradient and then every
  weight are NaN.

``tools/report_screenshots.py`` trains the same runs (longer, wider) for the images in docs/.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import tensorlens as tl

#: The module whose bias the dead run breaks (its output goes into the ReLU ``DEAD_RELU``).
BROKEN_LAYER = "2"
DEAD_RELU = "3"


def mlp(width: int = 32, depth: int = 2) -> nn.Sequential:
    layers: list[nn.Module] = []
    size = 8
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, 4))


def train(out_dir: str | os.PathLike[str], name: str, fault: str | None = None, fault_step: int = 10,
          steps: int = 24, width: int = 32, depth: int = 2, save_interval: int = 1, lr: float = 0.2,
          hook_api: bool = False) -> str:
    """Train the MLP ``steps`` optimizer steps with ``fault`` (``None``, ``"dead"``, ``"nan"``) at
    ``fault_step``, recorded with ``tl.watch`` (or ``tl.Hook`` with ``hook_api``): activations and
    dynamics on, every ``save_interval`` steps. Returns the run folder."""
    torch.manual_seed(0)
    model = mlp(width, depth)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    folder = os.path.join(os.fspath(out_dir), name)
    if hook_api:
        hook = tl.Hook(out_dir=folder, run_name=name, backends=["local"],
                       include_collections=["weights", "biases", "gradients", "losses", "activations", "dynamics"],
                       save_config=tl.SaveConfig(save_interval=save_interval))
        hook.register_module(model)
        hook.register_loss(loss_fn)
    else:
        hook = tl.watch(model, loss_fn, save_interval=save_interval, activations=True, dynamics=True,
                        backends=["local"], out_dir=folder, run_name=name)
    data = torch.Generator().manual_seed(1)
    teacher = torch.randn(8, 4, generator=data)
    for step in range(steps):
        x = torch.randn(64, 8, generator=data)
        y = (x @ teacher).argmax(1)
        if fault == "nan" and step == fault_step:
            x[0, 0] = float("nan")
        if fault == "dead" and step == fault_step:
            with torch.no_grad():
                model[int(BROKEN_LAYER)].bias.fill_(-50.0)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    hook.close()
    return hook.run_dir


def train_all(out_dir: str | os.PathLike[str], **kwargs: object) -> dict[str, str]:
    """The three runs, by name (``healthy``, ``dead``, ``nan``)."""
    return {"healthy": train(out_dir, "healthy", **kwargs),  # type: ignore[arg-type]
            "dead": train(out_dir, "dead", "dead", hook_api=True, **kwargs),  # type: ignore[arg-type]
            "nan": train(out_dir, "nan", "nan", **kwargs)}  # type: ignore[arg-type]
