// trine console: the Runs list and one run's page (curves, logged metrics, steps, checkpoints).
"use strict";
(function () {
  const T = window.trine, esc = T.esc;

  // ---------------------------------------------------------------- what a run is (shared with compare)
  T.runTitle = (r) => r.name || r.id;
  T.tags = (tags) => (tags || []).map((t) => `<span class="tag">${esc(t)}</span>`).join("");
  T.lora = (l) => (l ? `${l.rank ? `r${l.rank}` : "full"} ${["mlp", "attn", "unembed"].filter((p) => l[`train_${p}`]).join("+") || "nothing trained"}` : "–");
  T.optimizer = (o) => (!o ? "–" : o.type === "dimuon"
    ? `dimuon lr ${T.num(o.learning_rate, 3)}, β ${o.beta1}, clip ${o.grad_clip_norm}`
    : `lr ${T.num(o.learning_rate, 3)}, β ${o.beta1}/${o.beta2}, wd ${o.weight_decay}, clip ${o.grad_clip_norm}`);
  T.lastMetrics = (m) => Object.entries(m || {}).map(([k, v]) => `${esc(k)}=${T.num(v, 4)}`).join(" ") || "–";
  T.SERIES_COLORS = ["#1f5fa8", "#b3261e", "#2e7d32", "#a15c00", "#6a3d9a", "#00838f", "#c2185b", "#5d4037"];
  // a run's series of a built-in curve or a logged metric, as {x: step, y: value} points
  T.BUILTIN = { loss: "loss (mean per token)", grad_norm: "gradient norm", seconds: "seconds per step" };
  T.series = (detail, metric) => (metric in T.BUILTIN
    ? detail.steps.filter((s) => s[metric] != null).map((s) => ({ x: s.step, y: s[metric] }))
    : (detail.metrics[metric] || []).map(([x, y]) => ({ x, y })));

  // ---------------------------------------------------------------- runs
  T.pages.runs = {
    title: () => "Runs",
    mount(main) {
      main.innerHTML = `<h1>Training runs</h1>
        <p class="muted">Name and tag runs at creation (<code>create_lora_training_client(..., name=, tags=)</code>);
        <code>training_client.log_metrics({...}, step=n)</code> adds your own curves. <a href="/console/compare" data-link>Compare runs</a>.</p>
        <div id="runs"></div>`;
    },
    load: () => T.api("/console/api/runs"),
    fill(data) {
      const rows = data.runs.map((r) => `<tr data-run="${esc(r.id)}">
        <td>${T.runLink(r.id)}</td><td>${esc(r.name || "")}</td><td>${T.tags(r.tags)}</td><td>${esc(r.model)}</td>
        <td>${T.lora(r.lora)}</td><td>${T.state(r.state)}</td><td class="num">${T.int(r.steps)}</td>
        <td class="num">${T.int(r.samplers)}</td><td class="mono">${T.lastMetrics(r.last_metrics)}</td>
        <td class="num">${T.int(r.pending)}</td><td>${T.time(r.created_at)}</td>
        <td title="${T.time(r.last_active)}">${T.ago(r.last_active)}</td></tr>`);
      document.getElementById("runs").innerHTML = T.table(
        [["run"], ["name"], ["tags"], ["model"], ["LoRA"], ["state"], ["steps", "num"], ["samplers", "num"],
         ["last metrics"], ["queued", "num"], ["created"], ["last active"]],
        rows, "No training runs yet: create one with service.create_lora_training_client(...).");
    },
  };

  // ---------------------------------------------------------------- one run
  const card = (id, title, label) => `<div class="card"><h3>${esc(title)}</h3><div class="chart">` +
    `<canvas id="${id}" role="img" aria-label="${esc(label || title)} (the table below has the numbers)"></canvas></div></div>`;
  const metricId = (name) => `chart-metric-${name.replace(/[^A-Za-z0-9_-]/g, "_")}`;

  T.pages.run = {
    title: (p) => `Run ${p.id}`,
    mount(main, p) {
      main.innerHTML = `<p><a href="/console/runs" data-link>← Runs</a></p>
        <h1>Run <span class="mono">${esc(p.id)}</span> <span id="run-name"></span></h1>
        <dl class="facts" id="run-facts"></dl>
        <div class="actions">
          <button class="small" type="button" id="download-csv">Download metrics (CSV)</button>
          <button class="small" type="button" id="download-json">Download metrics (JSON)</button>
          <a href="/console/compare?runs=${encodeURIComponent(p.id)}" data-link>Compare with other runs</a>
        </div>
        <div class="grid" id="run-charts">
          ${card("chart-loss", "Loss per step")}
          ${card("chart-grad", "Gradient norm per optim step")}
          ${card("chart-seconds", "Seconds per step (wall clock, from the previous step's end)")}
          <div id="run-metric-charts" class="contents"></div>
          ${card("chart-tokens", "Train tokens per step: computed vs in the loss")}
          <div class="card"><h3>Clock cycle of each step <span class="muted">(a dot in a ring: one cycle per step)</span></h3><div class="chart"><canvas id="chart-cycles" role="img" aria-label="Clock cycle of each step (the table below has the numbers)"></canvas></div></div>
        </div>
        <div id="run-failures"></div>
        <h2>Checkpoints</h2><div id="run-checkpoints"></div>
        <h2>Steps</h2><div id="run-steps"></div>`;
      const save = (format) => T.download(`/api/trine/v1/training-runs/${encodeURIComponent(p.id)}/metrics?format=${format}`,
        `${p.id}-metrics.${format}`).catch((e) => alert(`download failed: ${e.message}`));
      document.getElementById("download-csv").addEventListener("click", () => save("csv"));
      document.getElementById("download-json").addEventListener("click", () => save("json"));
    },
    load: (p) => T.api(`/console/api/runs/${encodeURIComponent(p.id)}`),
    fill(data) {
      const r = data.run, steps = data.steps;
      document.getElementById("run-name").textContent = r.name ? `· ${r.name}` : "";
      document.getElementById("run-facts").innerHTML = T.facts([
        ["model", esc(r.model)], ["LoRA", T.lora(r.lora)], ["state", T.state(r.state)], ["optim steps", T.int(r.steps)],
        ["optimizer (last used)", T.optimizer(r.optimizer)], ["tags", T.tags(r.tags) || "–"],
        ["samplers", T.int(r.samplers)], ["last metrics", `<span class="mono">${T.lastMetrics(r.last_metrics)}</span>`],
        ["queued events", T.int(r.pending)], ["session (timeline)", T.sessionLink(r.session_id)],
        ["created", T.time(r.created_at)], ["last active", `${T.ago(r.last_active)}`],
        ["last cycle", T.int(r.last_cycle)],
        ...Object.entries(r.user_metadata || {}).map(([k, v]) => [k, esc(v)]),
      ]);
      const labels = steps.map((s) => s.step);
      T.chart("chart-loss", "line", labels,
        [{ label: "loss (mean per token)", data: steps.map((s) => s.loss), borderColor: "#1f5fa8",
           backgroundColor: "#1f5fa8", pointRadius: 3, spanGaps: true }],
        { scales: T.axes("step", "loss") });
      const opt = steps.filter((s) => s.grad_norm != null);
      T.chart("chart-grad", "line", opt.map((s) => s.step),
        [{ label: "gradient norm (before clipping)", data: opt.map((s) => s.grad_norm), borderColor: "#b3261e",
           backgroundColor: "#b3261e", pointRadius: 3 }],
        { scales: T.axes("step", "norm") });
      T.chart("chart-seconds", "bar", labels,
        [{ label: "seconds", data: steps.map((s) => s.seconds), backgroundColor: "#a0cbe8", maxBarThickness: 40 }],
        { scales: T.axes("step", "seconds", { y: { beginAtZero: true } }) });
      const names = Object.keys(data.metrics), box = document.getElementById("run-metric-charts");
      if (box.dataset.names !== names.join("\n")) { // a new metric: its card, once
        names.forEach((n) => { const c = document.getElementById(metricId(n)); if (c && Chart.getChart(c)) Chart.getChart(c).destroy(); });
        box.innerHTML = names.map((n) => card(metricId(n), `${n} (logged)`)).join("");
        box.dataset.names = names.join("\n");
      }
      names.forEach((n, i) => {
        const pts = data.metrics[n];
        T.chart(metricId(n), "line", pts.map((p) => p[0]),
          [{ label: n, data: pts.map((p) => p[1]), borderColor: T.SERIES_COLORS[(i + 2) % T.SERIES_COLORS.length],
             backgroundColor: T.SERIES_COLORS[(i + 2) % T.SERIES_COLORS.length], pointRadius: 3 }],
          { scales: T.axes("step", n) });
      });
      T.chart("chart-tokens", "bar", labels,
        [{ label: "computed (whole sequences)", data: steps.map((s) => s.train_tokens), backgroundColor: T.PHASE_COLORS.train },
         { label: "in the loss", data: steps.map((s) => s.loss_tokens), backgroundColor: "#9fd18f" }],
        { scales: T.axes("step", "tokens") });
      T.chart("chart-cycles", "line", labels,
        [{ label: "forward_backward", data: steps.map((s) => s.cycle), borderColor: "#4e79a7",
           backgroundColor: "rgba(0,0,0,0)", pointRadius: 6, pointBorderWidth: 2, showLine: false },
         { label: "optim_step", data: steps.map((s) => s.optim_cycle), borderColor: "#f28e2b",
           backgroundColor: "#f28e2b", pointRadius: 3, showLine: false }],
        { scales: T.axes("step", "clock cycle", { y: { ticks: { precision: 0 } } }) });
      const rows = steps.slice().reverse().slice(0, 500).map((s) => `<tr>
        <td class="num">${s.step}</td><td class="num">${T.num(s.loss, 5)}</td><td class="num">${T.num(s.grad_norm, 4)}</td>
        <td class="num">${T.num(s.seconds, 3)}</td>
        <td class="num">${T.int(s.train_tokens)}</td><td class="num">${T.int(s.loss_tokens)}</td><td class="num">${s.chunks}</td>
        <td class="num">${s.cycle ?? "–"}</td><td class="num">${s.optim_cycle ?? "–"}</td>
        <td class="num">${s.cycle != null && s.cycle === s.optim_cycle ? "1" : s.optim_cycle != null ? "2+" : "–"}</td>
        <td class="num">${T.money(s.cost)}</td><td>${T.time(s.finished_at)}</td></tr>`);
      document.getElementById("run-steps").innerHTML = T.table(
        [["step", "num"], ["loss", "num"], ["grad norm", "num"], ["seconds", "num"], ["train tokens", "num"],
         ["loss tokens", "num"], ["chunks", "num"], ["fb cycle", "num"], ["optim cycle", "num"], ["cycles used", "num"],
         ["cost", "num"], ["finished"]],
        rows, "No finished forward_backward or optim_step yet.");
      document.getElementById("run-checkpoints").innerHTML = T.checkpointTable(data.checkpoints, false);
      document.getElementById("run-failures").innerHTML = data.failures.length
        ? `<h2>Failed events</h2>` + T.table([["index", "num"], ["type"], ["error"]], data.failures.map((f) =>
            `<tr><td class="num">${f.index}</td><td>${esc(f.type)}</td><td>${esc(f.error)}</td></tr>`), "") : "";
    },
  };
})();
