"""The W&B backend against the real library: offline runs in ``tmp_path``, read back from the
run file (``wandb_runfile``) and compared with the local store of the same hook."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl

wandb = pytest.importorskip("wandb")

from tensorlens.backends.keys import histogram_key, tracker_key  # noqa: E402
from tensorlens.integrations.wandb import (  # noqa: E402
    HEATMAP_COLUMNS,
    HEATMAP_SPEC_PATH,
    PROFILE_COLUMNS,
    WandbBackend,
)

try:  # tests/integrations may or may not be a package
    from .wandb_runfile import RunFile, read_run_dir
except ImportError:
    from wandb_runfile import RunFile, read_run_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # these tests check the whole store arrives: the default payload has tests of its own
    # (test_tracker_payload_wandb.py)
    monkeypatch.setenv("TENSORLENS_TRACKER_STATS", "all")
    yield
    if wandb.run is not None:  # a failed test must not leave its run active for the next one
        wandb.finish()


def start_run(tmp_path: Any, **kwargs: Any) -> Any:
    return wandb.init(dir=str(tmp_path), project="tensorlens-tests", **kwargs)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def train_and_finish(backend: WandbBackend, tmp_path: Any, steps: int) -> tuple[tl.Hook, nn.Module]:
    """``steps`` optimizer steps of :func:`make_model`, each saved, then the hook and the W&B run closed."""
    model = make_model()
    hook = tl.watch(model, save_interval=1, backends=[backend], out_dir=tmp_path / "tl")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    hook.close()
    wandb.finish()
    return hook, model


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def tl_rows(history: list[dict[str, Any]], prefix: str = "tensorlens") -> dict[int, dict[str, Any]]:
    """``{tensorlens/step: row}`` over the rows holding train statistics (each step once)."""
    out: dict[int, dict[str, Any]] = {}
    for row in history:
        if any(k.startswith(f"{prefix}-gradients/") and not k.endswith("_table") for k in row):
            step = row[f"{prefix}/step"]
            assert step not in out, f"step {step} logged twice"
            out[step] = row
    return out


def assert_matches_store(run_file: RunFile, run_dir: str, prefix: str = "tensorlens") -> dict[int, dict[str, Any]]:
    """Every scalar and histogram of every saved train step, exactly as in the local store."""
    rows = tl_rows(run_file.history, prefix)
    with tl.open_run(run_dir) as stored:
        steps = stored.steps("train")
        assert sorted(rows) == steps
        for step in steps:
            row = rows[step]
            expected = stored.scalars(step)
            logged = {k: v for k, v in row.items()  # histograms and tables are dicts
                      if k.startswith(prefix) and not isinstance(v, dict)
                      and k not in (f"{prefix}/step", f"{prefix}/nonfinite_count")}
            assert logged.keys() == {tracker_key(prefix, "train", None, key) for key in expected}
            for key, value in expected.items():
                found = logged[tracker_key(prefix, "train", None, key)]
                assert same(float(found), value), (step, key, found, value)
            for name in stored.tensor_names():
                try:
                    counts, edges = stored.tensor(name).histogram(step)
                except KeyError:
                    continue
                histogram = row[histogram_key(prefix, "train", None, name)]
                assert histogram["_type"] == "histogram"
                assert histogram["values"] == counts.tolist()
                assert histogram["bins"] == edges.tolist()
    return rows


def latest_table(run_file: RunFile, key: str) -> dict[str, Any]:
    values = [row[f"{key}_table"] for row in run_file.history if f"{key}_table" in row]
    assert values, f"no table logged under {key!r}"
    return run_file.table(values[-1])


# ---------------------------------------------------------------------------------------- end to end


def test_auto_backend_matches_local_store_and_keeps_user_rows(tmp_path: Any) -> None:
    run = start_run(tmp_path)
    model, criterion = make_model(), nn.MSELoss()
    hook = tl.watch(model, criterion, save_interval=2, out_dir=tmp_path / "tl")  # backends="auto"
    assert [b.name for b in hook.backends] == ["local", "wandb"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(7):
        loss = criterion(model(torch.randn(16, 6)), torch.randn(16, 3))
        opt.zero_grad()
        loss.backward()
        opt.step()
        hook.flush()  # the record reaches W&B before the user's next row: deterministic rows
        losses.append(loss.item())
        run.log({"loss": losses[-1]})
    model.eval()
    with torch.no_grad():
        criterion(model(torch.randn(4, 6)), torch.randn(4, 3))  # eval step 0: saved
    model.train()
    hook.close()
    assert {k: (v.written, v.failed, v.dropped) for k, v in hook.backend_stats().items()} == {
        "local": (5, 0, 0), "wandb": (5, 0, 0)}
    wandb.finish()

    run_file = read_run_dir(str(tmp_path))
    assert {"name": "tensorlens/step", "glob_name": "", "step_metric": ""} in run_file.metrics
    assert {"name": "", "glob_name": "tensorlens*", "step_metric": "tensorlens/step"} in run_file.metrics

    rows = assert_matches_store(run_file, hook.run_dir)
    assert sorted(rows) == [0, 2, 4, 6]

    # the user's rows: every loss once, in order, at its own _step; tensorlens merged into the
    # row that was open when its record arrived and touched nothing of the user's
    user_rows = [row for row in run_file.history if "loss" in row]
    assert [row["loss"] for row in user_rows] == losses
    assert [row["_step"] for row in user_rows] == list(range(7))
    for step, row in rows.items():
        assert row["_step"] == step and row["loss"] == losses[step]

    # eval records: their own keys and mode step, against the global step
    with tl.open_run(hook.run_dir) as stored:
        eval_scalars = stored.scalars(0, mode="eval")
    assert eval_scalars.keys() == {"losses/mseloss"}
    eval_rows = [row for row in run_file.history if "tensorlens-eval-losses/mseloss" in row]
    assert len(eval_rows) == 1
    assert eval_rows[0]["tensorlens-eval-losses/mseloss"] == eval_scalars["losses/mseloss"]
    assert eval_rows[0]["tensorlens-eval/step"] == 0 and eval_rows[0]["tensorlens/step"] == 7

    # the per-layer profile: logged at the first saved step and completed at close()
    profile = latest_table(run_file, "tensorlens-gradients/per-layer/l2")
    assert profile["columns"] == list(PROFILE_COLUMNS)
    names = [name for name, _ in model.named_parameters()]
    with tl.open_run(hook.run_dir) as stored:
        expected = [[step, depth, name, stored.tensor(f"gradients/{name}").reduction_value(step, "l2")]
                    for step in (0, 2, 4, 6) for depth, name in enumerate(names)]
    assert profile["data"] == expected
    panel = run_file.config["_wandb"]["visualize"]["tensorlens-gradients/per-layer/l2"]["panel_config"]
    assert panel["panelDefId"] == "wandb/line/v0"
    assert panel["fieldSettings"] == {"x": "depth", "y": "value", "stroke": "step"}
    assert len([row for row in run_file.history if "tensorlens-gradients/per-layer/l2_table" in row]) == 2


def test_extra_step_keys_get_rows_of_their_own_next_to_a_logger(tmp_path: Any) -> None:
    """What WandbLogger does: ``*`` plotted against trainer/global_step, one committed row per
    log_metrics call. Tensorlens rows carry their own step in that key and never share a row."""
    run = start_run(tmp_path)
    run.define_metric("trainer/global_step")
    run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
    backend = WandbBackend(run=run, extra_step_keys=("trainer/global_step",), table_every=2, table_interval=0,
                           heatmap_tensors=r"^gradients/2\.", heatmap_chart="my-team/tensorlens/histogram-heatmap")
    model = make_model()
    hook = tl.watch(model, save_interval=1, backends=[backend], out_dir=tmp_path / "tl")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(5):  # no hook.flush(): rows interleave however the threads run
        loss = model(torch.randn(8, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log({"train_loss": loss.item(), "trainer/global_step": step})
    hook.close()
    wandb.finish()

    run_file = read_run_dir(str(tmp_path))
    rows = assert_matches_store(run_file, hook.run_dir)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for row in run_file.history:
        ours = any(k.startswith("tensorlens") for k in row)
        assert not (ours and "train_loss" in row), "a tensorlens row merged into the logger's"
        if ours:
            assert row["trainer/global_step"] == row["tensorlens/step"]
    assert [row["trainer/global_step"] for row in run_file.history if "train_loss" in row] == list(range(5))

    # heatmaps: every saved step's bins of the chosen tensors, as (step, low, high, count)
    with tl.open_run(hook.run_dir) as stored:
        for name in ("gradients/2.weight", "gradients/2.bias"):
            table = latest_table(run_file, tracker_key("tensorlens", "train", None, f"{name}/heatmap"))
            assert table["columns"] == list(HEATMAP_COLUMNS)
            expected = []
            for step in range(5):
                counts, edges = stored.tensor(name).histogram(step)
                expected += [[step, edges[i], edges[i + 1], counts[i]] for i in range(len(counts))]
            assert table["data"] == expected
            panel = run_file.config["_wandb"]["visualize"][tracker_key("tensorlens", "train", None, f"{name}/heatmap")]
            panel = panel["panel_config"]
            assert panel["panelDefId"] == "my-team/tensorlens/histogram-heatmap"
            assert panel["fieldSettings"] == {c: c for c in HEATMAP_COLUMNS}
    assert not any(k.startswith("tensorlens-gradients/0.") and "heatmap" in k for k in run_file.keys())
    # table_every=2 over 5 saved steps: at the 1st, 3rd and 5th; nothing left for close()
    assert len([r for r in run_file.history if "tensorlens-gradients/2.weight/heatmap_table" in r]) == 3


def train_logging_loss(run: Any, tmp_path: Any, steps: int, flush: bool = False) -> tuple[tl.Hook, list[float]]:
    """``steps`` SGD steps of :func:`make_model` watched with the W&B backend (every step saved, no
    histograms), the user logging each loss to ``run`` after the step; ``flush``: each record lands
    before the user's row. Returns the closed hook and the losses."""
    model = make_model()
    hook = tl.watch(model, save_interval=1, backends=["wandb"], out_dir=tmp_path / "tl", histograms=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if flush:
            assert hook.flush()  # the record lands before the user's row is committed
        losses.append(loss.item())
        run.log({"loss": losses[-1]})
    hook.close()
    return hook, losses


def test_records_and_user_rows_all_arrive_when_the_threads_race(tmp_path: Any) -> None:
    """No flush: records reach W&B whenever the backend thread gets to them, between, into or
    after the user's rows. None is lost or overwritten, and neither are the user's."""
    run = start_run(tmp_path)
    hook, losses = train_logging_loss(run, tmp_path, 20)
    wandb.finish()
    run_file = read_run_dir(str(tmp_path))
    assert sorted(assert_matches_store(run_file, hook.run_dir)) == list(range(20))
    assert [row["loss"] for row in run_file.history if "loss" in row] == losses


def test_a_user_committing_every_step_costs_one_step_query_per_record(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run.step`` is a round trip to the W&B service. When the user's own rows move W&B's step
    on, the run's client-side counter says so, and only the read after logging is left."""
    run = start_run(tmp_path)
    reads = []
    step_property = type(run).step
    monkeypatch.setattr(type(run), "step", property(lambda self: reads.append(1) or step_property.fget(self)))
    hook, losses = train_logging_loss(run, tmp_path, 10, flush=True)
    monkeypatch.undo()
    wandb.finish()
    # one read per logged row: 10 records and the tables at close() (21 before: one more per
    # record after the first, asking whether our previous row was closed)
    assert len(reads) == 11
    run_file = read_run_dir(str(tmp_path))
    rows = assert_matches_store(run_file, hook.run_dir)
    assert sorted(rows) == list(range(10))
    for step, row in rows.items():  # each record in the user's row of its step
        assert row["loss"] == losses[step]


def test_user_rows_with_explicit_steps_stay_intact(tmp_path: Any) -> None:
    run = start_run(tmp_path)
    model = make_model()
    hook = tl.watch(model, save_interval=1, backends=["wandb"], out_dir=tmp_path / "tl", histograms=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        loss = model(torch.randn(8, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        hook.flush()
        run.log({"loss": loss.item()}, step=step)  # explicit steps: the row stays open...
        run.log({"acc": step / 10}, step=step)  # ...for a second call at the same step
    hook.close()
    wandb.finish()

    run_file = read_run_dir(str(tmp_path))
    assert run_file.series("acc") == {step: step / 10 for step in range(4)}
    assert len(run_file.series("loss")) == 4
    rows = assert_matches_store(run_file, hook.run_dir)
    assert sorted(rows) == [0, 1, 2, 3]
    assert not any(k.endswith("/histogram") for k in run_file.keys())


def test_records_wait_for_the_next_row_of_a_user_who_passes_step(tmp_path: Any) -> None:
    """Two records arrive while the user's row for step i is open, and the user logs once more
    at step i afterwards. Closing that row for the second record would make W&B drop the
    user's call; the record waits for the user's next row instead (and the rest for close())."""
    run = start_run(tmp_path)
    model = make_model()
    hook = tl.watch(model, save_interval=1, backends=["wandb"], out_dir=tmp_path / "tl", histograms=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        run.log({"loss": float(step)}, step=step)
        for _ in range(2):  # two optimizer steps, two records, within one user step
            model(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            hook.flush()
        run.log({"acc": step / 10}, step=step)
    hook.close()
    wandb.finish()

    run_file = read_run_dir(str(tmp_path))
    assert run_file.series("loss") == {step: float(step) for step in range(4)}
    assert run_file.series("acc") == {step: step / 10 for step in range(4)}  # none dropped
    assert sorted(assert_matches_store(run_file, hook.run_dir)) == list(range(8))


def test_without_user_rows_every_record_keeps_its_own_row(tmp_path: Any) -> None:
    """Nobody else commits: tensorlens closes its own open row before the next record, so no
    record overwrites the previous one in the open row."""
    start_run(tmp_path)
    backend = WandbBackend(table_every=100)
    hook, _ = train_and_finish(backend, tmp_path, steps=4)
    run_file = read_run_dir(str(tmp_path))
    assert sorted(assert_matches_store(run_file, hook.run_dir)) == [0, 1, 2, 3]
    # one profile line per step although the table was logged only at the first step and at close
    profile = latest_table(run_file, "tensorlens-gradients/per-layer/l2")
    assert sorted({row[0] for row in profile["data"]}) == [0, 1, 2, 3]


def test_tables_are_logged_at_most_once_per_table_interval_and_complete_at_close(tmp_path: Any) -> None:
    start_run(tmp_path)
    backend = WandbBackend(table_every=1, table_interval=3600)
    hook, model = train_and_finish(backend, tmp_path, steps=5)
    run_file = read_run_dir(str(tmp_path))
    assert sorted(assert_matches_store(run_file, hook.run_dir)) == [0, 1, 2, 3, 4]
    # table_every=1 alone would log the tables five times: the first saved step and close() only
    logged = [row for row in run_file.history if "tensorlens-gradients/per-layer/l2_table" in row]
    assert len(logged) == 2
    profile = latest_table(run_file, "tensorlens-gradients/per-layer/l2")
    names = [name for name, _ in model.named_parameters()]
    with tl.open_run(hook.run_dir) as stored:
        expected = [[step, depth, name, stored.tensor(f"gradients/{name}").reduction_value(step, "l2")]
                    for step in range(5) for depth, name in enumerate(names)]
    assert profile["data"] == expected


def test_nan_gradients_are_visible(tmp_path: Any) -> None:
    start_run(tmp_path)
    model = make_model()
    hook = tl.watch(model, save_interval=1, backends=["wandb"], out_dir=tmp_path / "tl")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: NaN gradients leave the weights finite
    for step in range(3):
        x = torch.randn(8, 6)
        if step == 1:
            x[0, 0] = float("nan")  # NaN in some of the first layer's gradient entries
        if step == 2:
            x[:] = float("inf")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    hook.close()
    wandb.finish()

    run_file = read_run_dir(str(tmp_path))
    rows = assert_matches_store(run_file, hook.run_dir)  # NaN equals NaN, Inf equals Inf
    assert rows[0]["tensorlens-gradients/0.weight/nan_count"] == 0
    assert rows[1]["tensorlens-gradients/0.weight/nan_count"] > 0
    assert math.isnan(rows[1]["tensorlens-gradients/0.weight/l2"])
    assert rows[2]["tensorlens-gradients/2.weight/nan_count"] == 24
    with tl.open_run(hook.run_dir) as stored:
        nan_count = stored.tensor("gradients/0.weight").reduction_value(1, "nan_count")
    assert rows[1]["tensorlens-gradients/0.weight/nan_count"] == nan_count


# ---------------------------------------------------------------------------------------- errors, laziness


def test_missing_active_run_is_a_clear_error(tmp_path: Any) -> None:
    assert wandb.run is None
    with pytest.raises(RuntimeError, match=r"No active W&B run: call wandb\.init\(\.\.\.\) before tl\.watch"):
        WandbBackend().open(tl.RunInfo("r", str(tmp_path)))
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook = tl.watch(model, save_interval=1, backends=["wandb"], out_dir=tmp_path / "tl")
        model(torch.randn(2, 6)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        hook.close()
    assert any("No active W&B run" in str(w.message) for w in caught)
    stats = hook.backend_stats()
    assert (stats["wandb"].written, stats["wandb"].failed) == (0, 1)
    assert stats["local"].written == 1  # the local store is unaffected


def test_run_finished_before_close_is_named(tmp_path: Any) -> None:
    start_run(tmp_path)
    model = make_model()
    hook = tl.watch(model, save_interval=1, backends=[WandbBackend(table_every=100)], out_dir=tmp_path / "tl")
    model(torch.randn(2, 6)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    hook.flush()
    wandb.finish()  # too early: the profile table of the last steps is still to come
    # the warning comes from the backend's thread when it writes the next step, which may be
    # before close(): catch from the step on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 6)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        hook.close()
    messages = [str(w.message) for w in caught]
    assert any("W&B run is already finished" in m and "call hook.close() before wandb.finish()" in m for m in messages)
    stats = hook.backend_stats()
    assert (stats["wandb"].written, stats["wandb"].failed) == (1, 1)
    assert stats["local"].written == 2


def test_disabled_run_is_skipped(tmp_path: Any) -> None:
    run = wandb.init(mode="disabled")
    model = make_model()
    hook = tl.watch(model, save_interval=1, out_dir=tmp_path / "tl")  # auto: the NoopRun is active
    assert [b.name for b in hook.backends] == ["local", "wandb"]
    model(torch.randn(2, 6)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    hook.close()
    run.finish()
    assert hook.backend_stats()["wandb"].written == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefix": ""}, "Expected `prefix` to be a non-empty string"),
        ({"prefix": "a/"}, "Expected `prefix` to be"),
        ({"histograms": 1}, "Expected `histograms` to be a bool, but got 1"),
        ({"extra_step_keys": [""]}, "Expected `extra_step_keys` to be"),
        ({"table_every": 0}, "Expected `table_every` to be an integer >= 1, but got 0"),
        ({"table_interval": -1}, "Expected `table_interval` to be a number of seconds >= 0, but got -1"),
        ({"table_interval": "60"}, "Expected `table_interval` to be a number of seconds >= 0"),
        ({"profile": ("gradients",)}, "Expected `profile` to be \"panels\", None or a pair"),
        ({"heatmap_tensors": "("}, "Expected `heatmap_tensors` to be"),
        ({"heatmap_tensors": [1]}, "Expected `heatmap_tensors` to be"),
        ({"run": object()}, "Expected `run` to be None or a wandb Run"),
    ],
)
def test_arguments_are_checked_eagerly(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        WandbBackend(**kwargs)


def test_import_is_lazy_and_a_missing_wandb_names_the_extra() -> None:
    code = (
        "import sys\n"
        "import tensorlens, tensorlens.cli, tensorlens.integrations.wandb as tlw\n"
        "assert 'wandb' not in sys.modules, 'wandb imported at module import'\n"
        "sys.modules['wandb'] = None  # as if it were not installed\n"
        "try:\n"
        "    tlw.WandbBackend()\n"
        "except ImportError as err:\n"
        "    print('ERR', err)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERR The W&B backend needs the `wandb` package: pip install 'tensorlens[wandb]'" in proc.stdout


# ---------------------------------------------------------------------------------------- chart spec, CLI


def test_heatmap_spec_uses_the_table_columns() -> None:
    with open(HEATMAP_SPEC_PATH, encoding="utf-8") as f:
        text = f.read()
    spec = json.loads(text)
    assert spec["data"] == {"name": "wandb"}
    assert spec["$schema"].startswith("https://vega.github.io/schema/vega-lite/")
    for column in HEATMAP_COLUMNS:
        assert f"${{field:{column}}}" in text
    assert "${string:title}" in text


def test_install_chart_command_offline_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    from tensorlens.cli import main

    assert main(["wandb-install-chart", "--entity", "my-team"]) == 1
    out = capsys.readouterr().out
    assert "my-team/tensorlens/histogram-heatmap was not installed" in out
    assert "--print-spec" in out
    assert main(["wandb-install-chart", "--entity", "my-team", "--print-spec"]) == 0
    with open(HEATMAP_SPEC_PATH, encoding="utf-8") as f:
        assert json.loads(capsys.readouterr().out) == json.load(f)
