"""The report and the explorer, built from real runs: the numbers they carry match the reader,
names are escaped, nothing outside the run folders is read. (The browser tests draw them.)"""

from __future__ import annotations

import base64
import html
import json
import os
import re

import numpy as np
import pytest
import torch

import tensorlens as tl
from tensorlens.capture.modules import describe_modules
from tensorlens.reports import ReportOptions, build_explorer, build_report, load_run, register_section
from tensorlens.reports.blocks import Note, Section
from tensorlens.reports.explorer import build_tree
from tensorlens.reports.page import LEVELS, LOG_FLOOR, rounded, script_json
from tensorlens.reports.sections import _PROVIDERS

try:
    from .report_runs import HOSTILE, write_run
except ImportError:
    from report_runs import HOSTILE, write_run


def payload(page_html: str) -> dict:
    found = re.search(r'<script type="application/json" id="tl-data">(.*?)</script>', page_html, re.S)
    assert found is not None
    return json.loads(found.group(1))


def expand_table(dataset: dict) -> list[dict]:
    columns = dataset["columns"]
    keys = list(columns)
    return [dict(zip(keys, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def charts_titled(data: dict, prefix: str) -> list[dict]:
    return [c for c in data["charts"].values() if str(c["spec"].get("title", {}).get("text", "")).startswith(prefix)]


def test_report_carries_the_global_gradient_norm_and_losses(real_run: str) -> None:
    page = build_report(real_run)
    data = payload(page.html)
    [norm] = charts_titled(data, "Global gradient norm")
    rows = expand_table(norm["data"]["values"])
    with tl.open_run(real_run) as run:
        grads = run.tensor_names(collection="gradients")
        for row in rows:
            want = np.sqrt(sum(run.tensor(g).reduction_value(row["step"], "l2") ** 2 for g in grads))
            assert row["value"] == pytest.approx(want, rel=1e-4)  # 5 significant digits in the page
        assert [r["step"] for r in rows] == run.steps()
        losses = run.tensor("losses/crossentropyloss")
        train = losses.values()
        evals = losses.values(mode="eval")
    [loss] = charts_titled(data, "losses/crossentropyloss")
    rows = expand_table(loss["data"]["values"])
    got_train = {r["step"]: r["value"] for r in rows if r["mode"] == "train"}
    assert got_train.keys() == train.keys()
    assert all(got_train[s] == pytest.approx(v, rel=1e-4) for s, v in train.items())
    assert sum(r["mode"] == "eval" for r in rows) == len(evals) == 2
    assert loss["spec"]["layer"][0]["encoding"]["strokeDash"]["field"] == "mode"  # eval dashed
    assert loss["spec"]["layer"][1]["mark"]["type"] == "point"  # and shown as points, even one alone


def test_report_sections_and_layer_heatmap_values(real_run: str) -> None:
    data = payload(build_report(real_run).html)
    page = build_report(real_run).html
    for title in ("Gradient norm and losses", "Layers over steps", "NaN and Inf", "Distributions over steps"):
        assert f">{title}</h2>" in page
    [grad_l2] = charts_titled(data, "gradients l2")
    matrix = grad_l2["data"]["values"]
    assert matrix["format"] == "matrix"
    values = np.array(matrix["values"], dtype=float).reshape(len(matrix["rows"]), len(matrix["steps"]))
    with tl.open_run(real_run) as run:
        for i, label in enumerate(matrix["rows"]):
            view = run.tensor(f"gradients/{label}")
            for j, step in enumerate(matrix["steps"]):
                assert values[i, j] == pytest.approx(view.reduction_value(int(step), "l2"), rel=1e-4)
    assert "No NaN or Inf" in page or "no NaN or Inf" in page


def test_histogram_heatmap_levels_decode_to_the_grid_fractions(real_run: str) -> None:
    from tensorlens.stats.views import heatmap_grid

    data = payload(build_report(real_run).html)
    [chart] = charts_titled(data, "gradients/0.weight")
    grid = chart["data"]["values"]
    levels = np.frombuffer(base64.b64decode(grid["levels"]), dtype=np.uint8)
    rows = len(grid["edges"]) - 1
    levels = levels.reshape(len(grid["steps"]), rows).T
    with tl.open_run(real_run) as run:
        view = run.tensor("gradients/0.weight")
        hists = [view.histogram(int(s)) for s in grid["steps"]]
    edges_ref, image = heatmap_grid([c for c, _ in hists], [e for _, e in hists], rows, axis="quantile")
    np.testing.assert_allclose(grid["edges"], edges_ref, rtol=1e-5)
    decoded = np.where(levels > 0, LOG_FLOOR + (levels.astype(float) - 1) / (LEVELS - 1) * -LOG_FLOOR, -np.inf)
    with np.errstate(divide="ignore"):
        want = np.maximum(np.log10(image), LOG_FLOOR)
    nonzero = image > 0
    assert np.array_equal(levels > 0, nonzero)
    np.testing.assert_allclose(decoded[nonzero], want[nonzero], atol=-LOG_FLOOR / (LEVELS - 1))


def test_names_are_escaped_everywhere(hostile_run: str) -> None:
    for page in (build_report(hostile_run).html, build_explorer(hostile_run).html):
        assert HOSTILE not in page  # neither as markup nor raw in the JSON
        assert html.escape(HOSTILE) in page  # shown as text in the markup
        data = payload(page)
        assert HOSTILE in json.dumps(data, ensure_ascii=False)  # the data keeps the real name
        assert "</script" not in page.split('id="tl-data">', 1)[1].split("</script>", 1)[0]


def test_script_json_cannot_close_its_element() -> None:
    text = script_json({"a": "</script><script>alert(1)</script>", "b": "&\u2028", "c": "<!--"})
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    # U+2028 is shown as its escape (see test_page_data.py)
    assert json.loads(text) == {"a": "</script><script>alert(1)</script>", "b": "&\\u2028", "c": "<!--"}


def test_rounded_keeps_significant_digits_and_drops_non_finite() -> None:
    assert rounded([123456.789, 0.000123456789, 0.0, -2.5, np.nan, np.inf]) == [123460.0, 0.00012346, 0.0, -2.5, None, None]


def test_several_runs_are_overlaid_with_distinct_names(real_run: str, tmp_path) -> None:
    other = write_run(str(tmp_path / "other"), 5, ["weights/lin.weight", "gradients/lin.weight"])
    page = build_report([real_run, other, other])
    data = payload(page.html)
    [norm] = charts_titled(data, "Global gradient norm")
    runs = {r["run"] for r in expand_table(norm["data"]["values"])}
    assert len(runs) == 3 and "other (2)" in runs  # the same run twice still gets two legend entries
    scale = norm["spec"]["encoding"]["color"]["scale"]
    assert set(scale["domain"]) == runs and len(set(scale["range"])) == 3  # one colour per run, in every chart


def test_nan_steps_are_counted_and_listed(hostile_run: str) -> None:
    page = build_report(hostile_run).html
    data = payload(page)
    [chart] = charts_titled(data, "NaN + Inf values per collection")
    rows = expand_table(chart["data"]["values"])
    nan = {r["step"]: r["value"] for r in rows if r["collection"] == "gradients"}
    assert nan == {s: (3.0 if s in (3, 4) else 0.0) for s in range(8)}
    assert "<td>3</td><td>4</td><td>3</td>" in page  # first step, last step, most in one step


def test_long_runs_are_thinned(tmp_path) -> None:
    path = write_run(str(tmp_path / "long"), 400, ["gradients/a.weight"])
    page = build_report(path, ReportOptions(max_points=100))
    data = payload(page.html)
    [norm] = charts_titled(data, "Global gradient norm")
    assert len(norm["data"]["values"]["columns"]["step"]) <= 102
    loaded = load_run(path)
    assert len(loaded.steps) == 400 and len(loaded.column_records) <= 150 and len(loaded.histogram_records) <= 100


def test_tl_report_writes_and_displays_inline(real_run: str, tmp_path) -> None:
    target = tmp_path / "out" / "report.html"
    page = tl.report(real_run, path=target)
    assert target.read_text(encoding="utf-8") == page.html
    inline = page._repr_html_()
    assert inline.startswith("<iframe") and "srcdoc=" in inline and "<script" not in inline
    explorer = tl.explore(tl.open_run(real_run), path=None)
    assert "tl-page-explorer" in explorer.html
    with pytest.raises(ValueError, match="histogram_axis"):
        tl.report(real_run, histogram_axis="log")
    with pytest.raises(ValueError, match="runs"):
        tl.report([], path=None)


def test_no_external_reference_in_the_page(real_run: str) -> None:
    page = build_report(real_run).html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "sourceMappingURL" not in page
    assert "Content-Security-Policy" in page and "connect-src 'none'" in page


def test_store_file_linked_outside_the_run_folder_is_refused(real_run: str, tmp_path) -> None:
    folder = tmp_path / "linked"
    folder.mkdir()
    os.symlink(os.path.join(real_run, "tensorlens.sqlite"), folder / "tensorlens.sqlite")
    with pytest.raises(PermissionError, match="outside its run folder"):
        build_report(str(folder))
    with pytest.raises(FileNotFoundError, match="no run"):
        build_report(str(tmp_path / "missing"))


def test_custom_section_provider(real_run: str) -> None:
    def findings(runs, options):  # noqa: ANN001, ANN202
        return Section("findings", "Rule findings", [Note(f"{len(runs)} run checked: {HOSTILE}")])

    register_section("my-findings", findings, order=16)
    try:
        page = build_report(real_run).html
    finally:
        _PROVIDERS.pop("my-findings")
    assert page.index(">Rule findings</h2>") < page.index(">Layers over steps</h2>")
    assert html.escape(HOSTILE) in page and HOSTILE not in page


def test_findings_section_lists_what_the_rules_stored(hostile_run: str, real_run: str) -> None:
    page = build_report(hostile_run).html
    data = payload(page)
    [chart] = charts_titled(data, "Rule findings over steps")
    rows = expand_table(chart["data"]["values"])
    # what the rules stored while training, beside what the default rules find on the store now
    stored = [r for r in rows if r["rule"] == "NaNTensor"]
    assert [(r["rule"], r["step"]) for r in stored] == [("NaNTensor", 3), ("NaNTensor", 4)]
    assert {(r["rule"], r["step"]) for r in rows if r["rule"] == "NonFiniteGradient"} == {("NonFiniteGradient", 3),
                                                                                      ("NonFiniteGradient", 4)}
    assert stored[0]["message"] == f"3 NaN in {HOSTILE}"  # the data keeps the text ...
    assert f"<td>3 NaN in {html.escape(HOSTILE)}</td>" in page  # ... the table escapes it
    assert ">Rule findings</h2>" not in build_report(real_run).html  # no findings: no section


def test_scales_section_from_a_run_watched_with_scales(scales_run: str) -> None:
    data = payload(build_report(scales_run).html)
    charts = charts_titled(data, "forward scales") + charts_titled(data, "backward scales")
    assert len(charts) == 2
    rows = expand_table(charts[0]["data"]["values"])
    with tl.open_run(scales_run) as run:
        last = run.steps()[-1]
        names = [t for t in run.tensor_names() if t.startswith("scales/")]
        assert names
        for row in rows:
            tensor = f"scales/{'fwd' if row['direction'] == 'forward' else 'bwd'}/{row['node']}"
            want = np.log2(run.tensor(tensor).reduction_value(last, row["metric"]))
            assert row["log2"] == pytest.approx(want, abs=1e-4)
    assert {r["direction"] for r in rows} == {"forward", "backward"}


def test_explorer_tree_from_the_module_list_and_from_names(real_run: str, hostile_run: str) -> None:
    nodes, owned = build_tree(load_run(hostile_run))
    by_id = {n["id"]: n for n in nodes}
    module = f"enc.{HOSTILE}"
    assert by_id[module]["parent"] == "enc" and by_id["enc"]["parent"] == "" and by_id[""]["parent"] is None
    assert by_id[module]["extra_repr"] == "in_features=4, out_features=4, bias=False"
    assert by_id[module]["parameters"] == {"weight": [4, 4]}
    assert set(owned[module]) == {f"weights/{module}.weight", f"gradients/{module}.weight", f"activations/{module}"}
    nodes, owned = build_tree(load_run(real_run))  # no module list: from the tensor names
    assert {n["id"] for n in nodes} == {"", "0", "1", "2"}
    assert set(owned["0"]) == {"weights/0.weight", "biases/0.bias", "gradients/0.weight", "gradients/0.bias", "activations/0"}
    assert owned["1"] == ["activations/1"] and "losses/crossentropyloss" in owned[""]


def test_describe_modules_matches_the_model() -> None:
    import tensorlens.reports

    assert tensorlens.reports.describe_modules is describe_modules  # documented there, imported on first use
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.LayerNorm(5))
    described = describe_modules(model)
    assert [m["name"] for m in described] == ["", "0", "1", "2"]
    assert described[1] == {"name": "0", "type": "Linear", "extra_repr": "in_features=3, out_features=5, bias=True",
                            "parameters": {"weight": [5, 3], "bias": [5]}}
    assert described[3]["extra_repr"] == model[2].extra_repr()
    json.dumps(described)  # storable as the meta entry as it is


def test_the_recorder_stores_the_module_tree_the_explorer_shows(tmp_path) -> None:
    encoder, head = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU()), torch.nn.Linear(5, 2)
    hook = tl.watch({"encoder": encoder, "head": head}, save_interval=1, out_dir=tmp_path / "run")
    head(encoder(torch.randn(2, 3))).sum().backward()
    torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1).step()
    hook.close()
    with tl.open_run(hook.run_dir) as run:
        stored = json.loads(run.meta["modules"])
    assert stored == describe_modules(encoder, "encoder") + describe_modules(head, "head")
    assert load_run(hook.run_dir).modules() == stored


def test_benchmark_runs_end_to_end(tmp_path) -> None:
    """benchmarks/report.py in its quickest form (no timing asserted)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "report.py")
    spec = importlib.util.spec_from_file_location("tensorlens_benchmark_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.run_benchmark(steps=12, blocks=1, store=None, out=str(tmp_path))
    assert results["tensors"] == 20 and results["records_read"] == 12
    assert results["report_bytes"] > 0 and results["explorer_bytes"] > 0
    assert (tmp_path / "report.html").exists()
    # the synthetic store carries a module list: the explorer shows the Linear layers with their shapes
    data = payload((tmp_path / "explorer.html").read_text(encoding="utf-8"))
    node = next(n for n in data["nodes"] if n["id"] == "blocks.0.attn.q")
    assert node["type"] == "Linear" and node["parameters"] == {"weight": [256, 256], "bias": [256]}
