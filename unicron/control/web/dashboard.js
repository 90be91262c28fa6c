// The Unicron dashboard: polls GET /v1/dashboard (unicron/control/dashboard.py) about once a
// second with the token from this tab's sessionStorage as the bearer header, and draws the
// snapshot. Every text from the cluster goes in as text (textContent, text nodes), never as
// HTML, so a task name, reason or note is shown as text, whatever it holds. Charts: uPlot.
"use strict";

(() => {
  const KEY = "unicron.token";
  const POLL_MS = 1000;
  const SNAPSHOT = "../v1/dashboard"; // relative: works behind a proxy's path prefix too
  const $ = (id) => document.getElementById(id);
  const charts = new Map(); // task name -> {card, loss, rate, workers}
  let timer = null;
  let polls = 0;

  // -- small helpers ----------------------------------------------------------------------
  function el(tag, cls, ...children) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    for (const c of children) {
      if (c === null || c === undefined) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  function fmtS(x) {
    if (x === null || x === undefined) return "-";
    return x < 1 ? `${Math.round(x * 1000)} ms` : `${x.toFixed(2)} s`;
  }

  function clock(ts) {
    return new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
  }

  function alloc(a) {
    if (!a) return "-";
    return Object.entries(a).map(([k, v]) => `${k}: ${v}`).join(", ");
  }

  // events name nodes by id: show their names
  let nodeNames = new Map();
  function named(text) {
    return String(text).replace(/\bnode (\d+)/g, (_m, id) => `node ${nodeNames.get(Number(id)) ?? id}`);
  }

  function num(x, digits) {
    return x === null || x === undefined ? "-" : Number(x).toFixed(digits);
  }

  // -- the token ------------------------------------------------------------------------------
  function showLogin(message) {
    stop();
    $("board").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message;
    setLive(false, "signed out");
    $("token").focus();
  }

  function signIn(ev) {
    ev.preventDefault();
    const t = $("token").value.trim();
    if (!t) return;
    sessionStorage.setItem(KEY, t);
    $("token").value = "";
    $("login").hidden = true;
    poll();
  }

  function signOut() {
    sessionStorage.removeItem(KEY);
    showLogin("");
  }

  // -- polling --------------------------------------------------------------------------------
  function stop() {
    if (timer !== null) clearTimeout(timer);
    timer = null;
  }

  function schedule() {
    stop();
    timer = setTimeout(poll, POLL_MS);
  }

  function setLive(ok, text) {
    $("live").dataset.live = ok ? "yes" : "no";
    $("live").textContent = text;
  }

  async function poll() {
    const token = sessionStorage.getItem(KEY);
    if (!token) {
      showLogin("");
      return;
    }
    let snap;
    try {
      const r = await fetch(SNAPSHOT, {
        headers: { Authorization: `Bearer ${token}` },
        cache: "no-store",
      });
      if (r.status === 401) {
        sessionStorage.removeItem(KEY);
        showLogin("The coordinator refused that token.");
        return;
      }
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      snap = await r.json();
    } catch (err) {
      setLive(false, `coordinator unreachable (${err.message}); retrying`);
      schedule();
      return;
    }
    $("board").hidden = false;
    $("logout").hidden = false;
    render(snap);
    polls += 1;
    document.body.dataset.polls = String(polls);
    setLive(true, `live · ${clock(snap.now)}`);
    schedule();
  }

  // -- drawing --------------------------------------------------------------------------------
  function render(snap) {
    const up = snap.nodes.filter((n) => n.state === "up").length;
    const running = snap.tasks.filter((t) => t.state === "running").length;
    $("summary").textContent =
      `${up}/${snap.nodes.length} nodes up · ${running}/${snap.tasks.length} tasks running`;
    nodeNames = new Map(snap.nodes.map((n) => [n.id, n.name]));
    renderNodes(snap.nodes);
    renderTasks(snap.tasks, snap.now);
    renderTimeline(snap.tasks);
    renderDecisions(snap.tasks);
  }

  function renderNodes(nodes) {
    const box = $("nodes");
    box.replaceChildren(
      ...nodes.map((n) => {
        const card = el(
          "div", "node",
          el("div", "node-head",
            el("span", "node-name", n.name),
            el("span", `badge ${n.state}`, n.state)),
          el("div", "node-meta",
            `${n.address} · ${n.used}/${n.slots} slots used · heard ${fmtS(n.silent_s)} ago`),
          el("div", "slots", ...n.slot_list.map(slot)),
        );
        card.dataset.node = n.name;
        card.dataset.state = n.state;
        return card;
      }),
    );
  }

  function slot(s) {
    const text = s.task === undefined ? "free" : `${s.task} r${s.rank}`;
    const e = el("span", `slot h-${s.health}`, text);
    e.title = s.health;
    e.dataset.health = s.health;
    if (s.task !== undefined) e.dataset.task = s.task;
    return e;
  }

  function taskOrder(a, b) {
    const active = (t) => ["running", "waiting", "pending", "queued"].includes(t.state);
    return active(b) - active(a) || b.submitted_ts - a.submitted_ts;
  }

  function renderTasks(tasks, now) {
    const box = $("tasks");
    $("no-tasks").hidden = tasks.length > 0;
    const cards = [...tasks].sort(taskOrder).map((t) => {
      let c = charts.get(t.name);
      if (!c) {
        c = newTask(t.name, box);
        charts.set(t.name, c);
      }
      fillTask(c, t, now);
      return c.card;
    });
    box.replaceChildren(...cards);
    for (const c of charts.values()) {
      if (!c.sized && c.card.isConnected) sizeCharts(c);
    }
  }

  function plot(title, label, stroke, box, extra = {}) {
    const opts = {
      title,
      width: 380,
      height: 170,
      scales: { x: { time: true }, ...(extra.scales || {}) },
      series: [
        {},
        { label, stroke, width: 2, fill: `${stroke}1a`, spanGaps: true, ...(extra.series || {}) },
      ],
      axes: [{ space: 70, values: (_u, ticks) => ticks.map(clock) }, { size: 56 }],
      legend: { show: false },
    };
    return new uPlot(opts, [[], []], box);
  }

  function newTask(name, box) {
    const card = el("div", "task");
    card.dataset.task = name;
    const head = el("div", "task-head");
    const note = el("div", "task-note");
    const charts = el("div", "charts");
    const boxes = [0, 1, 2].map(() => el("div", "chart"));
    charts.append(...boxes);
    card.append(head, note, charts);
    box.append(card);
    return {
      card, head, note,
      loss: plot("loss", "loss", "#4a7fe0", boxes[0]),
      rate: plot("step rate (steps/s)", "steps/s", "#2e9d5b", boxes[1]),
      workers: plot("workers", "workers", "#e08a1e", boxes[2], {
        scales: { y: { range: (_u, _min, max) => [0, Math.max(max || 0, 1) + 1] } },
        series: { paths: uPlot.paths.stepped({ align: 1 }) },
      }),
      sized: false,
    };
  }

  function sizeCharts(c) {
    for (const u of [c.loss, c.rate, c.workers]) {
      const w = u.root.parentElement.clientWidth;
      if (w > 0) u.setSize({ width: w, height: 170 });
    }
    c.sized = true;
  }

  function fillTask(c, t, now) {
    c.card.dataset.state = t.state;
    c.card.dataset.step = String(t.step);
    c.card.dataset.workers = String(t.workers);
    const rate = t.series.rate.length ? t.series.rate[t.series.rate.length - 1] : null;
    c.head.replaceChildren(
      el("span", "task-name", t.name),
      el("span", `badge ${t.state}`, t.state),
      el("span", "task-facts",
        `step ${t.step + 1} · ${num(rate, 2)} steps/s · ` +
        `${t.workers} worker${t.workers === 1 ? "" : "s"} ` +
        `(${t.min_workers}-${t.max_workers}) · epoch ${t.epoch} · weight ${t.weight}`),
    );
    const notes = [];
    if (t.last_fault) notes.push(`last fault: ${named(t.last_fault)}`);
    if (t.waiting) notes.push(`waiting: ${t.waiting}`);
    if (t.outcome && t.outcome.reason && t.state !== "done") notes.push(t.outcome.reason);
    if (t.plan_error) notes.push(`planner: ${t.plan_error}`);
    c.note.textContent = notes.join(" · ");
    c.loss.setData([t.series.ts, t.series.loss]);
    c.rate.setData([t.series.ts, t.series.rate]);
    const w = t.workers_series;
    const active = ["running", "waiting", "pending"].includes(t.state);
    const ts = [...w.ts];
    const count = [...w.count];
    const end = active ? now : t.outcome?.ts; // the last membership holds until then
    if (ts.length && end > ts[ts.length - 1]) {
      ts.push(end);
      count.push(count[count.length - 1]);
    }
    c.workers.setData([ts, count]);
  }

  function cell(text, cls) {
    return el("td", cls, text);
  }

  function renderTimeline(tasks) {
    const rows = [];
    for (const t of tasks) for (const r of t.timeline) rows.push([t.name, r]);
    rows.sort((a, b) => b[1].ts - a[1].ts);
    $("no-faults").hidden = rows.length > 0;
    $("timeline").tBodies[0].replaceChildren(
      ...rows.map(([task, r]) => {
        const tr = el(
          "tr", r.injected ? "injected" : "real",
          cell(clock(r.ts), "nowrap"), cell(task, "nowrap"), cell(named(r.fault)), cell(r.detected_by || "-"),
          cell(r.kind || "-"), cell(fmtS(r.detection_s), "num"),
          cell(fmtS(r.transition_s), "num"), cell(fmtS(r.recovery_s), "num"),
          cell(r.state_source || "-"), cell(r.reused ?? "-", "num"),
          cell(r.recomputed ?? "-", "num"), cell(named(r.actions.join(", ")) || "-"),
        );
        tr.dataset.kind = r.kind || "";
        tr.dataset.task = task;
        return tr;
      }),
    );
  }

  function renderDecisions(tasks) {
    const rows = [];
    for (const t of tasks) for (const d of t.decisions) rows.push([t.name, d]);
    rows.sort((a, b) => b[1].ts - a[1].ts);
    $("no-decisions").hidden = rows.length > 0;
    $("decisions").tBodies[0].replaceChildren(
      ...rows.slice(0, 60).map(([task, d]) => {
        const why = named(d.trigger ? `${d.trigger}: ${d.reason}` : d.reason);
        const allocation = d.allocation_before
          ? `${alloc(d.allocation_before)} → ${alloc(d.allocation)}`
          : alloc(d.allocation);
        const waf = d.waf_after === null || d.waf_after === undefined
          ? "-"
          : `${num(d.waf_before, 4)} → ${num(d.waf_after, 4)}`;
        return el(
          "tr", d.by,
          cell(clock(d.ts), "nowrap"), cell(task, "nowrap"),
          cell(d.by === "planner" ? "planner" : `epoch ${d.epoch}`, "nowrap"),
          cell(why), cell(allocation), cell(waf, "num"),
        );
      }),
    );
  }

  // -- start ------------------------------------------------------------------------------------
  $("login").addEventListener("submit", signIn);
  $("logout").addEventListener("click", signOut);
  window.addEventListener("resize", () => {
    for (const c of charts.values()) sizeCharts(c);
  });
  poll();
})();
