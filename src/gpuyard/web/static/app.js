/* The dashboard's core: the token, API calls, the hash router and live polling. */
"use strict";

const TOKEN_KEY = "gpuyard.token";

const GY = {
  pages: {},          // name -> {title, render(main) -> Promise, refresh() -> Promise, every: ms}
  me: null,
  timer: null,
  busy: false,
  current: null,

  token() { return localStorage.getItem(TOKEN_KEY); },

  /** Call the API with the stored token; a 401 signs out, other errors throw with the server's detail. */
  async api(path, opts = {}) {
    const headers = { Authorization: `Bearer ${this.token()}`, ...(opts.headers || {}) };
    if (opts.json !== undefined) headers["Content-Type"] = "application/json";
    const resp = await fetch(path, {
      method: opts.method || (opts.json !== undefined ? "POST" : "GET"),
      headers,
      body: opts.json !== undefined ? JSON.stringify(opts.json) : undefined,
    });
    const body = await resp.json().catch(() => null);
    if (resp.status === 401) {
      localStorage.removeItem(TOKEN_KEY);
      this.showLogin((body && body.detail) || "Your token was refused.");
      throw new Error("unauthenticated");
    }
    if (!resp.ok) {
      let detail = body && body.detail;
      if (Array.isArray(detail)) detail = detail.map((d) => `${(d.loc || []).filter((p) => p !== "body").join(".")}: ${d.msg}`).join("; ");
      throw new Error(detail || `HTTP ${resp.status}`);
    }
    return body;
  },

  toast(text, bad = false) {
    const t = document.getElementById("toast");
    t.textContent = text;
    t.className = bad ? "bad" : "";
    t.hidden = false;
    clearTimeout(this._toastTimer);
    this._toastTimer = setTimeout(() => { t.hidden = true; }, 4000);
  },

  showLogin(message) {
    this.stop();
    document.getElementById("who").textContent = "";
    document.getElementById("logout").hidden = true;
    const main = document.getElementById("main");
    main.innerHTML = "";
    main.appendChild(document.getElementById("login-tpl").content.cloneNode(true));
    document.getElementById("login-error").textContent = message || "";
    document.getElementById("login-form").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      localStorage.setItem(TOKEN_KEY, document.getElementById("token-input").value.trim());
      this.me = null;
      await this.route();
    });
  },

  stop() {
    if (this.timer) clearInterval(this.timer);
    this.timer = null;
  },

  /** Render the page named in the URL hash, then refresh it every `every` ms while it is shown. */
  async route() {
    this.stop();
    if (!this.token()) { this.showLogin(); return; }
    if (!this.me) {
      try { this.me = await this.api("/me"); } catch (e) { return; }
      document.getElementById("who").textContent = `${this.me.user} · ${this.me.team} · ${this.me.role}`;
      document.getElementById("logout").hidden = false;
    }
    const name = (location.hash.replace(/^#\/?/, "").split("/")[0]) || "cluster";
    const page = this.pages[name] || this.pages.cluster;
    this.current = page;
    document.querySelectorAll("#nav a").forEach((a) => a.classList.toggle("active", a.dataset.page === name));
    document.title = `gpuyard · ${page.title}`;
    const main = document.getElementById("main");
    main.innerHTML = "";
    try {
      await page.render(main);
    } catch (e) {
      if (e.message !== "unauthenticated") main.insertAdjacentHTML("beforeend", `<p class="error">${esc(e.message)}</p>`);
      return;
    }
    if (page.refresh) {
      this.timer = setInterval(async () => {
        if (this.busy || this.current !== page) return;
        this.busy = true;
        try { await page.refresh(); } catch (e) { /* shown by the next successful refresh */ } finally { this.busy = false; }
      }, page.every || 3000);
    }
  },
};

/**
 * Computed styles (a bar's width, a heatmap cell's colour) are written as data-css="..." in the pages'
 * markup and set here through the DOM: the Content-Security-Policy forbids inline style attributes.
 */
function applyCss(root) {
  if (root.nodeType !== 1) return;
  const els = root.matches("[data-css]") ? [root, ...root.querySelectorAll("[data-css]")] : root.querySelectorAll("[data-css]");
  for (const el of els) { el.style.cssText = el.dataset.css; el.removeAttribute("data-css"); }
}
new MutationObserver((changes) => {
  for (const c of changes) for (const n of c.addedNodes) applyCss(n);
}).observe(document.documentElement, { childList: true, subtree: true });

window.addEventListener("hashchange", () => GY.route());
window.addEventListener("DOMContentLoaded", () => {
  document.getElementById("logout").addEventListener("click", () => {
    localStorage.removeItem(TOKEN_KEY);
    GY.me = null;
    GY.showLogin();
  });
  GY.route();
});

/** Format helpers shared by the pages. */
const fmt = {
  time(iso) { return iso ? iso.replace("T", " ").slice(0, 19) : "-"; },
  num(v, d = 3) { return v === null || v === undefined ? "-" : (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(d)) : esc(v)); },
  gib(b) { return b === null || b === undefined ? "-" : `${(b / 2 ** 30).toFixed(1)} GiB`; },
  badge(s) { return `<span class="badge ${esc(s)}">${esc(s)}</span>`; },
  /** Escaped, and free to break after / _ @ # : . (validation/<wbr>f1_<wbr>macro, patients@<wbr>478e6e21142f). */
  breaks(v) { return String(v ?? "").split(/(?<=[/_@#:.])/).map(esc).join("<wbr>"); },
  /** Params as key=value pairs that wrap (nested values as JSON); past `limit`, "+N more". */
  pairs(params, limit = Infinity, maxLen = Infinity) {
    const entries = Object.entries(params || {});
    if (!entries.length) return "-";
    const value = (v) => {
      const s = typeof v === "string" ? v : JSON.stringify(v);
      return s.length > maxLen ? `${s.slice(0, maxLen - 1)}…` : s;
    };
    const shown = entries.slice(0, limit).map(([k, v]) => `<span class="pair"><span class="k">${esc(k)}</span>=${esc(value(v))}</span>`);
    if (entries.length > limit) shown.push(`<span class="muted">+${entries.length - limit} more</span>`);
    return `<span class="pairs">${shown.join(" ")}</span>`;
  },
};

/** Which metrics to show as columns when the rows (runs, model versions) record different ones. */
const metrics = {
  /** {"validation/mse": 1} and {validation: {mse: 1}} (a registered version's) both as {"validation/mse": 1}; numbers only. */
  flat(m) {
    const out = {};
    for (const [k, v] of Object.entries(m || {})) {
      if (typeof v === "number") out[k] = v;
      else if (v && typeof v === "object") for (const [k2, v2] of Object.entries(v)) if (typeof v2 === "number") out[`${k}/${k2}`] = v2;
    }
    return out;
  },
  /** Held-out test first, then validation, then the rest, training last. */
  rank(k) { return k.startsWith("test/") ? 0 : k.startsWith("validation/") ? 1 : k.startsWith("train/") ? 3 : 2; },
  /** The keys its objective `metric` has in one row (validation/mse, test/mse, or any other split/mse but train/). */
  objective(row, metric) {
    if (!metric) return [];
    const keys = Object.keys(row).filter((k) => k === metric || k.endsWith(`/${metric}`));
    const heldOut = keys.filter((k) => this.rank(k) < 3);  // train/loss only where nothing else is
    return (heldOut.length ? heldOut : keys).sort((a, b) => this.rank(a) - this.rank(b) || a.localeCompare(b));
  },
  /**
   * Columns for `rows` (each {key: number}): the `preferred` keys (the rows' objectives), then for any
   * row still without a filled cell the key that fills most such rows (a held-out one before a
   * training one), then the keys most rows share, up to `max` (exceeded only where it takes more to
   * give every row with a metric a filled cell).
   */
  columns(rows, preferred = [], max = 6) {
    const count = new Map();
    for (const r of rows) for (const [k, v] of Object.entries(r)) if (v !== null && v !== undefined) count.set(k, (count.get(k) || 0) + 1);
    const has = (r, k) => r[k] !== null && r[k] !== undefined;
    const better = (a, b) => b === null || count.get(a) > count.get(b) || (count.get(a) === count.get(b) && (this.rank(a) - this.rank(b) || a.localeCompare(b)) < 0);
    const picked = [];
    for (const k of preferred) if (count.has(k) && !picked.includes(k) && picked.length < max) picked.push(k);
    for (;;) {
      const bare = rows.filter((r) => Object.keys(r).some((k) => has(r, k)) && !picked.some((k) => has(r, k)));
      if (!bare.length) break;
      let best = null, filled = 0;
      for (const k of count.keys()) {
        if (picked.includes(k)) continue;
        const n = bare.filter((r) => has(r, k)).length;
        const tie = n === filled && n > 0 && (this.rank(k) < this.rank(best) || (this.rank(k) === this.rank(best) && better(k, best)));
        if (n > filled || tie) { best = k; filled = n; }
      }
      picked.push(best);
    }
    const rest = [...count.keys()].filter((k) => !picked.includes(k)).sort((a, b) => (better(a, b) ? -1 : 1));
    for (const k of rest) { if (picked.length >= max) break; picked.push(k); }
    const lead = picked.filter((k) => preferred.includes(k));
    return [...lead, ...picked.filter((k) => !lead.includes(k)).sort((a, b) => this.rank(a) - this.rank(b) || a.localeCompare(b))];
  },
};
