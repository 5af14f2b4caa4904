/* The six pages: Cluster, Jobs, Runs, Models, Deployments, Planner. Each renders from the API only. */
"use strict";

/* ---------------------------------------------------------------- Cluster */
GY.pages.cluster = {
  title: "Cluster",
  every: 5000,
  async render(main) {
    main.innerHTML = `
      <div class="card"><h2>Scheduler</h2><div id="sched"></div></div>
      <div id="nodes"></div>`;
    if (GY.me.role === "admin") {
      main.querySelector(".card").insertAdjacentHTML("beforeend",
        '<p><button id="probe" class="secondary" type="button">Probe this machine again</button></p>');
      main.querySelector("#probe").addEventListener("click", async () => {
        try { await GY.api("/cluster/probe", { json: {} }); GY.toast("Inventory recorded"); await this.refresh(); }
        catch (e) { GY.toast(e.message, true); }
      });
    }
    await this.refresh();
  },
  async refresh() {
    const [nodes, sched] = await Promise.all([GY.api("/cluster/nodes"), GY.api("/cluster/scheduler")]);
    this.renderScheduler(sched);
    this.renderNodes(nodes);
  },
  renderScheduler(s) {
    const el = document.getElementById("sched");
    if (!el) return;
    if (!s.policy) { el.innerHTML = '<p class="muted">This server runs no job service.</p>'; return; }
    // Who holds what: whole GPUs, shares of a GPU (fraction), MIG slices (by UUID).
    const holder = {}, shares = {}, slices = {};
    for (const j of s.active) for (const p of (j.placement || {}).nodes || []) {
      if (p.mig) for (const m of p.mig) slices[m.uuid] = j;
      else if (p.share) for (const g of p.gpus) (shares[`${p.node}/${g}`] ||= []).push([j, p.share.fraction]);
      else for (const g of p.gpus) holder[`${p.node}/${g}`] = j;
    }
    const who = (j) => `job ${j.id} ${esc(j.name)} (${esc(j.team)})`;
    let h = `<p>policy <b>${esc(s.policy)}</b> · executor <b>${esc(s.executor)}</b> · teams ${Object.entries(s.teams).map(([t, w]) => `${esc(t)} (weight ${w})`).join(", ")} · ${s.active.length} job(s) holding resources</p>`;
    for (const n of s.nodes) {
      const mine = (k) => k.startsWith(`${n.name}/`);
      const migBusy = (n.mig || []).filter((m) => slices[m.uuid]).map((m) => `${n.name}/${m.gpu}`);
      const busy = new Set([...Object.keys(holder), ...Object.keys(shares), ...migBusy].filter(mine)).size;
      h += `<h3>${esc(n.name)} · ${n.gpus} GPU slot(s) ${esc(n.gpu_type)} · ${n.cpus} CPU slot(s) · ${busy} busy</h3><div class="slots">`;
      for (let g = 0; g < n.gpus; g++) {
        const key = `${n.name}/${g}`, j = holder[key], parts = shares[key] || [];
        if ((n.mig_mode || []).includes(g)) {  // a MIG GPU: its slices, each free or held by one job
          const rows = (n.mig || []).filter((m) => m.gpu === g).map((m) => {
            const sj = slices[m.uuid];
            return `<span class="mig ${sj ? "busy" : ""}" title="${esc(m.uuid)}${sj ? `: ${who(sj)}` : ""}">${esc(m.profile)}: ${sj ? `job ${sj.id}` : "free"}</span>`;
          }).join("");
          h += `<div class="slot mig-gpu"><b>GPU${g} MIG</b>${rows || '<span class="muted">no slice</span>'}</div>`;
        } else if (parts.length) {  // shares of one GPU: how much is held, by whom
          const used = parts.reduce((a, [, f]) => a + f, 0);
          h += `<div class="slot busy shared" title="${parts.map(([pj, f]) => `${who(pj)}: ${f}`).join("; ")}"><b>GPU${g} shared</b>${Math.round(used * 100)}% · ${parts.map(([pj, f]) => `job ${pj.id} (${f})`).join(", ")}</div>`;
        } else {
          const cls = n.excluded.includes(g) ? "excluded" : j ? "busy" : "";
          h += `<div class="slot ${cls}" title="${j ? who(j) : cls || "free"}"><b>GPU${g}</b>${j ? `job ${j.id}` : cls || "free"}</div>`;
        }
      }
      h += "</div>";
    }
    el.innerHTML = h;
  },
  renderNodes(nodes) {
    const el = document.getElementById("nodes");
    if (!el) return;
    if (!nodes.length) { el.innerHTML = '<div class="card muted">No node recorded yet: run <code>gpuyard hw</code> on each machine.</div>'; return; }
    el.innerHTML = nodes.map((n, i) => {
      const node = n.inventory.node || n.inventory;
      const cpu = node.cpu || {};
      const rows = (node.accelerators || []).map((a) => {
        const util = a.utilization ? a.utilization.gpu : null;
        return `<tr><td>${a.index}</td><td>${esc(a.name)}</td><td>${fmt.gib(a.memory_bytes)}</td>
          <td>${util === null ? "-" : `<div class="bar" title="${util}%"><span data-css="width:${Number(util)}%"></span></div> ${util}%`}</td>
          <td>${a.temperature_c ?? "-"}${a.temperature_c != null ? " C" : ""}</td>
          <td>${a.power_w != null ? `${Math.round(a.power_w)} / ${Math.round(a.power_limit_w)} W` : "-"}</td>
          <td>${fmt.badge(a.health)} <span class="muted">${esc((a.health_reasons || []).map((r) => r.message).join("; "))}</span></td></tr>`;
      }).join("");
      return `<div class="card node"><h2>${esc(n.hostname)} ${fmt.badge(n.health)}</h2>
        <p class="muted">${esc(cpu.model)} · ${cpu.cores} cores · ${fmt.gib(cpu.memory_bytes)} · recorded ${fmt.time(n.updated_at)}</p>
        <div class="row"><div class="card grow"><h3>Accelerators</h3>${rows ? `<table><tr><th>#</th><th>name</th><th>memory</th><th>utilization</th><th>temp</th><th>power</th><th>health</th></tr>${rows}</table>` : '<p class="muted">No accelerator.</p>'}</div>
        <div class="card shrink"><h3>Topology</h3><div class="topo" id="topo-${i}"></div></div></div></div>`;
    }).join("");
    nodes.forEach((n, i) => Charts.topology(document.getElementById(`topo-${i}`), (n.inventory.node || n.inventory).topology || {}));
  },
};

/* ---------------------------------------------------------------- Jobs */
/* A job's wall time as one stacked bar: productive, then the time lost by cause (docs/scheduler.md). */
const GOODPUT_COLORS = { productive: "#2e9d5b", queueing: "#b8bec8", startup: "#7fb3e0", restart: "#d9534f",
  recomputed: "#f0a030", checkpoint: "#9b7fd0", data: "#e6cf4a", straggler: "#e07fb3", other: "#dde1e6" };
// What a job asks for, as `gpuyard jobs show` says it: 2, 0.5, 20 GB, MIG 1g.10gb, 4 (elastic 1-4).
function asked(j) {
  const r = (j.spec && j.spec.resources) || {};
  if (r.mig) return (r.slices > 1 ? `${r.slices}x ` : "") + `MIG ${esc(r.mig)}`;
  if (r.gpus_max) return `${j.gpus} (elastic ${r.gpus}-${r.gpus_max}${j.resize_to ? `, restarts on ${j.resize_to}` : ""})`;
  const parts = [];
  if (r.gpu_fraction != null) parts.push(`${r.gpu_fraction}`);
  if (r.gpu_memory_gb != null) parts.push(`${r.gpu_memory_gb} GB`);
  return parts.length ? parts.join(", ") : `${j.gpus}`;
}

// A queued job's predicted start, a running one's predicted end; the range and the source on hover.
function predicted(j) {
  const p = j.prediction;
  if (!p) return "";
  const running = ["scheduled", "running"].includes(j.state);
  const [at, range] = running ? [p.end, p.end_range] : [p.start, p.start_range];
  const span = `${fmt.time(range[0])} .. ${range[1] ? fmt.time(range[1]) : "no bound"}`;
  const tip = `${running ? "end" : "start"} ${span} UTC; from ${p.basis}${p.note ? ": " + p.note : ""}`;
  return `<span title="${esc(tip)}">${running ? "ends" : "starts"} ${at ? fmt.time(at).slice(5, 16) : "unknown"}</span>`;
}

function goodputBar(gp) {
  if (!gp || !gp.wall_s) return '<span class="muted">-</span>';
  const parts = [["productive", gp.productive_s], ...Object.entries(gp.lost_s)].filter(([, s]) => s > 0);
  const tip = parts.map(([k, s]) => `${k} ${s.toFixed(1)} s`).join(", ");
  const ettr = gp.ettr === null ? "-" : `${(gp.ettr * 100).toFixed(1)}%`;
  return `<div class="stack goodput" title="ETTR ${ettr} of ${gp.wall_s.toFixed(1)} s: ${esc(tip)}">` +
    parts.map(([k, s]) => `<span data-cause="${esc(k)}" data-css="width:${(100 * s / gp.wall_s).toFixed(2)}%;background:${GOODPUT_COLORS[k] || "#ccc"}"></span>`).join("") +
    `</div> <span class="muted">${ettr}</span>`;
}
GY.pages.jobs = {
  title: "Jobs",
  every: 2000,
  selected: null,
  logOffset: 0,
  async render(main) {
    this.selected = null;
    main.innerHTML = `
      <div class="card"><h2>Submit a job</h2>
        <form id="submit-form" class="inline">
          <label>name<input name="name" required pattern="[A-Za-z0-9][A-Za-z0-9._\\-]*" value="job"></label>
          <label class="grow">command<input name="command" class="full" required placeholder="python train.py --epochs 3"></label>
          <label>GPUs<input name="gpus" type="number" min="0" value="0"></label>
          <label>team<input name="team" value="${esc(GY.me.team)}"></label>
          <label>priority<input name="priority" type="number" value="0"></label>
          <button type="submit">Submit</button>
        </form></div>
      <div class="card"><h2>Queue</h2>
        <form id="filter-form" class="inline">
          <label>state<select name="state"><option value="">any</option>${["queued", "scheduled", "running", "succeeded", "failed", "cancelled", "preempted"].map((s) => `<option>${s}</option>`).join("")}</select></label>
          <label>team<input name="team" placeholder="any"></label>
        </form>
        <div id="jobs-table"></div></div>
      <div class="card" id="log-card" hidden><h2 id="log-title"></h2><pre class="log" id="log"></pre></div>`;
    main.querySelector("#submit-form").addEventListener("submit", (ev) => this.submit(ev));
    main.querySelector("#filter-form").addEventListener("change", () => this.refresh());
    main.querySelector("#filter-form").addEventListener("submit", (ev) => { ev.preventDefault(); this.refresh(); });
    await this.refresh();
  },
  async submit(ev) {
    ev.preventDefault();
    const f = new FormData(ev.target);
    const spec = {
      name: f.get("name"), command: f.get("command"), team: f.get("team"),
      priority: Number(f.get("priority") || 0), resources: { gpus: Number(f.get("gpus") || 0) },
    };
    try {
      const job = await GY.api("/jobs", { json: spec });
      GY.toast(`Job ${job.id} ${job.name}: ${job.state}`);
      await this.refresh();
    } catch (e) { GY.toast(e.message, true); }
  },
  async refresh() {
    const f = new FormData(document.getElementById("filter-form"));
    const q = new URLSearchParams();
    if (f.get("state")) q.set("state", f.get("state"));
    if (f.get("team")) q.set("team", f.get("team"));
    let jobs;
    try { jobs = await GY.api(`/jobs?${q}`); }
    catch (e) { document.getElementById("jobs-table").innerHTML = `<p class="error">${esc(e.message)}</p>`; return; }
    const el = document.getElementById("jobs-table");
    if (!el) return;
    el.innerHTML = jobs.length ? `<table id="jobs"><tr><th>id</th><th>name</th><th>team</th><th>user</th><th>state</th><th>GPUs</th><th>attempts</th><th>submitted</th><th>predicted</th><th>goodput</th><th>reason</th><th></th></tr>` +
      jobs.map((j) => `<tr data-id="${j.id}" class="${j.id === this.selected ? "sel" : ""}"><td>${j.id}</td><td>${esc(j.name)}</td><td>${esc(j.team)}</td><td>${esc(j.user)}</td>
        <td class="state">${fmt.badge(j.state)}${j.stop_requested ? ' <span class="muted">stopping</span>' : ""}</td><td>${asked(j)}</td><td>${j.attempts}</td>
        <td>${fmt.time(j.submitted_at)}</td><td>${predicted(j)}</td><td>${goodputBar(j.goodput)}</td><td class="muted">${esc(j.reason)}</td>
        <td><button class="secondary logs" type="button">Logs</button>
        ${["succeeded", "failed", "cancelled"].includes(j.state) || GY.me.role === "viewer" ? "" : '<button class="danger cancel" type="button">Cancel</button>'}</td></tr>`).join("") + "</table>"
      : '<p class="muted">No job matches.</p>';
    el.querySelectorAll("button.logs").forEach((b) => b.addEventListener("click", () => this.showLogs(Number(b.closest("tr").dataset.id))));
    el.querySelectorAll("button.cancel").forEach((b) => b.addEventListener("click", () => this.cancel(Number(b.closest("tr").dataset.id))));
    if (this.selected !== null) await this.pollLog();
  },
  async cancel(id) {
    try { const j = await GY.api(`/jobs/${id}/cancel`, { json: {} }); GY.toast(`Job ${id}: ${j.state}${j.stop_requested ? " (stopping)" : ""}`); await this.refresh(); }
    catch (e) { GY.toast(e.message, true); }
  },
  async showLogs(id) {
    this.selected = id;
    this.logOffset = 0;
    document.getElementById("log-card").hidden = false;
    document.getElementById("log-title").textContent = `Log of job ${id}`;
    document.getElementById("log").textContent = "";
    document.querySelectorAll("#jobs tr[data-id]").forEach((tr) => tr.classList.toggle("sel", Number(tr.dataset.id) === id));
    await this.pollLog();
  },
  async pollLog() {
    const id = this.selected;
    for (let i = 0; i < 20; i++) {  // read what is there, 64 KiB at a time
      const chunk = await GY.api(`/jobs/${id}/logs?offset=${this.logOffset}`);
      if (id !== this.selected) return;
      if (!chunk.text) break;
      const pre = document.getElementById("log");
      pre.textContent += chunk.text;
      pre.scrollTop = pre.scrollHeight;
      this.logOffset = chunk.offset;
    }
  },
};

/* ---------------------------------------------------------------- Runs */
GY.pages.runs = {
  title: "Runs",
  chosen: new Set(),
  async render(main) {
    this.chosen = new Set();
    const runs = await GY.api("/runs?limit=200");
    main.innerHTML = `<div class="card"><h2>Runs</h2>
      <p><button id="compare" type="button" disabled>Compare selected</button> <span class="muted">Tick two or more runs to compare; click a row for its curves.</span></p>
      <div id="runs-table"></div></div><div id="run-detail"></div>`;
    const el = main.querySelector("#runs-table");
    if (!runs.length) { el.innerHTML = '<p class="muted">No run tracked yet (<code>gpuyard train</code>, <code>gpuyard tune</code>).</p>'; return; }
    // Columns from every run shown: each run's objective (validation/<its metric>, test/<...>), then
    // whatever gives a run with metrics but no column yet a filled cell, then the most shared keys.
    const latest = runs.map((r) => metrics.flat(r.latest));
    const objectives = [...new Set(runs.flatMap((r, i) => metrics.objective(latest[i], (r.tags || {}).metric)))];
    const keys = metrics.columns(latest, objectives, 6);
    el.innerHTML = `<table class="runs"><tr><th></th><th>id</th><th>name</th><th>experiment</th><th>kind</th><th>status</th><th>dataset</th><th>started</th><th>params</th>${keys.map((k) => `<th class="metric">${fmt.breaks(k)}</th>`).join("")}</tr>` +
      runs.map((r, i) => `<tr class="clickable" data-id="${esc(r.id)}"><td><input type="checkbox" class="pick"></td><td class="mono">${esc(r.id.slice(0, 8))}</td><td>${esc(r.name)}</td><td>${esc(r.experiment)}</td><td>${esc(r.kind)}</td><td>${fmt.badge(r.status)}</td><td class="mono">${fmt.breaks(r.dataset_version || "-")}</td><td>${fmt.time(r.started_at)}</td><td class="params mono" title="${esc(JSON.stringify(r.params))}">${fmt.pairs(r.params, 6, 40)}</td>${keys.map((k) => `<td class="metric">${fmt.num(latest[i][k], 4)}</td>`).join("")}</tr>`).join("") + "</table>";
    el.querySelectorAll("tr[data-id]").forEach((tr) => tr.addEventListener("click", (ev) => {
      if (ev.target.classList.contains("pick")) {
        ev.target.checked ? this.chosen.add(tr.dataset.id) : this.chosen.delete(tr.dataset.id);
        main.querySelector("#compare").disabled = this.chosen.size < 2;
        return;
      }
      el.querySelectorAll("tr").forEach((t) => t.classList.toggle("sel", t === tr));
      this.show([tr.dataset.id]);
    }));
    main.querySelector("#compare").addEventListener("click", () => this.show([...this.chosen]));
    await this.show([runs[0].id]);
  },
  async show(ids) {
    const el = document.getElementById("run-detail");
    const series = await Promise.all(ids.map((id) => GY.api(`/runs/${encodeURIComponent(id)}/metrics`)));
    let head;
    if (ids.length > 1) {
      const cmp = await GY.api(`/runs/compare?${ids.map((i) => `ids=${encodeURIComponent(i)}`).join("&")}`);
      const tr = (k, vals, differs) => `<tr class="${differs ? "differs" : ""}"><td class="mono">${esc(k)}</td>${vals.map((v) => `<td>${v === null || v === undefined ? "-" : typeof v === "number" ? fmt.num(v, 4) : typeof v === "string" ? esc(v) : esc(JSON.stringify(v))}</td>`).join("")}</tr>`;
      head = `<div class="card"><h2>Compare ${ids.length} runs</h2><table class="compare"><tr><th></th>${cmp.runs.map((r, i) => `<th>${esc(cmp.names[i])} <span class="mono muted">${esc(r.slice(0, 8))}</span></th>`).join("")}</tr>
        <tr><td class="muted">dataset</td>${cmp.dataset_versions.map((d) => `<td class="mono">${esc(d || "-")}</td>`).join("")}</tr>
        ${Object.entries(cmp.params).map(([k, v]) => tr(k, v, cmp.differs.includes(k))).join("")}
        ${Object.entries(cmp.metrics).map(([k, v]) => tr(k, v, false)).join("")}</table><p class="muted">Highlighted: parameters that differ.</p></div>`;
    } else {
      const r = await GY.api(`/runs/${encodeURIComponent(ids[0])}`);
      head = `<div class="card"><h2>${esc(r.name)} <span class="mono muted">${esc(r.id)}</span> ${fmt.badge(r.status)}</h2>
        <dl class="kv"><dt>experiment</dt><dd>${esc(r.experiment)}</dd><dt>dataset</dt><dd class="mono">${esc(r.dataset_version || "-")}</dd>
        <dt>code</dt><dd class="mono">${esc(r.code_version || "-")}</dd><dt>params</dt><dd class="mono">${fmt.pairs(r.params)}</dd>
        <dt>artifacts</dt><dd>${r.artifacts.map((a) => `<span class="mono">${esc(a.name)}</span> (${a.size} B)`).join(", ") || "-"}</dd>
        ${r.error ? `<dt>error</dt><dd class="error">${esc(r.error)}</dd>` : ""}</dl></div>`;
    }
    const keys = [...new Set(series.flatMap((s) => Object.keys(s.series)))].filter((k) => !k.startsWith("sys/")).sort();
    el.innerHTML = head + `<div class="card"><h2>Metric curves</h2><div class="charts" id="curves"></div>${keys.length ? "" : '<p class="muted">No metric series.</p>'}</div>`;
    const box = document.getElementById("curves");
    for (const k of keys) {
      const { xs, values } = Charts.align(series.map((s) => s.series[k] || []));
      const div = document.createElement("div");
      div.className = "chart";
      box.appendChild(div);
      Charts.line(div, k, xs, values.map((v, i) => ({ label: series[i].run.slice(0, 8), values: v })), { xlabel: "step", width: 420, height: 200 });
    }
  },
};

/* ---------------------------------------------------------------- Models */
GY.pages.models = {
  title: "Models",
  async render(main) {
    const models = await GY.api("/models");
    main.innerHTML = `<div class="card"><h2>Registered models</h2><div id="models-table"></div></div><div id="model-detail"></div>`;
    const el = main.querySelector("#models-table");
    if (!models.length) { el.innerHTML = '<p class="muted">No model registered yet (<code>gpuyard models register</code>).</p>'; return; }
    el.innerHTML = `<table><tr><th>name</th><th>flavor</th><th>versions</th><th>latest</th><th>production</th><th>staging</th><th>aliases</th><th>updated</th></tr>` +
      models.map((m) => `<tr class="clickable" data-name="${esc(m.name)}"><td><b>${esc(m.name)}</b></td><td>${esc(m.flavor)}</td><td>${esc(m.versions)}</td><td>${esc(m.latest)}</td><td>${esc(m.production ?? "-")}</td><td>${esc(m.staging ?? "-")}</td><td>${Object.entries(m.aliases).map(([a, v]) => `${esc(a)}→${esc(v)}`).join(", ") || "-"}</td><td>${fmt.time(m.updated_at)}</td></tr>`).join("") + "</table>";
    el.querySelectorAll("tr[data-name]").forEach((tr) => tr.addEventListener("click", () => {
      el.querySelectorAll("tr").forEach((t) => t.classList.toggle("sel", t === tr));
      this.show(tr.dataset.name);
    }));
    el.querySelector("tr[data-name]").classList.add("sel");
    await this.show(models[0].name);
  },
  async show(name) {
    const m = await GY.api(`/models/${encodeURIComponent(name)}`);
    const el = document.getElementById("model-detail");
    // A version registered from a run holds {split: {metric: value}}; one registered by hand, {key: value}.
    const flat = new Map(m.versions.map((v) => [v.version, metrics.flat(v.metrics)]));
    const objectives = [...new Set(m.versions.flatMap((v) => metrics.objective(flat.get(v.version), (v.lineage || {}).metric)))];
    const metricKeys = metrics.columns([...flat.values()], objectives, 6);
    const canWrite = GY.me.role !== "viewer";
    const stageCell = (v) => canWrite && v.stage !== "production"
      ? `<select class="stage" data-v="${esc(v.version)}">${["none", "staging", "archived"].map((s) => `<option ${s === v.stage ? "selected" : ""}>${s}</option>`).join("")}</select>`
      : fmt.badge(v.stage);
    const lineage = (v) => `<div class="lineage"><span class="node">dataset <span class="mono">${esc(v.dataset_version || "-")}</span></span><span class="arrow">→</span>
      <span class="node">run <span class="mono">${esc((v.run_id || "-").slice(0, 8))}</span></span><span class="arrow">→</span>
      <span class="node"><b>${esc(v.name)}:${esc(v.version)}</b> ${fmt.badge(v.stage)}</span>
      ${v.lineage && Object.keys(v.lineage).length ? `<span class="muted mono wrap">${esc(JSON.stringify(v.lineage).slice(0, 200))}</span>` : ""}</div>`;
    el.innerHTML = `<div class="card"><h2>${esc(name)}: versions</h2><div class="scroll-x"><table id="versions"><tr><th>version</th><th>stage</th><th>aliases</th><th>flavor</th><th>run</th><th>dataset</th><th>code</th>${metricKeys.map((k) => `<th class="metric">${fmt.breaks(k)}</th>`).join("")}<th>created</th></tr>` +
      m.versions.map((v) => `<tr data-v="${esc(v.version)}"><td><b>${esc(v.version)}</b></td><td>${stageCell(v)}</td><td>${v.aliases.map(esc).join(", ") || "-"}</td><td>${esc(v.flavor)}</td><td class="mono">${esc((v.run_id || "-").slice(0, 8))}</td><td class="mono">${fmt.breaks(v.dataset_version || "-")}</td><td class="mono">${esc((v.code_version || "-").slice(0, 10))}</td>${metricKeys.map((k) => `<td class="metric">${fmt.num(flat.get(v.version)[k], 4)}</td>`).join("")}<td>${fmt.time(v.created_at)}</td></tr>`).join("") +
      `</table></div></div><div class="row"><div class="card"><h2>Lineage</h2>${m.versions.slice(0, 5).map(lineage).join("<br>")}</div>
      <div class="card"><h2>Metrics by version</h2><div class="charts" id="model-metrics">${metricKeys.length ? "" : '<p class="muted">No version recorded a metric.</p>'}</div></div></div>
      <div class="card"><h2>Events</h2><table class="events"><tr><th>at</th><th>version</th><th>action</th><th>detail</th></tr>${m.events.map((e) => `<tr><td class="nowrap">${fmt.time(e.at)}</td><td>${esc(e.version ?? "-")}</td><td>${esc(e.action)}</td><td class="detail">${fmt.pairs(e.detail, 8, 120)}</td></tr>`).join("")}</table></div>`;
    const vs = [...m.versions].reverse();
    if (metricKeys.length && vs.length) {
      const div = document.createElement("div");
      document.getElementById("model-metrics").appendChild(div);
      Charts.line(div, "metric per version", vs.map((v) => v.version), metricKeys.map((k) => ({ label: k, values: vs.map((v) => flat.get(v.version)[k] ?? null) })), { xlabel: "version", width: 460, integerX: true });
    }
    el.querySelectorAll("select.stage").forEach((s) => s.addEventListener("change", async () => {
      try { await GY.api(`/models/${encodeURIComponent(name)}/versions/${s.dataset.v}/stage`, { json: { stage: s.value } }); GY.toast(`${name}:${s.dataset.v} → ${s.value}`); await this.show(name); }
      catch (e) { GY.toast(e.message, true); }
    }));
  },
};

/* ---------------------------------------------------------------- Deployments */
GY.pages.deployments = {
  title: "Deployments",
  every: 2000,
  selected: null,
  history: null,
  async render(main) {
    main.innerHTML = `<div class="card"><h2>Deployments</h2><div id="dep-table"></div></div>
      <div class="card" id="live-card" hidden><h2 id="live-title"></h2><div class="charts"><div id="lat-chart" class="chart"></div><div id="tput-chart" class="chart"></div></div>
      <h3>Drift over the sliding window</h3><div id="drift"></div></div>
      <div class="card"><h2>Drift alerts</h2><div id="alerts"></div></div>`;
    this.selected = null;
    await this.refresh();
  },
  async refresh() {
    const [deps, alerts] = await Promise.all([GY.api("/deployments?all=true"), GY.api("/deployments/alerts?limit=50")]);
    const el = document.getElementById("dep-table");
    if (!el) return;
    el.innerHTML = deps.length ? `<table><tr><th>id</th><th>model</th><th>ref</th><th>status</th><th>replicas</th><th>device</th><th>GPUs</th><th>job</th><th>url</th><th>created</th></tr>` +
      deps.map((d) => `<tr class="clickable ${d.id === this.selected ? "sel" : ""}" data-id="${esc(d.id)}"><td>${esc(d.id)}</td><td>${esc(d.model)}:${esc(d.version)}</td><td class="mono">${esc(d.ref)}</td><td>${fmt.badge(d.status)}</td><td>${esc(d.replicas)}</td><td>${esc(d.device)}</td><td class="mono">${esc((d.pids && d.pids.gpus) || "-")}</td><td>${esc(d.job ?? "-")}</td><td class="mono">${esc(d.url || "-")}</td><td>${fmt.time(d.created_at)}</td></tr>`).join("") + "</table>"
      : '<p class="muted">No deployment yet (<code>gpuyard deploy MODEL</code>).</p>';
    el.querySelectorAll("tr[data-id]").forEach((tr) => tr.addEventListener("click", () => this.select(Number(tr.dataset.id))));
    document.getElementById("alerts").innerHTML = alerts.length ? `<table><tr><th>at</th><th>model</th><th>kind</th><th>feature</th><th>test</th><th>value</th><th>threshold</th><th>window</th></tr>` +
      alerts.map((a) => `<tr><td>${fmt.time(a.created_at)}</td><td>${esc(a.model)}:${esc(a.version)}</td><td>${esc(a.kind)}</td><td>${esc(a.feature || "-")}</td><td>${esc(a.metric)}</td><td>${fmt.num(a.value, 4)}</td><td>${fmt.num(a.threshold, 3)}</td><td>${esc(a.window)}</td></tr>`).join("") + "</table>"
      : '<p class="muted">No drift alert.</p>';
    if (this.selected === null) {
      const first = deps.find((d) => d.status === "running");
      if (first) this.select(first.id);
    } else {
      await this.poll();
    }
  },
  select(id) {
    this.selected = id;
    this.history = { t: [], p50: [], p95: [], p99: [], rps: [] };
    document.querySelectorAll("#dep-table tr[data-id]").forEach((tr) => tr.classList.toggle("sel", Number(tr.dataset.id) === id));
    document.getElementById("live-card").hidden = false;
    document.getElementById("live-title").textContent = `Deployment ${id}: live`;
    return this.poll();
  },
  async poll() {
    const id = this.selected;
    const live = await GY.api(`/deployments/${id}/live`);
    if (id !== this.selected) return;
    const drift = document.getElementById("drift");
    if (!live.reachable) {
      drift.innerHTML = `<p class="muted">Not reachable: ${esc(live.error)}</p>`;
      return;
    }
    const h = this.history, s = live.stats;
    h.t.push(Date.now() / 1000); h.p50.push(s.p50_ms); h.p95.push(s.p95_ms); h.p99.push(s.p99_ms); h.rps.push(s.throughput_rps);
    for (const k of Object.keys(h)) if (h[k].length > 300) h[k].shift();
    const lat = document.getElementById("lat-chart"), tput = document.getElementById("tput-chart");
    lat.innerHTML = ""; tput.innerHTML = "";
    Charts.line(lat, `latency (ms, last ${Number(s.window_s)}s window)`, h.t, [{ label: "p50", values: h.p50 }, { label: "p95", values: h.p95 }, { label: "p99", values: h.p99 }], { time: true, width: 480 });
    Charts.line(tput, "throughput (requests/s)", h.t, [{ label: "req/s", values: h.rps }], { time: true, width: 480 });
    const d = live.drift || {};
    const r = d.report;
    // One row per feature, named by its column (city=paris for a one-hot category, image[3,4] for a pixel).
    const rows = (feats, head) => `<table class="${head}"><tr><th>${head === "skew" ? "raw column" : "feature"}</th><th>PSI</th><th>KS</th><th>KS p</th><th>${head}</th></tr>` +
      feats.slice(0, 64).map((f) => `<tr><td>${esc(f.feature)}</td><td>${fmt.num(f.psi, 3)}</td><td>${f.ks == null ? "-" : fmt.num(f.ks, 3)}</td><td>${f.ks_pvalue == null ? "-" : fmt.num(f.ks_pvalue, 2)}</td><td>${f.drift_psi || f.drift_ks ? fmt.badge("fail") : fmt.badge("pass")}</td></tr>`).join("") + "</table>";
    const k = d.skew;
    const skew = !d.enabled ? "" : k ? `<h4>Raw records against the training rows (skew)</h4><p class="muted">${esc(k.rows)} records; text columns by PSI over their categories</p>${rows(k.features, "skew")}` :
      d.skew_reason && d.skew_reason.includes("raw records") ? `<p class="muted">Skew: ${esc(d.skew_reason)}</p>` : "";
    drift.innerHTML = !d.enabled ? `<p class="muted">Drift off: ${esc(d.reason)}</p>` : (!r ? `<p class="muted">${esc(d.reason)}</p>` :
      `<p class="muted">${esc(r.rows)} samples; PSI alert at ≥ ${esc(r.psi_threshold)}, KS at p < ${fmt.num(r.ks_pvalue_threshold, 2)}</p>${rows(r.features, "drift")}`) + skew;
  },
};

/* ---------------------------------------------------------------- Planner */
GY.pages.planner = {
  title: "Planner",
  async render(main) {
    const p = await GY.api("/fabric/presets");
    const opt = (xs, sel) => xs.map((x) => `<option ${x === sel ? "selected" : ""}>${esc(x)}</option>`).join("");
    main.innerHTML = `<div class="card"><h2>Plan parallelism</h2>
      <form id="plan-form" class="inline">
        <label>model<select name="model">${opt(p.models, "llama3-70b")}</select></label>
        <label>cluster<select name="cluster">${opt(p.clusters, "dgx-h100")}</select></label>
        <label>GPUs<input name="gpus" type="number" min="1" value="512"></label>
        <label>global batch<input name="global_batch" type="number" min="1" value="1024"></label>
        <label>seq len<input name="seq_len" type="number" min="1" placeholder="model's"></label>
        <label>plans<input name="top" type="number" min="1" max="50" value="8"></label>
        <button type="submit">Plan</button>
      </form></div><div id="plan-out"></div>`;
    main.querySelector("#plan-form").addEventListener("submit", (ev) => this.plan(ev));
  },
  async plan(ev) {
    ev.preventDefault();
    const f = new FormData(ev.target);
    const req = { model: f.get("model"), cluster: f.get("cluster"), gpus: Number(f.get("gpus")), global_batch: Number(f.get("global_batch")), top: Number(f.get("top")) };
    if (f.get("seq_len")) req.seq_len = Number(f.get("seq_len"));
    const out = document.getElementById("plan-out");
    out.innerHTML = '<p class="muted">Searching…</p>';
    let r;
    try { r = await GY.api("/fabric/plan", { json: req }); }
    catch (e) { out.innerHTML = `<p class="error">${esc(e.message)}</p>`; return; }
    const name = (c) => `${c.tp}.${c.pp}.${c.dp}.${c.cp}${c.ep > 1 ? ` ep${c.ep}` : ""}`;
    out.innerHTML = `<div class="card"><h2>${esc(r.model)} on ${r.gpus} × ${esc(r.device)} (${esc(r.cluster)}), batch ${r.global_batch}, seq ${r.seq_len}</h2>
      <p>${r.fitting} of ${r.considered} layouts fit in memory. ${esc(r.explain)}</p>
      <table id="plans"><tr><th>#</th><th>tp.pp.dp.cp</th><th>micro-batch</th><th>virtual stages</th><th>recompute</th><th>ZeRO</th><th>SP</th><th>step s</th><th>tokens/s</th><th>MFU</th><th>GiB/GPU</th></tr>` +
      r.plans.map((c, i) => `<tr><td>${i + 1}</td><td class="mono">${name(c)}</td><td>${c.micro_batch}</td><td>${c.virtual_stages}</td><td>${esc(c.recompute)}</td><td>${c.zero}</td><td>${c.sequence_parallel ? "yes" : "no"}</td><td>${c.step_time_s.toFixed(2)}</td><td>${Math.round(c.tokens_per_s).toLocaleString("en")}</td><td>${(100 * c.mfu).toFixed(1)}%</td><td>${c.memory_gib_per_gpu.toFixed(1)}</td></tr>`).join("") +
      `</table></div><div class="card"><h2>Step time breakdown</h2><div id="breakdown"></div></div>`;
    const parts = [["compute", "compute_s"], ["pipeline bubble", "bubble_s"], ["exposed communication", "exposed_comm_s"]];
    Charts.stacked(document.getElementById("breakdown"),
      r.plans.map((c, i) => ({ label: `#${i + 1} ${name(c)}`, parts: parts.map(([l, k]) => ({ label: l, value: c.breakdown[k] || 0 })) })),
      parts.map((p) => p[0]));
  },
};
