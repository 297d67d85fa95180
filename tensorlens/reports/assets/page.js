/* tensorlens report and explorer pages. Reads the page's JSON (#tl-data), expands its compact
   datasets, draws charts with vega-embed when they come into view. Names reach the page only as
   text (textContent, title attributes, Vega text marks, tooltips of escaped text), never as markup. */
(function () {
  "use strict";
  var payload = JSON.parse(document.getElementById("tl-data").textContent);
  var views = {};
  var errors = [];

  // Names from the run (modules, tensors) key Maps, never plain objects: in an object a module named
  // `constructor`, `__proto__` or `toString` would find Object.prototype's members.
  function toMap(object) {
    var map = new Map();
    if (object) Object.keys(object).forEach(function (k) { map.set(k, object[k]); });
    return map;
  }
  function isSet(v) { return v !== null && v !== undefined; }

  // ------------------------------------------------------------------ datasets
  function withConstant(row, constant) {
    if (constant) Object.keys(constant).forEach(function (key) { row[key] = constant[key]; });
    return row;
  }
  function decodeTable(d) {
    var keys = Object.keys(d.columns), n = keys.length ? d.columns[keys[0]].length : 0, rows = new Array(n);
    for (var i = 0; i < n; i++) {
      var row = {};
      for (var k = 0; k < keys.length; k++) row[keys[k]] = d.columns[keys[k]][i];
      rows[i] = row;
    }
    return rows;
  }
  function decodeGrid(d) {
    var bytes = atob(d.levels), nRows = d.edges.length - 1, nCols = d.steps.length, rows = [];
    var span = -d.floor / (d.count - 1);
    for (var c = 0; c < nCols; c++) {
      for (var r = 0; r < nRows; r++) {
        var level = bytes.charCodeAt(c * nRows + r);
        if (level === 0) continue;
        rows.push(withConstant({step: d.steps[c], step_start: d.starts[c], step_end: d.ends[c], low: d.edges[r],
                                high: d.edges[r + 1], log_fraction: d.floor + (level - 1) * span}, d.constant));
      }
    }
    return rows;
  }
  function decodeMatrix(d) {
    var nCols = d.steps.length, rows = [], flagged = new Set(d.nonfinite || []);
    for (var i = 0; i < d.rows.length; i++) {
      for (var c = 0; c < nCols; c++) {
        var v = d.values[i * nCols + c], bad = flagged.has(i * nCols + c);
        if (v === null && !bad) continue;
        var row = {tensor: d.rows[i], step: d.steps[c], step_start: d.starts[c], step_end: d.ends[c], value: v};
        if (bad) row.nonfinite = "held NaN or Inf";
        rows.push(withConstant(row, d.constant));
      }
    }
    return rows;
  }
  var decoders = new Map([["table", decodeTable], ["grid", decodeGrid], ["matrix", decodeMatrix]]);
  function decode(d) {
    var f = decoders.get(d.format);
    if (!f) throw new Error("unknown dataset format " + d.format);
    return f(d);
  }

  // ------------------------------------------------------------------ tooltips
  // vega-tooltip's own formatter reads a key `image` as a picture to load (an <img> request) and
  // `title` as a heading; tooltip keys may be names from the run, so every key is a plain row of
  // escaped text here.
  function escapeHtml(value) {
    return String(value).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }
  function tooltipValue(value) {
    return value !== null && typeof value === "object" ? JSON.stringify(value) : String(value);
  }
  function formatTooltip(value) {
    if (value === null || typeof value !== "object" || Array.isArray(value)) return escapeHtml(tooltipValue(value));
    var rows = Object.keys(value).filter(function (k) { return value[k] !== undefined; }).map(function (k) {
      return '<tr><td class="key">' + escapeHtml(k) + '</td><td class="value">' + escapeHtml(tooltipValue(value[k])) + "</td></tr>";
    });
    return "<table>" + rows.join("") + "</table>";
  }
  var EMBED_OPTIONS = {actions: false, renderer: "canvas", logLevel: vega.Warn, tooltip: {formatTooltip: formatTooltip}};

  // ------------------------------------------------------------------ charts
  function embed(el, spec, data) {
    var full = JSON.parse(JSON.stringify(spec));
    // a chart as wide as its box, axes and legends included (Vega-Lite's default puts them outside
    // it: two charts side by side ran past the explorer's pane)
    if (full.width === "container" && !full.autosize) full.autosize = {type: "fit-x", contains: "padding"};
    full.datasets = {};
    Object.keys(data).forEach(function (name) { full.datasets[name] = decode(data[name]); });
    return vegaEmbed(el, full, EMBED_OPTIONS).then(function (result) {
      el.setAttribute("data-rendered", "1");
      return result.view;
    }).catch(function (err) {
      el.setAttribute("data-rendered", "error");
      el.classList.add("tl-error");
      el.textContent = "This chart could not be drawn: " + err;
      errors.push(String(err));
      throw err;
    });
  }
  function render(el) {
    if (el.getAttribute("data-state")) return el._tlPromise;
    el.setAttribute("data-state", "started");
    var id = el.getAttribute("data-chart"), chart = payload.charts[id];
    el._tlPromise = embed(el, chart.spec, chart.data).then(function (view) { views[id] = view; return view; });
    return el._tlPromise;
  }
  var observer = "IntersectionObserver" in window ? new IntersectionObserver(function (entries) {
    entries.forEach(function (e) { if (e.isIntersecting) { observer.unobserve(e.target); render(e.target); } });
  }, {rootMargin: "400px"}) : null;
  function watch(root) {
    root.querySelectorAll(".tl-chart[data-chart]").forEach(function (el) {
      if (el.getAttribute("data-eager") || !observer) render(el); else observer.observe(el);
    });
  }

  // ------------------------------------------------------------------ report controls
  function setupFilters() {
    document.querySelectorAll(".tl-section").forEach(function (section) {
      var input = section.querySelector(".tl-filter input");
      if (!input) return;
      var count = section.querySelector(".tl-filter-count");
      var groups = section.querySelectorAll(".tl-group");
      function apply() {
        var text = input.value, re = null, shown = 0;
        try { re = new RegExp(text, "i"); } catch (e) { re = null; }
        groups.forEach(function (g) {
          var name = g.getAttribute("data-name");
          var ok = !text || (re ? re.test(name) : name.toLowerCase().indexOf(text.toLowerCase()) >= 0);
          g.hidden = !ok;
          if (ok) shown++;
        });
        section.querySelectorAll(".tl-collection").forEach(function (c) {
          var any = c.querySelectorAll(".tl-group:not([hidden])").length > 0;
          c.hidden = !any;
          if (text && any) c.open = true;
        });
        count.textContent = shown + " of " + groups.length + " tensors" + (re || !text ? "" : " (not a valid regular expression: matching as text)");
      }
      input.addEventListener("input", apply);
      apply();
    });
    document.querySelectorAll(".tl-choice").forEach(function (choice) {
      var select = choice.querySelector("select");
      select.addEventListener("change", function () {
        choice.querySelectorAll(".tl-choice-pane").forEach(function (pane) {
          pane.hidden = pane.getAttribute("data-option") !== select.value;
          if (!pane.hidden) pane.querySelectorAll(".tl-chart").forEach(render);
        });
      });
    });
  }

  // ------------------------------------------------------------------ explorer
  var collator = new Intl.Collator(undefined, {numeric: true});
  function natural(a, b) { return collator.compare(a, b); }
  function text(tag, cls, value) {
    var el = document.createElement(tag);
    if (cls) el.className = cls;
    el.textContent = value;
    return el;
  }
  // The tree is HTML, its names text: the browser's find, copying and screen readers reach them,
  // and a long name wraps instead of being cut. Loops, not recursion: a name may have many dots.
  function setupExplorer() {
    var nodes = payload.nodes, byId = new Map(), kids = new Map(), folded = new Set(), items = new Map();
    var owned = toMap(payload.owned), tensors = toMap(payload.tensors), selected = null, query = "";
    var health = toMap(payload.health), below = new Map();  // module -> its findings; -> the worst status under it
    nodes.forEach(function (n) { byId.set(n.id, n); kids.set(n.id, []); });
    nodes.forEach(function (n) { if (isSet(n.parent) && kids.has(n.parent)) kids.get(n.parent).push(n.id); });
    function preorder() {  // every node below the root, parents first, siblings in order
      var out = [], stack = [""];
      while (stack.length) {
        var id = stack.pop(), k = kids.get(id);
        out.push(id);
        for (var i = k.length - 1; i >= 0; i--) stack.push(k[i]);
      }
      return out;
    }
    // siblings in the order they were first called, when recorded (a parent: its first child's call)
    var firstCall = new Map();
    preorder().reverse().forEach(function (id) {
      var best = typeof byId.get(id).call_order === "number" ? byId.get(id).call_order : null;
      kids.get(id).forEach(function (k) { var o = firstCall.get(k); if (o !== null && (best === null || o < best)) best = o; });
      firstCall.set(id, best);
    });
    kids.forEach(function (list) {
      list.sort(function (a, b) {
        var oa = firstCall.get(a), ob = firstCall.get(b);
        return oa === null || ob === null ? natural(byId.get(a).label, byId.get(b).label) : oa - ob;
      });
    });
    var order = preorder(), depth = new Map([["", 0]]);
    var RANK = {critical: 2, warning: 1};
    // a folded module shows the worst status of the modules under it (a dot), so marks are found from the top
    order.slice().reverse().forEach(function (id) {
      var worst = 0;
      kids.get(id).forEach(function (k) {
        var m = health.get(k);
        worst = Math.max(worst, below.get(k) || 0, m ? RANK[m.status] || 1 : 0);
      });
      below.set(id, worst);
    });
    order.forEach(function (id) { kids.get(id).forEach(function (k) { depth.set(k, depth.get(id) + 1); }); });
    if (nodes.length > 80) order.forEach(function (id) { if (kids.get(id).length && depth.get(id) >= 2) folded.add(id); });

    function hoverText(n) {  // the title attribute: the full name first, then what the module holds
      var lines = [n.id === "" ? "(root) " + n.label : n.id];
      if (n.type) lines.push("type: " + n.type);
      if (n.extra_repr) lines.push("extra_repr: " + n.extra_repr);
      var params = Object.keys(n.parameters || {});
      if (params.length) lines.push("parameters: " + params.map(function (p) { return p + " [" + n.parameters[p].join(", ") + "]"; }).join(", "));
      if (isSet(n.call_order)) lines.push("call order: " + n.call_order);
      (owned.get(n.id) || []).forEach(function (name) {
        var info = tensors.get(name), what = "";
        if (info && info.shape && info.shape.length) what = "shape [" + info.shape.join(", ") + "]";
        else if (info && info.stats && info.stats.numel !== undefined) what = info.stats.numel + " values";
        lines.push(name + (what ? ": " + what : ""));
      });
      var k = kids.get(n.id).length;
      if (k) lines.push(k + (k === 1 ? " child" : " children"));
      var m = health.get(n.id);
      if (m) m.rules.forEach(function (r) { lines.push(r[1] + ": " + r[0] + ", " + r[2] + " finding" + (r[2] === 1 ? "" : "s") + " from step " + r[3]); });
      else if (below.get(n.id)) lines.push((below.get(n.id) === 2 ? "critical" : "warning") + " findings below");
      return lines.join("\n");
    }
    var treeEl = document.getElementById("tl-tree"), count = document.querySelector(".tl-tree-pane .tl-filter-count");
    var rootList = document.createElement("ul");
    rootList.className = "tl-tree-list";
    order.forEach(function (id) {
      var n = byId.get(id), li = document.createElement("li"), row = document.createElement("div");
      var toggle = document.createElement("button"), name = text("span", "tl-name", n.label);
      li.setAttribute("role", "treeitem");
      row.className = "tl-node";
      row.title = hoverText(n);
      row._tlId = id;
      toggle.type = "button";
      toggle.className = "tl-fold";
      if (!kids.get(id).length) { toggle.disabled = true; toggle.tabIndex = -1; toggle.setAttribute("aria-hidden", "true"); }
      name.tabIndex = 0;
      name.setAttribute("role", "button");
      row.appendChild(toggle);
      row.appendChild(name);
      if (n.type) row.appendChild(text("span", "tl-type", n.type));
      var mark = health.get(id);
      if (mark) {
        var badge = row.appendChild(text("span", "tl-mark tl-mark-" + mark.status, (mark.status === "critical" ? "\u2716 " : "\u25b2 ") + mark.count));
        badge.setAttribute("aria-label", mark.status + ": " + mark.count + " finding" + (mark.count === 1 ? "" : "s"));
        row.classList.add("tl-has-" + mark.status);
      } else if (below.get(id)) {
        var dot = row.appendChild(text("span", "tl-mark-below tl-mark-" + (below.get(id) === 2 ? "critical" : "warning"), "\u25cf"));
        dot.setAttribute("aria-label", "findings below");
      }
      var mine = (owned.get(id) || []).length;
      if (mine) row.appendChild(text("span", "tl-tensors", mine + (mine === 1 ? " tensor" : " tensors")));
      var more = row.appendChild(text("span", "tl-more", ""));
      li.appendChild(row);
      var list = null;
      if (kids.get(id).length) {
        list = li.appendChild(document.createElement("ul"));
        list.setAttribute("role", "group");
      }
      (id === "" ? rootList : items.get(n.parent).list).appendChild(li);
      items.set(id, {li: li, row: row, toggle: toggle, more: more, list: list});
    });
    treeEl.appendChild(rootList);

    function matches(id) { return !!query && id.toLowerCase().indexOf(query) >= 0; }
    function update() {
      var matched = 0;
      items.forEach(function (it, id) {
        var m = matches(id), isFolded = folded.has(id);
        if (m) matched++;
        if (it.list) {
          it.list.hidden = isFolded;
          it.li.setAttribute("aria-expanded", String(!isFolded));
          it.toggle.textContent = isFolded ? "\u25b8" : "\u25be";
          it.toggle.setAttribute("aria-label", isFolded ? "unfold" : "fold");
          it.more.textContent = isFolded ? "+" + kids.get(id).length : "";
        }
        it.li.setAttribute("aria-selected", String(id === selected));
        it.row.classList.toggle("tl-selected", id === selected);
        it.row.classList.toggle("tl-match", m);
        it.row.classList.toggle("tl-dim", !!query && !m);
      });
      count.textContent = query ? matched + " match" + (matched === 1 ? "" : "es") : nodes.length + " modules";
    }
    function shown(id) {  // not inside a folded module
      for (var p = byId.get(id).parent; isSet(p); p = byId.get(p).parent) if (folded.has(p)) return false;
      return true;
    }
    treeEl.addEventListener("click", function (e) {
      var row = e.target.closest(".tl-node");
      if (!row) return;
      if (e.target.closest(".tl-fold")) {
        if (folded.has(row._tlId)) folded.delete(row._tlId); else folded.add(row._tlId);
        update();
      } else if (!String(window.getSelection())) {  // not the end of selecting text to copy
        select(row._tlId);
        update();
      }
    });
    treeEl.addEventListener("keydown", function (e) {
      if ((e.key !== "Enter" && e.key !== " ") || !e.target.classList.contains("tl-name")) return;
      e.preventDefault();
      select(e.target.parentNode._tlId);
      update();
    });
    var search = document.querySelector(".tl-search");
    search.addEventListener("input", function (e) {
      query = e.target.value.trim().toLowerCase();
      if (query) {  // unfold the way to every match, fold the rest
        var below = new Map();
        order.slice().reverse().forEach(function (id) {
          below.set(id, kids.get(id).some(function (k) { return matches(k) || below.get(k); }));
          if (kids.get(id).length) { if (below.get(id)) folded.delete(id); else folded.add(id); }
        });
      }
      update();
    });
    search.addEventListener("keydown", function (e) {
      if (e.key !== "Enter" || !query) return;
      var first = order.filter(function (id) { return matches(id) && shown(id); })[0];
      if (isSet(first)) { select(first); update(); items.get(first).row.scrollIntoView({block: "nearest"}); }
    });
    document.querySelectorAll(".tl-tree-tools button").forEach(function (b) {
      b.addEventListener("click", function () {
        var fold = b.getAttribute("data-action") === "collapse";
        order.forEach(function (id) { if (kids.get(id).length && id !== "") { if (fold) folded.add(id); else folded.delete(id); } });
        update();
      });
    });
    function chartInto(parent, template, data, title) {
      var spec = JSON.parse(JSON.stringify(payload.templates[template]));
      spec.title = {text: title, anchor: "start", fontSize: 11, limit: 600};
      var el = document.createElement("div");
      el.className = "tl-chart";
      parent.appendChild(el);
      var key = "m" + (chartCount++);
      var p = embed(el, spec, {values: data}).then(function (v) {
        if (el.isConnected) { views[key] = v; shownCharts.push(key); } else v.finalize();  // another module was picked meanwhile
      });
      pendingCharts.push(p);
      return el;
    }
    var pendingCharts = [], shownCharts = [], chartCount = 0;
    function select(id) {
      selected = id;
      var n = byId.get(id), detail = document.getElementById("tl-detail");
      shownCharts.forEach(function (key) { views[key].finalize(); delete views[key]; });  // their listeners and timers too
      shownCharts = [];
      detail.textContent = "";
      pendingCharts = [];
      detail.appendChild(text("h2", "", n.id || "(root) " + n.label));
      if (n.type) detail.appendChild(text("div", "tl-kv", "type: " + n.type));
      if (n.extra_repr) detail.appendChild(text("div", "tl-kv", "extra_repr: " + n.extra_repr));
      Object.keys(n.parameters || {}).forEach(function (p) {
        detail.appendChild(text("div", "tl-kv", "parameter " + p + ": [" + n.parameters[p].join(", ") + "]"));
      });
      var mark = health.get(id);
      if (mark) {
        detail.appendChild(text("p", "tl-findings-title tl-mark-" + mark.status, "Findings: " + mark.count + " (" + mark.status + ")"));
        var ft = document.createElement("table"), fh = document.createElement("tr"), fb = document.createElement("tbody");
        ft.className = "tl-table tl-findings";
        ["rule", "first step", "tensor", "message"].forEach(function (c) { fh.appendChild(text("th", "", c)); });
        mark.findings.forEach(function (f) {
          var tr = document.createElement("tr");
          [f[0], String(f[1]), f[2] || "-", f[3]].forEach(function (c) { tr.appendChild(text("td", "", c)); });
          fb.appendChild(tr);
        });
        var fhead = document.createElement("thead");
        fhead.appendChild(fh); ft.appendChild(fhead); ft.appendChild(fb);
        var fwrap = document.createElement("div"); fwrap.className = "tl-table-wrap"; fwrap.appendChild(ft);
        detail.appendChild(fwrap);
      }
      var mine = owned.get(id) || [];
      if (!mine.length) detail.appendChild(text("p", "tl-note", "No tensor of this module was recorded" +
        (kids.get(id).length ? "; its children's are (click one in the tree)." : ".")));
      mine.forEach(function (name) {
        var info = tensors.get(name);
        detail.appendChild(text("h3", "", name));
        var stats = Object.keys(info.stats);
        if (stats.length) {
          var tbl = document.createElement("table"), head = document.createElement("tr"), row = document.createElement("tr");
          tbl.className = "tl-table";
          head.appendChild(text("th", "", "step"));
          row.appendChild(text("td", "", String(info.step)));
          stats.forEach(function (s) {
            head.appendChild(text("th", "", s));
            var v = info.stats[s];
            row.appendChild(text("td", "", v === null ? "NaN/Inf" : (Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(3) : String(+v.toPrecision(5)))));
          });
          var thead = document.createElement("thead"), tbody = document.createElement("tbody");
          thead.appendChild(head); tbody.appendChild(row); tbl.appendChild(thead); tbl.appendChild(tbody);
          var wrap = document.createElement("div"); wrap.className = "tl-table-wrap"; wrap.appendChild(tbl);
          detail.appendChild(wrap);
        }
        var rowEl = document.createElement("div");
        rowEl.className = "tl-charts-row";
        detail.appendChild(rowEl);
        if (info.series) chartInto(rowEl, "series", info.series.data, info.series.stat + " over steps");
        if (info.histogram) chartInto(rowEl, "histogram", info.histogram.data, "histogram at step " + info.histogram.step);
        if (info.heatmap) chartInto(detail, "heatmap", info.heatmap, "histogram over steps (0.5–99.5 % quantile axis)");
      });
      explorerState.charts = Promise.all(pendingCharts);
    }
    var explorerState = {
      select: function (id) { select(id); update(); return explorerState.charts.then(function () { return id; }); },
      charts: Promise.resolve(),
      redraw: function () { update(); return Promise.resolve(true); },
      rows: function () {  // what the tree shows now, for tests: [id, label, folded, matched]
        return order.filter(shown).map(function (id) { return [id, byId.get(id).label, folded.has(id), matches(id)]; });
      },
      marks: function () {  // the health marks the tree shows, for tests: [id, status, count text]
        var out = [];
        items.forEach(function (it, id) {
          var m = it.row.querySelector(".tl-mark");
          if (m) out.push([id, health.get(id).status, m.textContent]);
        });
        return out;
      },
    };
    // open on the first module that owns tensors, so the page is never empty
    var start = order.filter(function (id) { return id !== "" && (owned.get(id) || []).length; })[0];
    select(isSet(start) ? start : "");
    update();
    treeEl.setAttribute("data-rendered", "1");
    explorerState.ready = explorerState.charts.then(function () { return true; });
    return explorerState;
  }

  // ------------------------------------------------------------------ start
  setupFilters();
  watch(document);
  var api = {views: views, errors: errors, payload: payload};
  api.renderVisible = function () {
    var all = [];
    // shown, i.e. not in a closed group or a hidden pane (checkVisibility knows closed <details>)
    document.querySelectorAll(".tl-chart[data-chart]").forEach(function (el) {
      if (el.checkVisibility ? el.checkVisibility() : el.getClientRects().length) all.push(render(el));
    });
    return Promise.all(all).then(function () { return all.length; });
  };
  api.openAll = function () { document.querySelectorAll("details.tl-group, details.tl-collection").forEach(function (d) { d.open = true; }); };
  if (payload.page === "explorer") api.explorer = setupExplorer();
  window.tensorlens = api;
})();
