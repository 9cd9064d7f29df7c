// trine console: Compare: several runs' curves on one chart (pick runs, a metric, smoothing).
// The choice lives in the URL (/console/compare?runs=a,b&metric=reward&smooth=0.6), so a view can be shared.
"use strict";
(function () {
  const T = window.trine, esc = T.esc;
  const MAX_RUNS = 12;
  const ui = { runs: [], metric: "", smooth: 0, chosen: false }; // chosen: the runs came from the URL or a click

  function readUrl() {
    const q = new URLSearchParams(location.search);
    ui.runs = (q.get("runs") || "").split(",").filter(Boolean).slice(0, MAX_RUNS);
    ui.metric = q.get("metric") || "";
    ui.smooth = Math.min(0.99, Math.max(0, Number(q.get("smooth")) || 0));
    ui.chosen = ui.runs.length > 0;
  }
  function writeUrl() {
    const q = new URLSearchParams();
    if (ui.runs.length) q.set("runs", ui.runs.join(","));
    if (ui.metric) q.set("metric", ui.metric);
    if (ui.smooth) q.set("smooth", String(ui.smooth));
    history.replaceState(null, "", `/console/compare${q.toString() ? `?${q}` : ""}`);
  }

  T.pages.compare = {
    title: () => "Compare runs",
    mount(main) {
      readUrl();
      main.innerHTML = `<h1>Compare runs</h1>
        <p class="muted">Pick runs and a curve: the training loss, gradient norm, seconds per step, or any metric
        the runs logged with <code>log_metrics</code>. Smoothing is an exponential moving average (0 = raw).</p>
        <div class="picker card" id="compare-runs"></div>
        <div class="controls">
          <label>metric <select id="compare-metric"></select></label>
          <label>smoothing <input id="compare-smooth" type="range" min="0" max="0.99" step="0.01" value="${ui.smooth}">
            <span id="compare-smooth-value">${ui.smooth}</span></label>
        </div>
        <div class="card"><h3 id="compare-title">–</h3>
          <div class="chart" style="height:340px"><canvas id="chart-compare" role="img" aria-label="The chosen metric of each picked run by step"></canvas></div></div>
        <div id="compare-table"></div>`;
      document.getElementById("compare-runs").addEventListener("change", (ev) => {
        const box = ev.target.closest("input[data-compare-run]");
        if (!box) return;
        const id = box.dataset.compareRun;
        ui.chosen = true;
        ui.runs = box.checked ? [...ui.runs.filter((r) => r !== id), id].slice(-MAX_RUNS) : ui.runs.filter((r) => r !== id);
        writeUrl();
        T.refresh();
      });
      document.getElementById("compare-metric").addEventListener("change", (ev) => {
        ui.metric = ev.target.value;
        writeUrl();
        T.redraw();
      });
      document.getElementById("compare-smooth").addEventListener("input", (ev) => {
        ui.smooth = Number(ev.target.value);
        document.getElementById("compare-smooth-value").textContent = ui.smooth;
        writeUrl();
        T.redraw();
      });
    },
    async load() {
      const { runs } = await T.api("/console/api/runs");
      if (!ui.chosen) ui.runs = runs.filter((r) => Object.keys(r.last_metrics || {}).length).slice(0, 3).map((r) => r.id);
      const known = new Set(runs.map((r) => r.id));
      ui.runs = ui.runs.filter((id) => known.has(id));
      const details = await Promise.all(ui.runs.map((id) => T.api(`/console/api/runs/${encodeURIComponent(id)}`)));
      return { runs, details };
    },
    fill({ runs, details }) {
      document.getElementById("compare-runs").innerHTML = runs.length ? runs.map((r) => `<label>
        <input type="checkbox" data-compare-run="${esc(r.id)}" ${ui.runs.includes(r.id) ? "checked" : ""}>
        ${esc(T.runTitle(r))} <span class="muted mono">${r.name ? esc(r.id) : ""}</span> ${T.tags(r.tags)}</label>`).join("")
        : `<span class="muted">No training runs yet.</span>`;
      const logged = [...new Set(details.flatMap((d) => Object.keys(d.metrics)))].sort();
      const options = [...logged.map((m) => [m, `${m} (logged)`]), ...Object.entries(T.BUILTIN)];
      if (!options.some(([v]) => v === ui.metric)) ui.metric = options[0][0];
      document.getElementById("compare-metric").innerHTML = options.map(([v, t]) =>
        `<option value="${esc(v)}" ${v === ui.metric ? "selected" : ""}>${esc(t)}</option>`).join("");
      const label = T.BUILTIN[ui.metric] || ui.metric;
      document.getElementById("compare-title").textContent = `${label} by step` + (ui.smooth ? ` (smoothed ${ui.smooth})` : "");
      const datasets = details.map((d, i) => {
        const pts = T.series(d, ui.metric), smooth = T.ema(pts.map((p) => p.y), ui.smooth);
        const color = T.SERIES_COLORS[i % T.SERIES_COLORS.length];
        return { label: T.runTitle(d.run), run: d.run.id, data: pts.map((p, k) => ({ x: p.x, y: smooth[k] })),
                 borderColor: color, backgroundColor: color, pointRadius: 2, tension: 0 };
      });
      const chart = T.chart("chart-compare", "line", undefined, datasets,
        { scales: T.axes("step", label, { x: { type: "linear", ticks: { precision: 0 } } }) });
      if (chart && chart.options.scales.y.title.text !== label) { chart.options.scales.y.title.text = label; chart.update("none"); }
      document.getElementById("compare-table").innerHTML = T.table(
        [["run"], ["name"], ["steps", "num"], [`last ${label}`, "num"], ["LoRA"], ["optimizer (last used)"]],
        details.map((d, i) => {
          const pts = T.series(d, ui.metric);
          return `<tr data-compare-row="${esc(d.run.id)}"><td><span class="legend-dot" style="background:${T.SERIES_COLORS[i % T.SERIES_COLORS.length]}"></span>${T.runLink(d.run.id)}</td>
            <td>${esc(d.run.name || "")}</td><td class="num">${T.int(d.run.steps)}</td>
            <td class="num">${pts.length ? T.num(pts[pts.length - 1].y, 5) : "–"}</td><td>${T.lora(d.run.lora)}</td>
            <td>${T.optimizer(d.run.optimizer)}</td></tr>`;
        }), "Pick one or more runs above.");
    },
  };
})();
