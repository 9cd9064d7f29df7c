// trine console: the Runs list, one run's page (curves, steps, checkpoints) and Checkpoints & samplers.
"use strict";
(function () {
  const T = window.trine, esc = T.esc;

  // ---------------------------------------------------------------- runs
  T.pages.runs = {
    title: () => "Runs",
    mount(main) {
      main.innerHTML = `<h1>Training runs</h1><div id="runs"></div>`;
    },
    load: () => T.api("/console/api/runs"),
    fill(data) {
      const rows = data.runs.map((r) => `<tr data-run="${esc(r.id)}">
        <td>${T.runLink(r.id)}</td><td>${esc(r.model)}</td><td class="num">${r.rank}</td>
        <td>${T.state(r.state)}</td><td class="num">${T.int(r.steps)}</td><td class="num">${T.int(r.pending)}</td>
        <td class="num">${T.int(r.last_cycle)}</td><td>${T.time(r.created_at)}</td>
        <td title="${T.time(r.last_active)}">${T.ago(r.last_active)}</td></tr>`);
      document.getElementById("runs").innerHTML = T.table(
        [["run"], ["model"], ["rank", "num"], ["state"], ["steps", "num"], ["queued", "num"],
         ["last cycle", "num"], ["created"], ["last active"]],
        rows, "No training runs yet: create one with service.create_lora_training_client(...).");
    },
  };

  // ---------------------------------------------------------------- one run
  T.pages.run = {
    title: (p) => `Run ${p.id}`,
    mount(main, p) {
      main.innerHTML = `<p><a href="/console/runs" data-link>← Runs</a></p>
        <h1>Run <span class="mono">${esc(p.id)}</span></h1>
        <dl class="facts" id="run-facts"></dl>
        <div class="grid">
          <div class="card"><h3>Loss per step</h3><div class="chart"><canvas id="chart-loss" role="img" aria-label="Loss per step (the table below has the numbers)"></canvas></div></div>
          <div class="card"><h3>Gradient norm per optim step</h3><div class="chart"><canvas id="chart-grad" role="img" aria-label="Gradient norm per optim step (the table below has the numbers)"></canvas></div></div>
          <div class="card"><h3>Train tokens per step: computed vs in the loss</h3><div class="chart"><canvas id="chart-tokens" role="img" aria-label="Train tokens per step: computed vs in the loss (the table below has the numbers)"></canvas></div></div>
          <div class="card"><h3>Clock cycle of each step <span class="muted">(a dot in a ring: one cycle per step)</span></h3><div class="chart"><canvas id="chart-cycles" role="img" aria-label="Clock cycle of each step (the table below has the numbers)"></canvas></div></div>
        </div>
        <div id="run-failures"></div>
        <h2>Checkpoints</h2><div id="run-checkpoints"></div>
        <h2>Steps</h2><div id="run-steps"></div>`;
    },
    load: (p) => T.api(`/console/api/runs/${encodeURIComponent(p.id)}`),
    fill(data) {
      const r = data.run, steps = data.steps;
      document.getElementById("run-facts").innerHTML = T.facts([
        ["model", esc(r.model)], ["LoRA rank", r.rank], ["state", T.state(r.state)], ["optim steps", T.int(r.steps)],
        ["queued events", T.int(r.pending)], ["session", `<span class="mono">${esc(r.session_id)}</span>`],
        ["created", T.time(r.created_at)], ["last active", `${T.ago(r.last_active)}`],
        ["last cycle", T.int(r.last_cycle)],
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
        <td class="num">${T.int(s.train_tokens)}</td><td class="num">${T.int(s.loss_tokens)}</td><td class="num">${s.chunks}</td>
        <td class="num">${s.cycle ?? "–"}</td><td class="num">${s.optim_cycle ?? "–"}</td>
        <td class="num">${s.cycle != null && s.cycle === s.optim_cycle ? "1" : s.optim_cycle != null ? "2+" : "–"}</td>
        <td class="num">${T.money(s.cost)}</td><td>${T.time(s.finished_at)}</td></tr>`);
      document.getElementById("run-steps").innerHTML = T.table(
        [["step", "num"], ["loss", "num"], ["grad norm", "num"], ["train tokens", "num"], ["loss tokens", "num"],
         ["chunks", "num"], ["fb cycle", "num"], ["optim cycle", "num"], ["cycles used", "num"], ["cost", "num"],
         ["finished"]],
        rows, "No finished forward_backward or optim_step yet.");
      document.getElementById("run-checkpoints").innerHTML = T.checkpointTable(data.checkpoints, false);
      document.getElementById("run-failures").innerHTML = data.failures.length
        ? `<h2>Failed events</h2>` + T.table([["index", "num"], ["type"], ["error"]], data.failures.map((f) =>
            `<tr><td class="num">${f.index}</td><td>${esc(f.type)}</td><td>${esc(f.error)}</td></tr>`), "") : "";
    },
  };

  // ---------------------------------------------------------------- checkpoints and samplers
  T.checkpointTable = (cks, showRun) => T.table(
    [["name"], ["kind"], ...(showRun ? [["run"]] : []), ["URI"], ["size", "num"], ["step", "num"],
     ["visibility"], ["created"], ["expires"], [""]],
    cks.map((c) => `<tr data-checkpoint="${esc(c.id)}"><td>${esc(c.name)}</td><td>${esc(c.kind)}</td>
      ${showRun ? `<td>${T.runLink(c.run_id)}</td>` : ""}<td class="mono">${esc(c.uri)}</td>
      <td class="num">${esc(c.size)}</td><td class="num">${c.step}</td><td>${esc(c.visibility)}</td>
      <td>${T.time(c.created_at)}</td><td>${c.expires_at ? T.time(c.expires_at) : "never"}</td>
      <td><button class="small" type="button" data-action="download" data-id="${esc(c.id)}"
            ${c.downloadable ? "" : 'disabled title="a temporary snapshot held in memory: nothing on disk to download"'}>Download</button>
          ${deleteButton(c.id)}</td></tr>`),
    "No checkpoints: save_state(name) and save_weights_for_sampler(name) make them.");

  const armed = {}; // checkpoint id -> until when a second click deletes it (survives refreshes)
  const deleteButton = (id) => armed[id] > Date.now()
    ? `<button class="small danger armed" type="button" data-action="delete" data-id="${esc(id)}">Confirm delete</button>`
    : `<button class="small danger" type="button" data-action="delete" data-id="${esc(id)}">Delete</button>`;

  T.pages.checkpoints = {
    title: () => "Checkpoints",
    mount(main) {
      main.innerHTML = `<h1>Checkpoints and samplers</h1><div id="checkpoints"></div>
        <h2>Samplers</h2><div id="samplers"></div>`;
    },
    load: () => T.api("/console/api/checkpoints"),
    fill(data) {
      document.getElementById("checkpoints").innerHTML = T.checkpointTable(data.checkpoints, true);
      document.getElementById("samplers").innerHTML = T.table(
        [["sampler"], ["model"], ["state"], ["weights"], ["created"], ["last active"]],
        data.samplers.map((s) => `<tr><td class="mono">${esc(s.id)}</td><td>${esc(s.model)}</td><td>${T.state(s.state)}</td>
          <td class="mono">${esc(s.source_checkpoint_uri || "base model")}</td><td>${T.time(s.created_at)}</td>
          <td>${T.ago(s.last_active)}</td></tr>`),
        "No samplers yet.");
    },
  };

  // Download: a short-lived signed URL from the API (the browser cannot add headers to a download).
  // Delete: the first click arms the button, a second click within 4 s deletes.
  document.addEventListener("click", async (ev) => {
    const b = ev.target.closest("button[data-action]");
    if (!b) return;
    const id = b.dataset.id;
    try {
      if (b.dataset.action === "download") {
        const r = await T.api(`/api/openapi/v1/checkpoints/${encodeURIComponent(id)}/download-url`);
        window.location.href = r.url;
      } else if (b.dataset.action === "delete") {
        if (!(armed[id] > Date.now())) {
          armed[id] = Date.now() + 4000;
          b.outerHTML = deleteButton(id);
          return;
        }
        delete armed[id];
        await T.api(`/api/openapi/v1/checkpoints/${encodeURIComponent(id)}`, { method: "DELETE" });
        T.refresh();
      }
    } catch (e) {
      if (!(e instanceof T.Unauthorized)) alert(`${b.dataset.action} failed: ${e.message}`);
    }
  });
})();
