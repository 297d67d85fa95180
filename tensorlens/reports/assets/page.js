/* tensorlens report and explorer pages. Reads the page's JSON (#tl-data), expands its compact
   datasets, draws charts with vega-embed when they come into view. Names reach the page only as
   text (textContent, Vega text marks, vega-tooltip's escaped tables), never as markup. */
(function () {
  "use strict";
  var payload = JSON.parse(document.getElementById("tl-data").textContent);
  var views = {};
  var errors = [];

  // ------------------------------------------------------------------ datasets
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
        var row = {step: d.steps[c], step_end: d.ends[c], low: d.edges[r], high: d.edges[r + 1],
                   log_fraction: d.floor + (level - 1) * span};
        for (var key in d.constant) row[key] = d.constant[key];
        rows.push(row);
      }
    }
    return rows;
  }
  function decodeMatrix(d) {
    var nCols = d.steps.length, rows = [];
    for (var i = 0; i < d.rows.length; i++) {
      for (var c = 0; c < nCols; c++) {
        var v = d.values[i * nCols + c];
        if (v === null) continue;
        rows.push({tensor: d.rows[i], step: d.steps[c], step_end: d.ends[c], value: v});
      }
    }
    return rows;
  }
  var decoders = {table: decodeTable, grid: decodeGrid, matrix: decodeMatrix};
  function decode(d) {
    var f = decoders[d.format];
    if (!f) throw new Error("unknown dataset format " + d.format);
    return f(d);
  }

  // ------------------------------------------------------------------ charts
  function embed(el, spec, data) {
    var full = JSON.parse(JSON.stringify(spec));
    full.datasets = {};
    for (var name in data) full.datasets[name] = decode(data[name]);
    return vegaEmbed(el, full, {actions: false, renderer: "canvas", logLevel: vega.Warn}).then(function (result) {
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
  function setupExplorer() {
    var nodes = payload.nodes, byId = {}, kids = {}, folded = {}, selected = null, query = "";
    nodes.forEach(function (n) { byId[n.id] = n; kids[n.id] = []; });
    nodes.forEach(function (n) { if (n.parent !== null && n.parent !== undefined) kids[n.parent].push(n.id); });
    function firstCall(id) {  // siblings in the order they were first called, when recorded
      var best = byId[id].call_order;
      kids[id].forEach(function (k) { var o = firstCall(k); if (o !== null && o !== undefined && (best === null || best === undefined || o < best)) best = o; });
      byId[id]._order = best;
      return best;
    }
    firstCall("");
    Object.keys(kids).forEach(function (id) {
      kids[id].sort(function (a, b) {
        var oa = byId[a]._order, ob = byId[b]._order;
        if (oa === null || oa === undefined || ob === null || ob === undefined) return natural(byId[a].label, byId[b].label);
        return oa - ob;
      });
    });
    function depth(id) { var d = 0; while (byId[id].parent !== null && byId[id].parent !== undefined) { id = byId[id].parent; d++; } return d; }
    if (nodes.length > 80) nodes.forEach(function (n) { if (kids[n.id].length && depth(n.id) >= 2) folded[n.id] = true; });
    function matches(id) { return query && id.toLowerCase().indexOf(query) >= 0; }
    function subtreeMatches(id) { return matches(id) || kids[id].some(subtreeMatches); }
    function tooltip(n) {
      var t = {module: n.id || "(root)"};
      if (n.type) t.type = n.type;
      if (n.extra_repr) t.extra_repr = n.extra_repr;
      var params = Object.keys(n.parameters || {});
      if (params.length) t.parameters = params.map(function (p) { return p + " [" + n.parameters[p].join(", ") + "]"; }).join(", ");
      if (n.call_order !== null && n.call_order !== undefined) t["call order"] = n.call_order;
      var owned = payload.owned[n.id] || [];
      if (owned.length) t.tensors = owned.length + (owned.length === 1 ? " tensor" : " tensors");
      owned.forEach(function (name) {
        var info = payload.tensors[name];
        if (info && info.shape && info.shape.length) t[name] = "shape [" + info.shape.join(", ") + "]";
        else if (info && info.stats && info.stats.numel !== undefined) t[name] = info.stats.numel + " values";
      });
      if (folded[n.id]) t.folded = kids[n.id].length + " children";
      return t;
    }
    function visible() {
      var out = [], matched = 0;
      (function walk(id) {
        var n = byId[id], m = matches(id);
        if (m) matched++;
        // a leaf shows its type; an inner node only its name (the type is in its tooltip and details)
        var leaf = !kids[id].length || folded[id];
        var text = n.label + (leaf && n.type ? "  " + n.type : "") + (folded[id] ? "  +" + kids[id].length : "");
        // d3's stratify takes an empty parent id for "no parent": prefix the ids (the root's is "")
        out.push({id: id, key: "m:" + id, pkey: n.parent === null || n.parent === undefined ? null : "m:" + n.parent, text: text, folded: !!folded[id], selected: id === selected,
                  match: m, dim: !!query && !m, tooltip: tooltip(n)});
        if (!folded[id]) kids[id].forEach(walk);
      })("");
      return {rows: out, matched: matched};
    }
    var treeEl = document.getElementById("tl-tree"), count = document.querySelector(".tl-tree-pane .tl-filter-count");
    var spec = JSON.parse(JSON.stringify(payload.tree_spec)), treeView = null;
    function redraw() {
      var v = visible(), leaves = v.rows.filter(function (r) { return r.folded || !kids[r.id].length; }).length;
      var maxDepth = 0;
      v.rows.forEach(function (r) { maxDepth = Math.max(maxDepth, depth(r.id)); });
      count.textContent = query ? v.matched + " match" + (v.matched === 1 ? "" : "es") : nodes.length + " modules";
      // levels 70-130 px apart, as the pane allows (not stretched: a shallow tree stays compact)
      var room = treeEl.clientWidth - 24 - 220;
      var step = Math.max(70, Math.min(130, Math.floor(room / Math.max(maxDepth, 1))));
      var width = Math.max(step * maxDepth + 220, 320);
      // labels of inner nodes sit above their node and get the room up to the next level
      return treeView.width(width).height(Math.max(60, 24 * leaves))
        .signal("innerLimit", step - 12)
        .data("nodes", v.rows).runAsync();
    }
    function attach(view) {
      treeView = view;
      view.addEventListener("click", function (event, item) {
        if (!item || !item.datum || item.datum.id === undefined) return;
        var id = item.datum.id;
        if (item.mark && item.mark.name === "circle" && kids[id].length) folded[id] = !folded[id];
        else select(id);
        redraw();
      });
      return redraw();
    }
    document.querySelector(".tl-search").addEventListener("input", function (e) {
      query = e.target.value.trim().toLowerCase();
      if (query) nodes.forEach(function (n) { if (kids[n.id].length) folded[n.id] = !subtreeMatches(n.id); });
      redraw();
    });
    document.querySelector(".tl-search").addEventListener("keydown", function (e) {
      if (e.key !== "Enter" || !query) return;
      var first = visible().rows.filter(function (r) { return r.match; })[0];
      if (first) { select(first.id); redraw(); }
    });
    document.querySelectorAll(".tl-tree-tools button").forEach(function (b) {
      b.addEventListener("click", function () {
        var fold = b.getAttribute("data-action") === "collapse";
        nodes.forEach(function (n) { if (kids[n.id].length && n.id !== "") folded[n.id] = fold; });
        redraw();
      });
    });
    function text(tag, cls, value) {
      var el = document.createElement(tag);
      if (cls) el.className = cls;
      el.textContent = value;
      return el;
    }
    function chartInto(parent, template, data, title, eager) {
      var spec = JSON.parse(JSON.stringify(payload.templates[template]));
      spec.title = {text: title, anchor: "start", fontSize: 11, limit: 600};
      var el = document.createElement("div");
      el.className = "tl-chart";
      parent.appendChild(el);
      var p = embed(el, spec, {values: data}).then(function (v) { views["m" + Object.keys(views).length] = v; });
      pendingCharts.push(p);
      return el;
    }
    var pendingCharts = [];
    function select(id) {
      selected = id;
      var n = byId[id], detail = document.getElementById("tl-detail");
      detail.textContent = "";
      pendingCharts = [];
      detail.appendChild(text("h2", "", n.id || "(root) " + n.label));
      if (n.type) detail.appendChild(text("div", "tl-kv", "type: " + n.type));
      if (n.extra_repr) detail.appendChild(text("div", "tl-kv", "extra_repr: " + n.extra_repr));
      Object.keys(n.parameters || {}).forEach(function (p) {
        detail.appendChild(text("div", "tl-kv", "parameter " + p + ": [" + n.parameters[p].join(", ") + "]"));
      });
      var owned = payload.owned[id] || [];
      if (!owned.length) detail.appendChild(text("p", "tl-note", "No tensor of this module was recorded" +
        (kids[id].length ? "; its children's are (click one in the tree)." : ".")));
      owned.forEach(function (name) {
        var info = payload.tensors[name];
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
    var explorerState = {select: function (id) { select(id); return redraw().then(function () { return explorerState.charts; }).then(function () { return id; }); },
                         charts: Promise.resolve(), redraw: function () { return redraw().then(function () { return true; }); }};
    // open on the first module that owns tensors, so the page is never empty
    var start = nodes.filter(function (n) { return (payload.owned[n.id] || []).length && n.id !== ""; })[0];
    if (start) select(start.id); else select("");
    explorerState.ready = vegaEmbed(treeEl, spec, {actions: false, renderer: "canvas", logLevel: vega.Warn})
      .then(function (result) { explorerState.tree = result.view; treeEl.setAttribute("data-rendered", "1"); return attach(result.view); })
      .then(function () { return explorerState.charts; }).then(function () { return true; })
      .catch(function (err) { errors.push(String(err)); treeEl.textContent = "The tree could not be drawn: " + err; throw err; });
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
