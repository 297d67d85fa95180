"""What a tracker receives (issue 24), with the real libraries: W&B offline (the run file read back)
and TensorBoard event files.

- GPT-2 124M from ``GPT2Config()`` (148 parameter tensors), one or two steps: ``tl.watch`` defaults
  send at most 400 distinct keys per tracker, ``activations=True, dynamics=True`` at most 1,200;
  keys group by collection with the global section first; the user's keys stay as they were; the
  global statistics are found under their documented names.
- A small GPT-2: ``tracker_stats="all"`` equals the store; two runs send the same keys; a NaN shows
  in the global count and in the tensor's own series from the step it appears; the per-layer panels
  hold the stored values; the environment variable and the per-backend override.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tensorlens as tl

wandb = pytest.importorskip("wandb")
pytest.importorskip("tensorboard")
transformers = pytest.importorskip("transformers")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    HISTOGRAMS,
    SCALARS,
    TENSORS,
    EventAccumulator,
)

from tensorlens.backends.keys import histogram_key, panel_key, tracker_key  # noqa: E402
from tensorlens.backends.payload import TRACKER_STATS_ENV  # noqa: E402
from tensorlens.integrations.tensorboard import TensorBoardBackend  # noqa: E402
from tensorlens.integrations.wandb import WandbBackend  # noqa: E402

try:  # tests/integrations may or may not be a package
    from .wandb_runfile import RunFile, read_run_dir
except ImportError:
    from wandb_runfile import RunFile, read_run_dir

#: W&B's own history columns
W_AND_B_COLUMNS = {"_step", "_runtime", "_timestamp"}
USER_KEY = "train/loss"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv(TRACKER_STATS_ENV, raising=False)
    yield
    if wandb.run is not None:
        wandb.finish()


@pytest.fixture(scope="module")
def gpt2_124m() -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    assert len(list(model.parameters())) == 148
    return model


def small_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32))


def train_and_read(
    tmp_path: Any, model: torch.nn.Module, steps: int, nan_at: int | None = None, **watch: Any
) -> tuple[RunFile, EventAccumulator, str]:
    """Train ``model`` for ``steps`` steps with W&B and TensorBoard attached; the run file, the
    events and the run folder."""
    run = wandb.init(dir=str(tmp_path), project="tensorlens-tests")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch.setdefault("backends", ["wandb", "tensorboard"])
    hook = tl.watch(model, save_interval=1, out_dir=tmp_path / "tl", **watch)
    if nan_at is not None:
        # after tensorlens read the gradients (its global pre-hook runs first): keep the weights finite,
        # so only the one tensor ever holds a NaN
        def finite_grads(*_: Any) -> None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.nan_to_num_(0.0)

        opt.register_step_pre_hook(finite_grads)
    vocab = model.config.vocab_size
    for step in range(steps):
        ids = torch.randint(0, vocab, (2, 6))
        loss = model(ids, labels=ids).loss
        loss.backward()
        if step == nan_at:  # a NaN in one gradient entry, from this step on
            first = next(model.parameters())
            first.grad.view(-1)[0] = float("nan")
        opt.step()
        opt.zero_grad()
        run.log({USER_KEY: float(loss)})
    hook.close()
    assert all(s.failed == 0 for s in hook.backend_stats().values())
    wandb.finish()
    events = EventAccumulator(os.path.join(hook.run_dir, "tensorboard"), size_guidance={SCALARS: 0, HISTOGRAMS: 0, TENSORS: 0})
    if os.path.isdir(os.path.join(hook.run_dir, "tensorboard")):
        events.Reload()
    return read_run_dir(str(tmp_path)), events, hook.run_dir


def wandb_keys(run_file: RunFile) -> set[str]:
    """Every distinct key tensorlens sent to W&B (history and summary), the user's left out."""
    keys = {k for row in run_file.history for k in row} | set(run_file.summary)
    return {k for k in keys - W_AND_B_COLUMNS if k != USER_KEY and not k.startswith("_")}


def tensorboard_tags(events: EventAccumulator) -> set[str]:
    """Every card's tag (the custom-scalars layout is configuration, not a card)."""
    tags = events.Tags()
    return (set(tags["scalars"]) | set(tags["histograms"]) | set(tags["tensors"])) - {"custom_scalars__config__"}


def sections(keys: set[str]) -> list[str]:
    return sorted({k.split("/", 1)[0] for k in keys})


# ---------------------------------------------------------------------------------------- GPT-2 124M budgets


def test_gpt2_124m_defaults_stay_within_400_keys_grouped_by_collection(tmp_path: Any, gpt2_124m: torch.nn.Module) -> None:
    run_file, events, _ = train_and_read(tmp_path, gpt2_124m, steps=1)
    for keys in (wandb_keys(run_file), tensorboard_tags(events)):
        assert 296 <= len(keys) <= 400, len(keys)
        # what wandb.watch users expect: a histogram of every parameter's weights and gradients
        for name, _ in gpt2_124m.named_parameters():
            collection = "biases" if name.endswith("bias") else "weights"
            assert histogram_key("tensorlens", "train", None, f"{collection}/{name}") in keys
            assert histogram_key("tensorlens", "train", None, f"gradients/{name}") in keys
        # one panel per collection and statistic with every layer, not one series per tensor
        assert panel_key("tensorlens", "train", None, "gradients", "l2") in {k.removesuffix("_table") for k in keys}
        per_tensor = [k for k in keys if "/per-layer/" not in k]
        assert not any(k.endswith(("/l2", "/numel", "/nan_count", "/inf_count")) for k in per_tensor)
        # the global section first, then one per collection
        assert sections(keys) == ["tensorlens", "tensorlens-biases", "tensorlens-gradients", "tensorlens-weights"]
    assert run_file.series(USER_KEY)  # the user's own key, as logged
    assert "tensorlens/nonfinite_count" in tensorboard_tags(events)


def test_gpt2_124m_activations_and_dynamics_stay_within_1200_keys(tmp_path: Any, gpt2_124m: torch.nn.Module) -> None:
    run_file, events, run_dir = train_and_read(tmp_path, gpt2_124m, steps=2, activations=True, dynamics=True)
    w_keys, tb_tags = wandb_keys(run_file), tensorboard_tags(events)
    for keys in (w_keys, tb_tags):
        assert len(keys) <= 1200, len(keys)
        assert sections(keys)[0] == "tensorlens"
        assert {"tensorlens-activations", "tensorlens-dynamics", "tensorlens-gradients"} <= set(sections(keys))
    # every global statistic under its documented name, equal to the store
    with tl.open_run(run_dir) as stored:
        for stat in ("grad_norm", "weight_norm", "update_norm", "grad_nonfinite_count"):
            key = f"tensorlens/dynamics/global/{stat}"
            expected = {s: stored.tensor("dynamics/global").reduction_value(s, stat) for s in (0, 1)}
            assert run_file.series(key, "tensorlens/step") == pytest.approx(expected)
            assert {e.step: e.value for e in events.Scalars(key)} == pytest.approx(expected, rel=1e-6)
    assert run_file.series(USER_KEY)


# ---------------------------------------------------------------------------------------- small GPT-2


def test_all_sends_the_whole_store(tmp_path: Any) -> None:
    run_file, events, run_dir = train_and_read(tmp_path, small_gpt2(), steps=2, activations=True, tracker_stats="all")
    keys, tags = wandb_keys(run_file), tensorboard_tags(events)
    with tl.open_run(run_dir) as stored:
        for step in stored.steps("train"):
            for key in stored.scalars(step):
                assert tracker_key("tensorlens", "train", None, key) in keys, key
                assert tracker_key("tensorlens", "train", None, key) in tags, key
            for name in stored.tensor_names():
                try:
                    stored.tensor(name).histogram(step)
                except KeyError:
                    continue  # a plain value
                assert histogram_key("tensorlens", "train", None, name) in keys, name
                assert histogram_key("tensorlens", "train", None, name) in tags, name


def test_two_runs_send_the_same_keys(tmp_path: Any) -> None:
    found = []
    for i in range(2):
        run_file, events, _ = train_and_read(tmp_path / str(i), small_gpt2(), steps=2, activations=True, dynamics=True)
        found.append((wandb_keys(run_file), tensorboard_tags(events)))
    assert found[0] == found[1]


def test_a_nan_shows_from_the_step_it_appears(tmp_path: Any) -> None:
    run_file, events, run_dir = train_and_read(tmp_path, small_gpt2(), steps=3, nan_at=1)
    first = next(iter(dict(small_gpt2().named_parameters())))
    key = tracker_key("tensorlens", "train", None, f"gradients/{first}/nan_count")
    with tl.open_run(run_dir) as stored:
        expected = {s: stored.tensor(f"gradients/{first}").reduction_value(s, "nan_count") for s in (1, 2)}
    assert expected == {1: 1, 2: 0}
    assert run_file.series(key, "tensorlens/step") == expected  # from step 1 on (not at 0), and after it
    assert {e.step: e.value for e in events.Scalars(key)} == expected
    total = run_file.series("tensorlens/nonfinite_count", "tensorlens/step")
    assert total[0] == 0 and total[1] >= expected[1]
    # no other tensor's counts: only the one that held a NaN
    assert [k for k in wandb_keys(run_file) if k.endswith("/nan_count")] == [key]


def test_panels_hold_every_layer_as_stored(tmp_path: Any) -> None:
    model = small_gpt2()
    names = [name for name, _ in model.named_parameters()]
    run_file, events, run_dir = train_and_read(tmp_path, model, steps=2)
    key = panel_key("tensorlens", "train", None, "gradients", "l2")
    tables = [row[f"{key}_table"] for row in run_file.history if f"{key}_table" in row]
    table = run_file.table(tables[-1])
    with tl.open_run(run_dir) as stored:
        expected = [[s, depth, name, stored.tensor(f"gradients/{name}").reduction_value(s, "l2")]
                    for s in (0, 1) for depth, name in enumerate(names)]
        assert table["data"] == expected
        # TensorBoard: one histogram card, layer i the bucket (i, i + 1], its value the height
        for event in events.Histograms(key):
            histo = event.histogram_value
            values = [stored.tensor(f"gradients/{name}").reduction_value(event.step, "l2") for name in names]
            assert histo.bucket == pytest.approx(values)
            assert histo.bucket_limit == [float(i + 1) for i in range(len(names))]
    layers = events.Tensors(f"{key}/layers/text_summary")[0].tensor_proto.string_val[0].decode()
    assert all(f"| {i} | {name} |" in layers for i, name in enumerate(names))


@pytest.mark.parametrize("interval", [None, 4])
def test_parameter_histograms_go_once_per_interval_and_the_store_keeps_every_step(tmp_path: Any, interval: int | None) -> None:
    """The default payload sends the parameters' histograms at the first saved step of every 100
    train steps (``tracker_histogram_interval``), the per-layer panels and global values at every
    saved step; the store keeps every step's histograms."""
    extra = {} if interval is None else {"tracker_histogram_interval": interval}
    run_file, events, run_dir = train_and_read(tmp_path, small_gpt2(), steps=10, **extra)
    first = next(iter(dict(small_gpt2().named_parameters())))
    hist = histogram_key("tensorlens", "train", None, f"gradients/{first}")
    expected = [0] if interval is None else [0, 4, 8]
    assert sorted(run_file.series(hist, "tensorlens/step")) == expected
    assert [e.step for e in events.Histograms(hist)] == expected
    panel = panel_key("tensorlens", "train", None, "gradients", "l2")
    assert [e.step for e in events.Histograms(panel)] == list(range(10))  # every saved step
    assert sorted(run_file.series("tensorlens/nonfinite_count", "tensorlens/step")) == list(range(10))
    with tl.open_run(run_dir) as stored:
        assert [s for s in stored.steps("train") if stored.tensor(f"gradients/{first}").histogram(s) is not None] == list(range(10))


def test_the_environment_chooses_and_an_explicit_choice_wins(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACKER_STATS_ENV, "l2")
    run_file, events, _ = train_and_read(
        tmp_path, small_gpt2(), steps=1,
        backends=[WandbBackend(), TensorBoardBackend(tracker_stats=["l2", "histogram"])],
    )
    w_keys, tb_tags = wandb_keys(run_file), tensorboard_tags(events)
    first = next(iter(dict(small_gpt2().named_parameters())))
    l2 = tracker_key("tensorlens", "train", None, f"gradients/{first}/l2")
    hist = histogram_key("tensorlens", "train", None, f"gradients/{first}")
    assert l2 in w_keys and hist not in w_keys  # the environment: each tensor's l2, nothing else
    assert l2 in tb_tags and hist in tb_tags  # the backend's own choice wins
    assert not any("/per-layer/" in k for k in w_keys | tb_tags)  # a list: no panels
    assert "tensorlens/nonfinite_count" in w_keys  # the global values always go
    monkeypatch.setenv(TRACKER_STATS_ENV, "all")
    run_file, _, _ = train_and_read(tmp_path / "explicit", small_gpt2(), steps=1, backends=["wandb"], tracker_stats="default")
    assert not any(k.endswith("/l2") for k in wandb_keys(run_file))  # the argument wins over the environment


def test_a_bad_choice_fails_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("some", [], ["a/b"], 3):
        with pytest.raises(ValueError, match="Expected `tracker_stats` to be"):
            tl.Options(tracker_stats=bad)
        with pytest.raises(ValueError, match="Expected `tracker_stats` to be"):
            WandbBackend(tracker_stats=bad)
    monkeypatch.setenv(TRACKER_STATS_ENV, "l2,,histogram")
    from tensorlens.backends.payload import resolve_tracker_stats

    assert resolve_tracker_stats() == ("l2", "histogram")
    monkeypatch.setenv(TRACKER_STATS_ENV, "l2;histogram")  # read at run time: one warning, the default
    with pytest.warns(UserWarning, match=TRACKER_STATS_ENV):
        assert resolve_tracker_stats() == "default"


def test_tensorboard_custom_scalars_put_every_layer_in_one_chart(tmp_path: Any) -> None:
    import re

    from tensorboard.plugins.custom_scalar import layout_pb2

    _, events, _ = train_and_read(tmp_path, small_gpt2(), steps=1, dynamics=True, backends=["tensorboard"], tracker_stats="all")
    proto = events.Tensors("custom_scalars__config__")[0].tensor_proto
    layout = layout_pb2.Layout.FromString(proto.string_val[0])
    charts = {(c.title, ch.title): list(ch.multiline.tag) for c in layout.category for ch in c.chart}
    tags = set(events.Tags()["scalars"])

    def matched(chart: tuple[str, str]) -> set[str]:
        return {t for t in tags if any(re.search(p, t) for p in charts[chart])}

    assert matched(("tensorlens", "global norms")) == {
        f"tensorlens/dynamics/global/{n}_norm" for n in ("grad", "weight", "update")}
    gradients_l2 = matched(("tensorlens: every layer", "gradients l2"))
    assert gradients_l2 == {t for t in tags if t.startswith("tensorlens-gradients/") and t.endswith("/l2")}
    assert len(gradients_l2) == len(list(small_gpt2().parameters()))


def test_a_sync_sends_the_payload_chosen_for_it(tmp_path: Any) -> None:
    from tensorlens.sync import sync_run

    model = small_gpt2()
    hook = tl.watch(model, save_interval=1, out_dir=tmp_path / "run", backends=["local"])
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    model(ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    hook.close()
    for name, option in (("default", None), ("l2", ["l2", "histogram"])):
        extra = {} if option is None else {"tracker_stats": option}
        result = sync_run(hook.run_dir, "tensorboard", logdir=str(tmp_path / name), progress=False, **extra)
        events = EventAccumulator(os.path.join(tmp_path / name, result.run_id), size_guidance={SCALARS: 0})
        events.Reload()
        l2 = {t for t in events.Tags()["scalars"] if t.endswith("/l2")}
        assert len(l2) == (0 if option is None else 2 * len(list(model.parameters())))  # weights|biases and gradients
    with pytest.raises(ValueError, match="Expected `tracker_stats`"):
        sync_run(hook.run_dir, "tensorboard", logdir=str(tmp_path / "bad"), progress=False, tracker_stats="l2/x")


def test_a_sync_sends_the_histograms_a_live_run_would(tmp_path: Any) -> None:
    """``sync_run(..., tracker_histogram_interval=)`` and ``tensorlens sync --tracker-histogram-interval``
    send the parameter histograms at the same steps as a live run would; a bad value is a usage error."""
    try:
        from .test_sync_safety import cli
    except ImportError:
        from test_sync_safety import cli
    from tensorlens.sync import sync_run

    model = small_gpt2()
    hook = tl.watch(model, save_interval=1, out_dir=tmp_path / "run", backends=["local"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(5):
        ids = torch.randint(0, model.config.vocab_size, (2, 6))
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    hook.close()
    first = next(iter(dict(model.named_parameters())))
    hist = histogram_key("tensorlens", "train", None, f"gradients/{first}")

    def steps_in(logdir: Any, run_id: str) -> list[int]:
        events = EventAccumulator(os.path.join(logdir, run_id), size_guidance={HISTOGRAMS: 0})
        events.Reload()
        return [e.step for e in events.Histograms(hist)]

    result = sync_run(hook.run_dir, "tensorboard", logdir=str(tmp_path / "default"), progress=False)
    assert steps_in(tmp_path / "default", result.run_id) == [0]
    result = sync_run(hook.run_dir, "tensorboard", logdir=str(tmp_path / "two"), progress=False, tracker_histogram_interval=2)
    assert steps_in(tmp_path / "two", result.run_id) == [0, 2, 4]
    done = cli("sync", hook.run_dir, "--to", "tensorboard", "--logdir", str(tmp_path / "cli"),
               "--tracker-histogram-interval", "1", "--no-progress")
    assert done.returncode == 0, done.stderr
    (run_id,) = os.listdir(tmp_path / "cli")
    assert steps_in(tmp_path / "cli", run_id) == [0, 1, 2, 3, 4]
    bad = cli("sync", hook.run_dir, "--to", "tensorboard", "--logdir", str(tmp_path / "bad"),
              "--tracker-histogram-interval", "0", "--no-progress")
    assert bad.returncode == 2 and "--tracker-histogram-interval" in bad.stderr  # click's usage error
