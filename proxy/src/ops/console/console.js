// The pet-gateway console: every figure from the admin API, every change through it. Text is
// always set as text (never as markup), so a key named `<img src=x onerror=alert(1)>` shows
// exactly those characters. The admin token, when the gateway asks for one, lives in this tab's
// sessionStorage and nowhere else.
"use strict";

const TOKEN = "pet-gateway-admin-token";
const REFRESH_MS = 3000;
let timer = null;
let lastOverview = null;
/** Bumped by every navigation (and by a key shown once): a render that finishes after the
 * page it was for was left draws nothing. */
let routeGen = 0;

// ---- small helpers -------------------------------------------------------------------------

/** An element with attributes and children; strings become text nodes. */
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === false || v === null || v === undefined) continue;
    if (k === "text") e.textContent = String(v);
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

/** A time in the browser's zone, UTC on hover. */
function when(unixSeconds) {
  if (!unixSeconds) return el("span", { class: "muted" }, "never");
  const d = new Date(unixSeconds * 1000);
  return el("time", { datetime: d.toISOString(), title: d.toISOString().replace(".000Z", "Z") + " (UTC)" },
    d.toLocaleString());
}

function whenText(iso) {
  if (!iso) return el("span", { class: "muted" }, "none");
  return when(Date.parse(iso) / 1000);
}

function bar(used, limit) {
  const pct = limit > 0 ? Math.min(100, (100 * used) / limit) : 0;
  const b = el("div", { class: pct >= 100 ? "bar full" : "bar", role: "img",
    "aria-label": `${used} of ${limit} used` }, el("span"));
  b.firstChild.style.width = pct.toFixed(1) + "%";
  return b;
}

function say(message) {
  const s = document.getElementById("status");
  s.textContent = message;
  setTimeout(() => { if (s.textContent === message) s.textContent = ""; }, 5000);
}

function show(...nodes) {
  const main = document.getElementById("main");
  // A page may return lists among its nodes (one section a plan): replaceChildren would
  // write a list as the text "[object HTMLElement]".
  main.replaceChildren(...nodes.flat(Infinity).filter((n) => n !== null && n !== undefined && n !== ""));
  // Each cell names its column, for the narrow layout where a row is a card of its cells.
  for (const table of main.querySelectorAll("table")) {
    const heads = [...table.querySelectorAll("thead th")].map((th) => th.textContent);
    for (const row of table.querySelectorAll("tbody tr")) {
      [...row.children].forEach((cell, i) => { if (heads[i]) cell.dataset.label = heads[i]; });
    }
  }
}

// ---- the admin API -------------------------------------------------------------------------

class NeedsToken extends Error {}

async function api(method, path, body) {
  const headers = { "Accept": "application/json" };
  const token = sessionStorage.getItem(TOKEN);
  if (token) headers["Authorization"] = "Bearer " + token;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "omit", cache: "no-store",
  });
  if (resp.status === 401) throw new NeedsToken(token ? "wrong token" : "token needed");
  let data = null;
  const text = await resp.text();
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = { message: text }; }
  if (!resp.ok) {
    const why = (data && (data.message || data.error)) || resp.statusText;
    throw new Error(`${method} ${path}: ${resp.status} ${why}`);
  }
  return data;
}

function loginPage(why) {
  stopRefresh();
  document.getElementById("main").hidden = true;
  const login = document.getElementById("login");
  login.hidden = false;
  document.getElementById("login-error").textContent =
    why === "wrong token" ? "That token was refused. Check it and try again." : "";
  document.getElementById("token").focus();
}

/** Runs a change or a render; a refused token opens the sign-in, an error is shown. */
async function guarded(work) {
  try {
    return await work();
  } catch (e) {
    if (e instanceof NeedsToken) { loginPage(e.message); return null; }
    return [el("h2", { text: "Something went wrong" }), el("p", { class: "error", role: "alert", text: e.message })];
  }
}

/** An SVG element (the chart draws itself: no script from elsewhere). */
function svg(tag, attrs, ...children) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") e.textContent = String(v);
    else if (v !== null && v !== undefined) e.setAttribute(k, String(v));
  }
  for (const c of children.flat()) if (c) e.append(c);
  return e;
}

/** A line chart of the last 15 minutes of `samples` (`t` in Unix seconds), one line a series
 * (`{key, label, color, dash}`), with its legend and, for readers of the page, a summary of the
 * latest values. */
function chart(title, samples, series, unit) {
  const W = 600, H = 160, PAD = 28;
  const now = samples.length ? samples[samples.length - 1].t : Math.floor(Date.now() / 1000);
  const from = now - 900;
  const values = series.flatMap((s) => samples.map((p) => p[s.key]).filter((v) => typeof v === "number"));
  const top = Math.max(1, ...values);
  const x = (t) => PAD + ((t - from) / 900) * (W - 2 * PAD);
  const y = (v) => H - PAD - (v / top) * (H - 2 * PAD);
  const last = samples[samples.length - 1] || {};
  const fmt = (v) => (typeof v === "number" ? (v >= 10 ? v.toFixed(0) : v.toFixed(1)) : "none");
  const summary = series.map((s) => `${s.label} ${fmt(last[s.key])}`).join(", ");
  const lines = series.map((s) => {
    const points = samples.filter((p) => typeof p[s.key] === "number" && p.t >= from)
      .map((p) => `${x(p.t).toFixed(1)},${y(p[s.key]).toFixed(1)}`).join(" ");
    return points ? svg("polyline", { points, fill: "none", stroke: s.color, "stroke-width": 2,
      "stroke-dasharray": s.dash ? "5 4" : null, "data-series": s.key }) : null;
  });
  const picture = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img",
    "aria-label": `${title}, now: ${summary}`, class: "chart" },
    svg("title", { text: `${title}, now: ${summary}` }),
    svg("line", { x1: PAD, y1: H - PAD, x2: W - PAD, y2: H - PAD, stroke: "#d8dde3" }),
    svg("line", { x1: PAD, y1: PAD, x2: W - PAD, y2: PAD, stroke: "#eef1f4" }),
    svg("text", { x: PAD, y: PAD - 8, "font-size": 11, fill: "#5b6470", text: `${fmt(top)} ${unit}` }),
    svg("text", { x: PAD, y: H - 8, "font-size": 11, fill: "#5b6470", text: "15 min ago" }),
    svg("text", { x: W - PAD, y: H - 8, "font-size": 11, fill: "#5b6470", "text-anchor": "end", text: "now" }),
    lines);
  const legend = el("p", { class: "legend" }, series.map((s) =>
    el("span", { class: "key" }, el("span", { class: "swatch" + (s.dash ? " dashed" : "") }), `${s.label} ${fmt(last[s.key])}`)));
  for (const [i, s] of series.entries()) legend.children[i].firstChild.style.background = s.color;
  return el("section", { class: "card chart-card", "aria-label": title }, el("h3", {}, title), picture, legend,
    samples.length ? null : el("p", { class: "muted" }, "Collecting: a point every 5 seconds."));
}

// ---- pages ---------------------------------------------------------------------------------

async function overviewPage() {
  const [o, history] = await Promise.all([api("GET", "/overview"), api("GET", "/overview/history")]);
  const samples = history.samples || [];
  const prev = lastOverview;
  lastOverview = o;
  const rate = (k) => {
    if (!prev || o.now <= prev.now) return "…";
    return ((o[k] - prev[k]) / (o.now - prev.now)).toFixed(1);
  };
  const card = (label, figure, ...extra) =>
    el("div", { class: "card" }, el("div", { class: "muted" }, label), el("div", { class: "figure" }, figure), ...extra);
  const events = o.events || {};
  const pending = Object.entries(events.pending || {}).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
  const reg = o.registry;
  const delivered = Object.entries(events.delivered_total || {}).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
  const failures = Object.entries(events.failures_total || {}).filter(([, v]) => v > 0).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
  return [
    el("h2", { text: "Overview" }),
    el("div", { class: "cards" },
      card("Requests per second", rate("requests_total")),
      card("429s per second", rate("rate_limited_total")),
      card("Bans now", o.bans_active === null ? "unknown" : o.bans_active),
      card("Quota store", o.store.state === "ok" && o.store.reachable ? "ok" : o.store.state === "ok" ? "unreachable" : "fallback",
        el("div", { class: "muted" }, `breaker ${o.store.breaker}`),
        el("div", { class: "muted" }, "errors: " + (Object.entries(o.store.errors_total || {})
          .filter(([, n]) => n > 0).map(([k, n]) => `${k} ${n}`).join(", ") || "none"))),
      card("Key registry", reg ? (reg.ok ? "in step" : "not in step") : "keys file", reg ? el("div", { class: "muted" }, reg.says) : ""),
      card("Events pending", pending,
        el("div", { class: "muted" }, `delivered ${delivered}`),
        el("div", { class: "muted" }, `failed tries ${failures}`),
        el("div", { class: "muted" }, `dead-lettered ${events.dead_lettered_total || 0}, dropped ${events.dropped_total || 0}`)),
      o.overload ? card("At the backends", `${o.overload.in_flight}` +
          (o.overload.limits.every((l) => l === null) ? "" : ` of ${o.overload.limits.reduce((a, l) => a + (l || 0), 0)}`),
        el("div", { class: "muted" }, `waiting ${o.overload.queued}, key places held ${o.overload.slots_held}`),
        el("div", { class: "muted" }, "refused: " + (Object.entries(o.overload.refusals_total || {})
          .filter(([, n]) => n > 0).map(([k, n]) => `${k} ${n}`).join(", ") || "none"))) : null,
    ),
    el("div", { class: "charts" },
      chart("Requests per second", samples, [
        { key: "admitted", label: "answered", color: "#1f6feb" },
        { key: "refused", label: "refused (429)", color: "#d97706" },
        { key: "shed", label: "shed (503)", color: "#b42318" },
      ], "/s"),
      chart("At the backends", samples, [
        { key: "in_flight", label: "in flight", color: "#137333" },
        { key: "limit", label: "limit", color: "#5b6470", dash: true },
      ], "requests")),
    el("p", { class: "muted" }, "Updated ", when(o.now), "; refreshed every few seconds."),
  ];
}

const STATUSES = ["active", "rotated", "banned", "expired", "revoked"];

/** A record's status word: `banned until …`, `active until …` and `rotated until …` say when. */
const statusWord = (status) => String(status || "").split(" ")[0];
/** Whether a key with this status still works, so it can be rotated, reset or revoked. */
const inForce = (status) => ["active", "rotated", "banned"].includes(statusWord(status));

async function keysPage(params) {
  const ask = new URLSearchParams();
  for (const k of ["q", "status", "plan", "page"]) if (params.get(k)) ask.set(k, params.get(k));
  const [found, plans] = await Promise.all([api("GET", "/key-search?" + ask), api("GET", "/plans")]);
  const q = params.get("q") || "";
  const status = params.get("status") || "";
  const plan = params.get("plan") || "";
  const filters = el("form", { class: "filters", role: "search", onsubmit: (ev) => {
    ev.preventDefault();
    const f = new FormData(ev.target);
    const p = new URLSearchParams();
    for (const [k, v] of f) if (v) p.set(k, v);
    location.hash = "#/keys" + (p.toString() ? "?" + p : "");
  } },
  el("div", {}, el("label", { for: "q" }, "Search id, name or customer"), el("input", { id: "q", name: "q", value: q })),
  el("div", {}, el("label", { for: "filter-status" }, "Status"),
    el("select", { id: "filter-status", name: "status" }, el("option", { value: "" }, "any"),
      STATUSES.map((s) => el("option", { value: s, selected: s === status }, s)))),
  el("div", {}, el("label", { for: "filter-plan" }, "Plan"),
    el("select", { id: "filter-plan", name: "plan" }, el("option", { value: "" }, "any"),
      plans.map((p) => el("option", { value: p.name, selected: p.name === plan }, p.name)))),
  el("button", { type: "submit" }, "Filter"));

  const usageOf = (k) => {
    if (!k.usage) return "";
    if (k.usage.error) return el("span", { class: "muted" }, "unknown");
    const w = (k.usage.windows || []).filter((x) => !x.shadow);
    return el("div", {}, w.map((x) => el("div", {}, el("span", { class: "muted" }, `${x.name} ${x.used}/${x.limit}`), bar(x.used, x.limit))));
  };
  const rows = found.keys.map((k) => el("tr", {},
    el("td", {}, el("a", { href: "#/keys/" + encodeURIComponent(k.id) }, k.id)),
    el("td", {}, k.name || ""),
    el("td", {}, k.customer || ""),
    el("td", {}, k.plan),
    el("td", {}, k.status),
    el("td", {}, usageOf(k)),
    el("td", {}, inForce(k.status) ? actions(k) : "")));
  const filtered = q || status || plan;
  const table = found.keys.length
    ? el("div", { class: "table-wrap" }, el("table", {},
      el("thead", {}, el("tr", {}, ["Id", "Name", "Customer", "Plan", "Status", "Usage", "Actions"].map((h) =>
        el("th", { scope: "col" }, h)))),
      el("tbody", {}, rows)))
    : el("p", { class: "muted" }, filtered ? "No key matches." : "No keys yet: issue one below.");
  const page = found.page;
  const last = Math.max(1, Math.ceil(found.total / found.per_page));
  const to = (n) => { const p = new URLSearchParams(ask); p.set("page", n); return "#/keys?" + p; };
  const pager = el("p", { class: "muted" }, `${found.total} key(s), page ${page} of ${last} `,
    page > 1 ? el("a", { href: to(page - 1) }, "Previous") : "", " ",
    page < last ? el("a", { href: to(page + 1) }, "Next") : "");
  const stale = found.stale ? el("p", { class: "muted", role: "status" },
    "Showing the keys as they were a moment ago: the newest are being read.") : "";
  return [el("h2", { text: "Keys" }), filters, issueForm(plans), stale, table, pager];
}

function actions(k) {
  return el("span", {},
    el("button", { type: "button", onclick: () => change("rotate", k) }, "Rotate"), " ",
    el("button", { type: "button", onclick: () => change("reset-usage", k) }, "Reset usage"), " ",
    el("button", { type: "button", class: "danger", onclick: () => change("revoke", k) }, "Revoke"));
}

async function change(what, k) {
  // Control and direction characters out of what a dialog shows.
  const plain = (t) => String(t).replace(/[\u0000-\u001f\u007f-\u009f\u200e\u200f\u202a-\u202e\u2066-\u2069]/g, "");
  const named = k.name ? `${k.id} (${plain(k.name)})` : k.id;
  if (what === "revoke" && !confirm(`Revoke key ${named}? Requests with it get 401 from now on.`)) return;
  if (what === "rotate" && !confirm(`Rotate key ${named}? The old key keeps working for 24 hours.`)) return;
  const failed = await guarded(async () => {
    const r = await api("POST", `/keys/${encodeURIComponent(k.id)}/${what}`, {});
    // A rotation answers {"old": record, "new": record with its key}: the successor's key is
    // shown once, here, or never.
    const successor = what === "rotate" && r && r.new;
    if (successor && successor.key) {
      showKeyOnce(`Rotated ${k.id} to ${successor.id}: the new key is shown only now.`, successor.key);
    } else {
      say(`${what} done: ${k.id}`);
      await route();
    }
  });
  if (failed) say(failed[1].textContent);
}

function issueForm(plans) {
  return el("form", { class: "inline", "aria-label": "Issue a key", onsubmit: async (ev) => {
    ev.preventDefault();
    const f = new FormData(ev.target);
    const body = { plan: f.get("plan") };
    if (f.get("name")) body.name = f.get("name");
    if (f.get("customer")) body.customer = f.get("customer");
    const failed = await guarded(async () => {
      const r = await api("POST", "/keys", body);
      showKeyOnce(`Issued ${r.id} on plan ${body.plan}: the key is shown only now.`, r.key);
    });
    if (failed) say(failed[1].textContent);
  } },
  el("div", {}, el("label", { for: "issue-plan" }, "Plan"),
    el("select", { id: "issue-plan", name: "plan", required: true }, plans.map((p) => el("option", { value: p.name }, p.name)))),
  el("div", {}, el("label", { for: "issue-name" }, "Name"), el("input", { id: "issue-name", name: "name", maxlength: 128 })),
  el("div", {}, el("label", { for: "issue-customer" }, "Customer"), el("input", { id: "issue-customer", name: "customer", maxlength: 64 })),
  el("button", { type: "submit", class: "primary" }, "Issue key"));
}

function showKeyOnce(title, key) {
  stopRefresh();
  routeGen += 1; // nothing drawn by a refresh in flight may replace the key
  const code = el("p", { class: "shown-key", id: "new-key" }, key);
  show(el("h2", { text: title }), code,
    el("p", {},
      el("button", { type: "button", id: "copy-key", onclick: async () => {
        try { await navigator.clipboard.writeText(key); say("Copied."); } catch (_) { say("Select the key and copy it."); }
      } }, "Copy key"), " ",
      el("a", { href: "#/keys", id: "back-to-keys" }, "Back to keys")),
    el("p", { class: "muted" }, "Store it now: the gateway keeps only its hash."));
}

async function keyPage(id, params, first) {
  // One key's own record and its customer's other keys: a search, not the whole list.
  const [k, found] = await Promise.all([
    api("GET", "/keys/" + encodeURIComponent(id)).catch((e) => ({ error: e.message })),
    api("GET", "/key-search?per_page=1&id=" + encodeURIComponent(id))]);
  const record = found.keys.find((x) => x.id === id);
  if (k.error && !record) {
    return [el("h2", { text: "Key " + id }), el("p", { class: "error", role: "alert" }, k.error)];
  }
  let siblings = [];
  if (record && record.customer) {
    const same = await api("GET", "/key-search?per_page=100&customer=" + encodeURIComponent(record.customer));
    siblings = same.keys.filter((x) => x.id !== id);
    // The total counts this key too, shown here or not.
    siblings.more = Math.max(0, same.total - 1 - siblings.length);
  }
  // The history is read when the page opens, not at every refresh.
  if (first || !keyPage.history || keyPage.history.id !== id) {
    keyPage.history = { id, value: await api("GET", "/keys/" + encodeURIComponent(id) + "/audit").catch((e) => ({ error: e.message })) };
  }
  const usage = k.usage || {};
  const windows = (usage.windows || []).map((w) => el("tr", {},
    el("th", { scope: "row" }, w.name + (w.shadow ? " (shadow)" : "")),
    el("td", {}, bar(w.used, w.limit)),
    el("td", {}, `${w.used} / ${w.limit}`),
    el("td", {}, String(w.remaining)),
    el("td", {}, when(w.reset))));
  return [
    el("h2", { text: "Key " + id }),
    el("dl", {},
      el("dt", {}, "Name"), el("dd", {}, (record && record.name) || ""),
      el("dt", {}, "Plan"), el("dd", {}, (record && record.plan) || k.plan || ""),
      el("dt", {}, "Status"), el("dd", {}, (record && record.status) || k.status || ""),
      el("dt", {}, "Customer"), el("dd", {}, (record && record.customer) || "none"),
      el("dt", {}, "Created"), el("dd", {}, whenText(record && record.created_at)),
      el("dt", {}, "Expires"), el("dd", {}, whenText(record && record.expires_at)),
      el("dt", {}, "Last used"), el("dd", {}, whenText(usage.last_used)),
      el("dt", {}, "Refused today"), el("dd", {}, String(usage.refused_today ?? "")),
      el("dt", {}, "Banned until"), el("dd", {}, usage.ban_until ? when(usage.ban_until) : "not banned"),
      el("dt", {}, "Own limits"), el("dd", {}, ownLimits(record))),
    el("h2", { text: "Windows" }),
    windows.length ? el("div", { class: "table-wrap" }, el("table", {},
      el("thead", {}, el("tr", {}, ["Window", "Usage", "Used", "Remaining", "Resets"].map((h) => el("th", { scope: "col" }, h)))),
      el("tbody", {}, windows))) : el("p", { class: "muted" }, k.usage_error || "No usage: the key is not active."),
    record && inForce(record.status) ? el("p", {}, actions(record)) : "",
    el("h2", { text: "The customer's other keys" }),
    siblings.length ? el("ul", {}, siblings.map((s) => el("li", {}, el("a", { href: "#/keys/" + encodeURIComponent(s.id) }, s.id), ` ${s.name || ""} (${s.plan}, ${s.status})`)),
      siblings.more ? el("li", { class: "muted" }, `and ${siblings.more} more`) : "")
      : el("p", { class: "muted" }, record && record.customer ? "None." : "The key has no customer."),
    el("h2", { text: "History" }),
    historyTable(keyPage.history.value),
  ];
}

function ownLimits(record) {
  const own = record && record.limits ? Object.entries(record.limits) : [];
  const first = record ? [["minute", record.per_minute], ["day", record.per_day]].filter(([, n]) => n) : [];
  const all = [...first, ...own];
  return all.length ? all.map(([w, n]) => `${w}: ${n}`).join(", ") : "the plan's";
}

function historyTable(history) {
  if (history.error) return el("p", { class: "error" }, "The history cannot be read: " + history.error);
  const entries = history.entries || [];
  if (!entries.length) return el("p", { class: "muted" }, "No change of this key among the recent ones kept (the fleet's last 10,000 with keys_source = \"store\", else this node's audit_log).");
  return el("div", { class: "table-wrap" }, el("table", { id: "history" },
    el("thead", {}, el("tr", {}, ["When", "Change", "By"].map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, entries.map((e) => el("tr", {},
      el("td", {}, whenText(e.time)), el("td", {}, e.action || ""), el("td", {}, e.who || ""))))));
}

async function bansPage() {
  const b = await api("GET", "/bans");
  const bans = b.bans || [];
  return [el("h2", { text: "Bans" }),
    bans.length ? el("div", { class: "table-wrap" }, el("table", {},
      el("thead", {}, el("tr", {}, ["Key", "Plan", "Until", ""].map((h) => el("th", { scope: "col" }, h)))),
      el("tbody", {}, bans.map((x) => el("tr", {},
        el("td", {}, el("a", { href: "#/keys/" + encodeURIComponent(x.key_id) }, x.key_id)),
        el("td", {}, x.plan), el("td", {}, when(x.until)),
        el("td", {}, el("button", { type: "button", onclick: () => lift(x.key_id) }, "Lift ban " + x.key_id)))))))
      : el("p", { class: "muted" }, "No key is banned.")];
}

async function lift(id) {
  if (!confirm(`Lift the ban of key ${id}?`)) return;
  const failed = await guarded(async () => {
    await api("POST", `/bans/${encodeURIComponent(id)}/lift`, {});
    say("Ban lifted: " + id);
    await route();
  });
  if (failed) say(failed[1].textContent);
}

async function topPage(params) {
  const window = params.get("window") === "month" ? "month" : "day";
  const t = await api("GET", `/usage/top?window=${window}&limit=20`);
  const entries = t.entries || [];
  return [el("h2", { text: "Top consumers" }),
    el("p", {}, el("a", { href: "#/top?window=day", "aria-current": window === "day" ? "true" : null }, "Today"), " · ",
      el("a", { href: "#/top?window=month", "aria-current": window === "month" ? "true" : null }, "This month"),
      el("span", { class: "muted" }, " (UTC calendar periods)")),
    entries.length ? el("div", { class: "table-wrap" }, el("table", {},
      el("thead", {}, el("tr", {}, ["#", "Holder", "Plan", "Used", "Limit"].map((h) => el("th", { scope: "col" }, h)))),
      el("tbody", {}, entries.map((e, i) => el("tr", {},
        el("td", {}, String(i + 1)),
        el("td", {}, e.key_id ? el("a", { href: "#/keys/" + encodeURIComponent(e.key_id) }, e.key_id) : "customer " + e.customer),
        el("td", {}, e.plan || ""), el("td", {}, String(e.used)),
        el("td", {}, e.limit === null || e.limit === undefined ? "" : String(e.limit)))))))
      : el("p", { class: "muted" }, "Nothing spent yet in this period.")];
}

async function plansPage() {
  const plans = await api("GET", "/plans");
  return [el("h2", { text: "Plans" }), el("p", { class: "muted" }, "Plans are files edited by hand; this page only shows them."),
    plans.map((p) => el("section", { class: "card", "aria-label": "Plan " + p.name },
      el("h3", {}, p.name),
      el("ul", {}, p.windows.map((w) => el("li", {}, `${w.name}: ${w.limit}${w.shadow ? " (shadow)" : ""}`))),
      p.concurrency ? el("p", {}, `At once: ${p.concurrency} in flight`) : "",
      p.priority ? el("p", {}, `Priority: ${p.priority > 0 ? "+" : ""}${p.priority}`) : "",
      Object.keys(p.costs).length ? el("p", {}, "Costs: " + Object.entries(p.costs).map(([o, c]) => `${o} ${c}`).join(", ")) : "",
      p.notify_at.length ? el("p", {}, "Notify at: " + p.notify_at.map((n) => n + " %").join(", ")) : ""))];
}

// ---- routing -------------------------------------------------------------------------------

const PAGES = [
  [/^#\/overview$/, (m, p, first) => overviewPage(), "overview", true],
  [/^#\/keys\/(.+)$/, (m, p, first) => keyPage(decodeURIComponent(m[1]), p, first), "keys", true],
  [/^#\/keys$/, (m, p) => keysPage(p), "keys", true],
  [/^#\/bans$/, () => bansPage(), "bans", true],
  [/^#\/top$/, (m, p) => topPage(p), "top", true],
  [/^#\/plans$/, () => plansPage(), "plans", false],
];

function stopRefresh() {
  if (timer) clearTimeout(timer);
  timer = null;
}

/** Whether the operator is at work inside the page (typing, or on a control): a refresh now
 * would take the focus away. */
function busy() {
  const main = document.getElementById("main");
  const a = document.activeElement;
  return a && a !== main && main.contains(a);
}

async function route() {
  stopRefresh();
  const gen = ++routeGen;
  const [path, query] = (location.hash || "#/overview").split("?");
  const params = new URLSearchParams(query || "");
  const found = PAGES.find(([re]) => re.test(path));
  if (!found) { location.hash = "#/overview"; return; }
  const [re, render, nav, live] = found;
  for (const a of document.querySelectorAll("nav a")) {
    if (a.id === "nav-" + nav) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  document.getElementById("login").hidden = true;
  document.getElementById("main").hidden = false;
  document.getElementById("logout").hidden = !sessionStorage.getItem(TOKEN);
  document.title = `${nav[0].toUpperCase()}${nav.slice(1)} · pet-gateway console`;
  const draw = async (first) => {
    const nodes = await guarded(() => render(path.match(re), params, first));
    if (gen !== routeGen) return false; // the operator has moved on
    if (nodes) show(...nodes);
    return nodes !== null;
  };
  if (!(await draw(true)) || !live) return;
  // The next refresh is planned when this one has finished: slow answers never pile up.
  const again = async () => {
    if (gen !== routeGen) return;
    if (!busy() && !(await draw(false))) return;
    if (gen === routeGen) timer = setTimeout(again, REFRESH_MS);
  };
  timer = setTimeout(again, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("login-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN, document.getElementById("token").value);
    document.getElementById("token").value = "";
    await route();
  });
  document.getElementById("logout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN);
    routeGen += 1;
    document.getElementById("main").replaceChildren();
    loginPage("");
  });
  // A link to the page the hash already names (the nav's, or "Back to keys" after a key
  // shown once) fires no hashchange: draw the page again.
  document.addEventListener("click", (ev) => {
    const a = ev.target instanceof Element ? ev.target.closest('a[href^="#/"]') : null;
    if (a && location.hash === a.getAttribute("href")) { ev.preventDefault(); route(); }
  });
  window.addEventListener("hashchange", route);
  route();
});
