// The vdstream console: reads the server's API (docs/openapi.json) with the operator's
// bearer token, follows GET /api/v1/events for live figures, and changes the farm only
// through the API, each change after a confirmation that names it. Text from the API is
// put in the page as text (textContent), never as markup.
'use strict';

const TOKEN_KEY = 'vdstream-token';
const HISTORY = 60; // sparkline points: one a second
const CACHE_TYPES = ['ram-overflow', 'device-ram', 'device-disk', 'device-disk-persistent', 'server', 'server-persistent', 'private'];

const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || '',
  farm: null,
  vdisks: [], // VdiskInfo, or {name, error}
  audit: [],
  storeChanges: null,
  history: new Map(), // target id -> [{g, s}]
  rows: new Map(), // target id -> row elements
  tab: 'targets',
  filter: '',
  live: false,
  abort: null, // the AbortController of the live stream's fetch
};

// ---- small helpers ----

const $ = (sel) => document.querySelector(sel);

function el(tag, props, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') e.className = v;
    else if (k === 'text') e.textContent = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else if (k === 'dataset') Object.assign(e.dataset, v);
    else e.setAttribute(k, v === true ? '' : v);
  }
  for (const k of kids.flat()) {
    if (k === null || k === undefined || k === false) continue;
    e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  }
  return e;
}

function bytes(n) {
  if (n === null || n === undefined) return '–';
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${u[i]}`;
}

function rate(n) {
  if (n === null || n === undefined) return '–';
  const v = Number(n);
  if (v >= 100000) return `${(v / 1000).toFixed(0)}k`;
  if (v >= 10000) return `${(v / 1000).toFixed(1)}k`;
  return v.toFixed(0);
}

function ago(ms) {
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

function when(text) {
  if (!text) return '';
  const d = new Date(text);
  return Number.isNaN(d.getTime()) ? text : d.toLocaleString();
}

// Replaces the children of `e` with `kids`, leaving out null, undefined and false.
function put(e, ...kids) {
  e.replaceChildren(...kids.flat().filter((k) => k !== null && k !== undefined && k !== false));
}

// An NBD endpoint as a person reads it: host:port, or the socket's file name.
function endpointText(uri) {
  const m = /^nbds?\+unix:\/\/\/([^?]*)\?socket=(.*)$/.exec(uri || '');
  if (m) return `unix ${m[2].split('/').pop()}`;
  const t = /^nbds?:\/\/([^/]+)/.exec(uri || '');
  return t ? t[1] : uri || '';
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---- the API ----

class ApiError extends Error {
  constructor(status, error, whatToDo) {
    super(error);
    this.status = status;
    this.whatToDo = whatToDo || '';
  }
}

function headers(extra) {
  const h = { Accept: 'application/json', ...extra };
  if (state.token) h.Authorization = `Bearer ${state.token}`;
  return h;
}

async function api(method, path, body) {
  let r;
  try {
    r = await fetch(path, {
      method,
      headers: headers(body === undefined ? {} : { 'Content-Type': 'application/json' }),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    throw new ApiError(0, `the server did not answer ${method} ${path}: ${e.message}`, 'check that vdstream server is running and reachable');
  }
  const text = await r.text();
  let doc = null;
  try { doc = text ? JSON.parse(text) : null; } catch (_) { doc = null; }
  if (!r.ok) {
    const err = new ApiError(r.status, (doc && doc.error) || `HTTP ${r.status} from ${method} ${path}`, doc && doc.what_to_do);
    if (r.status === 401) askToken(err.message);
    throw err;
  }
  return doc;
}

function showError(e, prefix) {
  const b = $('#banner');
  b.classList.remove('info');
  $('#banner-error').textContent = prefix ? `${prefix}: ${e.message}` : e.message;
  $('#banner-what').textContent = e.whatToDo || '';
  b.hidden = false;
}

function showInfo(text) {
  const b = $('#banner');
  b.classList.add('info');
  $('#banner-error').textContent = text;
  $('#banner-what').textContent = '';
  b.hidden = false;
}

// ---- the token ----

let tokenWaiters = [];
let tokenPromise = null; // one promise for every wait until the next change

function askToken(why) {
  const d = $('#login');
  $('#login-why').textContent = why || '';
  $('#login-token').value = state.token;
  if (!d.open) d.showModal();
}

function setToken(t) {
  state.token = t;
  if (t) sessionStorage.setItem(TOKEN_KEY, t); else sessionStorage.removeItem(TOKEN_KEY);
  // The live stream follows with the new token from its next connection: start it anew.
  if (state.abort) state.abort.abort();
  const w = tokenWaiters;
  tokenWaiters = [];
  tokenPromise = null;
  w.forEach((f) => f());
}

const tokenChanged = () => tokenPromise || (tokenPromise = new Promise((r) => tokenWaiters.push(r)));

// ---- live updates: GET /api/v1/events (server-sent events, read with fetch so that the
// token can go in the Authorization field) ----

function setLive(on, text) {
  state.live = on;
  const p = $('#live');
  p.className = on ? 'pill on' : 'pill off';
  p.textContent = text || (on ? 'live' : 'offline');
}

async function follow() {
  for (;;) {
    let r;
    try {
      state.abort = new AbortController();
      r = await fetch('/api/v1/events', { headers: headers({ Accept: 'text/event-stream' }), signal: state.abort.signal });
    } catch (e) {
      setLive(false, 'server unreachable');
      await sleep(2000);
      continue;
    }
    if (r.status === 401) {
      setLive(false, 'needs a token');
      askToken('this server needs a bearer token to show the farm');
      await tokenChanged();
      continue;
    }
    if (!r.ok) {
      const doc = await r.json().catch(() => null);
      setLive(false, `offline (${r.status})`);
      showError(new ApiError(r.status, (doc && doc.error) || `HTTP ${r.status}`, doc && doc.what_to_do), 'live updates');
      await Promise.race([sleep(5000), tokenChanged()]);
      continue;
    }
    setLive(true);
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = '';
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value.replace(/\r\n?/g, '\n');
        let i;
        while ((i = buf.indexOf('\n\n')) >= 0) {
          const chunk = buf.slice(0, i);
          buf = buf.slice(i + 2);
          onEvent(chunk);
        }
      }
    } catch (_) { /* the connection broke: start again */ }
    setLive(false, 'reconnecting…');
    await sleep(1000);
  }
}

function onEvent(chunk) {
  let event = 'message';
  const data = [];
  for (const line of chunk.split('\n')) {
    if (line.startsWith('event:')) event = line.slice(6).trim();
    else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
  }
  if (event !== 'farm' || data.length === 0) return;
  let doc;
  try { doc = JSON.parse(data.join('\n')); } catch (_) { return; }
  onFarm(doc);
}

function sessionsByTarget(farm) {
  const m = new Map();
  for (const s of farm.sessions || []) {
    if (!s.target) continue;
    const list = m.get(s.target) || [];
    list.push(s);
    m.set(s.target, list);
  }
  return m;
}

// The figures of a target: from its agent's report, else from its sessions here.
function figures(t, sessions) {
  const a = t.agent;
  const ss = sessions.get(t.id) || [];
  if (a) {
    const c = a.cache || {};
    return {
      state: a.state || 'running',
      server: (a.server && a.server.endpoint) || '',
      connected: a.server ? a.server.connected : null,
      guest: a.guest ? a.guest.iops : 0,
      storage: a.storage ? a.storage.iops : 0,
      ram: c.ram_bytes || 0,
      overflow: c.file_bytes || 0,
      capacity: c.capacity_bytes || c.limit_bytes || 0,
      cacheType: c.type || t.cache,
      retries: a.server ? a.server.retries || 0 : 0,
      failovers: a.server ? a.server.failovers || 0 : 0,
      reconnects: a.server ? a.server.reconnects || 0 : 0,
      lost: a.server && a.server.lost,
      pid: a.pid,
      reported: a.received_unix_ms || a.updated_unix_ms,
      export: a.vdisk && (a.vdisk.description || a.vdisk.export),
      running: a.vdisk ? runningOf(a.vdisk.description || a.vdisk.export || '') : null,
      migration: a.migration || null,
    };
  }
  if (ss.length) {
    const s = ss[0];
    const c = s.cache || {};
    return {
      state: 'session',
      server: s.server,
      connected: true,
      guest: ss.reduce((n, x) => n + ((x.guest && x.guest.iops) || 0), 0),
      storage: ss.reduce((n, x) => n + ((x.store && x.store.iops) || 0), 0),
      ram: c.used_bytes || 0,
      overflow: 0,
      capacity: c.capacity_bytes || c.limit_bytes || 0,
      cacheType: c.type || t.cache,
      retries: 0,
      failovers: 0,
      reconnects: s.reconnects || 0,
      export: `${s.export} @ version ${s.version}`,
      running: typeof s.version === 'number' ? (s.version === 0 ? 'base' : `version ${s.version}`) : null,
    };
  }
  return null;
}

function onFarm(doc) {
  state.farm = doc;
  if (doc.targets_error) showError(new ApiError(500, doc.targets_error, 'see the server\'s log; `vdstream target list` names the damaged record'), 'reading the targets');
  const sessions = sessionsByTarget(doc);
  const seen = new Set();
  for (const t of doc.targets || []) {
    seen.add(t.id);
    const f = figures(t, sessions);
    const h = state.history.get(t.id) || [];
    h.push({ g: f ? f.guest : 0, s: f ? f.storage : 0 });
    while (h.length > HISTORY) h.shift();
    state.history.set(t.id, h);
  }
  for (const id of [...state.history.keys()]) if (!seen.has(id)) state.history.delete(id);
  if (doc.store_changes !== state.storeChanges) {
    state.storeChanges = doc.store_changes;
    loadStore();
  }
  render();
}

// ---- the store's documents (re-read when the store changes) ----

let loading = null;

async function loadStore() {
  if (loading) { loading.again = true; return; }
  loading = { again: false };
  try {
    const list = await api('GET', '/api/v1/vdisks');
    const infos = await Promise.all(list.map((v) => (v.error ? v : api('GET', `/api/v1/vdisks/${encodeURIComponent(v.name)}`).catch((e) => ({ name: v.name, error: e.message })))));
    state.vdisks = infos;
    renderVdisks();
    try {
      state.audit = await api('GET', '/api/v1/audit?limit=200');
      renderAudit();
    } catch (e) {
      if (e.status !== 401) showError(e, 'reading the audit trail');
    }
  } catch (e) {
    if (e.status !== 401) showError(e, 'reading the store');
  } finally {
    const again = loading.again;
    loading = null;
    if (again) loadStore();
  }
}

// ---- rendering ----

function render() {
  const f = state.farm;
  if (!f) return;
  const s = f.server || {};
  $('#server-name').textContent = `${s.name || ''} · vdstream ${s.version || ''}${s.draining ? ' · draining' : ''}`;
  const sessions = sessionsByTarget(f);
  let g = 0;
  let st = 0;
  for (const t of f.targets || []) {
    const x = figures(t, sessions);
    if (x) { g += x.guest || 0; st += x.storage || 0; }
  }
  $('#sum-guest').textContent = rate(g);
  $('#sum-storage').textContent = rate(st);
  const rc = s.read_cache || {};
  $('#sum-hit').textContent = rc.hit_ratio === null || rc.hit_ratio === undefined ? '–' : `${(rc.hit_ratio * 100).toFixed(1)} %`;
  $('#sum-hit-sub').textContent = `${bytes(rc.used_bytes)} of ${bytes(rc.capacity_bytes)} · ${rc.hits || 0} hits, ${rc.misses || 0} misses`;
  $('#sum-sessions').textContent = String(s.sessions ?? (f.sessions || []).length);
  // Boot pacing (--boot): machines in their boot window against --max-booting, and those waiting.
  const b = s.boot;
  const pacing = b ? ` · booting ${b.booting} of ${b.max_booting || 'no limit'}${b.waiting ? `, ${b.waiting} waiting` : ''}` : '';
  // Rebalancing: this server's targets against its share of the farm, and what it moved away.
  const bal = s.balance;
  const share = bal && bal.servers > 1
    ? ` · ${bal.targets} targets, share ${Number(bal.share).toFixed(1)} of ${bal.servers} servers, ${bal.moved_out} moved out${bal.drained ? ' · drained' : ''}`
    : '';
  $('#sum-server').textContent = (s.store ? `store ${s.store}` : '') + pacing + share;
  $('#count-targets').textContent = String((f.targets || []).length);
  $('#count-sessions').textContent = String((f.sessions || []).length);
  renderTargets(sessions);
  renderSessions();
}

function sparkline(h) {
  const w = 110;
  const ht = 26;
  const max = Math.max(1, ...h.map((p) => Math.max(p.g, p.s)));
  const pts = (key) => h.map((p, i) => `${((i + HISTORY - h.length) * w) / (HISTORY - 1)},${(ht - 2 - ((p[key] / max) * (ht - 4))).toFixed(1)}`).join(' ');
  const ns = 'http://www.w3.org/2000/svg';
  const svg = document.createElementNS(ns, 'svg');
  svg.setAttribute('class', 'spark');
  svg.setAttribute('viewBox', `0 0 ${w} ${ht}`);
  svg.setAttribute('preserveAspectRatio', 'none');
  svg.setAttribute('aria-hidden', 'true');
  for (const key of ['s', 'g']) {
    const l = document.createElementNS(ns, 'polyline');
    l.setAttribute('class', key);
    l.setAttribute('points', h.length > 1 ? pts(key) : '');
    svg.append(l);
  }
  return svg;
}

function versionText(v) {
  return typeof v === 'number' ? `version ${v}` : String(v);
}

// The version an agent reads, from its export's description ("... vdisk/NAME@3 (...)"):
// "version 3" or "base"; null when the description names none.
function runningOf(description) {
  const m = /vdisk\/[^@\s]+@(base|[0-9]+)\b/.exec(description);
  if (!m) return null;
  return m[1] === 'base' ? 'base' : `version ${m[1]}`;
}

// What the target's record selects now ("version 2", "base"), from its vDisk's stages;
// null when that is not known here (the vDisk not loaded, `latest`).
function selectedNow(t) {
  if (typeof t.version === 'number') return `version ${t.version}`;
  if (t.version === 'base') return 'base';
  const info = findVdisk(t.vdisk);
  if (!info) return null;
  if (t.version === 'production') return layerName(info.production);
  if (t.version === 'test') return layerName(info.test);
  return null;
}

function targetMatches(t, q) {
  if (!q) return true;
  const hay = [t.id, t.vdisk, t.cache, t.description, ...(t.macs || []), t.hostname].filter(Boolean).join(' ').toLowerCase();
  return hay.includes(q);
}

function makeRow(id) {
  const cells = {};
  const tr = el('tr', { dataset: { target: id } });
  for (const [key, label] of [['target', 'Target'], ['state', 'State'], ['vdisk', 'vDisk'], ['cache', 'Cache'], ['retries', 'Retries · failovers'], ['iops', 'IOPS'], ['boot', 'Boot']]) {
    cells[key] = el('td', { class: `c-${key}`, 'data-label': label });
    tr.append(cells[key]);
  }
  cells.actions = el('td', { class: 'row-actions' },
    el('button', { type: 'button', class: 'small', text: 'Edit', onclick: () => editTarget(id) }),
    el('button', { type: 'button', class: 'small', text: 'Remove', onclick: () => removeTarget(id) }));
  tr.append(cells.actions);
  return { tr, cells };
}

function renderTargets(sessions) {
  const f = state.farm;
  const q = state.filter.trim().toLowerCase();
  const tbody = $('#targets tbody');
  const targets = (f.targets || []).filter((t) => targetMatches(t, q));
  const keep = new Set(targets.map((t) => t.id));
  for (const [id, row] of state.rows) {
    if (!keep.has(id)) { row.tr.remove(); state.rows.delete(id); }
  }
  let prev = null;
  for (const t of targets) {
    let row = state.rows.get(t.id);
    if (!row) { row = makeRow(t.id); state.rows.set(t.id, row); }
    fillRow(row.cells, t, figures(t, sessions));
    const want = prev ? prev.nextSibling : tbody.firstChild;
    if (want !== row.tr) tbody.insertBefore(row.tr, want);
    prev = row.tr;
  }
  $('#targets-empty').hidden = (f.targets || []).length > 0;
}

// (Through the CSSOM: the page's CSP allows no style attributes.)
function widthOf(e, pct) {
  e.style.width = `${pct.toFixed(1)}%`;
  return e;
}

// A live migration as its agent reports it: which way, its phase, and what moved.
function migrationText(m) {
  const way = m.role === 'source' ? 'out' : 'in';
  const ended = ['done', 'cancelled', 'failed', 'reverted'].includes(m.phase);
  const head = m.phase === 'done' ? `migrated ${way}` : ended ? `migration ${m.phase}` : `migrating ${way}: ${m.phase}`;
  const parts = [`${m.rounds || 0} rounds`, `${bytes(m.data_bytes || 0)} moved`];
  if (m.qemu_downtime_ms !== undefined && m.qemu_downtime_ms !== null) parts.push(`downtime ${m.qemu_downtime_ms} ms`);
  if (m.fenced_ms) parts.push(`fenced ${m.fenced_ms} ms`);
  if (ended && m.finished_unix_ms) parts.push(ago(m.finished_unix_ms));
  return `${head} · ${parts.join(' · ')}`;
}

function fillRow(c, t, x) {
  put(c.target,
    el('div', { class: 'id', text: t.id }),
    t.description ? el('div', { class: 'sub2', text: t.description }) : null,
  );
  const stateName = x ? (x.lost ? 'lost' : x.state) : 'offline';
  const cls = x ? (x.lost || x.state === 'cache lost' ? 'lost' : x.connected === false ? 'failing' : x.state === 'session' ? 'session' : x.state === 'running' ? 'running' : '') : '';
  put(c.state,
    el('span', { class: `state ${cls}`, text: x && x.connected === false && !x.lost ? `${stateName}, reconnecting` : stateName }),
    x && x.server ? el('div', { class: 'sub2', text: endpointText(x.server), title: x.server }) : null,
    x && x.migration ? el('div', { class: `migration ${x.migration.phase}`, text: migrationText(x.migration), title: x.migration.error || `the other agent: ${x.migration.peer}` }) : null,
  );
  // The version the target runs (its agent's report or its session), beside what its record
  // selects; one that runs behind (a promote since it booted) is marked.
  const running = x && x.running;
  const selected = selectedNow(t);
  const behind = running && selected && running !== selected;
  put(c.vdisk,
    el('div', { text: t.vdisk }),
    el('div', { class: 'sub2 running', text: running ? `runs ${running} (${versionText(t.version)})` : versionText(t.version), title: x && x.export ? x.export : null }),
    behind ? el('div', { class: 'behind', text: `behind: ${versionText(t.version)} is ${selected} now; its next boot picks it up` }) : null,
  );
  if (x && x.capacity) {
    const ramPct = Math.min(100, (x.ram / x.capacity) * 100);
    const ovfPct = Math.min(100 - ramPct, (x.overflow / x.capacity) * 100);
    put(c.cache,
      el('div', { class: 'sub2', text: x.cacheType }),
      el('div', { class: 'bar', role: 'img', 'aria-label': `cache ${bytes(x.ram + x.overflow)} of ${bytes(x.capacity)}` },
        widthOf(el('div', { class: 'ram' }), ramPct),
        widthOf(el('div', { class: 'ovf' }), ovfPct)),
      el('div', { class: 'bar-legend', text: `${bytes(x.ram + x.overflow)} of ${bytes(x.capacity)}${x.overflow ? ` · overflow ${bytes(x.overflow)}` : ''}` }),
    );
  } else {
    put(c.cache, el('div', { text: t.cache }), el('div', { class: 'sub2', text: x ? 'no figures' : 'not attached' }));
  }
  put(c.retries,
    el('span', { class: 'num', text: x ? `${x.retries} · ${x.failovers}` : '–' }),
    x && x.reconnects ? el('div', { class: 'sub2', text: `${x.reconnects} reconnects` }) : null,
  );
  put(c.iops, el('div', { class: 'iops' },
    el('div', { class: 'nums' }, el('span', { class: 'g', text: x ? rate(x.guest) : '–' }), ' / ', el('span', { class: 's', text: x ? rate(x.storage) : '–' })),
    sparkline(state.history.get(t.id) || [])));
  const boot = [];
  for (const m of t.macs || []) boot.push(el('div', { class: 'mac', text: m }));
  if (t.boot) boot.push(el('div', { class: 'sub2', text: `script sent ${ago(t.boot.at_unix_ms)}`, title: t.boot.what }));
  else if ((t.macs || []).length) boot.push(el('div', { class: 'sub2', text: 'not booted since the server started' }));
  if (!boot.length) boot.push(el('span', { class: 'sub2', text: 'local attach' }));
  put(c.boot, ...boot);
}

function renderSessions() {
  const tbody = $('#sessions tbody');
  const list = state.farm.sessions || [];
  put(tbody, ...list.map((s) => el('tr', {},
    el('td', { class: 'num', text: String(s.id) }),
    el('td', { text: s.export }),
    el('td', { class: 'sub2', text: s.peer }),
    el('td', { text: s.target || '–' }),
    el('td', { text: `${s.vdisk} @ ${s.version === 0 ? 'base' : `v${s.version}`}` }),
    el('td', { text: (s.cache && s.cache.type) || '–' }),
    el('td', { class: 'num', text: rate(s.guest && s.guest.iops) }),
    el('td', { class: 'num', text: rate(s.store && s.store.iops) }),
    el('td', { class: 'sub2', text: ago(s.connected_unix_ms) }))));
  $('#sessions-empty').hidden = list.length > 0;
}

function layerName(l) {
  return l === 'base' ? 'base' : l && typeof l === 'object' && 'version' in l ? `version ${l.version}` : String(l);
}

function renderVdisks() {
  const box = $('#vdisks');
  $('#count-vdisks').textContent = String(state.vdisks.length);
  $('#vdisks-empty').hidden = state.vdisks.length > 0;
  put(box, ...state.vdisks.map((info) => {
    if (info.error) {
      return el('div', { class: 'vdisk' }, el('div', { class: 'vdisk-head' }, el('h3', { text: info.name })), el('p', { class: 'dialog-error', text: info.error }));
    }
    const m = info.meta;
    const sizes = new Map((info.layers || []).map((l) => [layerName(l.layer), l]));
    const prodName = layerName(info.production);
    const testName = layerName(info.test);
    const serves = (name) => [name === prodName ? 'production' : null, name === testName ? 'test' : null].filter(Boolean);
    const base = sizes.get('base');
    const chain = [el('div', { class: 'layer', dataset: { layer: 'base' } },
      el('div', { class: 'name' }, 'base', el('span', { class: 'access base', text: 'base' })),
      el('div', { class: 'meta', text: `${bytes(base && base.allocated)} · ${when(m.base.created)}` }),
      serves('base').length ? el('div', { class: 'serves', text: `serves ${serves('base').join(' and ')}` }) : null)];
    let parent = 'base';
    for (const v of m.versions) {
      const name = `version ${v.number}`;
      const l = sizes.get(name);
      const sched = v.scheduled_at ? `scheduled for ${when(v.scheduled_at)}` : null;
      const buttons = [];
      if (v.access !== 'production' || v.scheduled_at) buttons.push(el('button', { type: 'button', class: 'small', text: 'Promote…', onclick: () => promote(m.name, v) }));
      chain.push(el('div', { class: 'layer', dataset: { layer: String(v.number) } },
        el('div', { class: 'name' }, `v${v.number}`, el('span', { class: `access ${v.access}`, text: v.access })),
        el('div', { class: 'meta', text: `${bytes(l && l.allocated)} · parent ${parent}` }),
        v.note ? el('div', { class: 'meta', text: v.note }) : null,
        sched ? el('div', { class: 'meta', text: sched }) : null,
        serves(name).length ? el('div', { class: 'serves', text: `serves ${serves(name).join(' and ')}` }) : null,
        buttons.length ? el('div', { class: 'buttons' }, buttons) : null));
      parent = `v${v.number}`;
    }
    return el('div', { class: 'vdisk', dataset: { vdisk: m.name } },
      el('div', { class: 'vdisk-head' },
        el('h3', { text: m.name }),
        el('span', { class: 'sub2', text: `${bytes(m.size)} · ${m.access} access · keeps ${m.max_versions} versions${m.override_version ? ` · production pinned to v${m.override_version}` : ''}` }),
        el('span', { class: 'spacer' }),
        el('div', { class: 'buttons' },
          el('button', { type: 'button', class: 'small', text: 'New version', onclick: () => newVersion(m.name) }),
          el('button', { type: 'button', class: 'small', text: 'Revert…', onclick: () => revert(m) }),
          el('button', { type: 'button', class: 'small', text: 'Merge…', onclick: () => merge(m) }))),
      el('div', { class: 'chain' }, chain));
  }));
}

// An audit entry's details as `key value` pairs, leaving out the empty ones.
function detailsText(d) {
  if (!d || typeof d !== 'object') return d === null || d === undefined ? '' : String(d);
  return Object.entries(d)
    .filter(([, v]) => v !== null && v !== undefined && !(Array.isArray(v) && v.length === 0))
    .map(([k, v]) => `${k} ${typeof v === 'object' ? (v.from !== undefined && v.to !== undefined ? `${v.from} → ${v.to}` : JSON.stringify(v)) : v}`)
    .join(' · ');
}

function renderAudit() {
  const tbody = $('#audit tbody');
  put(tbody, ...state.audit.slice().reverse().map((e) => el('tr', {},
    el('td', { class: 'sub2', text: when(e.time) }),
    el('td', { text: e.client ? `${e.client}` : `${e.user}@${e.host}` }),
    el('td', { text: e.action }),
    el('td', { text: e.vdisk || '–' }),
    el('td', { class: 'sub2', text: detailsText(e.details) }))));
}

// ---- actions: each asks first, naming what will change; a refusal shows the API's error
// and changes nothing (the server refuses before it changes anything) ----

let confirmRun = null;

function confirmAction({ title, fields, describe, ok, danger, run }) {
  const d = $('#confirm');
  $('#confirm-title').textContent = title;
  $('#confirm-fields').replaceChildren(...(fields || []));
  $('#confirm-error').hidden = true;
  const okButton = $('#confirm-ok');
  okButton.textContent = ok;
  okButton.className = danger ? 'danger' : 'primary';
  okButton.disabled = false;
  const update = () => { $('#confirm-text').textContent = describe(); };
  for (const f of fields || []) f.addEventListener('input', update);
  update();
  confirmRun = run;
  d.showModal();
}

async function confirmed() {
  const run = confirmRun;
  if (!run) return;
  const okButton = $('#confirm-ok');
  okButton.disabled = true;
  try {
    const said = await run();
    confirmRun = null;
    $('#confirm').close();
    if (said) showInfo(said);
    loadStore();
  } catch (e) {
    const box = $('#confirm-error');
    box.textContent = `${e.message}${e.whatToDo ? ` — ${e.whatToDo}` : ''}`;
    box.hidden = false;
    showError(e, 'refused, nothing was changed');
    okButton.disabled = false;
  }
}

function field(label, input) {
  return el('label', {}, label, input);
}

function findVdisk(name) {
  return state.vdisks.find((v) => v.meta && v.meta.name === name);
}

function newVersion(name) {
  const note = el('input', { type: 'text', name: 'note', placeholder: 'what this version is for (optional)' });
  confirmAction({
    title: `New version of ${name}`,
    fields: [field('Note', note)],
    describe: () => `A new maintenance version of ${name} will be made on top of its newest version${note.value ? ` ("${note.value}")` : ''}. Only a maintenance target sees it until it is promoted.`,
    ok: 'Make version',
    run: async () => {
      const doc = await api('POST', `/api/v1/vdisks/${encodeURIComponent(name)}/versions`, note.value ? { note: note.value } : {});
      return `${name}: version ${doc.version} made (maintenance)`;
    },
  });
}

function localToRfc3339(v) {
  const d = new Date(v);
  return Number.isNaN(d.getTime()) ? null : d.toISOString().replace(/\.\d{3}Z$/, 'Z');
}

function promote(name, v) {
  const to = el('select', { name: 'to' }, el('option', { value: 'test', text: 'test' }), el('option', { value: 'production', text: 'production' }));
  if (v.access === 'test') to.value = 'production';
  const at = el('input', { type: 'datetime-local', name: 'at' });
  // A release is scheduled to production only (as `version promote --at`).
  const onlyProduction = () => { at.disabled = to.value !== 'production'; if (at.disabled) at.value = ''; };
  to.addEventListener('input', onlyProduction);
  onlyProduction();
  confirmAction({
    title: `Promote version ${v.number} of ${name}`,
    fields: [field('To', to), field('At, for production (optional: leave empty for now)', at)],
    describe: () => {
      const t = at.value ? localToRfc3339(at.value) : null;
      return `Version ${v.number} of ${name} goes from ${v.access} to ${to.value}${t ? ` at ${new Date(t).toLocaleString()} (${t})` : ' now'}. ${to.value === 'production' ? 'Production targets boot it from their next connection.' : 'Test targets boot it from their next connection.'}`;
    },
    ok: 'Promote',
    run: async () => {
      const body = { to: to.value };
      if (at.value) {
        const t = localToRfc3339(at.value);
        if (!t) throw new ApiError(400, `${at.value} is not a time`, 'pick a date and time, or leave the field empty');
        body.at = t;
      }
      await api('POST', `/api/v1/vdisks/${encodeURIComponent(name)}/versions/${v.number}/promote`, body);
      return `${name}: version ${v.number} promoted to ${to.value}${body.at ? ` for ${body.at}` : ''}`;
    },
  });
}

function revert(m) {
  const choices = m.versions.filter((v) => v.access !== 'maintenance');
  const pick = el('select', { name: 'version' }, ...m.versions.map((v) => el('option', { value: String(v.number), text: `version ${v.number} (${v.access})` })));
  if (choices.length) pick.value = String(choices[choices.length - 1].number);
  confirmAction({
    title: `Revert a version of ${m.name}`,
    fields: [field('Version', pick)],
    describe: () => {
      const v = m.versions.find((x) => String(x.number) === pick.value);
      if (!v) return 'This vDisk has no versions to revert.';
      return `Version ${v.number} of ${m.name} steps back from ${v.access}: production goes back to test, test to maintenance (if no other version is in maintenance). Targets boot what it leaves from their next connection.`;
    },
    ok: 'Revert',
    danger: true,
    run: async () => {
      const doc = await api('POST', `/api/v1/vdisks/${encodeURIComponent(m.name)}/revert`, { version: Number(pick.value) });
      return `${m.name}: version ${pick.value} reverted (${typeof doc.result === 'string' ? doc.result : JSON.stringify(doc.result)})`;
    },
  });
}

function merge(m) {
  const kind = el('select', { name: 'kind' }, el('option', { value: 'updates', text: 'the versions into one version' }), el('option', { value: 'base', text: 'the base too, into a new base' }));
  confirmAction({
    title: `Merge ${m.name}`,
    fields: [field('Merge', kind)],
    describe: () => `The chain of ${m.name} up to the version production boots is merged into ${kind.value === 'base' ? 'one new base file' : 'one version on the base'}. What targets read does not change; the merged files are retired.`,
    ok: 'Merge',
    run: async () => {
      const doc = await api('POST', `/api/v1/vdisks/${encodeURIComponent(m.name)}/merge`, { base: kind.value === 'base' });
      const merged = doc.merge && doc.merge.merged ? doc.merge.merged.join(', ') : '';
      return `${m.name}: merged ${merged ? `versions ${merged}` : ''} into ${doc.merge ? doc.merge.file : 'a new layer'}`;
    },
  });
}

function targetFields(t) {
  const names = state.vdisks.filter((v) => v.meta).map((v) => v.meta.name);
  const f = {
    id: el('input', { type: 'text', name: 'id', placeholder: 'e.g. pc-07', value: t ? t.id : '', disabled: !!t }),
    vdisk: el('select', { name: 'vdisk' }, ...names.map((n) => el('option', { value: n, text: n }))),
    version: el('input', { type: 'text', name: 'version', value: t ? String(t.version) : 'production', placeholder: 'production, test, latest, base or a number' }),
    cache: el('select', { name: 'cache' }, ...CACHE_TYPES.map((c) => el('option', { value: c, text: c }))),
    description: el('input', { type: 'text', name: 'description', value: (t && t.description) || '' }),
    macs: el('input', { type: 'text', name: 'macs', value: t ? (t.macs || []).join(' ') : '', placeholder: 'MAC addresses for network boot (optional)' }),
  };
  if (t) {
    // The record's own vDisk stays a choice even when the list has not loaded it.
    if (!names.includes(t.vdisk)) f.vdisk.append(el('option', { value: t.vdisk, text: t.vdisk }));
    f.vdisk.value = t.vdisk;
    f.cache.value = t.cache;
  } else if (names.length) f.vdisk.value = names[0];
  return f;
}

function selector(text) {
  return /^\d+$/.test(text.trim()) ? Number(text.trim()) : text.trim();
}

function addTarget() {
  const f = targetFields(null);
  confirmAction({
    title: 'Add a target',
    fields: [field('Id', f.id), field('vDisk', f.vdisk), field('Version', f.version), field('Cache type', f.cache), field('Description', f.description), field('MACs', f.macs)],
    describe: () => `Target ${f.id.value || '(id)'} will be added: it boots ${f.vdisk.value || '(vDisk)'} (${f.version.value || 'production'}) with a ${f.cache.value} write cache${f.macs.value.trim() ? `, and network-boots by MAC ${f.macs.value.trim().split(/[\s,]+/).join(', ')}` : ''}.`,
    ok: 'Add target',
    run: async () => {
      const body = { id: f.id.value.trim(), vdisk: f.vdisk.value, cache: f.cache.value, version: selector(f.version.value || 'production') };
      if (f.description.value.trim()) body.description = f.description.value.trim();
      const macs = f.macs.value.trim().split(/[\s,]+/).filter(Boolean);
      if (macs.length) body.macs = macs;
      await api('POST', '/api/v1/targets', body);
      return `target ${body.id} added`;
    },
  });
}

function targetById(id) {
  return ((state.farm && state.farm.targets) || []).find((t) => t.id === id);
}

function editTarget(id) {
  const t = targetById(id);
  if (!t) return;
  const f = targetFields(t);
  const change = () => {
    const c = {};
    if (f.vdisk.value && f.vdisk.value !== t.vdisk) c.vdisk = f.vdisk.value;
    if (f.cache.value !== t.cache) c.cache = f.cache.value;
    if (f.version.value.trim() && String(selector(f.version.value)) !== String(t.version)) c.version = selector(f.version.value);
    const desc = f.description.value.trim();
    if (desc !== (t.description || '')) c.description = desc || null;
    const macs = f.macs.value.trim().split(/[\s,]+/).filter(Boolean).map((m) => m.toLowerCase().replace(/-/g, ':'));
    const had = t.macs || [];
    const add = macs.filter((m) => !had.includes(m));
    const remove = had.filter((m) => !macs.includes(m));
    if (add.length) c.add_macs = add;
    if (remove.length) c.remove_macs = remove;
    return c;
  };
  confirmAction({
    title: `Edit target ${id}`,
    fields: [field('vDisk', f.vdisk), field('Version', f.version), field('Cache type', f.cache), field('Description', f.description), field('MACs', f.macs)],
    describe: () => {
      const c = change();
      const said = [];
      if (c.vdisk) said.push(`vDisk ${t.vdisk} → ${c.vdisk}`);
      if (c.version !== undefined) said.push(`version ${t.version} → ${c.version}`);
      if (c.cache) said.push(`cache ${t.cache} → ${c.cache}`);
      if (c.description !== undefined) said.push(`description → ${c.description === null ? '(none)' : `"${c.description}"`}`);
      if (c.add_macs) said.push(`add MAC ${c.add_macs.join(', ')}`);
      if (c.remove_macs) said.push(`remove MAC ${c.remove_macs.join(', ')}`);
      return said.length ? `Target ${id}: ${said.join('; ')}. The target sees the change from its next attach.` : `Nothing changes for target ${id} yet.`;
    },
    ok: 'Save',
    run: async () => {
      const c = change();
      if (!Object.keys(c).length) return null;
      await api('PUT', `/api/v1/targets/${encodeURIComponent(id)}`, c);
      return `target ${id} changed`;
    },
  });
}

function removeTarget(id) {
  const t = targetById(id);
  confirmAction({
    title: `Remove target ${id}`,
    fields: [],
    describe: () => `The record of target ${id}${t ? ` (${t.vdisk}, ${t.cache} cache${(t.macs || []).length ? `, MAC ${t.macs.join(', ')}` : ''})` : ''} will be deleted from the store. A target in use is refused: stop its agent first.`,
    ok: 'Remove',
    danger: true,
    run: async () => {
      await api('DELETE', `/api/v1/targets/${encodeURIComponent(id)}`);
      return `target ${id} removed`;
    },
  });
}

// ---- wiring ----

function switchTab(name) {
  state.tab = name;
  for (const b of document.querySelectorAll('.tabs button')) b.classList.toggle('active', b.dataset.tab === name);
  for (const s of document.querySelectorAll('.tab')) s.hidden = s.id !== `tab-${name}`;
}

document.addEventListener('DOMContentLoaded', () => {
  for (const b of document.querySelectorAll('.tabs button')) b.addEventListener('click', () => switchTab(b.dataset.tab));
  $('#filter').addEventListener('input', (e) => { state.filter = e.target.value; render(); });
  $('#add-target').addEventListener('click', addTarget);
  $('#banner-close').addEventListener('click', () => { $('#banner').hidden = true; });
  $('#confirm-ok').addEventListener('click', confirmed);
  $('#confirm-cancel').addEventListener('click', () => { confirmRun = null; $('#confirm').close(); });
  $('#token-button').addEventListener('click', () => askToken(state.token ? 'this tab sends a token' : 'this tab sends no token'));
  $('#login-ok').addEventListener('click', () => {
    $('#login').close();
    $('#banner').hidden = true;
    setToken($('#login-token').value.trim());
    loadStore();
  });
  $('#login-token').addEventListener('keydown', (e) => { if (e.key === 'Enter') $('#login-ok').click(); });
  $('#login-clear').addEventListener('click', () => { $('#login').close(); setToken(''); });
  const tab = new URLSearchParams(location.search).get('tab');
  if (tab && document.getElementById(`tab-${tab}`)) switchTab(tab);
  follow();
  // Scheduled promotions take effect with time, not with a change: re-read now and then.
  setInterval(() => { if (state.live) loadStore(); }, 30000);
});
