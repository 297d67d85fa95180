"""SageMaker Debugger's JSON hook configuration: a hook made from the file records what it says."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens import json_config
from tensorlens.modes import ModeKeys

CONFIG = {
    "LocalPath": None,  # set per test
    "HookParameters": {
        "save_interval": "2",
        "eval.save_interval": "1",
        "reductions": "min, max,abs_mean,   l2_norm",
        "save_all": "false",
        "dry_run": False,
    },
    "CollectionConfigurations": [
        {"CollectionName": "weights", "CollectionParameters": {"save_histogram": "false"}},
        {"CollectionName": "gradients", "CollectionParameters": {"save_interval": "1", "reductions": "abs_l1_norm,std"}},
        {"CollectionName": "losses"},
        {"CollectionName": "labels", "CollectionParameters": {"save_raw_tensor": "true", "save_interval": 1}},
    ],
}


def write(tmp_path: Any, config: dict[str, Any]) -> str:
    path = tmp_path / "debughookconfig.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_a_hook_from_the_file_records_what_it_says(tmp_path: Any) -> None:
    config = {**CONFIG, "LocalPath": str(tmp_path / "run")}
    hook = json_config.create_hook_from_json_file(tl.Hook, write(tmp_path, config), backends=["local"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    loss_fn = nn.CrossEntropyLoss()
    hook.register_module(model).register_loss(loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    for _ in range(4):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        hook.save_tensor("labels", y, collections_to_write="labels")
        opt.step()
    model.eval()
    with torch.no_grad():
        loss_fn(model(x), y)
    hook.close()

    run = tl.open_run(str(tmp_path / "run"))
    assert run.collections() == ["gradients", "labels", "losses", "weights"]  # biases are not named: not recorded
    assert run.tensor("weights/0.weight").steps() == [0, 2]
    assert run.tensor("gradients/0.weight").steps() == [0, 1, 2, 3]
    assert run.tensor("weights/0.weight").reduction_names() == ["abs_mean", "inf_count", "l2", "max", "min", "nan_count", "numel"]
    names = run.tensor("gradients/0.weight").reduction_names()
    # the asked reductions, the counts always recorded, and the histogram's quantiles
    assert [n for n in names if not n.startswith("p")] == ["abs_l1", "inf_count", "nan_count", "numel", "std"]
    assert run.read_tensor("labels/labels", step=3).tensor.tolist() == y.tolist()
    assert run.tensor("losses/crossentropyloss").steps(mode="eval") == [0]
    with pytest.raises(Exception, match="no histogram"):
        run.tensor("weights/0.weight").histogram(0)
    assert run.tensor("gradients/0.weight").histogram(0)[0].sum() == 12


def test_mode_settings_merge_as_in_sagemaker() -> None:
    parsed = json_config.parse_json_config({
        "HookParameters": {"save_interval": 10, "eval.save_interval": 5, "train.start_step": "3"},
        "CollectionConfigurations": [{"CollectionName": "gradients", "CollectionParameters": {"save_interval": "50", "save_steps": "1,2"}}],
    })
    hook_save = parsed.hook_kwargs["save_config"]
    assert (hook_save.modes[ModeKeys.TRAIN].save_interval, hook_save.modes[ModeKeys.TRAIN].start_step) == (10, 3)
    assert hook_save.modes[ModeKeys.EVAL].save_interval == 5 and hook_save.modes[ModeKeys.EVAL].start_step == 0
    gradients = parsed.collections[0].save_config
    # the collection's save_interval overrides the hook's, even the hook's eval-only one
    assert gradients.modes[ModeKeys.EVAL].save_interval == 50 and gradients.modes[ModeKeys.TRAIN].start_step == 3
    assert gradients.modes[ModeKeys.TRAIN].save_steps == (1, 2)
    assert parsed.hook_kwargs["include_collections"] == ["gradients"]


def test_sagemaker_reduction_names() -> None:
    parsed = json_config.parse_json_config({"HookParameters": {
        "reductions": "min,max,mean,     std,abs_variance,abs_sum,abs_l2_norm,l1_norm", "include_regex": "regex1,regex2",
        "include_workers": "all", "save_shape": "true"}})
    config = parsed.hook_kwargs["reduction_config"]
    assert config.reductions == ("min", "max", "mean", "std") and config.abs_reductions == ("variance", "sum")
    assert config.norms == ("l1",) and config.abs_norms == ("l2",) and config.save_shape
    assert parsed.hook_kwargs["include_regex"] == ["regex1", "regex2"] and parsed.hook_kwargs["include_workers"] == "all"
    assert "include_collections" not in parsed.hook_kwargs  # no CollectionConfigurations: the defaults


def test_the_file_is_found_through_the_environment(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, {"LocalPath": str(tmp_path / "env-run"), "HookParameters": {"save_interval": "7"}})
    monkeypatch.setenv(json_config.CONFIG_FILE_PATH_ENV, path)
    hook = json_config.create_hook_from_json_file(tl.Hook, backends=["local"])
    assert hook.run_dir == str(tmp_path / "env-run") and hook.save_config.modes[ModeKeys.TRAIN].save_interval == 7
    hook.close()
    monkeypatch.delenv(json_config.CONFIG_FILE_PATH_ENV)
    monkeypatch.setattr(json_config, "SAGEMAKER_CONFIG_FILE_PATH", str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="TENSORLENS_CONFIG_FILE_PATH"):
        json_config.read_json_config()


@pytest.mark.parametrize("config, message", [
    ({"HookParameters": {"save_intervall": 3}}, "save_intervall"),
    ({"HookParameters": {"save_interval": "often"}}, "save_interval"),
    ({"HookParameters": {"reductions": "min,l3_norm"}}, "l3_norm"),
    ({"CollectionConfigurations": [{"CollectionParameters": {}}]}, "CollectionName"),
    ({"CollectionConfigurations": [{"CollectionName": "weights", "CollectionParameters": {"eval.save_histogram": "x"}}]}, "eval.save_histogram"),
    ({"HookOptions": {}}, "HookOptions"),
])
def test_mistakes_are_named(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        json_config.parse_json_config(config)


def test_sagemaker_only_settings_warn(tmp_path: Any) -> None:
    with pytest.warns(UserWarning, match="S3Path"):
        json_config.parse_json_config({"S3Path": "s3://bucket/prefix", "LocalPath": "x"})
    with pytest.warns(UserWarning, match="dry_run"):
        json_config.parse_json_config({"HookParameters": {"dry_run": "true"}})


def test_export_tensorboard_adds_the_backend(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    parsed = json_config.parse_json_config({"HookParameters": {"export_tensorboard": True, "tensorboard_dir": str(tmp_path / "tb")}})
    backends = parsed.hook_kwargs["backends"]
    assert backends[0] == "local" and type(backends[-1]).__name__ == "TensorBoardBackend"


def test_hook_create_from_json_file_is_the_classmethod(tmp_path, monkeypatch) -> None:
    config = {"LocalPath": str(tmp_path / "out"), "HookParameters": {"save_interval": "3"}}
    path = write(tmp_path, config)
    hook = tl.Hook.create_from_json_file(path, backends=["local"])
    try:
        assert isinstance(hook, tl.Hook) and hook.run_dir == str(tmp_path / "out")
        assert hook.save_config.should_save(tl.ModeKeys.TRAIN, 3) and not hook.save_config.should_save(tl.ModeKeys.TRAIN, 2)
    finally:
        hook.close()


def _raw(tmp_path: Any, data: bytes) -> str:
    path = tmp_path / "debughookconfig.json"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("data, message", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"HookParameters": {"save_interval": "\xff\xfe\x00"}}', "not UTF-8 text"),
    (bytes(range(256)), "not UTF-8 text"),
    (b'{"HookParameters": {"save_interval": ' + b"7" * 5000 + b"}}", r"HookParameters\['save_interval'\]: an integer of 5000 digits"),
    (b'{"HookParameters": {"save_interval": "often"}}', r"HookParameters\['save_interval'\]"),
    (b'{"HookParameters": {"save_interval": 3', "not valid JSON"),
    (b" " * ((1 << 20) + 1), "larger than"),
])
def test_an_unusable_file_is_one_error_naming_the_file_and_key(tmp_path: Any, data: bytes, message: str) -> None:
    path = _raw(tmp_path, data)
    with pytest.raises(json_config.ConfigFileError, match=message) as caught:
        json_config.read_json_config(path)
    assert isinstance(caught.value, ValueError) and str(caught.value).startswith(f"{path}: ")
    assert len(str(caught.value)) < 1200


def test_a_fifo_or_a_folder_is_refused_without_blocking(tmp_path: Any) -> None:
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)  # nothing writes to it: opening it to read would block forever
    for path in (fifo, tmp_path):
        with pytest.raises(json_config.ConfigFileError, match="not a regular file"):
            json_config.read_json_config(path)
    with pytest.raises(json_config.ConfigFileError, match="cannot be read"):
        json_config.read_json_config(tmp_path / "absent.json")


def test_a_file_with_a_bom_is_read(tmp_path: Any) -> None:
    path = _raw(tmp_path, b"\xef\xbb\xbf" + json.dumps({"HookParameters": {"save_interval": "7"}}).encode())
    assert json_config.read_json_config(path).hook_kwargs["save_config"].modes[ModeKeys.TRAIN].save_interval == 7
