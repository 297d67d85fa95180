"""One set of options kept in step across its five entry points (issue 23).

``tl.watch``, ``tl.Hook``, ``tl.Recorder``, the Lightning callback and the Hugging Face callback
each take every :class:`tl.Options` field (under its friendly spelling where they have one),
except where ``tensorlens.options.NOT_ON`` documents why not; a bad value gets the same error
from each; ``options=`` gives them all at once and keeps each entry point's own defaults.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens import options as O
from tensorlens.collection import DEFAULT_KINDS

pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

ENTRY_CALLABLES: dict[str, Callable[..., Any]] = {
    "watch": tl.watch,
    "Hook": tl.Hook,
    "Recorder": tl.Recorder,
    "lightning": importlib.import_module("tensorlens.integrations.lightning").TensorLensCallback,
    "transformers": importlib.import_module("tensorlens.integrations.transformers").TensorLensCallback,
}
#: Parameters of an entry point that are not recording options.
NOT_OPTIONS = {"self", "models", "criterion", "log", "log_freq", "options", "args", "kwargs"}


def parameters(entry: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """An entry point's keywords, following ``**kwargs`` into the ``__init__`` it forwards to."""
    if not isinstance(entry, type):
        return dict(inspect.signature(entry).parameters)
    out: dict[str, inspect.Parameter] = {}
    for cls in entry.__mro__:
        if "__init__" not in vars(cls):
            continue
        params = inspect.signature(vars(cls)["__init__"]).parameters
        out.update({k: p for k, p in params.items() if k not in out and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)})
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            break
    return out


def keywords_for(entry: str, field: str) -> list[str]:
    """The keywords that set ``field`` on ``entry``."""
    if entry not in O.SPELLED_ENTRIES:
        return [field]
    spelled = [k for k, f in O.SPELLINGS.items() if f == field and k != "activations"]
    return spelled + ([field] if field == "save_config" or not spelled else [])


@pytest.mark.parametrize("entry", O.ENTRY_POINTS)
@pytest.mark.parametrize("field", O.FIELDS)
def test_every_option_is_taken_by_every_entry_point_but_the_documented_exceptions(entry: str, field: str) -> None:
    params = parameters(ENTRY_CALLABLES[entry])
    accepted = [k for k in keywords_for(entry, field) if k in params]
    if entry in O.NOT_ON.get(field, ()):
        assert not accepted, f"{entry} takes {field}, but tensorlens.options.NOT_ON says it makes no sense there"
        assert field in O.__doc__
    else:
        assert accepted == keywords_for(entry, field), f"{entry} does not take {field} (as {keywords_for(entry, field)})"


@pytest.mark.parametrize("entry", O.ENTRY_POINTS)
def test_no_entry_point_has_an_option_outside_options(entry: str) -> None:
    params = parameters(ENTRY_CALLABLES[entry])
    assert "options" in params
    known = set(O.FIELDS) | (set(O.SPELLINGS) if entry in O.SPELLED_ENTRIES else set())
    assert set(params) - NOT_OPTIONS <= known


@pytest.mark.parametrize("entry", O.ENTRY_POINTS)
def test_defaults_are_the_entry_points_own(entry: str) -> None:
    params = parameters(ENTRY_CALLABLES[entry])
    fields = {f.name: f.default for f in O.dataclasses.fields(O.Options)}
    for name, param in params.items():
        if name in NOT_OPTIONS:
            continue
        if name in O.ENTRY_DEFAULTS[entry] and not (entry in ("lightning", "transformers") and name == "backends"):
            assert param.default == O.ENTRY_DEFAULTS[entry][name], (entry, name)
        elif name in O.SPELLED_DEFAULTS and entry in O.SPELLED_ENTRIES:
            assert param.default == O.SPELLED_DEFAULTS[name], (entry, name)
        elif name != "backends":
            assert param.default == fields[name], (entry, name)


def test_each_callback_keeps_its_defaults_with_and_without_options() -> None:
    for entry, trackers in (("lightning", "loggers"), ("transformers", "report_to")):
        for callback in (ENTRY_CALLABLES[entry](), ENTRY_CALLABLES[entry](options=tl.Options())):
            assert callback.options.backends == [trackers]
            assert callback.options.save_config == tl.SaveConfig(save_interval=100)
            assert list(callback.options.include_collections or DEFAULT_KINDS) == list(DEFAULT_KINDS)


def test_watch_and_hook_keep_their_save_interval_with_options(tmp_path: Any) -> None:
    model = nn.Linear(2, 2)
    with tl.watch(model, out_dir=str(tmp_path / "a"), backends=["local"]) as a, \
            tl.watch(model, options=tl.Options(out_dir=str(tmp_path / "b"), backends=["local"])) as b:
        assert a.save_config == b.save_config == tl.SaveConfig(save_interval=100)
    with tl.Hook(out_dir=str(tmp_path / "c"), backends=["local"]) as c, \
            tl.Hook(options=tl.Options(out_dir=str(tmp_path / "d"), backends=["local"])) as d:
        assert c.save_config == d.save_config == tl.SaveConfig()


#: A bad value per keyword (every entry point that takes the keyword must reject it the same way).
BAD: dict[str, Any] = {
    "save_interval": 0, "save_config": 5, "collections": "gradients", "activations": "yes", "histograms": 64,
    "reductions": ["l2"], "reduction_config": ["l2"], "histogram_config": 64, "include_collections": 3,
    "include_regex": 3, "backends": 3, "run_name": "", "include_workers": "some", "max_pending_steps": 0,
    "resume": "sometimes", "dynamics": 3, "dynamics_config": 3, "epoch_statistics": 5, "rules": [3],
    "collective_timeout": -1, "scales": "yes", "scales_plot_interval": 0, "record_clipped_gradients": 1,
    "out_dir": 3,
}


def error_of(entry: str, keyword: str, tmp_path: Any) -> str:
    call = ENTRY_CALLABLES[entry]
    args = (nn.Linear(2, 2),) if entry == "watch" else ()
    extra = {} if entry in ("lightning", "transformers") or keyword == "out_dir" else {"out_dir": str(tmp_path / entry)}
    with pytest.raises(ValueError) as info:
        call(*args, **extra, **{keyword: BAD[keyword]})
    return str(info.value)


@pytest.mark.parametrize("keyword", sorted(BAD))
def test_a_bad_value_gets_the_same_error_from_every_entry_point(keyword: str, tmp_path: Any) -> None:
    messages = {
        entry: error_of(entry, keyword, tmp_path) for entry in O.ENTRY_POINTS if keyword in parameters(ENTRY_CALLABLES[entry])
    }
    assert messages, keyword
    assert all(m.startswith(f"Expected `{keyword}` to be ") for m in messages.values()), messages
    if keyword == "backends":  # a callback names its tracker word ("loggers", "report_to") too
        messages = {e: m.split(" to be ")[0] for e, m in messages.items()}
    assert len(set(messages.values())) == 1, messages
    assert not any(os.path.exists(tmp_path / entry) for entry in O.ENTRY_POINTS)  # checked before anything is made


def test_a_renamed_option_gets_the_same_error_under_each_name(tmp_path: Any) -> None:
    assert error_of("Recorder", "reduction_config", tmp_path).replace("reduction_config", "reductions") == \
        error_of("watch", "reductions", tmp_path)


def test_options_and_keywords_are_one_source_each(tmp_path: Any) -> None:
    opts = tl.Options(out_dir=str(tmp_path / "x"))
    for entry in O.ENTRY_POINTS:
        call = ENTRY_CALLABLES[entry]
        args = (nn.Linear(2, 2),) if entry == "watch" else ()
        with pytest.raises(ValueError, match=r"Expected `options` to be None when option keywords are given too \(run_name\)"):
            call(*args, options=opts, run_name="other")
        with pytest.raises(ValueError, match="Expected `options` to be None or a tl.Options"):
            call(*args, options={"run_name": "x"})
    with pytest.raises(TypeError):
        tl.Hook(out_dir=str(tmp_path / "y"), no_such_option=1)


def test_options_are_frozen_and_checked_when_made() -> None:
    with pytest.raises(ValueError, match="Expected `max_pending_steps` to be an integer >= 1, but got 0"):
        tl.Options(max_pending_steps=0)
    opts = tl.Options()
    with pytest.raises(AttributeError):
        opts.run_name = "x"  # type: ignore[misc]
    with pytest.raises(ValueError, match="Expected `collective_timeout`"):
        opts.replace(collective_timeout=0)


def test_the_lightning_callback_honours_the_options_it_gained(tmp_path: Any) -> None:
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = ENTRY_CALLABLES["lightning"](save_interval=1, collective_timeout=7.5, max_pending_steps=3, out_dir=str(tmp_path / "run"))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path), callbacks=[callback])
    trainer.fit(Tiny(), data)
    assert callback.hook is not None and callback.hook.collective_timeout == 7.5
    assert callback.hook.options.max_pending_steps == 3
    assert [r.step for r in tl.open_run(str(tmp_path / "run")).records()][:2] == [0, 1]


def test_options_an_entry_point_cannot_honour_are_refused_there(tmp_path: Any) -> None:
    for entry, field, value in (("Recorder", "scales", True), ("lightning", "scales_plot_interval", 3),
                                ("transformers", "scales", True), ("lightning", "scales", True)):
        with pytest.raises(ValueError, match=f"Expected `options` to be a tl.Options without {field} here"):
            ENTRY_CALLABLES[entry](options=tl.Options(out_dir=str(tmp_path / "r"), **{field: value}))
    for entry in ("watch", "Hook", "Recorder"):
        args = (nn.Linear(2, 2),) if entry == "watch" else ()
        with pytest.raises(ValueError, match="without record_clipped_gradients here"):
            ENTRY_CALLABLES[entry](*args, options=tl.Options(out_dir=str(tmp_path / "r"), record_clipped_gradients=True))
    assert not os.path.exists(tmp_path / "r")


def test_an_iterator_of_rules_or_collections_is_read_once_and_kept(tmp_path: Any) -> None:
    from tensorlens import rules as R

    opts = tl.Options(rules=iter([R.VanishingGradient()]), include_collections=iter(["gradients"]))
    assert len(opts.rules or []) == 1 and opts.collections == ["gradients"]
    with tl.Hook(out_dir=str(tmp_path / "h"), backends=["local"], rules=(r for r in [R.VanishingGradient()])) as hook:
        assert len(hook.options.rules or []) == 1


def test_a_callback_attribute_set_before_a_run_changes_its_options_checked() -> None:
    callback = ENTRY_CALLABLES["lightning"]()
    callback.collections = ["gradients"]
    callback.record_clipped_gradients = True
    callback.backends = ["local"]
    assert callback.options.include_collections == ["gradients"] and callback.options.record_clipped_gradients
    assert callback.options.backends == ["local"]
    with pytest.raises(ValueError, match="Expected `include_workers` to be one of"):
        callback.include_workers = "some"
    with pytest.raises(ValueError, match='Expected `backends` to be "loggers" or a list'):
        callback.backends = 3
