// The explorer's pages, filled from /api/ and refreshed on every server-sent event.
// Every value shown came from gossip: it only ever becomes text (append/textContent),
// never HTML.
"use strict";

const main = document.getElementById("page");
const PAGE = main.dataset.page;
const PEER = main.dataset.peer;
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else if (key === "href") node.href = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : text(child));
  }
  return node;
}

function text(value) {
  return document.createTextNode(value === null || value === undefined ? "–" : String(value));
}

const fmt = {
  credits: (micro) => (micro === null || micro === undefined ? "–" : (micro / 1e6).toFixed(3)),
  score: (x) => (x === null || x === undefined ? "–" : x.toFixed(3)),
  pct: (x) => (x === null || x === undefined ? "–" : `${Math.round(x * 100)}%`),
  gib: (mib) => (mib === null || mib === undefined ? "–" : `${(mib / 1024).toFixed(0)} GiB`),
  time: (t) => (t ? new Date(t * 1000).toLocaleString() : "–"),
  short: (peer) => (peer && peer.length > 16 ? `${peer.slice(0, 8)}…${peer.slice(-6)}` : peer),
};

function hostLink(peer) {
  return el("a", { href: `/hosts/${encodeURIComponent(peer)}`, title: peer }, fmt.short(peer));
}

// With orMissing, a 404 gives the API's {"error": ...} body for the page to show.
async function getJSON(path, { orMissing = false } = {}) {
  const response = await fetch(path, { headers: { Accept: "application/json" } });
  if (!response.ok && !(orMissing && response.status === 404)) {
    throw new Error(`${path}: ${response.status}`);
  }
  return response.json();
}

// A table: columns are {label, cell(row) -> Node|string, sort(row) -> comparable}.
function table(id, columns, rows, sorting) {
  const head = el("tr");
  for (const column of columns) {
    const th = el("th", {}, column.label);
    if (sorting && column.sort) {
      th.classList.add("sortable");
      if (sorting.column === column) th.classList.add(sorting.descending ? "desc" : "asc");
      th.addEventListener("click", () => sorting.by(column));
    }
    head.append(th);
  }
  const body = el("tbody");
  for (const row of rows) {
    body.append(el("tr", {}, ...columns.map((c) => el("td", {}, c.cell(row)))));
  }
  if (!rows.length) body.append(el("tr", {}, el("td", { colspan: columns.length, class: "muted" }, "nothing yet")));
  return el("table", { id }, el("thead", {}, head), body);
}

function sorted(rows, sorting) {
  if (!sorting.column) return rows;
  const key = sorting.column.sort;
  const sign = sorting.descending ? -1 : 1;
  return [...rows].sort((a, b) => {
    const x = key(a), y = key(b);
    if (x === y) return 0;
    if (x === null || x === undefined) return 1;
    if (y === null || y === undefined) return -1;
    return x < y ? -sign : sign;
  });
}

function section(title, ...children) {
  return el("section", {}, el("h2", {}, title), ...children);
}

// A line chart of one key of a host's history.
function chart(samples, key, label, format) {
  const width = 360, height = 120, pad = 28;
  const points = samples.filter((s) => s[key] !== null && s[key] !== undefined);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("class", "chart");
  svg.setAttribute("data-series", key);
  const caption = el("figcaption", {}, label);
  if (points.length < 1) return el("figure", {}, caption, el("p", { class: "muted" }, "no samples yet"));
  const ts = points.map((p) => p.t), vs = points.map((p) => p[key]);
  const t0 = Math.min(...ts), t1 = Math.max(...ts), v0 = Math.min(...vs, 0), v1 = Math.max(...vs);
  const x = (t) => pad + ((t - t0) / (t1 - t0 || 1)) * (width - 2 * pad);
  const y = (v) => height - pad + -((v - v0) / (v1 - v0 || 1)) * (height - 2 * pad);
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", points.map((p) => `${x(p.t)},${y(p[key])}`).join(" "));
  svg.append(line);
  const last = points[points.length - 1];
  const dot = document.createElementNS(SVG, "circle");  // a lone sample shows too
  dot.setAttribute("cx", x(last.t));
  dot.setAttribute("cy", y(last[key]));
  dot.setAttribute("r", 2.5);
  svg.append(dot);
  for (const [value, at] of [[v1, y(v1)], [v0, y(v0)]]) {
    const tick = document.createElementNS(SVG, "text");
    tick.setAttribute("x", 2);
    tick.setAttribute("y", at + 4);
    tick.textContent = format(value);
    svg.append(tick);
  }
  return el("figure", {}, caption, svg);
}

// --- pages ------------------------------------------------------------------------

const hostsView = {
  filter: "",
  onlineOnly: false,
  minScore: 0,
  rows: [],
  sorting: null,
  columns: [
    { label: "host", cell: (r) => hostLink(r.host), sort: (r) => r.host },
    { label: "state", cell: (r) => (r.online ? "online" : "offline"), sort: (r) => r.online },
    { label: "GPU", cell: (r) => r.gpu, sort: (r) => r.gpu },
    { label: "VRAM", cell: (r) => fmt.gib(r.vram_mib), sort: (r) => r.vram_mib },
    { label: "perf", cell: (r) => r.perf, sort: (r) => r.perf },
    { label: "price / share-h", cell: (r) => fmt.credits(r.price), sort: (r) => r.price },
    { label: "shares free", cell: (r) => r.shares_free, sort: (r) => r.shares_free },
    { label: "score", cell: (r) => fmt.score(r.score), sort: (r) => r.score },
    { label: "lower bound", cell: (r) => fmt.score(r.lower_bound), sort: (r) => r.lower_bound },
    { label: "±", cell: (r) => fmt.score(r.uncertainty), sort: (r) => r.uncertainty },
    {
      label: "evidence (ok / failed / beats / perf / bad blobs)",
      cell: (r) => `${r.evidence.service} / ${r.evidence.failure} / ${r.evidence.heartbeat} / ${r.evidence.performance} / ${r.evidence.badblob}`,
      sort: (r) => r.evidence.service + r.evidence.failure + r.evidence.heartbeat + r.evidence.performance + r.evidence.badblob,
    },
    { label: "uptime", cell: (r) => fmt.pct(r.uptime), sort: (r) => r.uptime },
  ],
  mount() {
    const sorting = { column: this.columns[8], descending: true };
    sorting.by = (column) => {
      sorting.descending = sorting.column === column ? !sorting.descending : true;
      sorting.column = column;
      this.draw();
    };
    this.sorting = sorting;
    const search = el("input", { id: "host-filter", type: "search", placeholder: "filter by host or GPU" });
    search.addEventListener("input", () => { this.filter = search.value.toLowerCase(); this.draw(); });
    const online = el("input", { id: "online-only", type: "checkbox" });
    online.addEventListener("change", () => { this.onlineOnly = online.checked; this.draw(); });
    const score = el("input", { id: "min-score", type: "number", min: "0", max: "1", step: "0.05", value: "0" });
    score.addEventListener("input", () => { this.minScore = Number(score.value) || 0; this.draw(); });
    main.replaceChildren(
      el("h1", {}, "Hosts"),
      el("div", { class: "controls" }, search, el("label", {}, online, " online only"),
         el("label", {}, "min score ", score)),
      el("div", { id: "hosts-table" }),
    );
  },
  async load() {
    this.rows = await getJSON("/api/hosts");
    this.draw();
  },
  draw() {
    const rows = this.rows.filter((r) =>
      (!this.filter || r.host.toLowerCase().includes(this.filter) || String(r.gpu).toLowerCase().includes(this.filter))
      && (!this.onlineOnly || r.online) && (r.score ?? 0) >= this.minScore);
    const holder = document.getElementById("hosts-table");
    holder.replaceChildren(
      el("p", { class: "muted", id: "host-count" }, `${rows.length} of ${this.rows.length} hosts`),
      table("hosts", this.columns, sorted(rows, this.sorting), this.sorting),
    );
  },
};

const hostView = {
  mount() {},
  async load() {
    const host = await getJSON(`/api/hosts/${encodeURIComponent(PEER)}`, { orMissing: true });
    if (host.error) {
      main.replaceChildren(el("h1", {}, "Host"), el("p", {}, `${host.error}: `, el("code", {}, PEER)));
      return;
    }
    const facts = el("dl", { class: "facts" });
    for (const [name, value] of [
      ["peer id", host.host], ["state", host.online ? "online" : "offline"], ["GPU", host.gpu],
      ["VRAM", fmt.gib(host.vram_mib)], ["perf units", host.perf],
      ["price / share-hour", fmt.credits(host.price)], ["shares free", host.shares_free],
      ["score", fmt.score(host.score)], ["lower bound", fmt.score(host.lower_bound)],
      ["uptime (explorer's samples)", fmt.pct(host.uptime)],
    ]) facts.append(el("dt", {}, name), el("dd", {}, value));
    main.replaceChildren(
      el("h1", {}, "Host ", el("code", { id: "host-id" }, fmt.short(host.host))),
      facts,
      section("Over time", el("div", { class: "charts" },
        chart(host.history, "score", "score", fmt.score),
        chart(host.history, "price", "price / share-hour", fmt.credits),
        chart(host.history, "shares_free", "shares free (availability)", (v) => String(v)))),
      section("Evidence", table("evidence", [
        { label: "kind", cell: (e) => e.kind },
        { label: "reported by", cell: (e) => el("code", { title: e.reporter }, fmt.short(e.reporter)) },
        { label: "reporter's weight", cell: (e) => fmt.score(e.weight) },
        { label: "when", cell: (e) => fmt.time(e.at) },
        { label: "share-seconds served", cell: (e) => e.served_share_s },
        { label: "ratio", cell: (e) => fmt.score(e.ratio) },
      ], host.evidence_history)),
      section("This node's leases with it", leasesTable(host.leases)),
      section("Receipts", receiptsTable(host.receipts)),
    );
  },
};

function leasesTable(rows) {
  return table("leases", [
    { label: "lease", cell: (r) => el("code", {}, fmt.short(r.lease_id)) },
    { label: "host / consumer", cell: (r) => (r.host ? hostLink(r.host) : el("code", {}, fmt.short(r.consumer))) },
    { label: "price / share-h", cell: (r) => fmt.credits(r.price) },
    { label: "receipts", cell: (r) => r.receipts },
    { label: "share-s", cell: (r) => r.share_seconds },
    { label: "bytes", cell: (r) => r.bytes },
    { label: "cost / earned", cell: (r) => fmt.credits(r.cost ?? r.earned) },
    { label: "state", cell: (r) => r.state },
    { label: "session", cell: sessionCell },
  ], rows);
}

// A host's lease shows its session at work: op rate and its waits for the device.
function sessionCell(r) {
  if (r.ops === undefined) return r.path || "";
  const waits = r.wait_p99_ms === undefined ? "" : `, waits ${r.wait_p50_ms.toFixed(1)}/${r.wait_p99_ms.toFixed(1)} ms (p50/p99)`;
  return `${Math.round(r.ops_per_s)} ops/s${waits}`;
}

function receiptsTable(rows) {
  return table("receipts", [
    { label: "lease", cell: (r) => el("code", {}, fmt.short(r.lease_id)) },
    { label: "host", cell: (r) => hostLink(r.host) },
    { label: "from", cell: (r) => fmt.time(r.interval_start) },
    { label: "to", cell: (r) => fmt.time(r.interval_end) },
    { label: "share-s", cell: (r) => r.share_seconds },
    { label: "bytes", cell: (r) => r.bytes_moved },
  ], rows);
}

function cleared(price, leases) {
  return price === null || price === undefined ? "–" : `${fmt.credits(price)} (${leases})`;
}

const bookView = {
  mount() {},
  async load() {
    const book = await getJSON("/api/book");
    const top = Math.max(1, ...book.depth.map((d) => d.cumulative));
    main.replaceChildren(
      el("h1", {}, "Order book"),
      section("Prices by GPU model (per share-hour; cleared: the last hour's leases)", table("prices", [
        { label: "GPU", cell: (p) => p.gpu_model },
        { label: "on-demand ask", cell: (p) => fmt.credits(p.ask) },
        { label: "contending floor", cell: (p) => fmt.credits(p.contend_floor) },
        { label: "on-demand cleared", cell: (p) => cleared(p.on_demand_cleared, p.on_demand_leases) },
        { label: "contending cleared", cell: (p) => cleared(p.contend_cleared, p.contend_leases) },
      ], book.prices)),
      section("Offers", table("offers", [
        { label: "host", cell: (r) => hostLink(r.host) },
        { label: "GPU", cell: (r) => r.gpu },
        { label: "VRAM", cell: (r) => fmt.gib(r.vram_mib) },
        { label: "perf", cell: (r) => r.perf },
        { label: "shares", cell: (r) => r.shares },
        { label: "price / share-h", cell: (r) => fmt.credits(r.price) },
        { label: "contending at", cell: (r) => (r.contend_price ? fmt.credits(r.contend_price) : "-") },
        { label: "standby GiB", cell: (r) => r.storage_gib ?? 0 },
        { label: "price / GiB-h", cell: (r) => (r.storage_gib ? fmt.credits(r.storage_price) : "-") },
        { label: "score", cell: (r) => fmt.score(r.score) },
        { label: "expires in s", cell: (r) => Math.round(r.expires_in) },
      ], book.offers)),
      section("Bids", table("bids", [
        { label: "consumer", cell: (r) => el("code", {}, fmt.short(r.consumer)) },
        { label: "GPU models", cell: (r) => (r.gpu_models.length ? r.gpu_models.join(", ") : "any") },
        { label: "shares", cell: (r) => r.shares },
        { label: "max price", cell: (r) => fmt.credits(r.max_price) },
        { label: "class", cell: (r) => r.priority },
      ], book.bids)),
      section("Depth by GPU model and price", table("depth", [
        { label: "GPU", cell: (d) => d.gpu },
        { label: "price / share-h", cell: (d) => fmt.credits(d.price) },
        { label: "shares", cell: (d) => d.shares },
        { label: "shares at or below", cell: (d) => {
          const bar = el("span", { class: "bar" });
          bar.style.width = `${Math.round((d.cumulative / top) * 100)}%`;
          return el("span", { class: "depth" }, bar, ` ${d.cumulative}`);
        } },
      ], book.depth)),
    );
  },
};

const leasesView = {
  mount() {},
  async load() {
    const leases = await getJSON("/api/leases");
    const total = leases.role === "provider" ? "earned" : "cost";
    main.replaceChildren(
      el("h1", {}, "This node's leases"),
      el("p", {}, `role: ${leases.role || "none"}; ${total} so far: ${fmt.credits(leases.total)} credits`),
      section("Leases and sessions", leasesTable(leases.leases)),
      section("Receipts in the ledger", receiptsTable(leases.receipts)),
    );
  },
};

const meshView = {
  mount() {},
  async load() {
    const mesh = await getJSON("/api/mesh");
    main.replaceChildren(
      el("h1", {}, "Mesh"),
      el("p", {}, "this node: ", el("code", { id: "own-peer" }, mesh.peer_id)),
      section("Its addresses", el("ul", {}, ...mesh.addrs.map((a) => el("li", {}, el("code", {}, a))))),
      section("Topics", el("ul", {}, ...mesh.topics.map((t) => el("li", {}, el("code", {}, t))))),
      section("Peers", table("peers", [
        { label: "peer", cell: (p) => el("code", { title: p.peer }, fmt.short(p.peer)) },
        { label: "connection", cell: (p) => p.connection },
        { label: "addresses", cell: (p) => el("span", {}, ...p.addrs.map((a) => el("code", { class: "addr" }, a))) },
      ], mesh.peers)),
    );
  },
};

const VIEWS = { hosts: hostsView, host: hostView, book: bookView, leases: leasesView, mesh: meshView };

async function showStatus() {
  const status = await getJSON("/api/status");
  const line = document.getElementById("node-status");
  if (!status.updated) line.textContent = "no node has run on this data directory yet";
  else if (status.running) line.textContent = `node ${fmt.short(status.peer_id)} (${status.role}), live`;
  else line.textContent = `node not running: its last known state, from ${fmt.time(status.updated)}`;
  main.dataset.version = status.version;
}

async function refresh() {
  try {
    await VIEWS[PAGE].load();
    await showStatus();
  } catch (error) {
    document.getElementById("node-status").textContent = `cannot reach the explorer: ${error.message}`;
  }
}

VIEWS[PAGE].mount();
refresh();
let pending = false;
new EventSource("/api/events").onmessage = () => {
  if (pending) return;
  pending = true;
  setTimeout(() => { pending = false; refresh(); }, 200);
};
