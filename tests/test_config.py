"""Configs: SageMaker Debugger's save semantics and eager, uniform validation."""

from __future__ import annotations

import pytest

import tensorlens as tl
from tensorlens.config import HistogramConfig, ReductionConfig, SaveConfig, SaveConfigMode


def saved(config: SaveConfig, mode=tl.modes.TRAIN, upto: int = 30) -> list[int]:
    return [s for s in range(upto) if config.should_save(mode, s)]


def test_save_interval_within_start_and_end() -> None:
    # smdebug: a step is saved when step % save_interval == 0 within [start_step, end_step)
    assert saved(SaveConfig(save_interval=10)) == [0, 10, 20]
    assert saved(SaveConfig(save_interval=5, start_step=7, end_step=20)) == [10, 15]
    assert saved(SaveConfig(save_interval=1, start_step=3, end_step=6)) == [3, 4, 5]
    # SageMaker Debugger's documented examples
    assert saved(SaveConfig(save_interval=100, start_step=150), upto=400) == [200, 300]
    assert saved(SaveConfig(save_steps=[3, 7]), upto=1001) == [0, 3, 7, 500, 1000]
    assert SaveConfig().modes[tl.modes.TRAIN].save_interval == 500  # SageMaker Debugger's default


def test_save_steps_are_unioned() -> None:
    assert saved(SaveConfig(save_interval=10, save_steps=[3, 7])) == [0, 3, 7, 10, 20]
    # listed steps are saved even outside the [start, end) window
    assert saved(SaveConfig(save_interval=10, start_step=10, end_step=15, save_steps=[2, 25])) == [2, 10, 25]


def test_per_mode_overrides() -> None:
    cfg = SaveConfig(save_interval=10, mode_save_configs={tl.modes.EVAL: SaveConfigMode(save_interval=1), "predict": SaveConfigMode(save_interval=3)})
    assert saved(cfg, tl.modes.TRAIN) == [0, 10, 20]
    assert saved(cfg, tl.modes.EVAL, 4) == [0, 1, 2, 3]
    assert saved(cfg, tl.modes.PREDICT, 7) == [0, 3, 6]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SaveConfig(save_interval=0), "Expected `save_interval` to be an integer >= 1, but got 0"),
        (lambda: SaveConfig(save_interval=2.5), "Expected `save_interval`"),
        (lambda: SaveConfig(start_step=-1), "Expected `start_step`"),
        (lambda: SaveConfig(start_step=5, end_step=3), "Expected `end_step`"),
        (lambda: SaveConfig(save_steps=[1, -2]), "Expected `save_steps`"),
        (lambda: SaveConfig(mode_save_configs={"training": SaveConfigMode()}), "Expected `mode`"),
        (lambda: SaveConfig(mode_save_configs={"eval": 3}), "SaveConfigMode"),
        (lambda: ReductionConfig(reductions=["mean", "average"]), "Expected `reductions` to be a list drawn from"),
        (lambda: ReductionConfig(norms=["l3"]), "Expected `norms`"),
        (lambda: ReductionConfig(save_raw_tensor="yes"), "Expected `save_raw_tensor` to be a bool"),
        (lambda: HistogramConfig(bins=513), "Expected `bins` to be an integer in [0, 512], but got 513"),
        (lambda: HistogramConfig(range=(1.0, 0.0)), "Expected `range`"),
        (lambda: HistogramConfig(range=(0.0, float("inf"))), "Expected `range`"),
        (lambda: HistogramConfig(sample=0), "Expected `sample`"),
        (lambda: HistogramConfig(reject_outliers=1.0), "Expected `reject_outliers`"),
        (lambda: SaveConfig(bogus=1), "unexpected keyword"),
    ],
)
def test_bad_values_fail_at_construction(make, message: str) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        make()
    assert message in str(info.value)


def test_reduction_config_stat_names() -> None:
    cfg = ReductionConfig(reductions=["min", "max"], abs_reductions=["max"], norms=["l2"], abs_norms=["l1"], counts=["zero_fraction"])
    assert cfg.stat_names() == ("min", "max", "l2", "abs_max", "abs_l1", "zero_fraction", "numel", "nan_count", "inf_count")


def test_configs_are_frozen() -> None:
    cfg = ReductionConfig()
    with pytest.raises(AttributeError):
        cfg.reductions = ("min",)  # type: ignore[misc]


def test_hook_arguments_fail_at_construction(tmp_path) -> None:
    with pytest.raises(ValueError, match="Expected `include_workers`"):
        tl.Hook(out_dir=tmp_path, include_workers="some")
    with pytest.raises(ValueError, match="Expected `save_config` to be a tl.SaveConfig"):
        tl.Hook(out_dir=tmp_path, save_config={"save_interval": 3})
    with pytest.raises(ValueError, match="Expected `backends`"):
        tl.Hook(out_dir=tmp_path, backends=["no-such-backend"])
    with pytest.raises(ValueError, match="Expected `log`"):
        tl.watch(__import__("torch").nn.Linear(2, 2), log="weights", out_dir=tmp_path)
