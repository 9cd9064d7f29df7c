// trine console: Checkpoints & samplers, and the checkpoint table the run page shows too.
// An RL loop's save_weights_and_get_sampling_client leaves a temp-sampling-* snapshot and a sampler
// per step: those are grouped by their training run (one row, opened on click), and every table pages.
"use strict";
(function () {
  const T = window.trine, esc = T.esc;
  const PAGE_SIZE = 20;
  const TEMP = /^temp-sampling-/;
  const ui = { open: {}, page: {} }; // open groups by table:key; page number by table id (survive refreshes)

  // Rows in display order where the items of one group become one unit at its first (newest) item.
  function units(items, groupOf) {
    const out = [], groups = {};
    for (const it of items) {
      const g = groupOf(it);
      if (g == null) { out.push({ item: it }); continue; }
      if (!groups[g]) { groups[g] = { key: g, items: [] }; out.push({ group: groups[g] }); }
      groups[g].items.push(it);
    }
    return out;
  }

  // A table of `items` (newest first) paged by PAGE_SIZE units; `groupOf(item)` names its group (or null).
  T.groupedTable = function ({ id, items, groupOf, head, row, groupRow, empty }) {
    const us = units(items, groupOf);
    const pages = Math.max(1, Math.ceil(us.length / PAGE_SIZE));
    const page = Math.min(ui.page[id] || 0, pages - 1);
    const rows = [];
    for (const u of us.slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE)) {
      if (u.item) { rows.push(row(u.item, "")); continue; }
      const key = `${id}:${u.group.key}`, open = !!ui.open[key];
      rows.push(`<tr class="group" data-group="${esc(u.group.key)}"><td colspan="${head.length}">
        <button class="small" type="button" data-action="toggle-group" data-key="${esc(key)}">${open ? "▾ hide" : "▸ show"}</button>
        ${groupRow(u.group.key, u.group.items)}</td></tr>`);
      if (open) u.group.items.forEach((it) => rows.push(row(it, "member")));
    }
    const pager = pages > 1 ? `<div class="pager" data-pager="${esc(id)}">
        <button class="small" type="button" data-action="page" data-table="${esc(id)}" data-page="${page - 1}" ${page ? "" : "disabled"}>‹ newer</button>
        <span>page ${page + 1} of ${pages} · ${us.length} rows</span>
        <button class="small" type="button" data-action="page" data-table="${esc(id)}" data-page="${page + 1}" ${page + 1 < pages ? "" : "disabled"}>older ›</button></div>` : "";
    return `<div data-table="${esc(id)}">${T.table(head, rows, empty)}${pager}</div>`;
  };

  const armed = {}; // checkpoint id -> until when a second click deletes it (survives refreshes)
  const deleteButton = (id) => armed[id] > Date.now()
    ? `<button class="small danger armed" type="button" data-action="delete" data-id="${esc(id)}">Confirm delete</button>`
    : `<button class="small danger" type="button" data-action="delete" data-id="${esc(id)}">Delete</button>`;

  T.checkpointTable = (cks, showRun, id = showRun ? "checkpoints" : "run-checkpoints") => T.groupedTable({
    id, items: cks, groupOf: (c) => (TEMP.test(c.name) ? c.run_id : null),
    head: [["name"], ["kind"], ...(showRun ? [["run"]] : []), ["URI"], ["size", "num"], ["step", "num"],
           ["visibility"], ["created"], ["expires"], [""]],
    row: (c, cls) => `<tr class="${cls}" data-checkpoint="${esc(c.id)}"><td>${esc(c.name)}</td><td>${esc(c.kind)}</td>
      ${showRun ? `<td>${T.runLink(c.run_id)}</td>` : ""}<td class="mono">${esc(c.uri)}</td>
      <td class="num">${esc(c.size)}</td><td class="num">${c.step}</td><td>${esc(c.visibility)}</td>
      <td>${T.time(c.created_at)}</td><td>${c.expires_at ? T.time(c.expires_at) : "never"}</td>
      <td><button class="small" type="button" data-action="download" data-id="${esc(c.id)}"
            ${c.downloadable ? "" : 'disabled title="a temporary snapshot held in memory: nothing on disk to download"'}>Download</button>
          ${deleteButton(c.id)}</td></tr>`,
    groupRow: (run, cs) => `<b>${cs.length}</b> temporary sampler snapshot${cs.length > 1 ? "s" : ""}
      (<code>save_weights_and_get_sampling_client</code>) of run ${T.runLink(run)}, steps
      ${Math.min(...cs.map((c) => c.step))}–${Math.max(...cs.map((c) => c.step))}, newest ${T.time(cs[0].created_at)}`,
    empty: "No checkpoints: save_state(name) and save_weights_for_sampler(name) make them.",
  });

  const samplerTable = (samplers) => T.groupedTable({
    id: "samplers", items: samplers, groupOf: (s) => s.training_run_id,
    head: [["sampler"], ["run"], ["model"], ["state"], ["weights"], ["created"], ["last active"]],
    row: (s, cls) => `<tr class="${cls}" data-sampler="${esc(s.id)}"><td class="mono">${esc(s.id)}</td>
      <td>${s.training_run_id ? T.runLink(s.training_run_id) : "–"}</td><td>${esc(s.model)}</td><td>${T.state(s.state)}</td>
      <td class="mono">${esc(s.source_checkpoint_uri || "base model")}</td><td>${T.time(s.created_at)}</td>
      <td>${T.ago(s.last_active)}</td></tr>`,
    groupRow: (run, ss) => `<b>${ss.length}</b> sampler${ss.length > 1 ? "s" : ""} of run ${T.runLink(run)}
      (their usage counts in the run's row of Usage), newest ${T.time(ss[0].created_at)}`,
    empty: "No samplers yet.",
  });

  T.pages.checkpoints = {
    title: () => "Checkpoints",
    mount(main) {
      main.innerHTML = `<h1>Checkpoints and samplers</h1><div id="checkpoints"></div>
        <h2>Samplers</h2><div id="samplers"></div>`;
    },
    load: () => T.api("/console/api/checkpoints"),
    fill(data) {
      document.getElementById("checkpoints").innerHTML = T.checkpointTable(data.checkpoints, true);
      document.getElementById("samplers").innerHTML = samplerTable(data.samplers);
    },
  };

  // Download: a short-lived signed URL from the API (the browser cannot add headers to a download).
  // Delete: the first click arms the button, a second click within 4 s deletes.
  document.addEventListener("click", async (ev) => {
    const b = ev.target.closest("button[data-action]");
    if (!b) return;
    const id = b.dataset.id;
    try {
      if (b.dataset.action === "toggle-group") {
        ui.open[b.dataset.key] = !ui.open[b.dataset.key];
        T.redraw();
      } else if (b.dataset.action === "page") {
        ui.page[b.dataset.table] = Number(b.dataset.page);
        T.redraw();
      } else if (b.dataset.action === "download") {
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
