/* Charts: line charts with the vendored uPlot; heatmaps and stacked bars in plain HTML. */
"use strict";

const COLORS = ["#3355cc", "#d9480f", "#2b8a3e", "#ae3ec9", "#0c8599", "#e67700", "#c2255c", "#5c940d"];

const Charts = {
  /** A uPlot line chart in `el`: xs shared, series = [{label, values}]. Returns the uPlot. */
  line(el, title, xs, series, opts = {}) {
    const width = opts.width || Math.max(320, Math.min(640, el.clientWidth || 480));
    const u = new uPlot({
      title, width, height: opts.height || 220,
      scales: { x: { time: !!opts.time } },
      axes: [{ label: opts.xlabel || "", ...(opts.integerX ? { incrs: [1, 2, 5, 10, 20, 50, 100] } : {}) }, { label: opts.ylabel || "", size: 60 }],
      series: [{ label: opts.xlabel || "x" }, ...series.map((s, i) => ({
        label: s.label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
        points: { show: xs.length < 40 },
      }))],
    }, [xs, ...series.map((s) => s.values)], el);
    return u;
  },

  /** Align several [[x, y], ...] series on the union of their x values (nulls where one has none). */
  align(seriesList) {
    const xs = [...new Set(seriesList.flatMap((pts) => pts.map((p) => p[0])))].sort((a, b) => a - b);
    const values = seriesList.map((pts) => {
      const m = new Map(pts.map((p) => [p[0], p[1]]));
      return xs.map((x) => (m.has(x) ? m.get(x) : null));
    });
    return { xs, values };
  },

  /** The topology matrix (nvidia-smi topo -m vocabulary) as a heatmap table: faster links are darker. */
  topology(el, topo) {
    const rank = (c) => {
      if (c === "X") return -1;
      if (/^NV\d+/.test(c)) return 6 + Math.min(parseInt(c.slice(2), 10), 18) / 18;
      return { PIX: 4, PXB: 3, PHB: 2, NODE: 1, SYS: 0 }[c] ?? 0;
    };
    const color = (c) => {
      const r = rank(c);
      if (r < 0) return "#d0d5dd";
      const t = Math.min(r / 7, 1);  // 0 (SYS) .. 1 (many NVLinks)
      const l = 78 - t * 48;
      return `hsl(${220 - t * 10}, 65%, ${l}%)`;
    };
    const devs = topo.devices || [];
    if (!devs.length) { el.innerHTML = '<p class="muted">No devices in the topology matrix.</p>'; return; }
    let h = '<table class="heat"><tr><th></th>' + devs.map((d) => `<th>${esc(d)}</th>`).join("") + "</tr>";
    topo.matrix.forEach((row, i) => {
      h += `<tr><th>${esc(devs[i])}</th>` + row.map((c) =>
        `<td data-css="background:${color(c)};color:${rank(c) > 2 || rank(c) < 0 ? "#fff" : "#1d2330"}" title="${esc(devs[i])} - ${esc(c)}">${esc(c)}</td>`
      ).join("") + "</tr>";
    });
    h += "</table>";
    h += '<div class="legend">' + ["NV18", "NV4", "PIX", "PXB", "PHB", "NODE", "SYS"].map(
      (c) => `<span><i data-css="background:${color(c)}"></i>${esc(c)}</span>`).join("") +
      "<span>X self, NV# bonded NVLinks, PIX one PCIe bridge, PXB several, PHB host bridge, NODE across host bridges, SYS across NUMA nodes</span></div>";
    el.innerHTML = h;
  },

  /** One stacked horizontal bar per row: parts = [{label, value}] (same labels on every row). */
  stacked(el, rows, labels) {
    const max = Math.max(...rows.map((r) => r.parts.reduce((a, p) => a + p.value, 0)), 1e-12);
    let h = "<table>";
    for (const r of rows) {
      const total = r.parts.reduce((a, p) => a + p.value, 0);
      h += `<tr><td class="mono w160">${esc(r.label)}</td><td><div class="stack" data-css="width:${(100 * total) / max}%">` +
        r.parts.map((p, i) => `<span data-css="width:${(100 * p.value) / (total || 1)}%;background:${COLORS[i % COLORS.length]}" title="${esc(p.label)}: ${p.value.toFixed(3)} s"></span>`).join("") +
        `</div></td><td class="mono w80">${total.toFixed(2)} s</td></tr>`;
    }
    h += "</table><div class=\"legend\">" + labels.map((l, i) => `<span><i data-css="background:${COLORS[i % COLORS.length]}"></i>${esc(l)}</span>`).join("") + "</div>";
    el.innerHTML = h;
  },
};

/** HTML-escape any value for interpolation into markup. */
function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
