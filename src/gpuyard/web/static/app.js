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
};
