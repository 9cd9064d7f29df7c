// trine console: the Sessions list and one session's timeline (where its time went, per engine
// replica: queue, prefill, decode, clock cycles, training steps), beside what each phase cost.
// The spans come from GET /api/trine/v1/sessions/{id}/timeline (server/traces.py); the same data
// downloads as a Chrome trace-event file that ui.perfetto.dev opens.
"use strict";
(function () {
  const T = window.trine, esc = T.esc;
  const LANES = ["queue", "prefill", "decode", "cycle", "train"];
  const LANE_TEXT = { queue: "queue", prefill: "prefill", decode: "decode", cycle: "clock cycles", train: "train" };
  // the cost of queue and cycle spans is their requests' / events' own, counted in the other lanes
  const PRICED = new Set(["prefill", "decode", "train"]);
  const BILLED = ["prefill", "prefill_cached", "sample", "train"]; // a span's tokens also say train_loss etc.
  const ROW = 14, GAP = 3, LABEL = 150, AXIS = 22;

  T.sessionLink = (id) => `<a href="/console/sessions/${encodeURIComponent(id)}" data-link class="mono">${esc(id)}</a>`;

  // ---------------------------------------------------------------- sessions
  T.pages.sessions = {
    title: () => "Sessions",
    mount(main) {
      main.innerHTML = `<h1>Sessions</h1>
        <p class="muted">A session is one <code>ServiceClient</code>: its training runs and samplers. Open one for its
        timeline: where its time went (queue, prefill, decode, training) beside what it cost.</p>
        <div id="sessions"></div>`;
    },
    load: () => T.api("/console/api/sessions"),
    fill(data) {
      const rows = data.sessions.map((s) => `<tr data-session="${esc(s.id)}">
        <td>${T.sessionLink(s.id)}</td><td>${esc(s.name || "")}</td><td>${T.tags(s.tags)}</td>
        <td>${T.state(s.state)}</td><td class="num">${T.int(s.training_runs)}</td><td class="num">${T.int(s.samplers)}</td>
        <td>${T.time(s.created_at)}</td><td title="${T.time(s.last_active)}">${T.ago(s.last_active)}</td></tr>`);
      document.getElementById("sessions").innerHTML = T.table(
        [["session"], ["name"], ["tags"], ["state"], ["training runs", "num"], ["samplers", "num"], ["created"],
         ["last active"]],
        rows, "No sessions yet: a ServiceClient opens one.");
    },
  };

  // ---------------------------------------------------------------- one session's timeline
  const seconds = (x) => (x == null ? "–" : x < 1 ? `${(1000 * x).toFixed(1)} ms` : `${x.toFixed(3)} s`);
  const tokenText = (tokens) => Object.entries(tokens || {}).map(([k, v]) => `${k} ${T.int(v)}`).join(", ") || "–";

  // a tick step of 1, 2 or 5 x 10^k giving about `n` ticks over `span`
  function tickStep(span, n) {
    const raw = span / n, p = 10 ** Math.floor(Math.log10(raw || 1));
    return [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw) || p;
  }

  function draw(data, width) {
    const groups = new Map(); // "model replica r" -> {lane -> rows}
    for (const s of data.spans) {
      const g = `${s.model} replica ${s.replica}`;
      if (!groups.has(g)) groups.set(g, Object.fromEntries(LANES.map((l) => [l, 0])));
      const lanes = groups.get(g);
      lanes[s.lane] = Math.max(lanes[s.lane], s.row + 1);
    }
    const total = Math.max(data.seconds, 1e-3), plot = width - LABEL - 12;
    const x = (t) => LABEL + (t / total) * plot;
    const step = tickStep(total, Math.max(2, Math.floor(plot / 110)));
    let y = AXIS, out = [];
    for (let t = 0; t <= total + 1e-9; t += step) {
      out.push(`<line class="tick" x1="${x(t)}" x2="${x(t)}" y1="${AXIS - 4}" y2="100%"/>` +
        `<text class="tick" x="${x(t)}" y="${AXIS - 8}" text-anchor="middle">${esc(seconds(t))}</text>`);
    }
    const top = {}; // "group|lane" -> y of its first row
    for (const [g, lanes] of groups) {
      out.push(`<text class="group" x="4" y="${y + 12}">${esc(g)}</text>`);
      y += 18;
      for (const lane of LANES) {
        if (!lanes[lane]) continue;
        top[`${g}|${lane}`] = y;
        out.push(`<text class="lane" x="14" y="${y + ROW - 3}">${esc(LANE_TEXT[lane])}` +
          `${lanes[lane] > 1 ? ` ×${lanes[lane]}` : ""}</text>`);
        y += lanes[lane] * (ROW + GAP);
      }
      y += 8;
    }
    for (const s of data.spans) {
      const y0 = top[`${s.model} replica ${s.replica}|${s.lane}`] + s.row * (ROW + GAP);
      const w = Math.max(1, x(s.end) - x(s.start));
      const tip = [s.name, `${seconds(s.end - s.start)} (from ${seconds(s.start)})`, `tokens: ${tokenText(s.tokens)}`,
        `cost: ${T.money(s.cost)} ${data.currency}${PRICED.has(s.lane) ? "" : " (its request's)"}`,
        ...Object.entries(s.args || {}).map(([k, v]) => `${k}: ${v}`)].join("\n");
      out.push(`<rect class="span lane-${esc(s.lane)}" data-lane="${esc(s.lane)}" data-request="${esc(s.request_id || "")}"` +
        ` x="${x(s.start).toFixed(2)}" y="${y0}" width="${w.toFixed(2)}" height="${ROW}" rx="2"><title>${esc(tip)}</title></rect>`);
    }
    return `<svg id="timeline-svg" width="${width}" height="${y + 4}" role="img" ` +
      `aria-label="Timeline of the session's requests by lane (the table below has the totals)">${out.join("")}</svg>`;
  }

  function summary(data) {
    const by = Object.fromEntries(LANES.map((l) => [l, { spans: 0, seconds: 0, tokens: 0, cost: 0 }]));
    for (const s of data.spans) {
      const b = by[s.lane];
      b.spans += 1;
      b.seconds += s.end - s.start;
      b.tokens += BILLED.reduce((a, k) => a + ((s.tokens || {})[k] || 0), 0);
      b.cost += s.cost;
    }
    let cost = 0;
    const rows = LANES.filter((l) => by[l].spans).map((l) => {
      const b = by[l], priced = PRICED.has(l);
      if (priced) cost += b.cost;
      return `<tr data-lane="${l}"><td><span class="legend-dot lane-${l}"></span>${esc(LANE_TEXT[l])}</td>` +
        `<td class="num">${T.int(b.spans)}</td><td class="num">${seconds(b.seconds)}</td>` +
        `<td class="num">${priced ? T.int(b.tokens) : "–"}</td><td class="num">${priced ? T.money(b.cost) : "–"}</td></tr>`;
    });
    rows.push(`<tr class="total"><td>total</td><td></td><td></td><td></td><td class="num" id="timeline-cost">${T.money(cost)}</td></tr>`);
    return T.table([["lane"], ["spans", "num"], ["time (sum of spans)", "num"], ["tokens", "num"],
      [`cost (${data.currency})`, "num"]], rows, "");
  }

  T.pages.session = {
    title: (p) => `Session ${p.id}`,
    pollMs: 5000,
    mount(main, p) {
      const id = encodeURIComponent(p.id);
      main.innerHTML = `<p><a href="/console/sessions" data-link>← Sessions</a></p>
        <h1>Session <span class="mono">${esc(p.id)}</span></h1>
        <dl class="facts" id="timeline-facts"></dl>
        <div class="actions">
          <button class="small" type="button" id="download-trace">Download trace (Perfetto)</button>
          <span class="muted">open the file in <a href="https://ui.perfetto.dev" target="_blank" rel="noopener">ui.perfetto.dev</a>
          (Open trace file); nothing leaves this server until you do</span>
        </div>
        <div class="card scroll" id="timeline"></div>
        <h2>Time and cost by lane</h2><div id="timeline-summary"></div>`;
      document.getElementById("download-trace").addEventListener("click", () =>
        T.download(`/api/trine/v1/sessions/${id}/trace`, `trace-${p.id}.json`).catch((e) => alert(`download failed: ${e.message}`)));
    },
    load: (p) => T.api(`/api/trine/v1/sessions/${encodeURIComponent(p.id)}/timeline`),
    fill(data) {
      const runs = new Set(data.spans.map((s) => s.run_id).filter(Boolean));
      document.getElementById("timeline-facts").innerHTML = T.facts([
        ["first span", T.time(data.start)], ["duration", seconds(data.seconds)], ["spans", T.int(data.spans.length)],
        ["runs and samplers", T.int(runs.size)],
        ["requests and events", data.left_out ? `latest ${T.int(data.requests)} of ${T.int(data.requests + data.left_out)}`
          : T.int(data.requests)],
      ]);
      const box = document.getElementById("timeline");
      box.innerHTML = data.spans.length
        ? draw(data, Math.max(640, box.clientWidth - 30))
        : `<div class="empty">No request of this session has finished yet.</div>`;
      document.getElementById("timeline-summary").innerHTML = summary(data);
    },
  };
})();
