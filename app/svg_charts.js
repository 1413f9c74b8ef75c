// asyncrl ui: every metric its own chart (small multiples grouped by section), several runs
// overlaid, x = step | wall time | samples, smoothing (0.6 by default, TensorBoard's; not for series
// of fewer than 20 points), a log y axis, each chart's data as CSV and the chart as PNG, hover for
// values, drag to zoom (all charts together), double-click to zoom out. The charts fill the page's
// width (two per row from 900 px, three from 1500 px); each says its unit on the y axis and whether
// its values are per step, cumulative or per evaluation. Runs in the browser as the js_on_load of a gr.HTML whose
// value is the JSON of asyncrl.analysis.metric_series.chart_data. No library: plain SVG.
const S = element.__arlCharts || (element.__arlCharts = {x: "step", smooth: 0.6, zoom: null, filter: "", closed: {}});
const NS = "http://www.w3.org/2000/svg";
let W = 460;  // a chart's width: set from the grid's width by drawGrid
const H = 230, L = 64, R = 12, T = 8, B = 32;
const XLABEL = {step: "step", time: "wall time", samples: "samples trained on"};

function el(tag, attrs, parent, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(NS, tag.slice(4)) : document.createElement(tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function fmtNum(v) {
  if (v === null || v === undefined || !isFinite(v)) return "-";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return String(+v.toPrecision(4));
}
function fmtX(v) {
  if (S.x !== "time") return fmtNum(v);
  if (v < 120) return (+v.toPrecision(3)) + " s";
  if (v < 7200) return (+(v / 60).toPrecision(3)) + " min";
  return (+(v / 3600).toPrecision(3)) + " h";
}
function ticks(lo, hi, n) {
  const span = hi - lo || 1, raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9 && out.length < 20; v += step) out.push(+v.toPrecision(12));
  return out;
}
function smoothed(y, w) {  // TensorBoard's debiased EMA; nulls skipped
  if (!w) return y;
  let last = 0, n = 0;
  return y.map(v => {
    if (v === null) return null;
    last = last * w + (1 - w) * v; n += 1;
    return last / (1 - Math.pow(w, n));
  });
}
const MIN_SMOOTHED = 20;  // a series of fewer points (held-out evaluations) is drawn as it is: no smoothing
function points(s) {  // [[x, y, raw]] of one series on the chosen x axis
  const few = s.y.filter(v => v !== null).length < MIN_SMOOTHED;
  const xs = s[S.x] || s.step, ys = few ? s.y : smoothed(s.y, S.smooth), out = [];
  for (let i = 0; i < xs.length; i++) if (xs[i] !== null && ys[i] !== null) out.push([xs[i], ys[i], s.y[i], s.step[i]]);
  return out;
}

function chart(box, c, runs) {
  const all = c.series.map(s => ({s, p: points(s)}));
  let xs = [].concat(...all.map(a => a.p.map(p => p[0])));
  if (!xs.length) return;
  let [x0, x1] = S.zoom || [Math.min(...xs), Math.max(...xs)];
  if (x0 === x1) { const d = Math.abs(x0) * 0.1 || 1; x0 = x0 >= 0 ? Math.max(0, x0 - d) : x0 - d; x1 += d; }  // (one point: no -1 ticks at step 0)
  const inView = [].concat(...all.map(a => a.p.filter(p => p[0] >= x0 && p[0] <= x1)));
  const ysAll = inView.length ? inView.map(p => p[1]) : [0];
  const logy = S.logy && ysAll.every(v => v > 0);  // a log y axis where every value in view is positive
  const ty = v => logy ? Math.log10(Math.max(v, 1e-300)) : v;
  let y0 = Math.min(...ysAll.map(ty)), y1 = Math.max(...ysAll.map(ty));
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad;
  const syT = t => T + (1 - (t - y0) / (y1 - y0)) * (H - T - B);
  const sx = v => L + (v - x0) / (x1 - x0) * (W - L - R), sy = v => syT(ty(v));
  const card = el("div", {class: "arl-chart", "data-metric": c.metric, "data-logy": logy ? "1" : "0"}, box);
  const title = el("div", {class: "arl-chart-title"}, card, c.metric);
  if (c.span) el("span", {class: "arl-chart-span"}, title, " \u00b7 " + c.span);
  const rows = [["run", "step", XLABEL[S.x], c.metric]];  // the chart's data, raw (not smoothed), as CSV
  for (const s of c.series) for (let i = 0; i < s.y.length; i++)
    if (s.y[i] !== null) rows.push([runs[s.run].name, s.step[i], (s[S.x] || s.step)[i], s.y[i]]);
  const csv = rows.map(r => r.map(v => /[",\n]/.test(String(v)) ? `"${String(v).replace(/"/g, '""')}"` : v).join(",")).join("\n");
  const file = c.metric.replace(/[^\w.-]+/g, "_");
  el("a", {class: "arl-csv", download: file + ".csv", href: "data:text/csv;charset=utf-8," + encodeURIComponent(csv),
           title: "the chart's data as CSV"}, title, " csv");
  const png = el("a", {class: "arl-png", download: file + ".png", href: "#", title: "the chart as a PNG image"}, title, " png");
  png.addEventListener("click", ev => {  // the SVG drawn onto a canvas, then downloaded
    if (png.dataset.ready) return;
    ev.preventDefault();
    const img = new Image(), canvas = document.createElement("canvas");
    canvas.width = W * 2; canvas.height = H * 2;
    img.onload = () => {
      const g = canvas.getContext("2d"); g.fillStyle = "#fff"; g.fillRect(0, 0, canvas.width, canvas.height);
      g.drawImage(img, 0, 0, canvas.width, canvas.height);
      png.href = canvas.toDataURL("image/png"); png.dataset.ready = "1"; png.click(); delete png.dataset.ready;
    };
    img.src = "data:image/svg+xml;charset=utf-8," + encodeURIComponent(new XMLSerializer().serializeToString(svg));
  });
  const svg = el("svg:svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "arl-chart-svg"}, card);
  const yt = ticks(y0, y1, 4), xt = ticks(x0, x1, 4);
  const yaxis = el("svg:g", {class: "arl-yaxis"}, svg);
  for (const v of yt) {  // (ticks in the axis's own scale: powers of ten on a log axis)
    el("svg:line", {x1: L, x2: W - R, y1: syT(v), y2: syT(v), stroke: "#eaeef2"}, yaxis);
    el("svg:text", {x: L - 4, y: syT(v) + 3, "text-anchor": "end", "font-size": 10, fill: "#57606a"}, yaxis,
       fmtNum(logy ? Math.pow(10, v) : v));
  }
  const xaxis = el("svg:g", {class: "arl-xaxis"}, svg);
  for (const v of xt) el("svg:text", {x: sx(v), y: H - B + 13, "text-anchor": "middle", "font-size": 10, fill: "#57606a"}, xaxis, fmtX(v));
  el("svg:text", {x: (L + W - R) / 2, y: H - 3, "text-anchor": "middle", "font-size": 10, fill: "#8c959f"}, xaxis, XLABEL[S.x]);
  const ym = T + (H - T - B) / 2;
  el("svg:text", {x: 11, y: ym, transform: `rotate(-90 11 ${ym})`, "text-anchor": "middle", "font-size": 10,
                  fill: "#8c959f", class: "arl-ylabel"}, svg, c.unit || c.metric);
  el("svg:rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#d0d7de"}, svg);
  const clip = "clip-" + Math.random().toString(36).slice(2);
  const cp = el("svg:clipPath", {id: clip}, el("svg:defs", {}, svg));
  el("svg:rect", {x: L, y: T, width: W - L - R, height: H - T - B}, cp);
  const plot = el("svg:g", {"clip-path": `url(#${clip})`}, svg);
  for (const a of all) {
    const color = runs[a.s.run].color;
    if (S.smooth) {  // the raw values, faint, under the smoothed line
      const raw = a.p.map(p => `${sx(p[0]).toFixed(1)},${sy(p[2]).toFixed(1)}`).join(" ");
      el("svg:polyline", {points: raw, fill: "none", stroke: color, "stroke-opacity": 0.25, "stroke-width": 1}, plot);
    }
    const pts = a.p.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    el("svg:polyline", {points: pts, fill: "none", stroke: color, "stroke-width": 1.6, class: "arl-line",
                        "data-run": runs[a.s.run].name}, plot);
    if (a.p.length < 30) for (const p of a.p) el("svg:circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: color}, plot);
  }
  const cursor = el("svg:line", {y1: T, y2: H - B, stroke: "#8c959f", "stroke-dasharray": "3,3", visibility: "hidden"}, svg);
  const band = el("svg:rect", {y: T, height: H - T - B, fill: "#0969da", "fill-opacity": 0.12, visibility: "hidden"}, svg);
  const tip = el("div", {class: "arl-tip", style: "display:none"}, card);
  const toData = ev => { const r = svg.getBoundingClientRect(); return x0 + (ev.clientX - r.left - L) / (W - L - R) * (x1 - x0); };
  let drag = null;
  svg.addEventListener("mousemove", ev => {
    const x = toData(ev);
    if (drag !== null) {
      const a = sx(Math.min(drag, x)), b = sx(Math.max(drag, x));
      band.setAttribute("x", a); band.setAttribute("width", Math.max(0, b - a)); band.setAttribute("visibility", "visible");
    }
    const rows = [];
    for (const a of all) {
      if (!a.p.length) continue;
      let best = a.p[0];
      for (const p of a.p) if (Math.abs(p[0] - x) < Math.abs(best[0] - x)) best = p;
      rows.push(`<span style="color:${runs[a.s.run].color}">\u25cf</span> ${runs[a.s.run].name}: <b>${fmtNum(best[1])}</b>` +
                (S.smooth ? ` (raw ${fmtNum(best[2])})` : "") + ` at ${XLABEL[S.x]} ${fmtX(best[0])}` +
                (S.x !== "step" ? ` (step ${fmtNum(best[3])})` : ""));
    }
    cursor.setAttribute("x1", sx(x)); cursor.setAttribute("x2", sx(x)); cursor.setAttribute("visibility", "visible");
    tip.innerHTML = rows.join("<br>"); tip.style.display = "block";
  });
  svg.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); tip.style.display = "none"; });
  svg.addEventListener("mousedown", ev => { drag = toData(ev); ev.preventDefault(); });
  svg.addEventListener("mouseup", ev => {
    const x = toData(ev), a = drag; drag = null; band.setAttribute("visibility", "hidden");
    if (a !== null && Math.abs(sx(x) - sx(a)) > 5) { S.zoom = [Math.min(a, x), Math.max(a, x)]; drawGrid(); }
  });
  svg.addEventListener("dblclick", () => { S.zoom = null; drawGrid(); });
}

let data = {runs: [], groups: []};
function drawGrid() {
  const grid = element.querySelector(".arl-charts-grid");
  if (!grid) return;
  grid.innerHTML = "";
  const width = grid.clientWidth || element.clientWidth || 1000, cols = width >= 1500 ? 3 : width >= 900 ? 2 : 1;
  W = Math.max(300, Math.floor((width - 8 * (cols - 1)) / cols) - 12);  // (the gap, a card's padding and border)
  const f = S.filter.toLowerCase();
  let shown = 0;
  for (const g of data.groups) {
    const charts = g.charts.filter(c => !f || c.metric.toLowerCase().includes(f));
    const flat = g.flat.filter(c => !f || c.metric.toLowerCase().includes(f));
    if (!charts.length && !flat.length) continue;
    const sec = el("details", {class: "arl-chart-group", "data-group": g.name}, grid);
    if (!S.closed[g.name]) sec.setAttribute("open", "");
    sec.addEventListener("toggle", () => { S.closed[g.name] = !sec.open; });
    el("summary", {}, sec, `${g.name} (${charts.length} chart${charts.length === 1 ? "" : "s"}` +
       (flat.length ? `, ${flat.length} constant` : "") + ")");
    const box = el("div", {class: "arl-chart-row"}, sec);
    for (const c of charts) { chart(box, c, data.runs); shown += 1; }
    if (flat.length) el("div", {class: "arl-flat"}, sec,
      "Not drawn, never changed: " + flat.map(c => `${c.metric} = ${c.why}`).join(" · "));
  }
  if (!shown && !grid.children.length) el("div", {class: "arl-note"}, grid,
    data.groups.length ? `No metric matches "${S.filter}".` : "No metrics logged yet: charts appear with the first step.");
  const st = element.querySelector(".arl-charts-state");
  if (st) st.textContent = S.zoom ? `zoomed to ${XLABEL[S.x]} ${fmtX(S.zoom[0])} - ${fmtX(S.zoom[1])} (double-click a chart to zoom out)`
                                  : "drag across a chart to zoom all of them, double-click to zoom out";
}
function draw() {
  try { data = JSON.parse(props.value || "{}"); } catch (e) { data = {}; }
  data.runs = data.runs || []; data.groups = data.groups || [];
  const root = element.querySelector(".arl-charts");
  if (!root) return;
  root.innerHTML = "";
  const bar = el("div", {class: "arl-charts-bar"}, root);
  const legend = el("span", {class: "arl-legend"}, bar);
  for (const r of data.runs) el("span", {class: "arl-legend-run", style: `color:${r.color}`}, legend, "\u25a0 " + r.name);
  const xl = el("label", {}, bar, "x ");
  const xsel = el("select", {class: "arl-x"}, xl);
  for (const k of ["step", "time", "samples"]) { const o = el("option", {value: k}, xsel, XLABEL[k]); if (k === S.x) o.selected = true; }
  xsel.addEventListener("change", () => { S.x = xsel.value; S.zoom = null; drawGrid(); });
  const sl = el("label", {}, bar, "smoothing ");
  const sm = el("input", {type: "range", min: 0, max: 0.99, step: 0.01, value: S.smooth, class: "arl-smooth"}, sl);
  const smv = el("span", {}, sl, " " + S.smooth);
  sm.addEventListener("input", () => { S.smooth = +sm.value; smv.textContent = " " + sm.value; drawGrid(); });
  const ll = el("label", {}, bar, "log y ");
  const lg = el("input", {type: "checkbox", class: "arl-logy"}, ll);
  lg.checked = !!S.logy;
  lg.addEventListener("change", () => { S.logy = lg.checked; drawGrid(); });
  const fl = el("input", {type: "search", placeholder: "filter metrics", value: S.filter, class: "arl-filter"}, bar);
  fl.addEventListener("input", () => { S.filter = fl.value; drawGrid(); });
  el("span", {class: "arl-charts-state"}, bar);
  el("div", {class: "arl-charts-grid"}, root);
  drawGrid();
}
draw();
watch("value", draw);
if (!element.__arlResize) {  // the charts follow the window's width (once per element)
  let pending = null;
  element.__arlResize = () => { clearTimeout(pending); pending = setTimeout(drawGrid, 150); };
  window.addEventListener("resize", element.__arlResize);
}
