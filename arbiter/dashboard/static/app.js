// The Themis dashboard: one page over the read-only JSON API (/api/v1) and its live stream.
// Plain JavaScript, no build step; charts by uPlot (vendored, static/uPlot.iife.min.js).
"use strict";

const API = "/api/v1";
const S = {
  about: {}, cluster: null, apps: new Map(), timeline: [], at: null, live: null,
  fetchedAt: 0, filter: "", cells: new Map(), sort: { key: "rho", dir: -1 }, charts: [],
  roundsBefore: null, eventsBefore: null, route: null, painted: false,
};
const $ = (id) => document.getElementById(id);
const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ESC[c]);

async function get(path) {
  const r = await fetch(API + path, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (r.status === 401) { banner("This dashboard needs a viewer token: open it with ?token=... once."); throw new Error("401"); }
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function banner(text) { const b = $("banner"); b.textContent = text; b.hidden = !text; }

// -- numbers, times, colours -------------------------------------------------------------------

const num = (x) => (x === "inf" ? Infinity : x === "-inf" ? -Infinity : x);
function fmtRho(x) {
  if (x === null || x === undefined) return "-";
  if (x === "inf" || x === Infinity) return "\u221e";
  return x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2);
}
// c_i of a contender, or the bounds that decided its lottery without it (D39)
function fmtC(c) {
  if (c.c !== null && c.c !== undefined) return c.c.toFixed(3);
  return c.c_bounds ? `${c.c_bounds[0].toFixed(3)}–${c.c_bounds[1].toFixed(3)}` : "-";
}
const recorded = () => S.about.mode === "recorded";
function dur(s) {
  if (!isFinite(s)) return "-";
  const neg = s < 0; s = Math.abs(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.floor(s % 60);
  return (neg ? "-" : "") + (h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`);
}
function when(t) {
  if (t === null || t === undefined) return "-";
  return recorded() ? "t=" + dur(t) : new Date(t * 1000).toLocaleTimeString();
}
function nowish() {  // the source's clock, moved on by the time since it was read (live only)
  if (!S.cluster) return 0;
  return S.cluster.now + (S.at === null && !recorded() ? (Date.now() - S.fetchedAt) / 1000 : 0);
}
// Distinct colours for the apps seen first (the biggest holders are coloured first), then hues a
// golden angle apart; an app keeps its colour for the session.
const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f",
  "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#bcbd22", "#e377c2", "#8c564b", "#393b79",
  "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363"];
const colours = new Map();
function colour(app) {
  let c = colours.get(app);
  if (!c) {
    const i = colours.size;
    c = i < PALETTE.length ? PALETTE[i] : `hsl(${Math.round((i * 137.508) % 360)},${[62, 48, 70][i % 3]}%,${[48, 38, 58][(i >> 1) % 3]}%)`;
    colours.set(app, c);
  }
  return c;
}
function colourFirst(apps) { for (const a of apps) colour(a); }
const sw = (app) => `<span class="sw" style="background:${colour(app)}"></span>`;
const appLink = (app) => `<a href="#/apps/${encodeURIComponent(app)}">${esc(app)}</a>`;
const roundLink = (id) => `<a href="#/rounds/${id}">${id}</a>`;
function gpuList(gpus) {  // "r0-m1: g0-7; r1-m5: g2,g4": GPUs by machine, runs of numbers joined
  if (!gpus || !gpus.length) return "";
  const by = new Map();
  for (const g of gpus) { const i = g.lastIndexOf("-"); const m = i > 0 ? g.slice(0, i) : ""; (by.get(m) || by.set(m, []).get(m)).push(g.slice(i + 1)); }
  const runs = (names) => {
    const m = names.map((n) => /^([^0-9]*)(\d+)$/.exec(n));
    if (m.some((x) => !x) || new Set(m.map((x) => x[1])).size > 1) return names.join(",");
    const ns = m.map((x) => Number(x[2])).sort((a, b) => a - b), out = [];
    for (let k = 0; k < ns.length; k++) {
      let j = k;
      while (j + 1 < ns.length && ns[j + 1] === ns[j] + 1) j++;
      out.push(j > k ? `${m[0][1]}${ns[k]}-${ns[j]}` : `${m[0][1]}${ns[k]}`);
      k = j;
    }
    return out.join(",");
  };
  const key = (s) => s.replace(/\d+/g, (d) => d.padStart(8, "0"));
  const ms = [...by].sort((a, b) => (key(a[0]) < key(b[0]) ? -1 : 1));
  return `<span class="gpus-list">${ms.map(([m, gs]) => `${esc(m)}: ${esc(runs(gs))}`).join("; ")}</span>`;
}

// -- the map -------------------------------------------------------------------------------------

function renderMap() {
  const c = S.cluster;
  if (!c) return;
  const byMachine = new Map();
  for (const g of c.gpus) (byMachine.get(g.machine) || byMachine.set(g.machine, []).get(g.machine)).push(g);
  const now = nowish(), lease = c.lease_s || 0;
  const parts = [];
  for (const [rack, machines] of c.racks) {
    parts.push(`<div class="rack"><b>${esc(rack)}</b><div class="machines">`);
    for (const m of machines) {
      const gs = byMachine.get(m) || [];
      const cols = gs.length < 4 ? ` style="grid-template-columns:repeat(${Math.max(1, gs.length)},14px)"` : "";
      parts.push(`<div class="machine${gs.some((g) => g.drained) ? " drained" : ""}" title="${esc(m)}"${cols}>`);
      for (const g of gs) parts.push(cellHtml(g, now, lease));
      parts.push("</div>");
    }
    parts.push("</div></div>");
  }
  const map = $("map");
  map.innerHTML = parts.join("");
  S.cells.clear();
  for (const el of map.querySelectorAll(".gpu")) S.cells.set(el.dataset.g, el);
  renderSummary();
  applyFilter();
}

function cellHtml(g, now, lease) {
  if (!g.holder) return `<div class="gpu" data-g="${esc(g.id)}" title="${esc(g.id)}: free"></div>`;
  const left = g.lease_end - now;
  const bar = lease > 0 ? Math.max(0, Math.min(100, (100 * left) / lease)) : 0;
  return `<div class="gpu" data-g="${esc(g.id)}" data-app="${esc(g.holder)}" style="background:${colour(g.holder)}" ` +
    `title="${esc(g.id)}: ${esc(g.holder)}, lease ends in ${dur(left)} (round ${g.round_id ?? "-"})"><i style="width:${bar}%"></i></div>`;
}

function gpuById(id) {
  if (!S.gpuIndex) S.gpuIndex = new Map(S.cluster.gpus.map((g) => [g.id, g]));
  return S.gpuIndex.get(id);
}

function updateCell(id) {
  const el = S.cells.get(id), g = S.cluster && gpuById(id);
  if (!el || !g) return;
  const tmp = document.createElement("div");
  tmp.innerHTML = cellHtml(g, nowish(), S.cluster.lease_s || 0);
  const fresh = tmp.firstChild;
  el.replaceWith(fresh);
  S.cells.set(id, fresh);
}

function refreshBars() {
  if (!S.cluster || S.route !== "cluster") return;
  const now = nowish(), lease = S.cluster.lease_s || 0;
  for (const g of S.cluster.gpus) {
    const el = S.cells.get(g.id);
    if (!el || !g.holder) continue;
    const left = g.lease_end - now;
    if (el.firstChild) el.firstChild.style.width = (lease > 0 ? Math.max(0, Math.min(100, (100 * left) / lease)) : 0) + "%";
    el.title = `${g.id}: ${g.holder}, lease ends in ${dur(left)} (round ${g.round_id ?? "-"})`;
  }
}

function renderSummary() {
  const c = S.cluster, held = new Map();
  let leased = 0;
  for (const g of c.gpus) if (g.holder) { leased++; held.set(g.holder, (held.get(g.holder) || 0) + 1); }
  const apps = [...S.appsShown().values()];
  const starving = apps.filter((a) => a.state === "active" && a.held === 0 && (a.demand ?? 1) > 0).length;
  const where = S.at !== null ? `after round ${S.at}, ${when(c.now)}` : recorded() ? `end of the run, ${when(c.now)}` : "now";
  $("summary").textContent = `${c.gpus.length} GPUs, ${leased} leased (${c.gpus.length ? Math.round((100 * leased) / c.gpus.length) : 0}%), ` +
    `${apps.length} app${apps.length === 1 ? "" : "s"}, ${starving} holding nothing; ${where}`;
  const top = [...held].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1)).slice(0, 24);
  $("legend").innerHTML = top.map(([a, n]) => `<span data-app="${esc(a)}">${sw(a)}${esc(a)} ${n}</span>`).join("") +
    (held.size > top.length ? `<span>and ${held.size - top.length} more apps</span>` : "");
}

function applyFilter() {
  const f = S.filter;
  for (const el of S.cells.values()) {
    const app = el.dataset.app;
    el.classList.toggle("dim", !!f && app !== f);
    el.classList.toggle("hit", !!f && app === f);
  }
}

S.appsShown = () => (S.at !== null && S.atApps ? S.atApps : S.apps);

// -- time slider -----------------------------------------------------------------------------------

function setupSlider() {
  const box = $("time-box"), tl = S.timeline;
  box.hidden = tl.length === 0;
  if (!tl.length) return;
  const slider = $("slider");
  slider.max = tl.length - 1;
  const i = S.at === null ? tl.length - 1 : Math.max(0, tl.findIndex((r) => r[0] === S.at));
  slider.value = i;
  labelSlider(i);
}

function labelSlider(i) {
  const r = S.timeline[i];
  if (!r) return;
  $("slider-label").textContent = `round ${r[0]} (${when(r[1])})`;
  $("round-link").href = `#/rounds/${r[0]}`;
}

let slideTimer = null;
function onSlide() {
  const i = Number($("slider").value);
  labelSlider(i);
  clearTimeout(slideTimer);
  slideTimer = setTimeout(() => {
    const r = S.timeline[i];
    if (!r) return;
    const latest = i === S.timeline.length - 1 && !recorded();
    history.replaceState(null, "", latest ? "#/cluster" : `#/cluster?at=${r[0]}`);
    loadCluster(latest ? null : r[0]);
  }, 60);
}

async function fetchCluster(at) {
  const q = at === null ? "" : `?at=${at}`;
  const [cluster, apps] = await Promise.all([get("/cluster" + q), get("/apps" + q + (q ? "&" : "?") + "history=0")]);
  S.at = at;
  S.cluster = cluster;
  S.gpuIndex = null;
  S.fetchedAt = Date.now();
  const m = new Map(apps.apps.map((a) => [a.app, a]));
  if (at === null) { S.apps = m; S.atApps = null; } else S.atApps = m;
}

async function loadCluster(at) {
  await fetchCluster(at);
  fillNames();
  renderMap();
  document.documentElement.dataset.at = at === null ? "" : String(at);
}

function fillNames() {
  const names = [...S.apps.keys(), ...(S.atApps ? S.atApps.keys() : [])];
  $("app-names").innerHTML = [...new Set(names)].sort().map((a) => `<option value="${esc(a)}">`).join("");
}

// -- apps ------------------------------------------------------------------------------------------

const APP_COLS = [
  ["app", "App"], ["model", "Model"], ["bound_model", "Bound model"], ["state", "State"], ["connected", "Agent"],
  ["demand", "Demand", 1], ["held", "GPUs", 1], ["rho", "Rho", 1], ["rho_wait", "Waiting rho", 1], ["arrived", "Arrived", 1],
];

function sortValue(a, key) {
  const v = a[key];
  if (key === "rho" || key === "rho_wait") return v === null || v === undefined ? -1 : num(v);
  if (typeof v === "boolean") return v ? 1 : 0;
  return v ?? "";
}

function renderApps() {
  const f = $("apps-filter").value.trim().toLowerCase();
  let apps = [...S.apps.values()];
  if (f) apps = apps.filter((a) => a.app.toLowerCase().includes(f) || String(a.model || "").toLowerCase().includes(f));
  const { key, dir } = S.sort;
  apps.sort((a, b) => { const x = sortValue(a, key), y = sortValue(b, key); return (x < y ? -1 : x > y ? 1 : a.app < b.app ? -1 : 1) * (x === y ? 1 : dir); });
  const head = "<thead><tr>" + APP_COLS.map(([k, t, n]) => `<th data-k="${k}"${n ? ' class="n"' : ""}>${t}${k === key ? (dir < 0 ? " \u25be" : " \u25b4") : ""}</th>`).join("") + "</tr></thead>";
  const rows = apps.map((a) => `<tr><td>${sw(a.app)}${appLink(a.app)}</td><td>${esc(a.model ?? "-")}</td><td>${esc(a.bound_model ?? "-")}</td>` +
    `<td>${esc(a.state)}</td><td>${a.connected ? "connected" : "gone"}</td><td class="n">${a.demand ?? "-"}</td><td class="n">${a.held}</td>` +
    `<td class="n">${fmtRho(a.rho)}</td><td class="n">${fmtRho(a.rho_wait)}</td><td class="n">${when(a.arrived)}</td></tr>`);
  $("apps-table").innerHTML = head + "<tbody>" + rows.join("") + "</tbody>";
  $("apps-count").textContent = `${apps.length} of ${S.apps.size} apps`;
}

async function renderApp(name) {
  $("app-title").innerHTML = sw(name) + esc(name);
  let app = null;
  try { app = await get(`/apps/${encodeURIComponent(name)}`); } catch (e) { $("app-facts").textContent = e.message; }
  if (app) {
    $("app-facts").textContent = `model ${app.model ?? "-"}, bound model ${app.bound_model ?? "-"}, ${app.state}, ` +
      `demand ${app.demand ?? "-"}, ${app.held} GPUs held, rho ${fmtRho(app.rho)}, waiting rho ${fmtRho(app.rho_wait)}`;
    const xs = app.rho_history.map((p) => p[0]), ys = app.rho_history.map((p) => { const v = num(p[1]); return isFinite(v) ? v : null; });
    chart("app-chart", [xs, ys], [{ label: "rho", stroke: colour(name), width: 2 }], { title: "rho over time (gaps: holding nothing)" });
  }
  const rs = await get(`/apps/${encodeURIComponent(name)}/rounds?limit=200`);
  const rows = rs.rounds.map((r) => {
    const c = r.contender;
    const auction = c ? (c.admitted ? `c_i ${fmtC(c)}, draw ${c.draw === null ? "-" : c.draw.toFixed(3)} ` +
      (c.won ? '<span class="won">won</span>' : c.pf_row.length ? '<span class="lost">lost</span>' : "no PF row") : c.shadow ? "shadow (D25)" : "not admitted (D25)") : "";
    const got = r.got.map((p) => `${p.gpus.length} by ${esc(p.tier)}`).join(", ");
    return `<tr><td>${roundLink(r.round_id)}</td><td>${when(r.now)}</td><td class="n">${r.rank ?? "-"} of ${r.ranked}</td>` +
      `<td class="n">${fmtRho(r.rho)}</td><td class="n">${fmtRho(r.rho_wait)}</td><td>${r.offered ? "yes" : "no"}</td>` +
      `<td>${r.offered ? (r.bid ? "yes" : "no") : ""}</td><td>${auction}</td><td>${got}</td><td>${esc(r.refused ?? "")}</td></tr>`;
  });
  $("app-rounds").innerHTML = "<thead><tr><th>Round</th><th>Time</th><th class=n>Rank</th><th class=n>Rho</th><th class=n>Waiting rho</th>" +
    "<th>Offered</th><th>Bid</th><th>Auction</th><th>Got</th><th>Refused</th></tr></thead><tbody>" + rows.join("") + "</tbody>";
}

// -- rounds ----------------------------------------------------------------------------------------

function roundRow(r) {
  return `<tr data-r="${r.round_id}"><td>${roundLink(r.round_id)}</td><td>${when(r.now)}</td><td>${esc(r.trigger)}</td>` +
    `<td class="n">${r.offered}</td><td class="n">${r.bidders}</td><td class="n">${r.contenders}</td><td class="n">${r.granted}</td>` +
    `<td class="n">${r.idle}</td><td>${r.worst ? appLink(r.worst) : "-"}</td><td>${r.winners.map(appLink).join(", ")}</td></tr>`;
}
const ROUNDS_HEAD = "<thead><tr><th>Round</th><th>Time</th><th>Trigger</th><th class=n>Offered</th><th class=n>Bidders</th>" +
  "<th class=n>Contenders</th><th class=n>Granted</th><th class=n>Idle</th><th>Worst off</th><th>Lottery winners</th></tr></thead>";

async function renderRounds(more) {
  const app = $("rounds-app").value.trim();
  const q = `?limit=100${more && S.roundsBefore ? `&before=${S.roundsBefore}` : ""}${app ? `&app=${encodeURIComponent(app)}` : ""}`;
  const { rounds } = await get("/rounds" + q);
  const table = $("rounds-table");
  if (!more) table.innerHTML = ROUNDS_HEAD + "<tbody></tbody>";
  table.tBodies[0].insertAdjacentHTML("beforeend", rounds.map(roundRow).join(""));
  S.roundsBefore = rounds.length ? rounds[rounds.length - 1].round_id : S.roundsBefore;
  $("rounds-more").hidden = rounds.length < 100;
}

async function renderRound(id) {
  $("round-prev").href = `#/rounds/${id - 1}`;
  $("round-next").href = `#/rounds/${id + 1}`;
  $("round-map").href = `#/cluster?at=${id}`;
  $("round-title").textContent = `Round ${id}`;
  for (const t of ["round-ranked", "round-contenders", "round-placed", "round-ended"]) $(t).innerHTML = "";
  let r;
  try { r = await get(`/rounds/${id}`); } catch (e) { $("round-facts").textContent = e.message; $("round-auction").textContent = ""; return; }
  $("round-title").textContent = `Round ${r.round_id}, ${when(r.now)}`;
  $("round-facts").innerHTML = `Trigger: ${esc(r.trigger)}. Policy ${esc(r.policy)}. ${r.offered.length} GPUs offered to ` +
    `${r.bidders.length} of ${r.ranked.length} apps that reported; ${r.idle.length} left idle.` +
    (r.waiting.length ? ` ${r.waiting.length} apps wait for admission (D33).` : "") +
    (r.offered.length ? `<br>Offer: ${gpuList(r.offered)}` : "");
  $("round-ranked").innerHTML = "<thead><tr><th class=n>Rank</th><th>App</th><th class=n>Rho</th><th class=n>Waiting rho</th>" +
    "<th class=n>Unmet</th><th>Offered</th><th>Bid</th><th>Refused</th></tr></thead><tbody>" +
    r.ranked.map((a, k) => `<tr><td class="n">${k + 1}</td><td>${sw(a.app)}${appLink(a.app)}</td><td class="n">${fmtRho(a.rho)}</td>` +
      `<td class="n">${fmtRho(a.rho_wait)}</td><td class="n">${a.unmet}</td><td>${a.offered ? "yes" : "no"}</td>` +
      `<td>${a.offered ? (a.bid ? "yes" : "no (D22)") : ""}</td><td>${esc(r.refused[a.app] ?? "")}</td></tr>`).join("") + "</tbody>";
  const cs = r.contenders;
  $("round-auction").textContent = cs.length
    ? `${cs.length} contender${cs.length === 1 ? "" : "s"} (${cs.filter((c) => c.admitted).length} admitted to the PF allocation, D25). Each PF winner keeps its row ` +
      `with probability c_i (1 - c_i is its hidden payment): it won when its draw < c_i (D15). The auction left ${r.auction_left.length} GPUs.`
    : "No auction this round.";
  if (cs.length) {
    $("round-contenders").innerHTML = "<thead><tr><th>App</th><th>In the PF</th><th class=n>PF row</th><th class=n>PF rho</th>" +
      "<th class=n>c_i</th><th class=n>Draw</th><th>Lottery</th><th>GPUs of the row</th></tr></thead><tbody>" +
      cs.map((c) => `<tr><td>${sw(c.app)}${appLink(c.app)}</td><td>${c.admitted ? "admitted" : c.shadow ? "shadow (D25)" : "not admitted"}</td>` +
        `<td class="n">${c.pf_row.length}</td><td class="n">${fmtRho(c.pf_rho)}</td><td class="n">${fmtC(c)}</td>` +
        `<td class="n">${c.draw === null ? "-" : c.draw.toFixed(3)}</td>` +
        `<td>${c.pf_row.length ? (c.won ? '<span class="won">won</span>' : '<span class="lost">lost</span>') : "no row"}</td>` +
        `<td>${gpuList(c.pf_row)}</td></tr>`).join("") + "</tbody>";
  }
  $("round-placed").innerHTML = r.placed.length ? "<thead><tr><th>Tier</th><th>App</th><th class=n>GPUs</th><th>Which</th><th>Lease ends</th></tr></thead><tbody>" +
    r.placed.map((p) => `<tr><td><span class="tag">${esc(p.tier)}</span></td><td>${sw(p.app)}${appLink(p.app)}</td><td class="n">${p.gpus.length}</td>` +
      `<td>${gpuList(p.gpus)}</td><td>${when(p.expires_at)}</td></tr>`).join("") + "</tbody>"
    : "<tbody><tr><td>Nothing was placed.</td></tr></tbody>";
  const ended = [...r.expired.map(([g, a]) => [g, a, r.reclaimed.some((x) => x[0] === g) ? "reclaimed (D27)" : "ran out"])];
  const byApp = new Map();
  for (const [g, a, why] of ended) { const k = a + "\u0000" + why; (byApp.get(k) || byApp.set(k, []).get(k)).push(g); }
  $("round-ended").innerHTML = byApp.size ? "<thead><tr><th>App</th><th>Why</th><th class=n>GPUs</th><th>Which</th></tr></thead><tbody>" +
    [...byApp].map(([k, gs]) => { const [a, why] = k.split("\u0000"); return `<tr><td>${sw(a)}${appLink(a)}</td><td>${why}</td><td class="n">${gs.length}</td><td>${gpuList(gs)}</td></tr>`; }).join("") + "</tbody>"
    : "<tbody><tr><td>None.</td></tr></tbody>";
  $("round-seed").innerHTML = r.seed ? `Seed <code>${esc(r.seed)}</code>, committed as <code>${esc(r.commitment)}</code> before the bids (D24).` +
    (r.canonical ? "" : " The allocation is an optimum the solver found, not the canonical one (D16; the service keeps the first it finds, D40).") : "";
  document.documentElement.dataset.round = String(r.round_id);
}

// -- fairness --------------------------------------------------------------------------------------

const tick = (s) => (s % 3600 === 0 ? `${s / 3600}h` : s >= 3600 ? `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}` : s % 60 === 0 ? `${s / 60}m` : dur(s));
const SIM_STEPS = [1, 5, 10, 30, 60, 300, 600, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800];
function chart(id, data, series, opts = {}) {
  const el = $(id);
  el.innerHTML = "";
  if (typeof uPlot === "undefined") { el.textContent = "charts unavailable"; return null; }
  const width = Math.min(1090, Math.max(360, el.clientWidth - 10 || 900));
  const rec = recorded();
  const plot = new uPlot({
    width, height: opts.height || 220, title: opts.title,
    scales: { x: { time: !rec } },
    axes: [rec ? { values: (u, v) => v.map(tick), incrs: SIM_STEPS } : {}, ...(opts.axes || [{ size: 60 }])],
    series: [{ label: "time", value: (u, v) => (v === null ? "-" : when(v)) }, ...series],
    bands: opts.bands,
  }, data, el);
  S.charts.push(plot);
  return plot;
}

async function renderFairness() {
  for (const c of S.charts) c.destroy();
  S.charts = [];
  const f = await get("/fairness?points=1500");
  const t = f.t, clean = (xs) => xs.map((v) => (v === null || v === "inf" ? null : v));
  chart("chart-rho", [t, clean(f.max_rho), clean(f.p99_rho)], [{ label: "max rho", stroke: "#b3261e", width: 2 }, { label: "p99 rho", stroke: "#2a5db0", width: 1.5, dash: [6, 4] }]);
  chart("chart-jain", [t, clean(f.jain)], [{ label: "Jain", stroke: "#1e7b34", width: 2 }]);
  chart("chart-util", [t, f.utilisation.map((u) => 100 * u), f.starving], [{ label: "GPUs leased %", stroke: "#2a5db0", width: 2, scale: "%" },
    { label: "apps holding nothing", stroke: "#b3261e", width: 1.5, scale: "n" }],
  { axes: [{ scale: "%", size: 50 }, { scale: "n", side: 1, size: 50, grid: { show: false } }] });
  const names = [...f.apps, "others"];
  const acc = [], series = [];
  let running = t.map(() => 0);
  f.gpus.forEach((row, k) => { running = running.map((v, i) => v + row[i]); acc.push(running.slice()); });
  // drawn from the top band down, each filled to zero, so each band shows its own app
  const order = names.map((_, k) => k).reverse();
  for (const k of order) series.push({ label: names[k], stroke: k === names.length - 1 ? "#8a94a3" : colour(names[k]), fill: k === names.length - 1 ? "#c6ccd5" : colour(names[k]), width: 1,
    value: (u, v, si, i) => (i === null || i === undefined ? "-" : String(f.gpus[k][i])) });
  chart("chart-gpus", [t, ...order.map((k) => acc[k])], series, { height: 300 });
  document.documentElement.dataset.fairness = String(t.length);
}

// -- events, settings ------------------------------------------------------------------------------

function eventRow(e) {
  return `<tr><td class="n">${e.seq}</td><td>${when(e.t)}</td><td><span class="tag">${esc(e.kind)}</span></td><td>${sw(e.app)}${appLink(e.app)}</td>` +
    `<td>${e.round_id === null ? "" : roundLink(e.round_id)}</td><td class="n">${e.gpus.length || ""}</td><td>${esc(e.reason)}</td></tr>`;
}

async function renderEvents(more) {
  const kind = $("events-kind").value, app = $("events-app").value.trim();
  const q = `?limit=200${more && S.eventsBefore ? `&before=${S.eventsBefore}` : ""}${kind ? `&kind=${kind}` : ""}${app ? `&app=${encodeURIComponent(app)}` : ""}`;
  const { events } = await get("/events" + q);
  const table = $("events-table");
  if (!more) table.innerHTML = "<thead><tr><th class=n>#</th><th>Time</th><th>Kind</th><th>App</th><th>Round</th><th class=n>GPUs</th><th>Reason</th></tr></thead><tbody></tbody>";
  table.tBodies[0].insertAdjacentHTML("beforeend", events.map(eventRow).join(""));
  S.eventsBefore = events.length ? events[events.length - 1].seq : S.eventsBefore;
  $("events-more").hidden = events.length < 200;
}

async function renderSettings() {
  const { settings, about } = await get("/settings");
  const rows = [...Object.entries(about.meta || {}), ...Object.entries(settings)];
  $("settings-table").innerHTML = "<tbody>" + rows.map(([k, v]) => `<tr><th>${esc(k)}</th><td>${esc(typeof v === "object" ? JSON.stringify(v) : v)}</td></tr>`).join("") + "</tbody>";
}

// -- routing ---------------------------------------------------------------------------------------

function parseRoute() {
  const [path, query] = (location.hash.replace(/^#/, "") || "/cluster").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { parts, query: new URLSearchParams(query || "") };
}

async function route() {
  const { parts, query } = parseRoute();
  let page = parts[0] || "cluster";
  if (page === "rounds" && parts[1]) page = "round";
  if (page === "apps" && parts[1]) page = "app";
  if (!$("page-" + page)) page = "cluster";
  S.route = page;
  for (const el of document.querySelectorAll(".page")) el.hidden = el.id !== "page-" + page;
  const tab = { round: "rounds", app: "apps" }[page] || page;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("on", a.dataset.page === tab);
  try {
    if (page === "cluster") {
      const at = query.has("at") ? Number(query.get("at")) : S.defaultAt ?? null;
      if (!S.cluster || at !== S.at) await loadCluster(at);
      else renderMap();
      setupSlider();
    } else if (page === "apps") renderApps();
    else if (page === "app") await renderApp(parts[1]);
    else if (page === "rounds") await renderRounds(false);
    else if (page === "round") await renderRound(Number(parts[1]));
    else if (page === "fairness") await renderFairness();
    else if (page === "events") await renderEvents(false);
    else if (page === "settings") await renderSettings();
    banner("");
  } catch (e) { if (e.message !== "401") banner(e.message); }
}

// -- live stream -----------------------------------------------------------------------------------

function connect() {
  if (recorded()) { $("status").textContent = "recorded run"; return; }
  const es = new EventSource(API + "/stream");
  S.live = es;
  es.addEventListener("hello", () => { $("status").textContent = "live"; $("status").className = "status live"; });
  es.onerror = () => { $("status").textContent = "reconnecting"; $("status").className = "status down"; };
  es.addEventListener("state", (m) => onState(JSON.parse(m.data)));
  es.addEventListener("round", (m) => onRound(JSON.parse(m.data)));
  es.addEventListener("event", (m) => onEvent(JSON.parse(m.data)));
  es.addEventListener("resync", () => resync());
  es.addEventListener("layout", () => resync());
  es.addEventListener("settings", () => { if (S.route === "settings") renderSettings(); });
  es.addEventListener("revoked", () => { es.close(); banner("Your viewer token was revoked."); $("status").textContent = "closed"; $("status").className = "status down"; });
}

let appsDirty = false;
function onState(d) {
  for (const [name, a] of Object.entries(d.apps)) { if (a === null) S.apps.delete(name); else S.apps.set(name, a); }
  if (S.at === null && S.cluster) {
    S.cluster.now = d.now; S.fetchedAt = Date.now();
    for (const [id, l] of Object.entries(d.leases)) {
      const g = gpuById(id);
      if (!g) continue;
      g.holder = l ? l.app : null; g.lease_end = l ? l.expires_at : null; g.round_id = l ? l.round_id : null;
      if (S.route === "cluster") updateCell(id);
    }
    if (S.route === "cluster") { renderSummary(); applyFilter(); }
  }
  if (Object.keys(d.apps).length && !appsDirty) {
    appsDirty = true;
    requestAnimationFrame(() => { appsDirty = false; fillNames(); if (S.route === "apps") renderApps(); });
  }
}

function onRound(b) {
  S.timeline.push([b.round_id, b.now]);
  if (S.route === "cluster") setupSlider();
  if (S.route === "rounds" && !$("rounds-app").value) {
    const body = $("rounds-table").tBodies[0];
    if (body) body.insertAdjacentHTML("afterbegin", roundRow(b));
  }
}

function onEvent(e) {
  if (S.route !== "events") return;
  const kind = $("events-kind").value, app = $("events-app").value.trim();
  if ((kind && e.kind !== kind) || (app && e.app !== app)) return;
  const body = $("events-table").tBodies[0];
  if (body) body.insertAdjacentHTML("afterbegin", eventRow(e));
}

async function resync() {
  S.gpuIndex = null;
  const tl = await get("/timeline");
  S.timeline = tl.rounds;
  S.cluster = null;
  await route();
}

// -- start -----------------------------------------------------------------------------------------

async function boot() {
  const [index, tl] = await Promise.all([get(""), get("/timeline"), fetchCluster(null)]);
  S.about = index.about || {};
  S.timeline = tl.rounds;
  const title = S.about.title && S.about.title !== "Themis" ? S.about.title : "";
  $("title").textContent = title;
  document.title = title ? `Themis - ${title}` : "Themis";
  $("events-kind").innerHTML = '<option value="">all</option>' + index.event_kinds.map((k) => `<option>${esc(k)}</option>`).join("");
  if (recorded()) $("to-latest").textContent = "Last round";
  fillNames();
  colourFirst([...S.apps.values()].sort((a, b) => b.held - a.held || (a.app < b.app ? -1 : 1)).map((a) => a.app));
  if (recorded() && S.timeline.length) {  // a finished run ends with an empty cluster: open at its busiest round
    const f = await get("/fairness?points=100000");
    colourFirst(f.apps);
    let best = 0;
    f.utilisation.forEach((u, i) => { if (u > f.utilisation[best]) best = i; });
    S.defaultAt = f.round_id[best] ?? null;
  }
  await route();
  painted();
  connect();
  window.addEventListener("hashchange", route);
  setInterval(refreshBars, 5000);
}

function painted() {
  requestAnimationFrame(() => setTimeout(() => {
    if (S.painted) return;
    S.painted = true;
    performance.mark("themis-painted");
    document.documentElement.dataset.painted = "1";
  }, 0));
}

function wire() {
  $("slider").addEventListener("input", onSlide);
  $("to-latest").addEventListener("click", () => {
    if (recorded()) { $("slider").value = S.timeline.length - 1; onSlide(); return; }
    history.replaceState(null, "", "#/cluster"); loadCluster(null).then(setupSlider);
  });
  $("app-filter").addEventListener("input", (e) => { S.filter = e.target.value.trim(); applyFilter(); });
  $("map").addEventListener("click", (e) => {
    const el = e.target.closest(".gpu");
    if (el && el.dataset.app) { S.filter = S.filter === el.dataset.app ? "" : el.dataset.app; $("app-filter").value = S.filter; applyFilter(); }
  });
  $("legend").addEventListener("click", (e) => {
    const el = e.target.closest("[data-app]");
    if (el) { S.filter = S.filter === el.dataset.app ? "" : el.dataset.app; $("app-filter").value = S.filter; applyFilter(); }
  });
  $("apps-filter").addEventListener("input", renderApps);
  $("apps-table").addEventListener("click", (e) => {
    const th = e.target.closest("th");
    if (!th) return;
    const k = th.dataset.k;
    S.sort = { key: k, dir: S.sort.key === k ? -S.sort.dir : (k === "app" || k === "model" ? 1 : -1) };
    renderApps();
  });
  $("rounds-app").addEventListener("change", () => renderRounds(false));
  $("rounds-more").addEventListener("click", () => renderRounds(true));
  $("events-kind").addEventListener("change", () => renderEvents(false));
  $("events-app").addEventListener("change", () => renderEvents(false));
  $("events-more").addEventListener("click", () => renderEvents(true));
}

wire();
boot();
