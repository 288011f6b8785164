// The GPU pool page: polls the broker's read-only API (2 s after the last answer, each request cut
// after 10 s) and draws the GPU grid, the jobs, the events and the allocation timeline (plotly.js).
//
// Every value from the API is untrusted: job names, reasons, metrics and event messages come from
// DAG authors, trainers and agents. Values go into the page as text only (textContent and Text
// nodes, never innerHTML), every number is checked with Number.isFinite before it is formatted, and
// text handed to plotly.js is escaped for plotly's own markup (plotlyText). Lookups by a job id use
// Maps, so that an id such as "__proto__" is just a string.
"use strict";

const params = new URLSearchParams(location.search);
let focusJob = params.get("job");
// opened from a task instance (Airflow's "GPU job" tab): the job it submitted, looked up at each
// refresh (a retry's job replaces its try's); an unmapped task's map index may come as a placeholder
const task = ["dag_id", "run_id", "task_id"].every(k => params.get(k)) ? {
  dag_id: params.get("dag_id"), run_id: params.get("run_id"), task_id: params.get("task_id"),
  map_index: /^-?[0-9]+$/.test(params.get("map_index") || "") ? params.get("map_index") : "-1",
} : null;
let poolChosen = params.has("pool");  // else the task's job's pool
// the read-only views' token, if the page was opened with ?token= (the page itself needs it): sent
// with each API call as a header, never in the URL of a call a proxy would log every 2 s
const token = params.get("token");
const POLL_MS = 2000;
const TIMEOUT_MS = 10000;
const palette = ["#3e7bfa", "#f0b429", "#3ebd93", "#e12d39", "#9446ed", "#f7c948", "#2bb0ed", "#ef4e7b",
                 "#8eedc7", "#fa8b3e"];
const colourOf = new Map();
let pool = params.get("pool") || "default";

function colour(jobId) {
  if (!colourOf.has(jobId)) colourOf.set(jobId, palette[colourOf.size % palette.length]);
  return colourOf.get(jobId);
}

// ---------------------------------------------------------------- values from the API
const list = x => (Array.isArray(x) ? x : []);
const isNum = x => typeof x === "number" && Number.isFinite(x);
const text = x => (x === null || x === undefined ? "" : String(x));
const fixed = (x, digits, unit = "") => (isNum(x) ? x.toFixed(digits) + unit : "-");
// the time of day, after the date when it is not today's (an event of a quiet pool days ago)
const fmtTime = t => {
  if (!isNum(t)) return "-";
  const d = new Date(t * 1000);
  const day = d.toDateString() === new Date().toDateString() ? "" : d.toLocaleDateString() + " ";
  return day + d.toLocaleTimeString();
};
// a reason in a line of text (the status line): its start (the API takes 20,000 characters)
const short = s => (text(s).length > 300 ? text(s).slice(0, 300) + "…" : text(s));
// plotly.js reads a little HTML in its labels (<b>, <br>, <a>): show the characters instead
const plotlyText = s => text(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");

function metricText(v) {
  if (typeof v === "string") return v;
  if (typeof v === "number") return isNum(v) ? String(v) : "-";
  return JSON.stringify(v);
}

// An element with a class and children; strings become Text nodes (never parsed as HTML).
function el(tag, className, ...children) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  node.append(...children.map(c => (c instanceof Node ? c : text(c))));
  return node;
}

async function get(path) {
  const url = new URL(path, location.href);  // relative to the page: works under Airflow's /elastic-gpu
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  let r;
  try {
    r = await fetch(url, { credentials: "same-origin", headers, signal: AbortSignal.timeout(TIMEOUT_MS) });
  } catch (err) {
    throw new Error(err && err.name === "TimeoutError"
      ? `${url.pathname}: no answer in ${TIMEOUT_MS / 1000} s` : `${url.pathname}: ${text(err && err.message)}`);
  }
  if (!r.ok) throw new Error(`${url.pathname}: HTTP ${r.status}`);
  return r.json();
}

// ---------------------------------------------------------------- the parts of the page
function renderGrid(snap, names) {
  const rows = list(snap.nodes).map(node => {
    const row = el("div", "node", el("div", "node-name", text(node.name) + (node.schedulable ? "" : " (drained)")));
    for (const g of list(node.gpus)) {
      const holder = g.in_use_by || g.target_of || null;
      // handed over: in use by one job and published to another (or to none), or published to a
      // job whose trainer does not run on it yet
      const moving = Boolean(holder) && g.target_of !== g.in_use_by;
      const out = g.healthy === false;  // out of service (a failing GPU): its job is moved off it
      const cell = el("div", "gpu" + (holder ? "" : " free") + (moving ? " moving" : "") + (out ? " unhealthy" : "")
                      + (holder && holder === focusJob ? " focus" : ""),
                      el("b", null, text(g.gpu)),
                      el("span", null, holder ? label(holder, names) : out ? "out of service" : "free"));
      cell.dataset.job = text(holder);
      if (holder) {
        cell.style.background = colour(holder);
        cell.style.color = "#fff";
      }
      cell.title = `${text(g.gpu)} (${text(g.gpu_type)})` + (out ? ", out of service" : "")
                   + (holder ? `: ${names.get(holder) || holder}` : "");
      row.append(cell);
    }
    return row;
  });
  document.getElementById("grid").replaceChildren(...rows);
}

function label(jobId, names) {
  return text(names.get(jobId) || text(jobId).slice(0, 8));
}

function renderJobs(snap) {
  const rows = list(snap.jobs).slice().reverse().map(j => {
    const inUse = list(j.in_use_gpus).length;
    const pct = isNum(j.steps_done) && isNum(j.total_steps) && j.total_steps > 0
      ? Math.min(100, Math.max(0, 100 * j.steps_done / j.total_steps)) : 0;
    const now = list(j.throughput).find(s => Array.isArray(s) && s[0] === inUse);
    const fill = el("div");
    fill.style.width = pct.toFixed(1) + "%";
    const swatch = el("span", "swatch");
    swatch.style.background = colour(j.id);
    const metrics = j.metrics !== null && typeof j.metrics === "object" ? j.metrics : {};
    const accuracy = Object.hasOwn(metrics, "accuracy") && metrics.accuracy !== null
      ? " accuracy " + metricText(metrics.accuracy) : "";
    const tr = el("tr", j.id === focusJob ? "focus" : null,
      el("td", "text", swatch, text(j.name)),
      el("td", null, text(j.status)),
      el("td", null, `${inUse} (${text(j.min_gpus)}-${text(j.max_gpus)})`),
      el("td", null, el("div", "bar", fill), `${fixed(j.steps_done, 0)}/${text(j.total_steps)}`),
      el("td", null, now && isNum(now[1]) ? now[1].toFixed(1) + " steps/s" : "-"),
      el("td", null, text(j.num_resizes)),
      el("td", null, fixed(j.jct_s, 0, " s")),
      el("td", "text", el("div", "long", text(j.reason) + accuracy)));
    tr.dataset.job = text(j.id);
    return tr;
  });
  document.querySelector("#jobs tbody").replaceChildren(...rows);
  const older = document.getElementById("older-jobs");
  const hidden = isNum(snap.ended_hidden) ? snap.ended_hidden : 0;
  older.hidden = hidden <= 0;
  older.textContent = hidden > 0
    ? `and ${hidden} older ended job${hidden === 1 ? "" : "s"} (api/v1/jobs?order=desc pages through every one, as \`airflow-elastic-gpu jobs\` lists them)` : "";
}

function renderEvents(snap, names) {
  const rows = list(snap.events).slice().reverse().map(e => el(
    "tr", e.job_id && e.job_id === focusJob ? "focus" : null,
    el("td", null, fmtTime(e.time_s)),
    el("td", "text", e.job_id ? label(e.job_id, names) : ""),  // a job listed nowhere else: its id
    el("td", null, text(e.kind)),
    el("td", "text", el("div", "long", text(e.message)))));
  document.querySelector("#events tbody").replaceChildren(...rows);
}

// the timeline's rows: every running job's, and the latest ended ones' up to this many (a sweep of
// short jobs leaves thousands in the timeline's window: a row each would be unreadable, and slow)
const TIMELINE_ROWS = 50;
let drawn = "";  // what the timeline last drew: a refresh that changes nothing redraws nothing

function renderTimeline(tl, names) {
  const byJob = new Map();
  for (const s of list(tl.segments)) {
    if (!isNum(s.start_s) || !isNum(s.num_gpus)) continue;
    if (!byJob.has(s.job_id)) byJob.set(s.job_id, []);
    byJob.get(s.job_id).push(s);
  }
  const end = s => (isNum(s.end_s) ? s.end_s : isNum(tl.time_s) ? tl.time_s : s.start_s);
  // the rows shown: every running job's, the linked job's, and those of the jobs that ended last
  const always = new Set([...byJob].filter(([id, segs]) => id === focusJob || segs.some(s => !isNum(s.end_s)))
                                   .map(([id]) => id));
  const ended = [...byJob].filter(([id]) => !always.has(id))
    .map(([id, segs]) => [id, Math.max(...segs.map(end))]).sort((a, b) => b[1] - a[1]);
  const keep = new Set([...always, ...ended.slice(0, Math.max(0, TIMELINE_ROWS - always.size)).map(([id]) => id)]);
  const rows = [...byJob].filter(([id]) => keep.has(id));  // in the API's order, as before
  const segs = rows.flatMap(([, s]) => s);
  const jobOf = rows.flatMap(([id, s]) => s.map(() => id));
  const gpus = s => s.num_gpus + " GPU" + (s.num_gpus > 1 ? "s" : "");
  // one trace for every bar (a trace per job took seconds to draw for a thousand jobs)
  const traces = [{
    type: "bar", orientation: "h", name: "GPUs held", showlegend: false,
    y: jobOf.map(id => plotlyText(label(id, names))),
    base: segs.map(s => new Date(s.start_s * 1000)),
    x: segs.map(s => (end(s) - s.start_s) * 1000),
    // labels in the middle of their bar: a resize's diamond sits on the bar's edge (where the new
    // allocation starts), so a label at the edge would lie under it
    text: segs.map(gpus), textposition: "inside", insidetextanchor: "middle",
    marker: { color: jobOf.map(colour), opacity: segs.map(s => 0.35 + 0.65 * Math.min(1, s.num_gpus / 4)) },
    hovertemplate: "%{text}<extra>%{y}</extra>",
  }];
  // the API gives each resize at the moment the trainer ran on its new GPUs: the start of a segment
  const resizes = list(tl.resizes).filter(e => isNum(e.time_s) && keep.has(e.job_id));
  traces.push({
    type: "scatter", mode: "markers", name: "resize", marker: { symbol: "diamond", size: 10, color: "#1f2933" },
    x: resizes.map(e => new Date(e.time_s * 1000)),
    y: resizes.map(e => plotlyText(label(e.job_id, names))),
    text: resizes.map(e => plotlyText(e.message)), hovertemplate: "%{text}<extra></extra>",
  });
  const note = document.getElementById("timeline-note");
  note.hidden = rows.length >= byJob.size;
  note.textContent = note.hidden ? "" : `showing the latest ${rows.length.toLocaleString("en-US")} of `
    + `${byJob.size.toLocaleString("en-US")} jobs (every running one among them)`;
  const layout = {
    barmode: "overlay", showlegend: false, margin: { l: 120, r: 20, t: 10, b: 40 },
    height: Math.max(320, 60 + 18 * rows.length),  // a row tall enough for its name
    // rows are job names: a category axis, whatever they look like ("2026-11-28", "42")
    xaxis: { type: "date" }, yaxis: { type: "category", automargin: true },
    uirevision: pool,  // a zoom or pan stays through the refreshes (another pool starts afresh)
  };
  const now = JSON.stringify([traces, layout]);
  if (now === drawn) return;
  Plotly.react("timeline", traces, layout, { displayModeBar: false, responsive: true });
  drawn = now;
}

function renderPools(pools) {
  const sel = document.getElementById("pool");
  const shown = [...sel.options].map(o => o.value);
  if (shown.length !== pools.length || shown.some((p, i) => p !== pools[i])) {
    sel.replaceChildren(...pools.map(p => {
      const option = el("option", null, p);
      option.value = p;
      return option;
    }));
  }
  sel.value = pool;  // the pool shown, also when the page chose it (the task's job's pool)
}

let latest = 0;  // the newest refresh: an older one's answer (another pool's, slower) is dropped
let lastData = null;  // when the page last showed data

async function refresh() {
  const status = document.getElementById("updated");
  const seq = ++latest;
  try {
    let note = "";  // what the status line says of the task's or the linked job
    if (task) {
      try {
        const job = await get(`api/v1/jobs/by-task?${new URLSearchParams(task)}`);
        focusJob = text(job.id);
        if (!poolChosen) pool = text(job.pool);
      } catch (err) {
        if (!/HTTP 404$/.test(text(err && err.message))) throw err;
        focusJob = null;
        note = "this task has submitted no GPU job (yet): it is not a training task, or it waits to start; ";
      }
    }
    const pools = list(await get("api/v1/pools")).map(text);
    if (seq !== latest) return;
    if (!pools.length) {
      status.textContent = "no GPU pool yet: register this host's GPUs with `airflow-elastic-gpu nodes add` "
        + "(or submit a training task); this page shows them as soon as there are some";
      return;
    }
    if (!pools.includes(pool)) pool = pools[0];
    renderPools(pools);
    const shown = pool;
    const where = `api/v1/pools/${encodeURIComponent(shown)}`;
    const [snap, tl] = await Promise.all([get(`${where}/snapshot?events=100`), get(`${where}/timeline`)]);
    if (seq !== latest) return;
    const jobs = list(snap.jobs);
    if (focusJob && !jobs.some(j => j.id === focusJob)) {  // ended before the jobs the snapshot lists
      try {
        const job = await get(`api/v1/jobs/${encodeURIComponent(focusJob)}`);
        const which = `job ${text(job.name)} (${text(job.id).slice(0, 8)})`;
        note = text(job.pool) !== shown ? `${which} is in pool ${text(job.pool)}; `
          : `${which} ended ${text(job.status)}` + (text(job.reason) ? `: ${short(job.reason)}` : "")
            + " (older than the jobs listed); ";
      } catch (err) {
        if (!/HTTP 404$/.test(text(err && err.message))) throw err;  // said as any failed refresh is
        note = `job ${text(focusJob).slice(0, 8)} is not known to this broker; `;
      }
      if (seq !== latest) return;
    }
    // a job's label: its name, with the start of its id where jobs share a name (two runs of one
    // task), so that the grid, the events and the timeline's rows tell them apart; a timeline bar
    // of an ended job older than the snapshot's has the name the timeline gives it
    const byId = new Map(jobs.map(j => [j.id, text(j.name)]));
    for (const s of list(tl.segments)) if (!byId.has(s.job_id)) byId.set(s.job_id, text(s.name));
    const seen = new Map();
    for (const name of byId.values()) seen.set(name, (seen.get(name) || 0) + 1);
    const names = new Map([...byId].map(([id, name]) => [id, seen.get(name) > 1
      ? `${name} · ${text(id).slice(0, 8)}` : name]));
    // colours of the jobs shown only: a page left open for weeks kept one for every job it had seen
    for (const id of [...colourOf.keys()]) if (!byId.has(id)) colourOf.delete(id);
    renderGrid(snap, names);
    renderJobs(snap);
    renderEvents(snap, names);
    renderTimeline(tl, names);
    lastData = new Date();
    status.textContent = note + `pool ${shown}: ${jobs.filter(j => j.status === "running").length} running, `
      + `${jobs.filter(j => j.status === "suspended").length} suspended, `
      + `${jobs.filter(j => j.status === "queued").length} queued; updated ${lastData.toLocaleTimeString()}`;
    document.body.dataset.ready = "1";
  } catch (err) {
    if (seq !== latest) return;
    // what is shown is old: say so, and since when
    status.textContent = "could not load: " + text(err && err.message)
      + (lastData ? `; the data shown is from ${lastData.toLocaleTimeString()}` : "");
  }
}

// one refresh at a time: the next starts 2 s after the last one ended (a slow broker is not sent a
// new request every 2 s while the old ones wait)
async function poll() {
  await refresh();
  setTimeout(poll, POLL_MS);
}

document.getElementById("pool").addEventListener("change", e => {
  pool = e.target.value;
  poolChosen = true;
  refresh();
});
poll();
