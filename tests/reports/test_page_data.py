"""What reaches a page's data from a run: the module list read strictly (NaN is not JSON), names
that cannot be written as UTF-8 or that end a Vega expression string, step axes with integer
ticks that end at the last step. (test_browser_names.py draws the same runs in Chromium.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tensorlens.reports import build_explorer, build_report, load_run
from tensorlens.reports.blocks import histogram_heatmap_spec, layer_heatmap_spec, line_spec
from tensorlens.reports.data import module_list
from tensorlens.reports.explorer import build_tree
from tensorlens.reports.page import grid, matrix, script_json, spans

try:
    from .report_runs import PROTOTYPE_NAMES, store_meta_as_is, write_run
    from .test_report import payload
except ImportError:
    from report_runs import PROTOTYPE_NAMES, store_meta_as_is, write_run
    from test_report import payload

MODULES = [{"name": "", "type": "Net"}, {"name": "enc", "type": "Linear", "parameters": {"weight": [2, 2]},
                                          "call_order": 0}]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "tensorlens", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200", "TENSORLENS_DEBUG": "0"})
    assert "Traceback" not in done.stderr, done.stderr
    return done


# ---------------------------------------------------------------------------- case 4: NaN in the module list


@pytest.mark.parametrize("bad", ["NaN", "-Infinity", "1e999"])
def test_explore_a_run_whose_module_list_holds_nan(bad: str, tmp_path: Path) -> None:
    """A store written before the writer stored JSON strict: the explorer says which file and entry
    are damaged, once, and builds its tree from the tensor names; the page's data is JSON."""
    run = write_run(str(tmp_path / "nan-modules"), 3, ["weights/enc.weight"])
    store_meta_as_is(run, "modules", json.dumps(MODULES).replace('"call_order": 0', f'"call_order": {bad}'))
    with pytest.warns(UserWarning) as caught:
        page = build_explorer(run)
    [warning] = caught  # one warning, not one per use
    message = str(warning.message)
    assert os.path.join(run, "tensorlens.sqlite") in message and "key 'modules'" in message
    assert "tensor names" in message
    assert "tensor names (the recorded module list is damaged)" in page.html
    assert {n["id"] for n in payload(page.html)["nodes"]} == {"", "enc"}
    done = _cli("explore", run, "-o", str(tmp_path / "explorer.html"))
    assert done.returncode == 0, done.stderr
    assert "key 'modules'" in done.stderr and run in done.stderr
    assert (tmp_path / "explorer.html").exists()


def test_a_module_list_is_kept_to_what_the_page_shows(tmp_path: Path) -> None:
    # the writer stores NaN as the text "NaN" now: it must not reach the page as a call order
    run = write_run(str(tmp_path / "text-nan"), 2, ["weights/enc.weight"],
                    {"modules": json.dumps(MODULES).replace('"call_order": 0', '"call_order": NaN')})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_run(run).modules() == [MODULES[0], {k: v for k, v in MODULES[1].items() if k != "call_order"}]
    found = [{"name": "a", "type": 3, "extra_repr": None, "parameters": {"w": [2, "x"], "b": [3]}, "call_order": True},
             {"name": 5}, "text", {"type": "no name"}]
    assert module_list(found, "r") == [{"name": "a", "parameters": {"b": [3]}}]
    with pytest.warns(UserWarning, match="'r': its meta entry 'modules' is not a JSON list"):
        assert module_list({"name": "a"}, "r") is None


def test_a_non_finite_number_in_page_data_says_where() -> None:
    with pytest.raises(ValueError, match=r"at charts\.c1\.data\.values\[2\] \(JSON has no NaN"):
        script_json({"charts": {"c0": {}, "c1": {"data": {"values": [1.0, 2.0, float("nan")]}}}})


# ---------------------------------------------------------------------------- cases 3 and 5: characters


def test_separators_and_surrogates_are_shown_as_escapes() -> None:
    text = script_json({"a\u2028": "b\u2029", "c": "layer\udc80", "d": "</script><!--", "e": "x\u202ey"})
    assert not re.search("[\u2028\u2029\ud800-\udfff\u202e<>&]", text)
    assert json.loads(text) == {"a\\u2028": "b\\u2029", "c": "layer\\udc80", "d": "</script><!--", "e": "x\\u202ey"}
    text.encode("utf-8")


def test_a_bidirectional_override_in_a_name_is_shown_as_its_escape(tmp_path: Path) -> None:
    run = write_run(str(tmp_path / "bidi"), 2, ["weights/fc\u202eexe.txt", "gradients/fc\u202eexe.txt"])
    page = build_report(run).html
    assert "\u202e" not in page  # it would reorder what follows it ("Trojan Source")
    markup, data = page.split('id="tl-data">', 1)
    assert "weights/fc\\u202eexe.txt" in markup and "weights/fc\\\\u202eexe.txt" in data


def test_report_and_explore_a_store_holding_lone_surrogates(surrogate_run: str, tmp_path: Path) -> None:
    for builder in (build_report, build_explorer):
        page = builder(surrogate_run)
        page.save(tmp_path / "page.html")  # the page can be written as UTF-8
        text = (tmp_path / "page.html").read_text(encoding="utf-8")
        markup, data = text.split('id="tl-data">', 1)
        assert "weights/layer\\\\udc80.weight" in data  # the escape as text (an escaped backslash in JSON)
        if builder is build_report:
            assert "weights/layer\\udc80.weight" in markup  # the same text in the markup
    nodes, owned = build_tree(load_run(surrogate_run))
    assert {n["id"] for n in nodes} >= {"", "layer\udc80"}  # the data builders keep the name as it is
    assert [n["type"] for n in nodes if n["id"] == "layer\udc80"] == ["Linear\udc81"]
    for command in ("report", "explore"):
        out = tmp_path / f"{command}.html"
        done = _cli(command, surrogate_run, "-o", str(out))
        assert done.returncode == 0, done.stderr
        assert "weights/layer\\\\udc80.weight" in out.read_text(encoding="utf-8")  # in the data


# ---------------------------------------------------------------------------- case 1: object members


def test_object_member_names_make_an_ordinary_tree(names_run: str) -> None:
    nodes, owned = build_tree(load_run(names_run))
    by_id = {n["id"]: n for n in nodes}
    for name in PROTOTYPE_NAMES:
        assert by_id[name]["parent"] == "" and by_id[f"{name}.constructor"]["parent"] == name
        assert f"weights/{name}.weight" in owned[name]
    data = payload(build_explorer(names_run).html)
    assert set(PROTOTYPE_NAMES) <= set(data["owned"])


def test_a_deep_module_name_needs_no_recursion(tmp_path: Path) -> None:
    deep = ".".join(f"m{i}" for i in range(3000))
    run = write_run(str(tmp_path / "deep"), 2, [f"weights/{deep}.weight"])
    nodes, owned = build_tree(load_run(run))
    assert len(nodes) == 3001 and owned[deep] == [f"weights/{deep}.weight"]


# ---------------------------------------------------------------------------- case 7: step axes


def test_step_axes_have_integer_ticks() -> None:
    specs = [line_spec("t", "v", ["r"]), layer_heatmap_spec("t", "l2", 3, False),
             histogram_heatmap_spec("t", "quantile", None)]
    for spec in specs:
        axis = spec["encoding"]["x"]["axis"]
        assert axis["tickMinStep"] == 1 and axis["format"].endswith("d")
        assert spec["encoding"]["x"]["scale"]["nice"] is False  # the axis ends at the last step drawn


def test_heatmap_columns_end_at_the_last_step() -> None:
    starts, ends = spans([0, 10, 30])
    np.testing.assert_allclose(starts, [0, 5, 20])  # centred on their step, from the first step
    np.testing.assert_allclose(ends, [5 + 1.5, 20 + 3, 30])  # 15 % over the next column, the last at the last step
    np.testing.assert_allclose(spans([7])[0], [6.5])
    np.testing.assert_allclose(spans([7])[1], [7.5])
    for dataset in (grid([2, 4, 9], np.array([0.0, 1.0]), np.ones((1, 3))), matrix(["a"], [2, 4, 9], np.ones((1, 3)))):
        assert dataset["starts"][0] == 2 and dataset["ends"][-1] == 9 and dataset["steps"] == [2, 4, 9]


def test_report_heatmaps_span_exactly_the_saved_steps(real_run: str) -> None:
    data = payload(build_report(real_run).html)
    heatmaps = [c for c in data["charts"].values() if c["spec"]["encoding"].get("x2")]
    assert heatmaps
    for chart in heatmaps:
        values = chart["data"]["values"]
        assert chart["spec"]["encoding"]["x"]["field"] == "step_start"
        assert values["starts"][0] == values["steps"][0] and values["ends"][-1] == values["steps"][-1]
    findings_and_lines = [c for c in data["charts"].values() if c["spec"]["encoding"].get("x", {}).get("field") == "step"]
    assert findings_and_lines and all(c["spec"]["encoding"]["x"]["axis"]["tickMinStep"] == 1 for c in findings_and_lines)
