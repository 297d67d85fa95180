"""Overhead of tensorlens on a training step, against a plain loop and against ``wandb.watch``.

Run it from the repository root::

    python benchmarks/overhead.py                 # every model and variant, readable table
    python benchmarks/overhead.py --quick         # the MLP, a few steps: checks that it runs
    python benchmarks/overhead.py --json > out.json
    python benchmarks/overhead.py --models mlp --variants baseline tl_full_every_step --steps 300

Method (why it is built this way):

- Each variant gets its own model (a deep copy of one seeded template, so the same init) and its
  own Adam optimizer; the same pre-generated synthetic batches are cycled for every variant.
- Variants are interleaved in blocks inside one process: each round runs ``--block`` steps of
  every variant, in an order rotated by one each round. A load spike from a neighbour on a
  shared machine then hits all variants alike, and ratios are taken against the baseline
  measured in the same rounds. A second, identical baseline (``baseline_control``) is an A/A
  control: its distance from 1.0× is the noise floor of the run.
- A step is ``zero_grad, forward, loss, backward, optimizer.step`` timed with ``perf_counter``.
  At the end of a tensorlens block ``hook.flush()`` is timed too and charged to that block, so
  work tensorlens defers to its background threads is neither hidden nor leaked into the next
  variant's block. The mean includes it; the median (of single steps) does not.
- tensorlens hooks are global optimizer hooks: a :class:`tensorlens.Hook` binds to the *first*
  optimizer that steps after it is created. Each variant's hook is therefore created right
  before that variant's own warm-up steps, and ``hook.global_step`` is checked at the end
  against the steps that variant took (``hook_steps_ok``).
- ``wandb.watch`` runs in one offline run (``WANDB_MODE=offline``, a temporary ``dir``, system
  stats off); its service process works in the background, so the CPU time of child processes
  during each variant's blocks is reported too (``background_cpu_ms_per_step``).
- Peak memory: one fresh subprocess per (model, variant). It imports everything, builds the model,
  optimizer and instrumentation, resets the kernel's RSS high-water mark
  (``/proc/self/clear_refs``), trains a few steps that include a saved one, and reads ``VmHWM``.
  ``footprint`` is that peak minus the RSS measured just before the model was built, so the size
  of the imported libraries (wandb's are large) does not blur the comparison. Where the mark
  cannot be reset, ``ru_maxrss`` of the child is used instead (``rss_method`` says which).
- Host syncs: ``hook.host_copies`` per saved step for tensorlens. In addition, one short pass
  per variant counts Python-level sync points (``Tensor.item``, ``.cpu``, ``.tolist``, ``bool``,
  ``float``, ``int``) with the methods wrapped, minus what the plain loop does (Adam itself calls
  ``.item()`` on its step counters). On a CPU machine these are not real device syncs, but they
  are exactly the places that block on a GPU. Syncs inside C++ kernels are not visible here.
- ``--profile`` adds a per-op breakdown (``torch.profiler``, tensorlens step minus baseline step)
  and a per-function breakdown of tensorlens's own code (``cProfile``) for the full-every-step
  variant.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import dataclasses
import io
import json
import math
import os
import platform
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import tensorlens as tl

# --------------------------------------------------------------------------------------------
# Models


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    label: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    default_steps: int  # measured steps per variant in a full run
    default_block: int | None = None  # steps per variant per round, where --block is not given


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(512, 10))


VOCAB = 1000
SEQUENCE = 64


class _TransformerLM(nn.Module):
    """Token embedding, ``nn.TransformerEncoder`` (PyTorch defaults: feed-forward 2048, dropout
    0.1), a per-token vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 256)
        layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, batch_first=True)
        # the nested-tensor fast path only applies to inference; turning it off silences a warning
        self.encoder = nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)
        self.head = nn.Linear(256, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def _convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 4 * 4, 10),
    )  # fmt: skip


def _classes(n: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randint(0, 10, (n,), generator=g)


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "mlp", "MLP 8x(Linear 512 + ReLU), batch 64", _mlp,
            lambda g: (torch.randn(64, 512, generator=g), _classes(64)(g)),
            nn.functional.cross_entropy, 400,
        ),
        ModelSpec(
            "transformer", "TransformerEncoder 6 layers, d 256, 4 heads, seq 64, batch 16", _TransformerLM,
            lambda g: (torch.randint(0, VOCAB, (16, SEQUENCE), generator=g), torch.randint(0, VOCAB, (16, SEQUENCE), generator=g)),
            _token_loss, 200,
        ),
        ModelSpec(
            "convnet", "ConvNet 3 conv + linear, 32x32, batch 32", _convnet,
            lambda g: (torch.randn(32, 3, 32, 32, generator=g), _classes(32)(g)),
            nn.functional.cross_entropy, 400,
        ),
    )
}  # fmt: skip


# Models of issue 17: a real architecture, the cost per tensor, and a run gone NaN.

GPT2_VOCAB = 50257


class _GPT2Logits(nn.Module):
    """Hugging Face GPT-2 124M built from its config (no download), returning its logits."""

    def __init__(self) -> None:
        super().__init__()
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError as err:  # an optional benchmark dependency
            raise SystemExit("the gpt2 model needs transformers: pip install 'tensorlens[transformers]'") from err
        self.model = GPT2LMHeadModel(GPT2Config())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def _gpt2_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, GPT2_VOCAB), targets.reshape(-1))


#: The tensor-count sweep: the same values as 10, 100 or 1000 parameters (and as many gradients).
SWEEP_VALUES = 20_000_000


class _ParameterBank(nn.Module):
    """``count`` parameters holding :data:`SWEEP_VALUES` values together; the forward pass reads
    each once, so the step is Adam's update and tensorlens's cost per tensor is visible."""

    def __init__(self, count: int) -> None:
        super().__init__()
        rows = SWEEP_VALUES // count // 1000
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(rows, 1000) * 0.02) for _ in range(count)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([w.sum() for w in self.weights]) * x


def _layers640(nan: bool) -> Callable[[], nn.Module]:
    """Ten Linear 640 layers; with ``nan`` one NaN in each weight: after the first step every
    weight and gradient is NaN (a diverged run), the case whose statistics must not cost more."""

    def build() -> nn.Module:
        model = nn.Sequential(*[m for _ in range(10) for m in (nn.Linear(640, 640), nn.ReLU())])
        if nan:
            with torch.no_grad():
                for module in model:
                    if isinstance(module, nn.Linear):
                        module.weight[0, 0] = math.nan
        return model

    return build


def _scalar_loss(output: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return output.sum()


for _spec in (
    ModelSpec(
        "gpt2", "Hugging Face GPT-2 124M from config, batch 2x128", _GPT2Logits,
        lambda g: (torch.randint(0, GPT2_VOCAB, (2, 128), generator=g), torch.randint(0, GPT2_VOCAB, (2, 128), generator=g)),
        _gpt2_loss, 24, 2,
    ),
    *(
        ModelSpec(
            f"sweep{count}", f"{SWEEP_VALUES // 1_000_000}M values as {count} parameters", lambda count=count: _ParameterBank(count),
            lambda g: (torch.randn(1, generator=g), torch.zeros(1)), _scalar_loss, 60, 5,
        )
        for count in (10, 100, 1000)
    ),
    ModelSpec("layers640", "10 x Linear 640, batch 64", _layers640(False),
              lambda g: (torch.randn(64, 640, generator=g), _classes(64)(g)), nn.functional.cross_entropy, 200),
    ModelSpec("layers640_nan", "10 x Linear 640, batch 64, every tensor NaN", _layers640(True),
              lambda g: (torch.randn(64, 640, generator=g), _classes(64)(g)), nn.functional.cross_entropy, 200),
):
    MODELS[_spec.name] = _spec

# --------------------------------------------------------------------------------------------
# Variants

FULL_COLLECTIONS = ("weights", "biases", "gradients", "activations")


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    name: str
    label: str
    kind: str  # "baseline", "tensorlens" or "wandb"
    save_interval: int | None  # None: records nothing
    path: str | None = None  # tensorlens: "native" (compiled CPU kernel) or "torch" (PyTorch ops, as on a GPU)
    base: str = ""  # the variant this one runs on another path (its name then ends in "[torch]")

    @property
    def base_name(self) -> str:
        return self.base or self.name


VARIANTS: dict[str, VariantSpec] = {
    v.name: v
    for v in (
        VariantSpec("baseline", "no instrumentation", "baseline", None),
        VariantSpec("baseline_control", "no instrumentation (A/A control)", "baseline", None),
        VariantSpec("tl_default", "tl.watch(model) (every 100)", "tensorlens", 100),
        # like for like with wandb.watch(log="all", log_freq=1): weights, biases, gradients, 64 bins
        VariantSpec("tl_watch_all_every_step", 'tl.watch(log="all", log_freq=1)', "tensorlens", 1),
        VariantSpec("tl_full_every_step", "tl full + 64-bin hist, every step", "tensorlens", 1),
        VariantSpec("tl_full_every_100", "tl full + 64-bin hist, every 100", "tensorlens", 100),
        # attached like tl_full but saving only step 0 (in the warm-up): the cost of a step not saved
        VariantSpec("tl_unsaved", "tl full, never saved after step 0", "tensorlens", 10**9),
        VariantSpec("wandb_all_every_step", 'wandb.watch(log="all", log_freq=1)', "wandb", 1),
        VariantSpec("wandb_all_every_100", 'wandb.watch(log="all", log_freq=100)', "wandb", 100),
        # opt-in: every value binned (HistogramConfig(sample=None)), to price exact histograms
        VariantSpec("tl_full_exact_every_step", "tl full + exact 64-bin hist, every step", "tensorlens", 1),
        # the dynamics collection alone (tl.watch(dynamics=True, collections=["dynamics"])): update
        # ratios, cosines (their copies every step), global norms, unit statistics, io_grad norms
        VariantSpec("tl_dynamics_every_step", "tl dynamics only, every step", "tensorlens", 1),
        # the same every 100 steps: steps 99, 199, ... copy the gradient and the update for the cosines
        VariantSpec("tl_dynamics_every_100", "tl dynamics only, every 100", "tensorlens", 100),
        # the full collections and the dynamics together
        VariantSpec("tl_full_dynamics_every_step", "tl full + dynamics, every step", "tensorlens", 1),
    )
}
#: What a run measures unless ``--variants`` says otherwise.
DEFAULT_VARIANTS = tuple(
    name for name in VARIANTS if name not in ("tl_full_exact_every_step", "tl_dynamics_every_100", "tl_full_dynamics_every_step")
)

# --------------------------------------------------------------------------------------------
# Paths: the compiled CPU kernel, or PyTorch ops only (what runs on a GPU, and on a CPU without a
# C compiler). Both run in one process, interleaved: a tensorlens variant runs once per path.

PATHS = ("native", "torch")


def default_paths() -> list[str]:
    from tensorlens.stats import native

    return list(PATHS) if native.available() else ["torch"]


def with_paths(variants: Sequence[VariantSpec], paths: Sequence[str]) -> list[VariantSpec]:
    """Each tensorlens variant once per path: ``name`` on the kernel, ``name[torch]`` on PyTorch ops."""
    out = []
    for v in variants:
        if v.kind != "tensorlens":
            out.append(v)
            continue
        for path in paths:
            name = v.name if path == "native" else f"{v.name}[{path}]"
            out.append(dataclasses.replace(v, name=name, path=path, base=v.name))
    return out


def variant_named(name: str) -> VariantSpec:
    """A variant by its name, with a path suffix (``tl_full_every_step[torch]``) or without."""
    if name.endswith("]") and "[" in name:
        base, path = name[:-1].split("[", 1)
        return dataclasses.replace(VARIANTS[base], name=name, path=path, base=base)
    return dataclasses.replace(VARIANTS[name], path="native") if VARIANTS[name].kind == "tensorlens" else VARIANTS[name]


def select_path(path: str | None) -> None:
    """Switch tensorlens to ``path`` for the steps that follow (``TENSORLENS_NATIVE`` is read at
    every use: no reload). Each variant keeps its own plans, so switching costs its steps nothing."""
    if path is None:
        return
    if path == "torch":
        os.environ["TENSORLENS_NATIVE"] = "0"
    else:
        os.environ.pop("TENSORLENS_NATIVE", None)


class Instrument:
    """What a variant attaches to its model; ``saves(step)`` says whether optimizer step ``step``
    (0-based, counted for this variant only) records something."""

    hook: tl.Hook | None = None

    def __init__(self, spec: VariantSpec) -> None:
        self.spec = spec

    def saves(self, step: int) -> bool:
        return False

    def settle(self) -> None:
        """Finish work deferred to background threads (timed, charged to the variant)."""

    def close(self) -> None:
        pass


class TensorlensInstrument(Instrument):
    def __init__(self, spec: VariantSpec, model: nn.Module, out_dir: str) -> None:
        super().__init__(spec)
        if spec.base_name == "tl_default":
            # the one-line default; backends given so an active wandb run is not picked up by "auto"
            self.hook = tl.watch(model, backends=["local"], out_dir=out_dir)
        elif spec.base_name == "tl_watch_all_every_step":
            self.hook = tl.watch(model, log="all", log_freq=1, backends=["local"], out_dir=out_dir)
        elif "dynamics" in spec.name:
            self.hook = tl.watch(
                model,
                collections=[*(FULL_COLLECTIONS if "full" in spec.name else ()), "dynamics"],
                dynamics=True,
                save_interval=spec.save_interval or 1,
                histograms=tl.HistogramConfig(bins=64),
                backends=["local"],
                out_dir=out_dir,
            )
        else:
            # bins=64 with the version's default sampling, or every value for the "exact" variant
            histograms = tl.HistogramConfig(bins=64, sample=None) if "exact" in spec.name else tl.HistogramConfig(bins=64)
            self.hook = tl.watch(
                model,
                collections=list(FULL_COLLECTIONS),
                save_interval=spec.save_interval or 1,
                histograms=histograms,
                backends=["local"],
                out_dir=out_dir,
            )
        self.interval = spec.save_interval or 1

    def saves(self, step: int) -> bool:
        return step % self.interval == 0  # SaveConfig: step 0, interval, 2 * interval, ...

    def settle(self) -> None:
        assert self.hook is not None
        self.hook.flush()

    def close(self) -> None:
        if self.hook is not None:
            self.hook.close()


class WandbInstrument(Instrument):
    def __init__(self, spec: VariantSpec, model: nn.Module) -> None:
        super().__init__(spec)
        import wandb

        self.model = model
        self.interval = spec.save_interval or 1
        wandb.watch(model, log="all", log_freq=self.interval)

    def saves(self, step: int) -> bool:
        # wandb counts calls and logs on the log_freq-th one: forward calls 1*f, 2*f, ...
        return (step + 1) % self.interval == 0

    def close(self) -> None:
        import wandb

        with contextlib.suppress(Exception):
            wandb.unwatch(self.model)


def wandb_available() -> bool:
    try:
        import wandb  # noqa: F401
    except Exception:
        return False
    return True


@contextlib.contextmanager
def wandb_offline_run(work_dir: str) -> Iterator[Any]:
    """One offline W&B run for every wandb variant of this process."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    settings = wandb.Settings(console="off", x_disable_stats=True, disable_git=True, save_code=False, silent=True)
    run = wandb.init(project="tensorlens-overhead", dir=work_dir, settings=settings, reinit="finish_previous")
    try:
        yield run
    finally:
        run.finish()


# --------------------------------------------------------------------------------------------
# One variant's training loop


class Trainer:
    def __init__(self, model_spec: ModelSpec, variant: VariantSpec, template: nn.Module,
                 batches: list[tuple[torch.Tensor, torch.Tensor]], work_dir: str) -> None:
        self.variant = variant
        self.model = copy.deepcopy(template)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.loss_fn = model_spec.loss
        self.batches = batches
        self.steps = 0
        self.activate()
        if variant.kind == "tensorlens":
            self.instrument: Instrument = TensorlensInstrument(
                variant, self.model, os.path.join(work_dir, f"{model_spec.name}-{variant.name}")
            )
        elif variant.kind == "wandb":
            self.instrument = WandbInstrument(variant, self.model)
        else:
            self.instrument = Instrument(variant)

    def activate(self) -> None:
        """Select this variant's path before its steps (outside the timed ones)."""
        select_path(self.variant.path)

    def step(self) -> None:
        x, y = self.batches[self.steps % len(self.batches)]
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.steps += 1


def _make_batches(spec: ModelSpec, count: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [spec.make_batch(g) for _ in range(count)]


def _template(spec: ModelSpec, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return spec.build()


# --------------------------------------------------------------------------------------------
# Background CPU of child processes (the wandb service), from /proc


def _descendants_cpu_seconds() -> float | None:
    """utime + stime of every live descendant process; None without /proc."""
    if not os.path.isdir("/proc"):
        return None
    parent_of: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2 :].split()  # the command name may hold spaces
        pid = int(entry)
        parent_of[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
    me = os.getpid()
    total = 0.0
    for pid in cpu:
        p, hops = parent_of.get(pid), 0
        while p and p != me and hops < 64:
            p, hops = parent_of.get(p), hops + 1
        if p == me:
            total += cpu[pid]
    return total


# --------------------------------------------------------------------------------------------
# Counting Python-level host sync points

SYNC_METHODS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def count_sync_points() -> Iterator[Counter[str]]:
    """Count calls of the Tensor methods that block on a device, from every thread.

    A ``TorchFunctionMode`` would miss calls made inside autograd hooks (where ``wandb.watch``
    computes gradient histograms), so the methods are wrapped on the class for the duration.
    """
    counts: Counter[str] = Counter()
    own = {name: torch.Tensor.__dict__.get(name) for name in SYNC_METHODS}
    original = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(self, *args, **kwargs)

        return wrapper

    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, counting(name, original[name]))
    try:
        yield counts
    finally:
        for name in SYNC_METHODS:
            if own[name] is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own[name])


def _sync_pass(trainer: Trainer, steps: int) -> tuple[list[int], list[bool]]:
    """Sync points of each of ``steps`` steps (with their flush), and whether each was saved."""
    per_step, saved = [], []
    trainer.activate()
    for _ in range(steps):
        saved.append(trainer.instrument.saves(trainer.steps))
        with count_sync_points() as counts:
            trainer.step()
            trainer.instrument.settle()
        per_step.append(sum(counts.values()))
    return per_step, saved


def _hook_time_unsaved(trainer: Trainer, calls: int = 2000) -> float:
    """tensorlens's own time in an unsaved step, in microseconds: the four callbacks such a step
    runs (root forward pre/post, optimizer pre/post), called directly. Deterministic where the
    step-time ratio of an unsaved step is below the noise floor."""
    hook = trainer.instrument.hook
    assert hook is not None
    trainer.activate()
    model, optimizer, steps = trainer.model, trainer.optimizer, hook.global_step
    started = time.perf_counter()
    for _ in range(calls):
        hook._root_forward_pre(model, (), {})
        hook._root_forward_post(model, (), None)
        hook._optimizer_pre_step(optimizer, (), {})
        hook._optimizer_post_step(optimizer, (), {})
    elapsed = time.perf_counter() - started
    hook.set_step(steps)  # these calls are not steps the variant took
    return elapsed / calls * 1e6


# --------------------------------------------------------------------------------------------
# Memory: one subprocess per (model, variant)


def _rss_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def memory_child(model_name: str, variant_name: str, steps: int, threads: int) -> dict[str, Any]:
    """Runs inside the subprocess: peak RSS while training ``steps`` steps of one variant."""
    torch.set_num_threads(threads)
    spec, variant = MODELS[model_name], variant_named(variant_name)
    work_dir = tempfile.mkdtemp(prefix="tl-bench-mem-")
    try:
        with contextlib.ExitStack() as stack:
            if variant.kind == "wandb":
                stack.enter_context(wandb_offline_run(work_dir))
            batches = _make_batches(spec)
            rss_before_model = _rss_kb("VmRSS")
            trainer = Trainer(spec, variant, _template(spec), batches, work_dir)
            method = "VmHWM after /proc/self/clear_refs"
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets the RSS high-water mark to the current RSS
            except OSError:
                method = "ru_maxrss (high-water mark could not be reset: includes imports)"
            for _ in range(steps):
                trainer.step()
            trainer.instrument.settle()
            peak_kb = _rss_kb("VmHWM") if method.startswith("VmHWM") else None
            if peak_kb is None:
                peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                method = "ru_maxrss (high-water mark could not be reset: includes imports)"
            trainer.instrument.close()
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return {
        "peak_rss_mb": peak_kb / 1024,
        "rss_before_model_mb": (rss_before_model or 0) / 1024,
        "footprint_mb": (peak_kb - (rss_before_model or 0)) / 1024,
        "steps": steps,
        "includes_saved_step": any(trainer.instrument.saves(i) for i in range(steps)) if variant.save_interval else None,
        "rss_method": method,
    }


def measure_memory(model_name: str, variant_name: str, steps: int, threads: int) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("WANDB_MODE", "offline")
    command = [sys.executable, os.path.abspath(__file__), "--memory-child", model_name, variant_name,
               "--steps", str(steps), "--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]}
    return json.loads(lines[-1])


# --------------------------------------------------------------------------------------------
# The interleaved measurement


@dataclasses.dataclass
class BenchConfig:
    models: Sequence[str] = ("mlp", "transformer", "convnet")
    variants: Sequence[str] = DEFAULT_VARIANTS
    steps: int | None = None  # measured steps per variant; None: each model's default
    block: int | None = None  # None: each model's default (10 for most)
    paths: Sequence[str] = ()  # "native", "torch"; empty: both where the kernel is built, else "torch"
    warmup: int = 10
    threads: int = 2
    memory: bool = True
    memory_steps: int = 12
    quick_memory: bool = False  # do not extend wandb's memory run to its first logged step
    sync_steps: int = 2
    profile: bool = False
    profile_steps: int = 20
    quiet: bool = False


def _log(config: BenchConfig, message: str) -> None:
    if not config.quiet:
        print(message, file=sys.stderr, flush=True)


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def measure_model(spec: ModelSpec, variants: Sequence[VariantSpec], config: BenchConfig, work_dir: str) -> list[dict[str, Any]]:
    steps = config.steps or spec.default_steps
    block = max(1, min(config.block or spec.default_block or 10, steps))
    rounds = max(1, math.ceil(steps / block))
    batches = _make_batches(spec)
    template = _template(spec)

    trainers: list[Trainer] = []
    for variant in variants:
        trainer = Trainer(spec, variant, template, batches, work_dir)
        # warm up now: the hook just created binds to the first optimizer that steps, i.e. this one
        for _ in range(config.warmup):
            trainer.step()
        trainer.instrument.settle()
        trainers.append(trainer)

    times: dict[str, list[float]] = {v.name: [] for v in variants}
    saved: dict[str, list[bool]] = {v.name: [] for v in variants}
    settle: dict[str, float] = dict.fromkeys(times, 0.0)
    background: dict[str, float] = dict.fromkeys(times, 0.0)
    block_means: dict[str, list[float]] = {v.name: [] for v in variants}
    # CPU time of this process (training thread, tensorlens's threads, PyTorch's workers) per step
    # of each block: what the variant costs this process, much less moved by a neighbour's load
    # than wall time (cache and memory bandwidth are still shared)
    block_cpu: dict[str, list[float]] = {v.name: [] for v in variants}
    has_background = _descendants_cpu_seconds() is not None
    _log(config, f"[{spec.name}] {len(variants)} variants x {rounds} rounds x {block} steps (warm-up {config.warmup})")
    started = time.perf_counter()
    for r in range(rounds):
        shift = r % len(trainers)
        for trainer in trainers[shift:] + trainers[:shift]:
            name = trainer.variant.name
            trainer.activate()
            cpu_before = _descendants_cpu_seconds() if has_background else None
            process_before = time.process_time()
            block_total = 0.0
            for _ in range(block):
                saved[name].append(trainer.instrument.saves(trainer.steps))
                t0 = time.perf_counter()
                trainer.step()
                elapsed = time.perf_counter() - t0
                times[name].append(elapsed)
                block_total += elapsed
            t0 = time.perf_counter()
            trainer.instrument.settle()
            flush = time.perf_counter() - t0
            settle[name] += flush
            block_means[name].append((block_total + flush) / block)
            block_cpu[name].append((time.process_time() - process_before) / block)
            if cpu_before is not None:
                background[name] += (_descendants_cpu_seconds() or 0.0) - cpu_before
        if r == 0:
            per_round = time.perf_counter() - started
            _log(config, f"[{spec.name}] one round took {per_round:.1f} s; about {per_round * (rounds - 1):.0f} s to go")

    # Host sync points, after timing: counting wraps Tensor methods and would slow the steps
    syncs: dict[str, tuple[list[int], list[bool]]] = {}
    for trainer in trainers:
        syncs[trainer.variant.name] = _sync_pass(trainer, config.sync_steps)
    base_syncs = syncs[variants[0].name][0] if variants[0].kind == "baseline" else None
    base_sync_per_step = statistics.mean(base_syncs) if base_syncs else 0.0

    results: list[dict[str, Any]] = []
    baseline_name = next((v.name for v in variants if v.name == "baseline"), None)
    for trainer in trainers:
        v = trainer.variant
        t = times[v.name]
        n = len(t)
        mean = (sum(t) + settle[v.name]) / n
        unsaved = [x for x, s in zip(t, saved[v.name], strict=True) if not s]
        row: dict[str, Any] = {
            "model": spec.name,
            "variant": v.name,
            "path": v.path,
            "label": v.label,
            "kind": v.kind,
            "save_interval": v.save_interval,
            "steps": n,
            "rounds": rounds,
            "block": block,
            "mean_ms": mean * 1e3,
            "median_ms": statistics.median(t) * 1e3,
            "p10_ms": _percentile(t, 0.1) * 1e3,
            "p90_ms": _percentile(t, 0.9) * 1e3,
            "flush_ms_per_step": settle[v.name] / n * 1e3,
            "saved_steps_measured": sum(saved[v.name]),
            "unsaved_mean_ms": statistics.mean(unsaved) * 1e3 if unsaved else None,
            "unsaved_median_ms": statistics.median(unsaved) * 1e3 if unsaved else None,
            "background_cpu_ms_per_step": background[v.name] / n * 1e3 if has_background else None,
            # every measured step in order, and which of them saved: for finer analysis than the summary
            "step_ms": [round(x * 1e3, 3) for x in t],
            # each round's block of steps, flush included: paired with the baseline's of the same round
            "round_block_ms": [round(x * 1e3, 4) for x in block_means[v.name]],
            "round_block_cpu_ms": [round(x * 1e3, 4) for x in block_cpu[v.name]],
            "cpu_ms": statistics.median(block_cpu[v.name]) * 1e3,
            "saved_step_indices": [i for i, s in enumerate(saved[v.name]) if s],
        }
        per_step_syncs, sync_saved = syncs[v.name]
        saved_syncs = [c - base_sync_per_step for c, s in zip(per_step_syncs, sync_saved, strict=True) if s]
        unsaved_syncs = [c - base_sync_per_step for c, s in zip(per_step_syncs, sync_saved, strict=True) if not s]
        row["sync_points_per_saved_step"] = statistics.mean(saved_syncs) if saved_syncs else None
        row["sync_points_per_unsaved_step"] = statistics.mean(unsaved_syncs) if unsaved_syncs else None
        if v.base_name == "tl_unsaved":
            row["hook_us_per_unsaved_step"] = _hook_time_unsaved(trainer)
        hook = trainer.instrument.hook
        if hook is not None:
            hook.flush()
            written = hook.backend_stats()["local"].written
            row["hook_global_step"] = hook.global_step
            row["steps_taken"] = trainer.steps
            row["hook_steps_ok"] = hook.global_step == trainer.steps
            row["saved_steps_total"] = written
            row["host_copies"] = hook.host_copies
            row["host_copies_per_saved_step"] = hook.host_copies / written if written else None
            row["histogram_config"] = repr(hook.histogram_config)
        results.append(row)

    if baseline_name is not None:
        base = next(r for r in results if r["variant"] == baseline_name)
        for row in results:
            row["ratio_mean"] = row["mean_ms"] / base["mean_ms"]
            row["ratio_median"] = row["median_ms"] / base["median_ms"]
            row["ratio_unsaved_mean"] = (
                row["unsaved_mean_ms"] / base["mean_ms"] if row["unsaved_mean_ms"] is not None else None
            )
            row["ratio_unsaved_median"] = (
                row["unsaved_median_ms"] / base["median_ms"] if row["unsaved_median_ms"] is not None else None
            )
            cpu_ratios = [a / b for a, b in zip(block_cpu[row["variant"]], block_cpu[baseline_name], strict=True) if b > 0]
            row["ratio_cpu"] = statistics.median(cpu_ratios) if cpu_ratios else None
            per_round = [a / b for a, b in zip(block_means[row["variant"]], block_means[baseline_name], strict=True)]
            row["round_ratio_median"] = statistics.median(per_round)
            row["round_ratio_p25"] = _percentile(per_round, 0.25)
            row["round_ratio_p75"] = _percentile(per_round, 0.75)

    if config.profile:
        for full in [t for t in trainers if t.variant.base_name == "tl_full_every_step"]:
            profile = profile_model(spec, trainers, config, full)
            for row in results:
                if row["variant"] == full.variant.name:
                    row["profile"] = profile

    for trainer in trainers:
        trainer.instrument.close()
    return results


# --------------------------------------------------------------------------------------------
# Profile: where the time of the full-every-step variant goes


def _op_times(trainer: Trainer, steps: int) -> dict[str, tuple[float, int]]:
    """Self CPU time (ms per step) and calls per step of each op over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            trainer.step()
        trainer.instrument.settle()
    out: dict[str, tuple[float, int]] = {}
    for event in prof.key_averages():
        out[event.key] = (event.self_cpu_time_total / 1e3 / steps, round(event.count / steps))
    return out


def profile_model(spec: ModelSpec, trainers: Sequence[Trainer], config: BenchConfig, full: Trainer) -> dict[str, Any]:
    """Op-level (torch.profiler, minus the baseline) and function-level (cProfile) breakdowns."""
    by_name = {t.variant.name: t for t in trainers}
    base = by_name.get("baseline")
    steps = config.profile_steps
    _log(config, f"[{spec.name}] profiling {full.variant.name} ({steps} steps)")

    # Wall time first, without any profiler
    def wall(trainer: Trainer) -> float:
        trainer.activate()
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.step()
        trainer.instrument.settle()
        return (time.perf_counter() - t0) / steps * 1e3

    wall_full = wall(full)
    wall_base = wall(base) if base is not None else None

    full.activate()
    ops_full = _op_times(full, steps)
    ops_base = _op_times(base, steps) if base is not None else {}
    extra = []
    for key, (ms, calls) in ops_full.items():
        base_ms, base_calls = ops_base.get(key, (0.0, 0))
        if ms - base_ms > 0.0:
            extra.append({"op": key, "extra_ms_per_step": ms - base_ms, "extra_calls_per_step": calls - base_calls})
    extra.sort(key=lambda e: -e["extra_ms_per_step"])
    extra_total = sum(e["extra_ms_per_step"] for e in extra)

    # Function level: cProfile over the same number of steps, tensorlens frames only
    full.activate()
    profiler = cProfile.Profile()
    profiler.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        full.step()
    full.instrument.settle()
    profiled_step_ms = (time.perf_counter() - t0) / steps * 1e3
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    package = os.path.dirname(tl.__file__)
    functions = []
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if filename.startswith(package):
            functions.append({
                "function": f"{os.path.relpath(filename, os.path.dirname(package))}:{line}({func})",
                "calls_per_step": ncalls / steps,
                "self_ms_per_step": tottime / steps * 1e3,
                "cum_ms_per_step": cumtime / steps * 1e3,
            })
    functions.sort(key=lambda f: -f["cum_ms_per_step"])
    return {
        "steps": steps,
        "wall_ms_per_step": wall_full,
        "baseline_wall_ms_per_step": wall_base,
        "extra_op_ms_per_step": extra_total,
        "top_extra_ops": extra[:15],
        "cprofile_step_ms": profiled_step_ms,
        "top_functions": functions[:20],
    }


# --------------------------------------------------------------------------------------------
# Targets from the issue

TARGETS = (
    ("MLP full every step", "<= 2.0x"),
    ("Transformer full every step", "<= 1.10x"),
    ("any model full every 100 steps", "<= 1.02x"),
    ("steps not saved", "<= 1.01x"),
    ("overhead vs wandb.watch(all, log_freq=1)", ">= 5x smaller"),
    ("peak memory full every step", "<= 1.10x baseline"),
)


def evaluate_targets(results: Sequence[dict[str, Any]], memory: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    rows = {(r["model"], r["variant"]): r for r in results}
    out: list[dict[str, Any]] = []

    def add(target: str, limit: str, model: str, measured: float | None, ok: bool | None, note: str = "") -> None:
        control = rows.get((model, "baseline_control"))
        noise = abs(control["ratio_mean"] - 1.0) if control and "ratio_mean" in control else None
        out.append({"target": target, "limit": limit, "model": model, "measured": measured, "ok": ok,
                    "noise_floor": noise, "note": note})

    models = sorted({r["model"] for r in results}, key=list(MODELS).index)
    for model in models:
        full = rows.get((model, "tl_full_every_step"))
        if full and "ratio_mean" in full:
            if model == "mlp":
                add("MLP full every step", "<= 2.0x", model, full["ratio_mean"], full["ratio_mean"] <= 2.0)
            if model == "transformer":
                add("Transformer full every step", "<= 1.10x", model, full["ratio_mean"], full["ratio_mean"] <= 1.10)
        every100 = rows.get((model, "tl_full_every_100"))
        if every100 and "ratio_mean" in every100:
            add("any model full every 100 steps", "<= 1.02x", model, every100["ratio_mean"], every100["ratio_mean"] <= 1.02)
        unsaved = rows.get((model, "tl_unsaved"))
        if unsaved and "ratio_mean" in unsaved:
            own = unsaved.get("hook_us_per_unsaved_step")
            share = own / 1e3 / rows[(model, "baseline")]["mean_ms"] if own is not None else math.nan
            add("steps not saved", "<= 1.01x", model, unsaved["ratio_mean"], unsaved["ratio_mean"] <= 1.01,
                note=f"tl_unsaved step time / baseline; tensorlens's own time {own:.0f} us/step = {share * 100:.2g}% of a step")
        for name in ("tl_full_every_100", "tl_default"):
            row = rows.get((model, name))
            if row and row.get("ratio_unsaved_mean") is not None:
                add("steps not saved", "<= 1.01x", model, row["ratio_unsaved_mean"], row["ratio_unsaved_mean"] <= 1.01,
                    note=f"{name}, mean of unsaved steps / baseline mean (includes the saved steps' background "
                    f"work draining); medians {row['ratio_unsaved_median']:.3f}x")
        wb = rows.get((model, "wandb_all_every_step"))
        # like for like first (same tensors as wandb), then tensorlens full (adds activations)
        for name in ("tl_watch_all_every_step", "tl_full_every_step"):
            ours = rows.get((model, name))
            if ours and wb and "ratio_mean" in ours and "ratio_mean" in wb:
                tl_over = ours["mean_ms"] - rows[(model, "baseline")]["mean_ms"]
                wb_over = wb["mean_ms"] - rows[(model, "baseline")]["mean_ms"]
                factor = wb_over / tl_over if tl_over > 0 else math.inf
                add("overhead vs wandb.watch(all, log_freq=1)", ">= 5x smaller", model, factor, factor >= 5.0,
                    note=f"wandb +{wb_over:.2f} ms/step vs {name} +{tl_over:.2f} ms/step")
        mem_full, mem_base = memory.get((model, "tl_full_every_step")), memory.get((model, "baseline"))
        if mem_full and mem_base and "peak_rss_mb" in mem_full and "peak_rss_mb" in mem_base:
            ratio = mem_full["peak_rss_mb"] / mem_base["peak_rss_mb"]
            footprint = mem_full["footprint_mb"] / mem_base["footprint_mb"] if mem_base["footprint_mb"] > 0 else math.nan
            add("peak memory full every step", "<= 1.10x baseline", model, ratio, ratio <= 1.10,
                note=f"process peak RSS; training footprint ratio {footprint:.2f}x")
    return out


# --------------------------------------------------------------------------------------------
# Targets of issue 17: both paths, GPT-2, NaN steps, cost per tensor

PATH_TARGETS = {  # (model, variant) -> limit on the step-time ratio, per path
    ("mlp", "tl_full_every_step"): {"native": 1.35, "torch": 1.6},
    ("transformer", "tl_full_every_step"): {"native": 1.05, "torch": 1.10},
    ("gpt2", "tl_full_every_step"): {"native": 1.10, "torch": 1.10},
}
#: a step whose tensors hold NaN costs at most this much tensorlens time per step of the same finite step
NAN_LIMIT = 1.2


def _overhead_ms(rows: dict[tuple[str, str], dict[str, Any]], model: str, variant: str,
                 key: str = "round_block_ms") -> float | None:
    """tensorlens's time per step: the median over rounds of (its block's mean step - the
    baseline's block of the same round), flush included; robust to a neighbour's load spike,
    which a mean over the run is not."""
    row, base = rows.get((model, variant)), rows.get((model, "baseline"))
    if not row or not base:
        return None
    return statistics.median(a - b for a, b in zip(row[key], base[key], strict=True))


def evaluate_path_targets(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step-time targets per path, the NaN step against the finite one, and the cost per
    tensor from the sweep (the same values as 10 and as 1000 parameters)."""
    rows = {(r["model"], r["variant"]): r for r in results}
    out: list[dict[str, Any]] = []
    paths = sorted({r["path"] for r in results if r.get("path")})
    for (model, base_variant), limits in PATH_TARGETS.items():
        for path in paths:
            name = base_variant if path == "native" else f"{base_variant}[{path}]"
            row = rows.get((model, name))
            if row and "round_ratio_median" in row:
                limit, measured = limits[path], row["round_ratio_median"]
                cpu = row.get("ratio_cpu")
                out.append({"target": f"{model} {base_variant}", "path": path, "limit": f"<= {limit}x",
                            "measured": measured, "ok": measured <= limit,
                            "note": f"median of per-round ratios (flush included), IQR {row['round_ratio_p25']:.2f}-"
                                    f"{row['round_ratio_p75']:.2f}; mean of the run {row['ratio_mean']:.3f}x; "
                                    f"process CPU {_fmt(cpu, '.3f', 'x')}"})
    variants = sorted({r["variant"] for r in results if r["model"] == "layers640_nan" and r.get("path")})
    for name in variants:
        nan, finite = _overhead_ms(rows, "layers640_nan", name), _overhead_ms(rows, "layers640", name)
        nan_cpu = _overhead_ms(rows, "layers640_nan", name, "round_block_cpu_ms")
        finite_cpu = _overhead_ms(rows, "layers640", name, "round_block_cpu_ms")
        if nan is not None and finite:
            ratio = nan / finite
            cpu = f"{nan_cpu / finite_cpu:.2f}x (+{nan_cpu:.2f} vs +{finite_cpu:.2f} ms)" if nan_cpu is not None and finite_cpu else "-"
            out.append({"target": "NaN step / finite step (tensorlens time)", "path": rows[("layers640_nan", name)]["path"],
                        "limit": f"<= {NAN_LIMIT}x", "measured": ratio, "ok": ratio <= NAN_LIMIT,
                        "note": f"{name}: +{nan:.2f} ms with NaN vs +{finite:.2f} ms finite; process CPU {cpu}"})
    variants = sorted({r["variant"] for r in results if r["model"] == "sweep1000" and r.get("path")})
    for name in variants:
        few, many = _overhead_ms(rows, "sweep10", name, "round_block_cpu_ms"), _overhead_ms(rows, "sweep1000", name, "round_block_cpu_ms")
        if few is not None and many is not None:
            per_tensor = (many - few) / (2 * (1000 - 10)) * 1e3  # weights and gradients
            out.append({"target": "cost per tensor (sweep 1000 - sweep 10)", "path": rows[("sweep1000", name)]["path"],
                        "limit": "report", "measured": per_tensor, "ok": None,
                        "note": f"{name}: process CPU us per watched tensor, training thread and background "
                                f"together (+{few:.1f} ms at 20 tensors, +{many:.1f} ms at 2000)"})
    return out


def format_path_targets(targets: Sequence[dict[str, Any]]) -> list[str]:
    if not targets:
        return []
    lines = ["", "Targets (issue 17) per path"]
    for t in targets:
        verdict = "report" if t["ok"] is None else "ok" if t["ok"] else "MISS"
        unit = " us" if t["limit"] == "report" else "x"
        lines.append(f"  {t['target']:<42} {t['path']:<7} {_fmt(t['measured'], '.3f', unit):>10}  target {t['limit']:<8} "
                     f"{verdict:<6} ({t['note']})")
    return lines


# --------------------------------------------------------------------------------------------
# Python cost per watched tensor, measured directly (issue 17)


def measure_per_tensor(paths: Sequence[str], count: int = 1000, steps: int = 15) -> list[dict[str, Any]]:
    """tensorlens's own time per watched tensor at a saved step's end, without the noise of a
    training step: ``count`` tiny ``Linear(4, 4)`` layers (``2 * count`` parameters and as many
    gradients, 8 to 16 values each, so the work per value is nil), weights, biases and gradients
    with 64-bin histograms, every step. Thread CPU time (``time.thread_time``) of the optimizer
    pre-hook (the jobs, the statistics, the one host copy) on the training thread, and of building
    the record and writing the store on the dispatcher thread; medians over ``steps`` steps."""
    import tensorlens.engine.recorder as recorder_module
    from tensorlens.dispatch import assemble
    from tensorlens.store import writer

    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # Python's cost, on one core: OpenMP workers waiting would count as CPU time
    for path in paths:
        select_path(path)
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(count)])
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(2, 4)
        work_dir = tempfile.mkdtemp(prefix="tl-bench-per-tensor-")
        hook = tl.watch(model, collections=["weights", "biases", "gradients"], save_interval=1,
                        histograms=tl.HistogramConfig(bins=64), backends=["local"], out_dir=work_dir)
        spent: dict[str, list[float]] = {"training thread": [], "record": [], "store": []}
        originals = []

        def timed(owner: Any, name: str, label: str, spent: dict[str, list[float]] = spent,
                  originals: list[tuple[Any, str, Any]] = originals) -> None:
            original = getattr(owner, name)
            originals.append((owner, name, original))

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                started = time.thread_time()
                try:
                    return original(*args, **kwargs)
                finally:
                    spent[label].append(time.thread_time() - started)

            setattr(owner, name, wrapper)

        try:
            for _ in range(3):  # plans built, caches warm
                optimizer.zero_grad(set_to_none=True)
                model(x).sum().backward()
                optimizer.step()
            hook.flush()
            timed(recorder_module.Recorder, "prepare_step", "training thread")
            timed(assemble, "build_record", "record")
            timed(writer.RunStoreWriter, "write", "store")
            hook._dispatcher._build = assemble.build_record if hasattr(hook._dispatcher, "_build") else None
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                model(x).sum().backward()
                optimizer.step()
                hook.flush()
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)
            hook.close()
            shutil.rmtree(work_dir, ignore_errors=True)
        tensors = 4 * count  # weights, biases and their gradients
        torch.set_num_threads(threads)
        row = {"path": path, "tensors": tensors}
        for label, values in spent.items():
            if values:
                row[f"{label} us/tensor"] = statistics.median(values) / tensors * 1e6
        out.append(row)
    return out


def format_per_tensor(rows: Sequence[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = ["", "Python cost per watched tensor (thread CPU time, 4000 tensors of 4-16 values, every step saved)"]
    for row in rows:
        parts = [f"{k.removesuffix(' us/tensor')} {v:.2f} us" for k, v in row.items() if k.endswith("us/tensor")]
        lines.append(f"  {row['path']:<7} " + ", ".join(parts))
    return lines


# --------------------------------------------------------------------------------------------
# Entry points


def run_benchmark(config: BenchConfig, progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the benchmark and return the JSON-ready result (see the module docstring).

    ``progress(report)`` receives the partial report after each model and each memory pass.
    The caller's ``TENSORLENS_NATIVE`` is restored afterwards (variants switch paths by setting it).
    """
    before = os.environ.get("TENSORLENS_NATIVE")
    try:
        return _run_benchmark(config, progress)
    finally:
        if before is None:
            os.environ.pop("TENSORLENS_NATIVE", None)
        else:
            os.environ["TENSORLENS_NATIVE"] = before


def _run_benchmark(config: BenchConfig, progress: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    unknown = [m for m in config.models if m not in MODELS] + [v for v in config.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"Expected models from {list(MODELS)} and variants from {list(VARIANTS)}, but got {unknown}")
    torch.set_num_threads(config.threads)
    skipped: list[str] = []
    names = list(dict.fromkeys(config.variants))
    if "baseline" not in names:
        names.insert(0, "baseline")  # every ratio is against it
    names.sort(key=lambda n: n != "baseline")  # first, so the sync pass can subtract it
    if any(VARIANTS[n].kind == "wandb" for n in names) and not wandb_available():
        skipped.append("wandb variants skipped: wandb is not installed (pip install 'tensorlens[wandb]')")
        names = [n for n in names if VARIANTS[n].kind != "wandb"]
    variants = with_paths([VARIANTS[n] for n in names], config.paths or default_paths())
    unknown_paths = [p for p in config.paths if p not in PATHS]
    if unknown_paths:
        raise ValueError(f"Expected paths from {list(PATHS)}, but got {unknown_paths}")

    meta = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensorlens": tl.__version__,
        "tensorlens_path": os.path.dirname(tl.__file__),
        "tensorlens_git": _git_revision(os.path.dirname(tl.__file__)),
        "wandb": _wandb_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "paths": sorted({v.path for v in variants if v.path}),
        "loadavg_before": _loadavg(),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()},
    }
    _log(config, f"torch.set_num_threads({config.threads}); torch.get_num_threads() = {torch.get_num_threads()}; "
                 f"cpu_count = {os.cpu_count()}; loadavg = {meta['loadavg_before']}")
    results: list[dict[str, Any]] = []
    memory: dict[tuple[str, str], dict[str, Any]] = {}
    caught: list[warnings.WarningMessage] = []

    def assemble() -> dict[str, Any]:
        for row in results:
            mem = memory.get((row["model"], row["variant"]))
            base = memory.get((row["model"], "baseline"))
            row["memory"] = mem
            row["peak_rss_ratio"] = (
                mem["peak_rss_mb"] / base["peak_rss_mb"] if mem and base and "peak_rss_mb" in mem and "peak_rss_mb" in base else None
            )
        meta["loadavg_after"] = _loadavg()
        messages = list(dict.fromkeys(str(w.message) for w in caught))
        return {"meta": meta, "results": results, "targets": evaluate_targets(results, memory),
                "path_targets": evaluate_path_targets(results), "skipped": skipped,
                "warnings": messages}

    work_dir = tempfile.mkdtemp(prefix="tl-bench-")
    try:
        with contextlib.ExitStack() as stack:
            if any(v.kind == "wandb" for v in variants):
                stack.enter_context(wandb_offline_run(work_dir))
            # recorded, not shown: a tensorlens hook that fails warns once and training goes on,
            # so a failure would otherwise look like a very cheap variant
            with warnings.catch_warnings(record=True) as recorded:
                warnings.simplefilter("always")
                for model in config.models:
                    results += measure_model(MODELS[model], variants, config, work_dir)
                    caught[:] = recorded
                    if progress is not None:  # a long run killed later still leaves what it measured
                        progress(assemble())
        if config.memory:
            for model in config.models:
                for variant in variants:
                    steps = config.memory_steps
                    if variant.kind == "wandb" and variant.save_interval and not config.quick_memory:
                        # wandb logs on its log_freq-th call (tensorlens at step 0): train far enough to include one
                        steps = max(steps, variant.save_interval)
                    _log(config, f"[{model}] peak memory of {variant.name} ({steps} steps, subprocess)")
                    memory[(model, variant.name)] = measure_memory(model, variant.name, steps, config.threads)
                if progress is not None:
                    progress(assemble())
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return assemble()


def _git_revision(path: str) -> dict[str, Any] | None:
    """The commit of the measured tensorlens, and whether its files differ from it (others may be
    editing the engine in the same checkout while this runs)."""
    try:
        commit = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def _wandb_version() -> str | None:
    try:
        import wandb
    except Exception:
        return None
    return str(wandb.__version__)


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{suffix}"


def format_report(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"tensorlens overhead — torch {meta['torch']}, {meta['torch_threads']} torch threads, "
        f"{meta['cpu_count']} CPUs, loadavg {meta['loadavg_before']} -> {meta.get('loadavg_after')}",
        f"tensorlens from {meta['tensorlens_path']} {meta['tensorlens_git'] or ''}",
        "",
    ]
    header = ("model", "variant", "mean ms", "median ms", "x base", "x base (median)", "round IQR", "x base (CPU)",
              "peak RSS MB", "x RSS", "host copies/saved", "syncs/saved", "bg CPU ms/step")
    table = [header]
    for r in report["results"]:
        mem = r.get("memory") or {}
        table.append((
            r["model"], r["variant"], _fmt(r["mean_ms"]), _fmt(r["median_ms"]), _fmt(r.get("ratio_mean"), ".3f"),
            _fmt(r.get("ratio_median"), ".3f"),
            f"{_fmt(r.get('round_ratio_p25'), '.2f')}–{_fmt(r.get('round_ratio_p75'), '.2f')}", _fmt(r.get("ratio_cpu"), ".3f"),
            _fmt(mem.get("peak_rss_mb"), ".0f"), _fmt(r.get("peak_rss_ratio"), ".3f"),
            _fmt(r.get("host_copies_per_saved_step"), ".1f"), _fmt(r.get("sync_points_per_saved_step"), ".0f"),
            _fmt(r.get("background_cpu_ms_per_step"), ".2f"),
        ))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        lines.append("  ".join(str(c).ljust(w) if j < 2 else str(c).rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += ["", "Targets (issue 5)  — noise floor = |A/A control ratio - 1| of the same model"]
    for t in report["targets"]:
        verdict = "ok" if t["ok"] else "MISS"
        measured = _fmt(t["measured"], ".3f", "x")
        noise = _fmt(t["noise_floor"], ".3f")
        note = f"  ({t['note']})" if t["note"] else ""
        lines.append(f"  {t['target']:<42} {t['model']:<12} {measured:>9}  target {t['limit']:<18} {verdict:<5} noise {noise}{note}")
    for r in report["results"]:
        if r.get("hook_steps_ok") is False:
            lines.append(f"  WARNING {r['model']}/{r['variant']}: hook counted {r['hook_global_step']} steps, "
                         f"the variant took {r['steps_taken']}")
        if (r.get("memory") or {}).get("error"):
            lines.append(f"  memory of {r['model']}/{r['variant']} failed: {r['memory']['error']}")
    lines += format_path_targets(report.get("path_targets", []))
    lines += [f"  {message}" for message in report["skipped"]]
    lines += [f"  warning: {message}" for message in report["warnings"] if "tensorlens" in message]
    for r in report["results"]:
        profile = r.get("profile")
        if not profile:
            continue
        lines += ["", f"Profile of {r['model']} / {r['variant']} over {profile['steps']} steps: "
                      f"{profile['wall_ms_per_step']:.2f} ms/step vs baseline {_fmt(profile['baseline_wall_ms_per_step'])} ms; "
                      f"ops added by tensorlens {profile['extra_op_ms_per_step']:.2f} ms/step (torch.profiler self CPU)"]
        for e in profile["top_extra_ops"][:10]:
            lines.append(f"    {e['op']:<40} +{e['extra_ms_per_step']:7.3f} ms  +{e['extra_calls_per_step']} calls")
        lines.append(f"  tensorlens functions (cProfile, {profile['cprofile_step_ms']:.2f} ms/step under the profiler):")
        for f in profile["top_functions"][:20]:
            lines.append(f"    {f['function']:<70} cum {f['cum_ms_per_step']:7.3f} ms  self {f['self_ms_per_step']:7.3f} ms"
                         f"  {f['calls_per_step']:.0f} calls")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=None)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                   help=f"default: {' '.join(DEFAULT_VARIANTS)}")
    p.add_argument("--steps", type=int, default=None, help="measured steps per variant (default: per model, 200-400)")
    p.add_argument("--block", type=int, default=None, help="steps per variant per round (default: per model, 10 for most)")
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=None,
                   help="tensorlens's compiled CPU kernel and/or PyTorch ops (the GPU path); default: both where the kernel is built")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: min(cpus, 8))")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    p.add_argument("--memory-steps", type=int, default=12)
    p.add_argument("--profile", action="store_true", help="profile tl_full_every_step (torch.profiler + cProfile)")
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="MLP only, a few steps: checks that everything runs")
    p.add_argument("--per-tensor", action="store_true", help="also measure the Python cost per watched tensor (4000 tiny tensors)")
    p.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--memory-child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    threads = args.threads or max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8))
    if args.memory_child:
        print(json.dumps(memory_child(*args.memory_child, steps=args.steps or 12, threads=threads)))
        return 0
    config = BenchConfig(threads=threads, block=args.block, warmup=args.warmup, memory=not args.no_memory,
                         memory_steps=args.memory_steps, profile=args.profile, profile_steps=args.profile_steps)
    if args.quick:
        config.models, config.steps, config.block, config.warmup = ["mlp"], 10, 5, 2
        config.memory_steps, config.profile_steps, config.quick_memory = 3, 3, True
    if args.models:
        config.models = args.models
    elif args.per_tensor:
        config.models = []  # --per-tensor alone: only that measurement
    if args.variants:
        config.variants = args.variants
    if args.steps:
        config.steps = args.steps
    if args.paths:
        config.paths = args.paths
    print(f"torch threads: {threads}", file=sys.stderr)

    def write(report: dict[str, Any]) -> None:
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                f.write(json.dumps(report, indent=2, default=str) + "\n")
            os.replace(args.out + ".tmp", args.out)

    report = run_benchmark(config, progress=write) if config.models else {"meta": {}, "results": [], "targets": [], "skipped": [], "warnings": []}
    if args.per_tensor:
        report["per_tensor"] = measure_per_tensor(config.paths or default_paths())
    write(report)
    text = format_report(report) if report["results"] else ""
    text += "\n".join(format_per_tensor(report.get("per_tensor", [])))
    payload = json.dumps(report, indent=2, default=str)
    if args.json:
        print(text, file=sys.stderr)
        print(payload)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
