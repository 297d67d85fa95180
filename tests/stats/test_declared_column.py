"""A statistic that needs a new partial column is one declaration: a ``Column`` with its
``compute`` and a ``statistic`` over it, in ``stats/registry.py``, and nothing else.

The partial row's layout is fixed when :mod:`tensorlens.stats` is imported, so each check runs in a
fresh interpreter that adds the declarations to the registry first, as an edit of registry.py
would: a ``positive_count`` column (values > 0, merged by sum) and ``positive_fraction``. The
values are checked against numpy on every path a tensor can take: small (shared buffer), stacked,
large, NaN throughout, sparse, merged across pieces, on the compiled kernel's CPU (which leaves
such tensors to the PyTorch path) and with PyTorch ops alone, and end to end through a Hook.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tensorlens.stats.registry import Column

DECLARE = """
import numpy as np
from tensorlens.stats import registry

registry.COLUMNS = registry.COLUMNS + (
    registry.Column("positive_count", "sum", "values > 0", compute=lambda x: (x > 0).sum(1)),
)

@registry.statistic("positive_fraction", ("positive_count",), "fraction of values > 0")
def _(p):
    return np.where(p["count"] == 0, np.nan, p["positive_count"] / np.where(p["count"] == 0, 1.0, p["count"]))
"""


def run(code: str, native: bool) -> None:
    env = dict(os.environ, TENSORLENS_NATIVE="1" if native else "0")
    done = subprocess.run([sys.executable, "-c", DECLARE + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("native", [True, False], ids=["kernel-cpu", "torch-ops"])
def test_partial_rows_compute_the_declared_column_on_every_path(native: bool) -> None:
    run("""
        import math, torch
        from tensorlens.stats import moments
        from tensorlens.stats.torch_rows import SMALL_TENSOR, STACK_TENSOR

        g = torch.Generator().manual_seed(0)
        sizes = [0, 1, 7, SMALL_TENSOR, SMALL_TENSOR + 1, SMALL_TENSOR + 1, STACK_TENSOR + 5, 300_000]
        values = [torch.randn(n, generator=g) for n in sizes]
        values[2][3] = math.nan                                  # a NaN among small ones
        values[5][:] = math.nan                                  # NaN throughout: the flagged shortcut
        values[6][::3] = 0.0
        values.append(torch.randn(5000, generator=g, dtype=torch.float64))
        values.append(torch.arange(-3, 9, dtype=torch.float64))  # an integer tensor's compute dtype
        for cols in (moments.needed_columns(["positive_fraction"]), moments.needed_columns(["positive_fraction", "std", "median"])):
            assert "positive_count" in cols and "positive_count" not in moments.NATIVE_COLUMNS
            rows = moments.partial_rows(values, [cols] * len(values))
            stats = moments.finalize_rows(rows.numpy(), ["positive_fraction", "numel"])
            for i, v in enumerate(values):
                x = v.numpy()
                assert rows[i, moments.COL["positive_count"]].item() == float((x > 0).sum()), (i, len(x))
                want = (x > 0).mean() if x.size else np.nan
                np.testing.assert_array_equal(stats["positive_fraction"][i], want)
        # merged across pieces (micro-batches, ranks): the column's merge rule
        whole = torch.randn(10_000, generator=g)
        pieces = torch.stack([moments.partial_row(p, cols) for p in whole.split([2500, 100, 7400])])
        merged = moments.merge_partials(pieces)
        assert merged[moments.COL["positive_count"]].item() == float((whole > 0).sum())
        # a column nobody asked for stays NaN
        plain = moments.partial_rows([whole], [moments.needed_columns(["mean"])])
        assert math.isnan(plain[0, moments.COL["positive_count"]].item())
    """, native)


def test_the_gpu_path_computes_it_without_waiting_for_the_device() -> None:
    """The path every GPU takes (counts in the first pass) under test_sync_free's counter: a declared
    column adds no read of a value, no data-sized op, no tensor from Python data after the plan."""
    run(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        from test_sync_free import SyncCounter
        from tensorlens.stats import moments
        from tensorlens.stats.torch_rows import TorchRows

        values = [torch.randn(n) for n in (5, 300, 3000, 3000, 100_000)]
        cols = [moments.needed_columns(["positive_fraction", "std"])] * len(values)
        plan = TorchRows([v.numel() for v in values], [v.dtype for v in values], cols, torch.device("cpu"), counts="always")
        plan.run(values)  # the first run finishes the plan (index tensors, built once)
        with SyncCounter() as counter:
            rows = plan.run(values)
        assert not counter.calls, counter.calls
        for i, v in enumerate(values):
            assert rows[i, moments.COL["positive_count"]].item() == float((v > 0).sum())
    """, native=False)


def test_a_sparse_tensor_counts_its_implicit_zeros_through_the_declaration() -> None:
    run("""
        import torch
        from tensorlens.stats import moments
        from tensorlens.stats.sparse import sparse_summary

        dense = torch.tensor([[0.0, 2.0, 0.0], [-1.0, 0.0, 5.0]])
        cols = moments.needed_columns(["positive_fraction"])
        row, _ = sparse_summary(dense.to_sparse(), cols, None, False)
        assert row[moments.COL["positive_count"]].item() == 2.0 and row[moments.COL["count"]].item() == 6.0
        negative = -dense
        row, _ = sparse_summary(negative.to_sparse(), cols, None, False)
        assert row[moments.COL["positive_count"]].item() == 1.0
    """, native=False)


@pytest.mark.parametrize("native", [True, False], ids=["kernel-cpu", "torch-ops"])
def test_a_declared_statistic_is_recorded_end_to_end(native: bool, tmp_path) -> None:
    run(f"""
        import torch
        from torch import nn
        import tensorlens as tl

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 80), nn.ReLU(), nn.Linear(80, 3))
        memory = tl.MemoryBackend()
        hook = tl.Hook(out_dir={str(tmp_path / "run")!r}, backends=[memory],
                       include_collections=["weights", "biases", "gradients", "activations"],
                       reduction_config=tl.ReductionConfig(reductions=["positive_fraction", "mean"]),
                       save_config=tl.SaveConfig(save_interval=1))
        hook.register_module(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        expected = {{}}
        for step in range(2):
            out = model(torch.randn(32, 64))
            out.sum().backward()
            expected[step] = {{f"{{'biases' if n.endswith('bias') else 'weights'}}/{{n}}": (p.detach().numpy() > 0).mean()
                              for n, p in model.named_parameters()}}
            expected[step].update({{f"gradients/{{n}}": (p.grad.numpy() > 0).mean() for n, p in model.named_parameters()}})
            opt.step()
            opt.zero_grad()
        hook.close()
        records = [r for r in memory.records if r.mode == tl.ModeKeys.TRAIN]
        assert [r.step for r in records] == [0, 1]
        for record in records:
            for tensor, want in expected[record.step].items():
                assert record.scalar(tensor, "positive_fraction") == want, (tensor, record.scalar(tensor, "positive_fraction"), want)
            relu = [t for t in record.tensor_names() if t.startswith("activations/") and "1" in t]
            assert relu and all(0.0 <= record.scalar(t, "positive_fraction") <= 1.0 for t in relu)
    """, native)


def test_a_column_is_checked_where_it_is_declared() -> None:
    with pytest.raises(ValueError, match="merge"):
        Column("positive_count", "add", "values > 0")
    with pytest.raises(TypeError, match="compute"):
        Column("positive_count", "sum", "values > 0", compute="x > 0")  # type: ignore[arg-type]
