// trine console, core: sign-in, the API helper, the router, live refresh, charts and formatting.
// Pages register themselves in trine.pages (pages-runs.js, pages-usage.js) as
//   {title, mount(main, params), load(params) -> data, fill(data, params), pollMs?}
// mount() builds the page once; load() + fill() run on every refresh: every pollMs (default
// POLL_MS) while the tab is shown, and at once when a control changes.
"use strict";

const T = (window.trine = { pages: {} });
const KEY_SLOT = "trine.apiKey";
const NAME_SLOT = "trine.keyName";
const POLL_MS = 2000;

T.NotFound = class extends Error {};
T.Unauthorized = class extends Error {};
T.key = () => sessionStorage.getItem(KEY_SLOT);

// ------------------------------------------------------------------ the API, with the SDK's header
T.api = async function (path, options = {}) {
  const res = await fetch(path, {
    ...options, cache: "no-store",
    headers: { "X-API-Key": T.key() || "", ...(options.headers || {}) },
  });
  const text = await res.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch (e) { body = { message: text }; }
  const message = (body && body.message) || `${res.status} ${res.statusText}`;
  if (res.status === 401) { signOut(message); throw new T.Unauthorized(message); }
  if (res.status === 404) throw new T.NotFound(message);
  if (!res.ok) throw new Error(message);
  return body;
};

// ------------------------------------------------------------------ formatting
const esc = (T.esc = (s) => String(s ?? "").replace(/[&<>"']/g,
  (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c])));
T.int = (x) => (x == null ? "–" : Math.round(x).toLocaleString("en-US"));
T.num = (x, d = 4) => (x == null ? "–" : Number(x).toPrecision(d).replace(/(\.\d*?)0+(e|$)/, "$1$2").replace(/\.(e|$)/, "$1"));
T.pct = (x) => (x == null ? "–" : `${(100 * x).toFixed(1)}%`);
// money fixed-point with 6 decimals, as the CLI prints it (never 6.7e-7); sizes come as text from the
// server (trine.sizes), so the console and `trine checkpoints` agree
T.money = (x) => (x == null ? "–" : Number(x).toFixed(6));
T.time = (ts) => {
  if (ts == null) return "–";
  const d = new Date(ts * 1000), p = (x) => String(x).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
};
T.ago = (ts) => {
  if (ts == null) return "–";
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
  return `${(s / 86400).toFixed(1)} d ago`;
};
T.state = (s) => `<span class="state ${esc(s)}">${esc(s)}</span>`;
T.runLink = (id) => `<a href="/console/runs/${encodeURIComponent(id)}" data-link class="mono">${esc(id)}</a>`;
T.facts = (pairs) => pairs.map(([k, v]) => `<div><dt>${esc(k)}</dt><dd>${v}</dd></div>`).join("");
T.table = (head, rows, empty) => rows.length
  ? `<div class="scroll"><table><thead><tr>${head.map(([h, cls]) => `<th class="${cls || ""}">${esc(h)}</th>`).join("")}</tr></thead>` +
    `<tbody>${rows.join("")}</tbody></table></div>`
  : `<div class="card empty">${esc(empty)}</div>`;

// ------------------------------------------------------------------ charts (Chart.js, vendored)
T.PHASE_COLORS = { prefill: "#4e79a7", prefill_cached: "#a0cbe8", sample: "#f28e2b", train: "#59a14f" };

// A chart with no value in any series says so over its (empty) axes.
function markEmpty(canvas, datasets) {
  const empty = !datasets.some((d) => (d.data || []).some((v) => v != null && (typeof v !== "object" || v.y != null)));
  let note = canvas.parentElement.querySelector(".nodata");
  if (empty && !note) {
    note = document.createElement("div");
    note.className = "nodata";
    note.textContent = "no data yet";
    canvas.parentElement.appendChild(note);
  }
  if (note) note.hidden = !empty;
}

// Create the chart on `canvasId` or update it in place (keeps zoom-free state like hidden series).
T.chart = function (canvasId, type, labels, datasets, options = {}) {
  const canvas = document.getElementById(canvasId);
  if (!canvas || !window.Chart) return null;
  markEmpty(canvas, datasets);
  let chart = Chart.getChart(canvas);
  if (!chart) {
    chart = new Chart(canvas, {
      type, data: { labels, datasets },
      options: {
        responsive: true, maintainAspectRatio: false, animation: false, normalized: true,
        interaction: { mode: "index", intersect: false },
        plugins: { legend: { position: "bottom", labels: { boxWidth: 12 } } },
        ...options,
      },
    });
    return chart;
  }
  chart.data.labels = labels;
  datasets.forEach((d, i) => {
    if (chart.data.datasets[i]) Object.assign(chart.data.datasets[i], d);
    else chart.data.datasets.push(d);
  });
  chart.data.datasets.length = datasets.length;
  chart.update("none");
  return chart;
};
// Exponential moving average with bias correction (as Weights & Biases smooths): weight 0 = raw.
T.ema = function (values, weight) {
  let avg = 0, n = 0;
  return values.map((v) => {
    if (v == null) return null;
    n++;
    avg = weight * avg + (1 - weight) * v;
    return weight ? avg / (1 - weight ** n) : v;
  });
};

// Save what an API path answers (with the key header) as a file named `filename`.
T.download = async function (path, filename) {
  const res = await fetch(path, { headers: { "X-API-Key": T.key() || "" }, cache: "no-store" });
  if (!res.ok) throw new Error(`${res.status} ${res.statusText}`);
  const url = URL.createObjectURL(await res.blob());
  const a = Object.assign(document.createElement("a"), { href: url, download: filename });
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
};

T.axes = (x, y, extra = {}) => ({
  x: { title: { display: true, text: x }, ...(extra.x || {}) },
  y: { title: { display: true, text: y }, ...(extra.y || {}) },
});

// ------------------------------------------------------------------ router and refresh
const main = () => document.getElementById("main");
let current = null;
let busy = false;
let lastRefresh = 0;

function route(path) {
  const p = path.replace(/\/+$/, "");
  const m = p.match(/^\/console\/runs\/([^/]+)$/);
  if (m) return ["run", { id: decodeURIComponent(m[1]) }];
  const sm = p.match(/^\/console\/sessions\/([^/]+)$/);
  if (sm) return ["session", { id: decodeURIComponent(sm[1]) }];
  const names = { "/console": "runs", "/console/runs": "runs", "/console/compare": "compare",
                  "/console/checkpoints": "checkpoints", "/console/usage": "usage", "/console/server": "server",
                  "/console/sessions": "sessions" };
  return [names[p] || null, {}];
}

function showNotFound(message) {
  current = null;
  document.title = "Not found · trine";
  main().innerHTML = `<div class="notfound card" id="notfound"><h1>Not found</h1><p>${esc(message)}</p>` +
    `<p><a href="/console/runs" data-link>Back to your runs</a></p></div>`;
}

async function show() {
  const [name, params] = route(location.pathname);
  const signedIn = !!T.key();
  document.querySelectorAll("#nav a").forEach((a) =>
    a.classList.toggle("active", signedIn && a.dataset.page === ({ run: "runs", session: "sessions" }[name] || name)));
  document.getElementById("signout").hidden = !signedIn;
  document.getElementById("who").textContent = signedIn ? `key: ${sessionStorage.getItem(NAME_SLOT) || "?"}` : "";
  if (!signedIn) return showSignIn();
  if (!name) return showNotFound(`There is no console page at ${location.pathname}.`);
  const page = T.pages[name];
  current = { page, params };
  document.title = `${page.title(params)} · trine`;
  main().innerHTML = "";
  page.mount(main(), params);
  await refresh();
}

async function refresh() {
  const c = current;
  if (!c || busy) return;
  busy = true;
  lastRefresh = Date.now();
  try {
    const data = await c.page.load(c.params);
    if (c !== current) return;
    c.data = data;
    c.page.fill(data, c.params);
    document.getElementById("live").textContent = `live · ${T.time(Date.now() / 1000).slice(11)}`;
  } catch (e) {
    if (c !== current) return;
    if (e instanceof T.NotFound) showNotFound(e.message);
    else if (!(e instanceof T.Unauthorized)) document.getElementById("live").textContent = `refresh failed: ${e.message}`;
  } finally {
    busy = false;
  }
}
T.refresh = refresh;
// Fill the page again from the data it last loaded (a control that only changes the view).
T.redraw = () => current && current.data && current.page.fill(current.data, current.params);

T.go = function (href) {
  history.pushState(null, "", href);
  show();
};

// ------------------------------------------------------------------ sign-in
function showSignIn(message) {
  current = null;
  document.title = "Sign in · trine";
  main().innerHTML = `<form class="signin card" id="signin">
    <h1>Sign in</h1>
    <p class="muted">Paste an API key of this server: <code>trine serve</code> prints one the first time, and
    <code>trine keys create --name NAME</code> makes more. The key stays in this browser tab (session storage)
    and goes to the server as the <code>X-API-Key</code> header, as the SDK sends it.</p>
    <label for="apikey">API key</label>
    <input id="apikey" name="apikey" type="password" autocomplete="off" placeholder="trine-…" required>
    <div id="signin-error" class="error" ${message ? "" : "hidden"}>${esc(message || "")}</div>
    <button type="submit" id="signin-submit">Sign in</button></form>`;
  const form = document.getElementById("signin");
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const key = document.getElementById("apikey").value.trim();
    const res = await fetch("/api/openapi/v1/api-key/verify", { headers: { "X-API-Key": key }, cache: "no-store" });
    const body = await res.json().catch(() => ({}));
    if (!res.ok) {
      const box = document.getElementById("signin-error");
      box.textContent = `Refused: ${body.message || res.statusText}`;
      box.hidden = false;
      return;
    }
    sessionStorage.setItem(KEY_SLOT, key);
    sessionStorage.setItem(NAME_SLOT, body.api_key_name || body.api_key_tid || "");
    show();
  });
  document.getElementById("apikey").focus();
}

function signOut(message) {
  sessionStorage.removeItem(KEY_SLOT);
  sessionStorage.removeItem(NAME_SLOT);
  document.getElementById("signout").hidden = true;
  document.getElementById("who").textContent = "";
  showSignIn(message ? `Signed out: the server refused the key (${message})` : "");
}

// ------------------------------------------------------------------ start
document.addEventListener("click", (ev) => {
  const a = ev.target.closest("a[data-link]");
  if (a && !ev.ctrlKey && !ev.metaKey && !ev.shiftKey && ev.button === 0) {
    ev.preventDefault();
    T.go(a.getAttribute("href"));
  }
});
window.addEventListener("popstate", show);
document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("signout").addEventListener("click", () => signOut());
  show();
  setInterval(() => {
    const every = (current && current.page.pollMs) || POLL_MS;
    if (document.visibilityState === "visible" && Date.now() - lastRefresh >= every - 100) refresh();
  }, 500);
});
