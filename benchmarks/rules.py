"""What the rules cost: per rule, the time to check one saved step's record; and how fast a stored
run is read by ``R.invoke``, ``R.compare_runs`` and the Trial API.

Run it from the repository root::

    python benchmarks/rules.py                  # the MLP of benchmarks/overhead.py (8 x 512)
    python benchmarks/rules.py --layers 4 --width 256 --steps 10

Method: one real training run (an MLP, Adam, every step saved with weights, biases, gradients,
activations, updates and losses, 64-bin histograms) is stored once. Each rule then checks every
record of it in this process (``rule.evaluate(record)``, the call the online runner makes on its
background thread), and the median time per record is reported; the runner's own overhead on
the training thread is one ``take_action()`` call per step (a lock and an empty list). Offline
numbers include reading the records back from SQLite. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorlens as tl  # noqa: E402
from tensorlens import rules as R  # noqa: E402


def make_run(path: str, layers: int, width: int, steps: int) -> None:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(width, 10))
    hook = tl.Hook(out_dir=path, save_config=tl.SaveConfig(save_interval=1), backends=["local"],
                   include_collections=["weights", "biases", "gradients", "activations", "updates", "losses"])
    loss_fn = nn.CrossEntropyLoss()
    hook.register_module(model).register_loss(loss_fn)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, width), torch.randint(0, 10, (64,))
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    hook.close()


def rules() -> list[R.Rule]:
    return [
        R.VanishingGradient(), R.ExplodingTensor(), R.NonFiniteGradient(), R.GradientNormSpike(),
        R.LossNotDecreasing(), R.DeadRelu(), R.AllZero(collection_names="gradients"),
        R.TensorVariance(collection_names="weights", max_threshold=10), R.UnchangedTensor(collection_names="weights,biases"),
        R.WeightUpdateRatio(), R.UpdateRatioOutOfRange(), R.PoorWeightInitialization(), R.Overtraining(),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "run")
        make_run(path, args.layers, args.width, args.steps)
        run = tl.open_run(path)
        records = list(run.records())
        print(f"{len(records)} records of {len(records[0].scalar_names)} scalars and {len(records[0].histogram_names)} histograms")
        print(f"{'rule':<28} {'median us/record':>17}")
        for rule in rules():
            times = []
            for record in records:
                started = time.perf_counter()
                rule.evaluate(record)
                times.append(time.perf_counter() - started)
            print(f"{rule.name:<28} {1e6 * statistics.median(times):>17.0f}")

        started = time.perf_counter()
        R.invoke(run, rules())
        elapsed = time.perf_counter() - started
        print(f"R.invoke, {len(rules())} rules over the stored run: {elapsed:.3f} s ({len(records) / elapsed:.0f} records/s)")
        started = time.perf_counter()
        result = R.compare_runs(path, path)
        elapsed = time.perf_counter() - started
        print(f"R.compare_runs of the run with itself: {elapsed:.3f} s ({result.steps_compared / elapsed:.0f} record pairs/s)")
        trial = R.create_trial(path)
        name = trial.tensor_names(collection="gradients")[0]
        started = time.perf_counter()
        for step in trial.steps():
            trial.tensor(name).reduction_value(step, "l2")
        elapsed = time.perf_counter() - started
        print(f"Trial reduction_value: {1e3 * elapsed / len(trial.steps()):.2f} ms per call")
        run.close()


if __name__ == "__main__":
    main()
