// trine console: Usage (tokens and cost by phase over time, by group, cache diagnostics) and Server.
// The usage page reads GET /api/trine/v1/usage, the endpoint `trine usage --url` reads: same code, same numbers.
"use strict";
(function () {
  const T = window.trine, esc = T.esc;
  const PHASES = [["prefill", "prefill computed"], ["prefill_cached", "prefill cached"], ["sample", "sample"],
                  ["train", "train"]];
  const BUCKETS = ["minute", "hour", "day"];
  const MAX_BARS = { minute: 180, hour: 168 };
  const ui = { by: "run", since: "", bucket: "auto", show: "tokens" };
  let autoBucket = "minute";

  const usageUrl = (by) => `/api/trine/v1/usage?by=${by}` + (ui.since ? `&since=${encodeURIComponent(ui.since)}` : "");
  const select = (name, label, options) => `<label>${label} <select data-ui="${name}">${options.map(([v, t]) =>
    `<option value="${v}" ${ui[name] === v ? "selected" : ""}>${t}</option>`).join("")}</select></label>`;

  // "2026-01-05 13:07Z" / "2026-01-05 13:00Z" / "2026-01-05" -> ms since the epoch (UTC)
  const keyTime = (k) => Date.parse(k.length === 10 ? `${k}T00:00:00Z` : `${k.slice(0, 10)}T${k.slice(11, 16)}:00Z`);
  const timeKey = (ms, bucket) => {
    const iso = new Date(ms).toISOString();
    return bucket === "day" ? iso.slice(0, 10) : bucket === "hour" ? `${iso.slice(0, 10)} ${iso.slice(11, 13)}:00Z`
      : `${iso.slice(0, 10)} ${iso.slice(11, 16)}Z`;
  };
  // Empty buckets between the first and the last one become zero bars, so the x axis is real time.
  function withGaps(rows, bucket) {
    if (rows.length < 2) return rows;
    const step = { minute: 60e3, hour: 3600e3, day: 86400e3 }[bucket];
    const have = Object.fromEntries(rows.map((r) => [r.key, r]));
    const out = [];
    for (let t = keyTime(rows[0].key); t <= keyTime(rows[rows.length - 1].key) && out.length < 2000; t += step) {
      const k = timeKey(t, bucket);
      out.push(have[k] || { key: k, requests: 0, tokens: {}, cost: {} });
    }
    return out;
  }

  async function loadTime() {
    if (ui.bucket !== "auto") return [ui.bucket, await T.api(usageUrl(ui.bucket))];
    for (let i = BUCKETS.indexOf(autoBucket); ; i++) {
      const b = BUCKETS[i], rep = await T.api(usageUrl(b));
      const span = rep.rows.length < 2 ? 0 : (keyTime(rep.rows[rep.rows.length - 1].key) - keyTime(rep.rows[0].key));
      const bars = span / { minute: 60e3, hour: 3600e3, day: 86400e3 }[b];
      if (b === "day" || bars <= MAX_BARS[b]) { autoBucket = b; return [b, rep]; }
    }
  }

  T.pages.usage = {
    title: () => "Usage",
    pollMs: 10000, // a report aggregates the key's whole history: refreshed less often than runs
    mount(main) {
      main.innerHTML = `<h1>Usage and cost by phase</h1>
        <div class="controls" id="usage-controls">
          ${select("by", "rows by", [["run", "run"], ["session", "session"], ["model", "model"]])}
          ${select("since", "since", [["", "all time"], ["1h", "last hour"], ["24h", "last 24 h"], ["7d", "last 7 days"]])}
          ${select("bucket", "bars per", [["auto", "auto"], ["minute", "minute"], ["hour", "hour"], ["day", "day"]])}
          ${select("show", "show", [["tokens", "tokens"], ["cost", "cost"]])}
        </div>
        <dl class="facts" id="usage-facts"></dl>
        <div class="card"><h3 id="usage-chart-title">Tokens by phase over time</h3>
          <div class="chart" style="height:280px"><canvas id="chart-usage" role="img" aria-label="Tokens or cost by phase over time, stacked (the table below has the totals)"></canvas></div></div>
        <h2>Cost by phase</h2><div class="card" id="usage-cost"></div>
        <h2 id="usage-groups-title">By run</h2><div id="usage-groups"></div>
        <h2>Prefix-cache diagnostics</h2><div id="usage-diagnostics"></div>`;
      main.querySelectorAll("select[data-ui]").forEach((s) => s.addEventListener("change", () => {
        ui[s.dataset.ui] = s.value;
        if (s.dataset.ui !== "show") autoBucket = "minute";
        T.refresh();
      }));
    },
    async load() {
      const [[bucket, time], groups] = await Promise.all([loadTime(), T.api(usageUrl(ui.by))]);
      return { bucket, time, groups };
    },
    fill({ bucket, time, groups }) {
      const t = groups.total, tk = t.tokens, cur = groups.currency;
      document.getElementById("usage-facts").innerHTML = T.facts([
        ["requests", T.int(t.requests)], ["prompt tokens", T.int(tk.prompt)],
        ["prefill computed", T.int(tk.prefill)], ["prefill cached", T.int(tk.prefill_cached)],
        ["cache hit rate", T.pct(t.cache_hit_rate)], ["of which image tokens", T.int(tk.image || 0)],
        ["sampled", T.int(tk.sample)],
        ["train computed", T.int(tk.train)], ["train sent", T.int(tk.train_sequence || tk.train)],
        ["train in the loss", T.int(tk.train_loss)],
        [`cost (${esc(cur)})`, T.money(t.cost.total)], ["dominant phase", esc(t.dominant_phase || "–")],
      ]);
      const rows = withGaps(time.rows, bucket), cost = ui.show === "cost";
      document.getElementById("usage-chart-title").textContent =
        `${cost ? `Cost (${cur})` : "Tokens"} by phase per ${bucket} (UTC), stacked`;
      T.chart("chart-usage", "bar", rows.map((r) => r.key),
        PHASES.map(([ph, label]) => ({ label, phase: ph, backgroundColor: T.PHASE_COLORS[ph], maxBarThickness: 48,
          data: rows.map((r) => (cost ? r.cost[ph] : r.tokens[ph]) || 0) })),
        { scales: { x: { stacked: true }, y: { stacked: true, beginAtZero: true,
                    title: { display: true, text: cost ? cur : "tokens" } } } });
      const total = t.cost.total || 0;
      document.getElementById("usage-cost").innerHTML =
        `<div class="meter">${PHASES.map(([ph]) => `<span style="width:${total ? (100 * t.cost[ph]) / total : 0}%;` +
          `background:${T.PHASE_COLORS[ph]}"></span>`).join("")}</div>` +
        PHASES.map(([ph, label]) => `<span class="legend-dot" style="background:${T.PHASE_COLORS[ph]}"></span>${label} ` +
          `<b>${T.money(t.cost[ph])}</b> (${T.pct(total ? t.cost[ph] / total : null)})`).join(" &nbsp; ");
      document.getElementById("usage-groups-title").textContent = `By ${groups.by}`;
      const byRun = groups.by === "run";
      const cells = (r, label, cls) => `<tr class="${cls}">${label}
          <td class="num">${T.int(r.requests)}</td><td class="num">${T.int(r.tokens.prefill)}</td>
          <td class="num">${T.int(r.tokens.prefill_cached)}</td><td class="num">${T.pct(r.cache_hit_rate)}</td>
          <td class="num">${T.int(r.tokens.sample)}</td><td class="num">${T.int(r.tokens.train)}</td>
          <td class="num">${T.int(r.tokens.train_loss)}</td><td class="num">${T.money(r.cost.total)}</td></tr>`;
      // by run: a training run's row holds its samplers' usage too, broken down under it
      const parts = (r) => Object.entries(r.parts || {}).map(([kind, p]) => cells(p, `<td>${kind === "sampling"
        ? `└ ${T.int(p.info.runs)} sampler${p.info.runs === 1 ? "" : "s"}` : "├ training"}</td><td></td>`, "member part"));
      document.getElementById("usage-groups").innerHTML = T.table(
        [[groups.by], ...(byRun ? [["name"]] : []), ["requests", "num"], ["prefill", "num"], ["cached", "num"],
         ["hit", "num"], ["sample", "num"], ["train", "num"], ["loss", "num"], [`cost (${cur})`, "num"]],
        [...groups.rows, { ...t, key: "total", isTotal: true }].flatMap((r) => [cells(r,
          `<td data-key="${esc(r.key)}">${byRun && r.key.startsWith("tr_") ? T.runLink(r.key) : `<span class="mono">${esc(r.key)}</span>`}</td>` +
          (byRun ? `<td>${esc((r.info && r.info.name) || "")}</td>` : ""), r.isTotal ? "total" : ""), ...parts(r)]),
        "No usage yet.");
      document.getElementById("usage-diagnostics").innerHTML = groups.diagnostics.length
        ? groups.diagnostics.map((d) => `<div class="card diag" data-pattern="${esc(d.pattern)}"><p><b>${esc(d.pattern)}</b>:
            ${T.int(d.requests)} request(s), ${T.int(d.tokens_lost)} prompt tokens prefilled that could have been cached
            (${esc(cur)} ${T.money(d.cost_lost)}); prompts diverge at token ${d.diverge_position}.</p>
            <p><b>Fix:</b> ${esc(d.fix)}</p></div>`).join("")
        : `<div class="card empty">No cache-unfriendly patterns found.</div>`;
    },
  };

  // ---------------------------------------------------------------- server
  const cycleTable = (cycles) => T.table(
    [["cycle", "num"], ["seconds", "num"], ["your runs"], ["other keys' runs", "num"], ["events", "num"]],
    cycles.map((c) => `<tr><td class="num">${c.cycle}</td><td class="num">${T.num(c.seconds, 3)}</td>
      <td>${c.runs.map(T.runLink).join(" ") || "–"}</td><td class="num">${c.other_runs}</td>
      <td class="num">${c.events}</td></tr>`),
    "No training cycle has run on this replica yet.");

  function engineCard(e) {
    const title = `<h3>${esc(e.model)} · replica ${e.replica}${e.where ? ` <span class="muted">(${esc(e.where)})</span>` : ""}</h3>`;
    if (!e.alive) return `<div class="card replica-card" data-model="${esc(e.model)}">${title}<div class="error">lost: ${esc(e.error || "")}</div></div>`;
    const kv = e.kv, c = e.cache, q = e.queues;
    const used = kv.blocks_total ? kv.blocks_used / kv.blocks_total : 0;
    return `<div class="card replica-card" data-model="${esc(e.model)}" data-replica="${e.replica}">${title}
      <div class="muted">KV pool: ${T.int(kv.blocks_used)} of ${T.int(kv.blocks_total)} blocks in use (${T.pct(used)}),
        ${T.int(kv.blocks_cached)} hold cached prefixes, ${T.int(kv.blocks_free)} free or evictable; ${kv.block_size} tokens a block</div>
      <div class="meter"><span style="width:${100 * used}%;background:${T.PHASE_COLORS.prefill}"></span></div>
      <dl class="facts">${T.facts([
        ["cache hit blocks", `${T.int(c.hit_blocks)} / ${T.int(c.queried_blocks)}`],
        ["token hit rate", T.pct(c.prompt_tokens ? c.cached_tokens / c.prompt_tokens : null)],
        ["evictions", T.int(c.evictions)], ["sample requests", T.int(c.requests)],
        ["samples waiting", T.int(q.sample_waiting)], ["sequences running", T.int(q.sample_running)],
        ["runs with queued events", T.int(q.train_runs_waiting)], ["queued training events", T.int(q.train_events_waiting)],
        ["engine jobs queued", T.int(q.engine_jobs)], ["training runs held", T.int(e.held.training_runs)],
        ["sampler adapters held", T.int(e.held.sampler_adapters)], ["current cycle", T.int(e.cycle)]])}</dl>
      <h3>Recent clock cycles</h3><div class="cycles">${cycleTable(e.cycles)}</div></div>`;
  }

  T.pages.server = {
    title: () => "Server",
    mount(main) {
      main.innerHTML = `<h1>Server</h1><h2>Served models and prices</h2><div id="server-models"></div>
        <h2>Engines</h2><p class="muted" id="server-cycle-note"></p><div id="server-engines"></div>`;
    },
    load: () => T.api("/console/api/server"),
    fill(data) {
      const unit = `${data.currency} / 1M tokens`;
      document.getElementById("server-models").innerHTML = T.table(
        [["model"], ["architecture"], ["context", "num"], ["replicas", "num"], [`prefill (${unit})`, "num"],
         ["prefill cached", "num"], ["sample", "num"], ["train", "num"], [`storage (${data.currency} / GB-month)`, "num"]],
        data.models.map((m) => `<tr><td>${esc(m.name)}</td><td>${esc(m.architecture || "–")}</td>
          <td class="num">${T.int(m.context_length)}</td><td class="num">${m.replicas}</td><td class="num">${m.pricing.prefill}</td>
          <td class="num">${m.pricing.prefill_cached}</td><td class="num">${m.pricing.sample}</td>
          <td class="num">${m.pricing.train}</td><td class="num">${m.pricing.storage_gb_month}</td></tr>`), "No models.");
      document.getElementById("server-cycle-note").textContent = (data.cycle_seconds > 0
        ? `A clock cycle starts every ${data.cycle_seconds} s with whatever is queued`
        : "A clock cycle starts as soon as training work is queued (after a short gather window)") +
        "; each replica runs its own cycles and batches every run placed on it.";
      document.getElementById("server-engines").innerHTML = data.engines.map(engineCard).join("");
    },
  };
})();
