"""Health at a glance, on real training (a healthy MLP, a dead-ReLU collapse, a NaN run; see
health_runs.py): the health summary the report opens with, one colour scale per statistic across
runs, the "what differs" ranking (report and ``tensorlens compare`` alike) and the explorer's marks,
checked against what the store holds, read with the public reader."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import tensorlens as tl
from tensorlens.analysis.compare import DivergenceRanking, rank_runs, relative_difference
from tensorlens.reports import build_explorer, build_report, load_run
from tensorlens.reports.health import run_health

try:
    from .conftest import FAULT_STEP
    from .health_runs import BROKEN_LAYER, DEAD_RELU
    from .test_report import charts_titled, payload
except ImportError:
    from conftest import FAULT_STEP
    from health_runs import BROKEN_LAYER, DEAD_RELU
    from test_report import charts_titled, payload

click_testing = pytest.importorskip("click.testing")


def _first_nonfinite_step(path: str) -> tuple[int, set[str]]:
    """The reference: the first step at which a stored count of NaN/Inf is above 0, and the tensors."""
    with tl.open_run(path) as run:
        for record in run.records(mode="train"):
            bad = {t for (t, s), v in zip(record.scalar_names, record.scalar_values, strict=True)
                   if s in ("nan_count", "inf_count") and v > 0}
            bad |= {t for (t, s), v in zip(record.scalar_names, record.scalar_values, strict=True)
                    if not s and not math.isfinite(v)}
            if bad:
                return record.step, bad
    raise AssertionError("no non-finite value stored")


def test_health_of_a_healthy_a_dead_and_a_nan_run(health_runs: dict[str, str]) -> None:
    health = {name: run_health(load_run(path)) for name, path in health_runs.items()}
    # the default rules follow what was recorded: activations and dynamics add DeadRelu and the update ratio
    assert {"NonFiniteGradient", "ExplodingTensor", "DeadRelu", "UpdateRatioOutOfRange"} <= set(health["healthy"].rules)

    healthy = health["healthy"]
    assert healthy.status == "healthy" and healthy.fired == [] and healthy.first_nonfinite is None
    assert healthy.counts() == {"critical": 0, "warning": 0}

    dead = health["dead"]
    assert dead.status == "warning"
    fired = {r.rule: r for r in dead.fired}
    assert fired["DeadRelu"].first.step == FAULT_STEP and fired["DeadRelu"].tensors == [f"activations/{DEAD_RELU}"]
    assert "NonFiniteGradient" not in fired and "ExplodingTensor" not in fired and dead.first_nonfinite is None
    assert dead.dead_statistic == "dead_fraction" and dead.dead[0] == (f"activations/{DEAD_RELU}", 1.0)
    ratios = dict(dead.update_ratios)
    with tl.open_run(health_runs["dead"]) as run:
        last = run.steps()[-1]
        assert run.tensor(f"activations/{DEAD_RELU}").reduction_value(last, "dead_fraction") == 1.0
        for param, ratio in ratios.items():
            assert ratio == run.tensor(f"dynamics/{param}").reduction_value(last, "update_ratio")
    # nothing before the dead ReLU learns any more: an update ratio of 0 is the farthest from 1e-3
    assert ratios["0.weight"] == 0.0 and ratios[f"{BROKEN_LAYER}.weight"] == 0.0 and dead.update_ratios[0][1] == 0.0
    assert ratios["4.bias"] > 0  # the last layer's bias still learns

    nan = health["nan"]
    assert nan.status == "critical" and nan.fired[0].severity == "critical"
    critical = {r.rule: r for r in nan.fired if r.severity == "critical"}
    assert set(critical) == {"NonFiniteGradient", "ExplodingTensor"}
    assert all(r.first.step == FAULT_STEP for r in critical.values())
    step, tensors = nan.first_nonfinite
    want_step, want_tensors = _first_nonfinite_step(health_runs["nan"])
    assert step == want_step == FAULT_STEP and set(tensors) == want_tensors
    # in the order a step computes them: the NaN entered at the input, so the first layer's output comes first
    assert tensors[0] == "activations/0" and tensors.index("losses/crossentropyloss") < tensors.index("gradients/0.weight")
    assert sum(nan.counts().values()) == len(nan.findings)
    # a dead fraction of NaN activations says nothing about dead units: not counted
    assert all(math.isnan(v) for _, v in nan.dead)


def _cards(page: str) -> dict[str, str]:
    """Each health card's markup by run name."""
    cards = page.split('<div class="tl-card ')[1:]
    return {re.search(r"</span>([^<]*)</h3>", c).group(1): c for c in cards}


def test_report_opens_with_each_runs_health(health_runs: dict[str, str]) -> None:
    page = build_report(list(health_runs.values())).html
    assert page.index('id="health"') < page.index('id="differences"') < page.index('id="overview"')
    cards = _cards(page)
    assert list(cards) == ["healthy", "dead", "nan"]
    assert [re.match(r'tl-status-(\w+)"', c).group(1) for c in cards.values()] == ["healthy", "warning", "critical"]
    assert "healthy: no rule fired" in cards["healthy"] and "none in 16 saved steps" in cards["healthy"]
    dead = cards["dead"]
    assert f"<td>\u25b2 DeadRelu</td><td>{16 - FAULT_STEP} from step {FAULT_STEP}</td><td>activations/{DEAD_RELU}</td>" in dead
    assert f"activations/{DEAD_RELU} 100 % (dead_fraction at step 15)" in dead
    nan = cards["nan"]
    assert f"<dt>first NaN/Inf</dt><dd>step {FAULT_STEP}: activations/0, activations/1, activations/2 +" in nan
    assert "<td>\u2716 ExplodingTensor</td>" in nan and "<td>\u2716 NonFiniteGradient</td>" in nan
    assert "not counted: all 5 layers hold NaN/Inf at step 15" in nan
    # the findings section lists what the rules find on the store now (the runs stored none while training)
    data = payload(page)
    [ticks] = charts_titled(data, "Rule findings over steps")
    assert "DeadRelu" in ticks["data"]["values"]["columns"]["rule"]


def test_one_colour_scale_per_statistic_across_runs(health_runs: dict[str, str]) -> None:
    data = payload(build_report(list(health_runs.values())).html)
    heatmaps: dict[str, list[dict]] = {}
    for chart in data["charts"].values():
        title = str(chart["spec"].get("title", {}).get("text", ""))
        if " — " in title and chart["data"]["values"].get("format") == "matrix":
            heatmaps.setdefault(title.split(" — ")[0], []).append(chart)
    assert {"gradients l2", "activations dead_fraction", "dynamics update_ratio"} <= set(heatmaps)
    for title, charts in heatmaps.items():
        assert len(charts) == 3, title
        domains = [c["spec"]["layer"][0]["encoding"]["color"]["scale"]["domain"] for c in charts]
        assert domains[0] == domains[1] == domains[2], title
    # a fraction runs from 0 to 1: a 6 %-dead layer is not drawn as bright as a 100 %-dead one
    assert heatmaps["activations dead_fraction"][0]["spec"]["layer"][0]["encoding"]["color"]["scale"]["domain"] == [0, 1]
    # other statistics: from the smallest to the largest finite value of any run, read back from the stores
    values = []
    for path in health_runs.values():
        with tl.open_run(path) as run:
            for name in run.tensor_names(collection="gradients"):
                values += list(run.tensor(name).reduction_values("l2").values())
    finite = np.array([v for v in values if math.isfinite(v)])
    low, high = heatmaps["gradients l2"][0]["spec"]["layer"][0]["encoding"]["color"]["scale"]["domain"]
    assert low == finite.min() and high == finite.max()
    # the NaN run's gradients are drawn red from the fault on, not left blank
    nan_chart = next(c for c in heatmaps["gradients l2"] if c["spec"]["title"]["text"].endswith("— nan"))
    flagged = nan_chart["data"]["values"]["nonfinite"]
    steps = nan_chart["data"]["values"]["steps"]
    assert flagged and min(i % len(steps) for i in flagged) == steps.index(FAULT_STEP)
    assert nan_chart["spec"]["layer"][1]["mark"]["color"] == "#e4002b"


def test_relative_difference_and_score_against_numpy(health_runs: dict[str, str]) -> None:
    a = np.array([1.0, 2.0, -1.0, 0.0, 0.0, np.nan, np.nan, np.inf, np.inf, 3.0])
    b = np.array([1.0, 1.0, 1.0, 0.0, 2.0, 1.0, np.nan, np.inf, -np.inf, np.inf])
    want = [0.0, 1 / 3, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    np.testing.assert_allclose(relative_difference(a, b), want)
    # the score of the top tensor, recomputed from the stores with numpy
    [top] = rank_runs(health_runs["healthy"], health_runs["dead"], top=1)
    with tl.open_run(health_runs["healthy"]) as x, tl.open_run(health_runs["dead"]) as y:
        sa = x.tensor(top.tensor).reduction_values(top.stat)
        sb = y.tensor(top.tensor).reduction_values(top.stat)
    steps = sorted(sa.keys() & sb.keys())
    d = np.array([abs(sa[s] - sb[s]) / (abs(sa[s]) + abs(sb[s])) if sa[s] != sb[s] else 0.0 for s in steps])
    onset = next(i for i, v in enumerate(d) if v > 0.01)
    assert top.step == steps[onset] and top.score == pytest.approx(d[onset:].sum() / len(steps))
    assert (top.a, top.b) == (sa[top.step], sb[top.step])
    with pytest.raises(ValueError, match="tolerance"):
        DivergenceRanking(tolerance=1.5)


def test_ranking_puts_the_changed_layer_first(health_runs: dict[str, str]) -> None:
    healthy, dead, nan = health_runs["healthy"], health_runs["dead"], health_runs["nan"]
    ranked = rank_runs(healthy, dead)
    # the runs are the same until the fault: nothing diverges before it, and the broken layer's bias comes first
    assert all(d.step >= FAULT_STEP for d in ranked) and len(ranked) == 20
    assert ranked[0].tensor == f"biases/{BROKEN_LAYER}.bias" and ranked[0].step == FAULT_STEP
    assert ranked[0].score == pytest.approx((16 - FAULT_STEP) / 16)
    ranked_nan = rank_runs(healthy, nan)
    assert ranked_nan[0].tensor == "activations/0" and ranked_nan[0].step == FAULT_STEP and math.isnan(ranked_nan[0].b)
    # the report shows the same ranking, run by run against the first
    page = build_report([healthy, dead, nan]).html
    section = page[page.index('id="differences"'):page.index('id="overview"')]
    tables = re.findall(r"<tbody>(.*?)</tbody>", section, re.S)
    assert len(tables) == 2
    for table, want in zip(tables, (ranked, ranked_nan), strict=True):
        rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td><td>([^<]*)</td><td>(\d+)</td>", table)
        assert [(r[1], r[3]) for r in rows] == [(d.tensor, str(d.step)) for d in want]
    assert "dead against healthy: 20 of" in section
    # tensorlens compare prints it first, then one line for the statistics that differ at all
    from tensorlens.cli import compare as compare_cli

    out = click_testing.CliRunner().invoke(compare_cli.command, [healthy, dead, "--limit", "5"]).output
    rows = re.findall(r"^  (\d+) +(\S+) +(\S+) +(\d+) +([\d.]+) ", out, re.M)
    assert [(r[1], int(r[3])) for r in rows] == [(d.tensor, d.step) for d in ranked[:5]], out
    assert re.search(r"^\d+ statistics differ beyond rtol=1e-06 atol=0 \(--all lists", out, re.M), out
    assert len(out.splitlines()) < 15  # not every statistic


def test_explorer_marks_modules_with_findings(health_runs: dict[str, str]) -> None:
    marks = payload(build_explorer(health_runs["dead"]).html)["health"]
    assert marks[DEAD_RELU]["status"] == "warning" and [r[0] for r in marks[DEAD_RELU]["rules"]] == ["DeadRelu"]
    assert marks[DEAD_RELU]["findings"][0][:3] == ["DeadRelu", FAULT_STEP, f"activations/{DEAD_RELU}"]
    assert "VanishingGradient" in [r[0] for r in marks["0"]["rules"]]
    nan = payload(build_explorer(health_runs["nan"]).html)["health"]
    assert nan["0"]["status"] == "critical"
    assert {r[0] for r in nan["0"]["rules"]} >= {"NonFiniteGradient", "ExplodingTensor"}
    assert payload(build_explorer(health_runs["healthy"]).html)["health"] == {}


def test_rules_that_had_nothing_to_read_are_shown_and_not_counted(scales_run: str) -> None:
    health = run_health(load_run(scales_run))  # watched without a loss function: no losses/
    notes = {n.rule: n.message for n in health.not_evaluated}
    assert "LossNotDecreasing" in notes and "LossNotDecreasing" in health.rules
    assert all(r.rule not in notes for r in health.fired)
    page = build_report(scales_run).html
    card = next(iter(_cards(page).values()))
    assert f"<dt>not evaluated</dt><dd>LossNotDecreasing: {notes['LossNotDecreasing']}" in card.replace("&#x27;", "'")


def test_what_changed_first_is_in_the_nan_runs_card(health_runs: dict[str, str]) -> None:
    from tensorlens.analysis.explain import explain

    want = explain(health_runs["nan"], top=3)
    assert want.event is not None and want.event.step == FAULT_STEP
    health = run_health(load_run(health_runs["nan"]))
    assert [c.tensor for c in health.explanation.causes] == [c.tensor for c in want.causes]
    card = _cards(build_report(health_runs["nan"]).html)["nan"]
    assert f"<dt>what changed first</dt><dd>{want.causes[0]}" in card
    assert run_health(load_run(health_runs["healthy"])).explanation is None  # no event: no line


def test_the_rules_run_in_the_pass_that_loads_the_run(health_runs: dict[str, str]) -> None:
    from tensorlens.reports.health import rules_reader
    from tensorlens.rules.offline import evaluate

    for path in health_runs.values():
        with tl.open_run(path) as run:
            calls = []
            records = run.records
            run.records = lambda *a, calls=calls, records=records, **k: calls.append(1) or records(*a, **k)  # type: ignore[method-assign]
            shared = load_run(run, reader=rules_reader)
            assert len(calls) == 1  # one read of the store for the page's data and the rules
            run.records = records  # type: ignore[method-assign]
            plain = load_run(run)
            assert shared.steps == plain.steps and shared.nonfinite_tensors == plain.nonfinite_tensors
            assert [r.step for r in shared.column_records] == [r.step for r in plain.column_records]
            assert shared.plain.keys() == plain.plain.keys() and shared.latest.step == plain.latest.step
            for key, (steps, values) in plain.plain.items():
                assert shared.plain[key][0] == steps
                np.testing.assert_array_equal(shared.plain[key][1], values)  # NaN equals NaN here
            want = {(f.rule, f.step, f.tensor) for f in evaluate(run).findings}
            assert {(f.rule, f.step, f.tensor) for f in run_health(shared).findings} == want
