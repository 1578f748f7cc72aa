// The status page: it renders each state the server sends over
// server-sent events. Every value is set as text (textContent), never as
// markup: events come from the network and are not trusted.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);

  // Epochs run to sixteen digits, and those of one deployment differ in
  // the last few: a cell shows its last six after a "…", and the whole
  // epoch as its title (and in data-epoch).
  const epochDigits = 6;
  const epochCols = new Set(["epoch", "max", "from_epoch", "fenced"]);

  function shortEpoch(s) {
    return /^[0-9]+$/.test(s) && s.length > epochDigits + 1 ? "…" + s.slice(-epochDigits) : s;
  }

  function cell(tr, text, cls, epoch) {
    const td = document.createElement("td");
    const s = text === undefined || text === null || text === "" ? "-" : String(text);
    td.textContent = epoch ? shortEpoch(s) : s;
    if (epoch && td.textContent !== s) {
      td.title = s;
      td.dataset.epoch = s;
    }
    if (cls) td.className = cls;
    tr.appendChild(td);
  }

  function fill(tbody, rows, columns, rowClass) {
    const trs = [];
    for (const r of rows) {
      const tr = document.createElement("tr");
      const c = rowClass ? rowClass(r) : "";
      if (c) tr.className = c;
      for (const col of columns) {
        const v = typeof col === "function" ? col(r) : r[col];
        const epoch = epochCols.has(col);
        cell(tr, v, epoch ? "epoch"
          : col === "reason" || col === "error" || col === "key" || col === "worker" ? "wrap" : "", epoch);
      }
      trs.push(tr);
    }
    if (trs.length === 0) {
      const tr = document.createElement("tr");
      const td = document.createElement("td");
      td.colSpan = columns.length;
      td.className = "empty";
      td.textContent = "none";
      tr.appendChild(td);
      trs.push(tr);
    }
    tbody.replaceChildren(...trs);
  }

  function time(t) {
    const d = new Date(t);
    return isNaN(d) ? "?" : d.toLocaleTimeString();
  }

  function list(ul, items) {
    ul.replaceChildren(...items.map((s) => {
      const li = document.createElement("li");
      li.textContent = String(s);
      return li;
    }));
  }

  // where names what a lease event is about: a partition, or a lock.
  const where = (e) => (e.lock ? "lock " + e.lock : e.partition);

  function render(st) {
    last = st;
    $("prefix").textContent = st.prefix || "";
    $("served-by").textContent = st.served_by || "?";
    $("now").textContent = time(st.now);
    fill($("partitions"), st.partitions || [], ["name", "holder", "epoch", "age", "renewed", "fenced", "progress", "lag"],
      (r) => (r.holder === "-" ? "free" : ""));
    $("members").textContent = (st.members || []).join(", ") || "none";
    $("locks-section").hidden = !(st.locks && st.locks.length);
    fill($("locks"), st.locks || [], ["name", "holder", "epoch", "age", "renewed", "fenced"]);
    $("findings-section").hidden = !(st.findings && st.findings.length);
    list($("findings"), st.findings || []);
    $("errors-section").hidden = !(st.errors && st.errors.length);
    list($("errors"), st.errors || []);
    fill($("refusals"), st.refusals || [],
      [(e) => time(e.time), "worker", "scope", "partition", "epoch", "max", "holder", "outcome", "key", "source"], () => "refused");
    fill($("moves"), st.moves || [],
      [(m) => time(m.time), "kind", "scope", where, "from", "from_epoch", "to", "epoch"], (m) => m.kind === "take-over" ? "take-over" : "");
    fill($("losses"), st.losses || [], [(e) => time(e.time), "worker", "scope", where, "epoch", "reason"]);
    $("destinations-section").hidden = !(st.destinations && st.destinations.length);
    fill($("destinations"), st.destinations || [],
      ["relay", "endpoint", "origin", (d) => (d.down ? "down" : "up"), (d) => time(d.since), "error", "source"],
      (d) => (d.down ? "down" : "up"));
    fill($("actions"), st.actions || [],
      [(e) => time(e.time), "actor", "action", "target", "result", "source"], (e) => (e.failed ? "failed" : "done"));
    actionsOn = !!st.actions_on;
    const dls = [];
    for (const d of st.dead_letters || []) {
      const h = document.createElement("h3");
      h.textContent = d.stream + ": " + d.count + (d.error ? " (" + d.error + ")" : "");
      dls.push(h);
      if (d.recent && d.recent.length) {
        const table = document.createElement("table");
        const head = document.createElement("tr");
        const acts = actionsOn && csrf !== "";
        for (const n of acts ? ["seq", "time", "subject", "partition", "id", "error", ""] : ["seq", "time", "subject", "partition", "id", "error"]) {
          const th = document.createElement("th");
          th.textContent = n;
          head.appendChild(th);
        }
        const tbody = document.createElement("tbody");
        fill(tbody, d.recent, ["seq", (x) => time(x.time), "subject", "partition", "id", "error"]);
        if (acts) {
          for (const tr of tbody.rows) {
            const x = d.recent[tr.sectionRowIndex];
            if (!x) continue;
            const td = document.createElement("td");
            for (const a of ["replay", "purge"]) {
              const b = document.createElement("button");
              b.type = "button";
              const key = a + " " + d.stream + " " + x.seq;
              b.textContent = a === "purge" && armed === key ? "confirm purge" : a;
              if (armed === key) b.className = "armed";
              b.dataset.action = a;
              b.dataset.stream = d.stream;
              b.dataset.seq = String(x.seq);
              td.appendChild(b);
            }
            tr.appendChild(td);
          }
        }
        table.dataset.stream = d.stream;
        table.append(head, tbody);
        dls.push(table);
      }
    }
    $("dead-letters").replaceChildren(...dls);
    $("invalid").textContent = !st.invalid ? ""
      : st.invalid === 1 ? "1 event in the stream was not valid and is not shown"
      : st.invalid + " events in the stream were not valid and are not shown";
    document.body.dataset.updates = String(Number(document.body.dataset.updates) + 1);
    // For whatever waits for the page to show a state (a screenshot, a
    // test): an event, not a guess at how long it takes.
    document.dispatchEvent(new CustomEvent("leasehold:state"));
  }

  // Actions: off unless the server takes them; then a sign-in with the
  // token (or the proxy's user), a CSRF token kept in memory and sent
  // with every action, and the answer shown.
  let actionsOn = false;
  let csrf = "";
  let armed = ""; // the purge waiting for its confirmation
  let last = null; // the last state rendered

  function message(ok, text) {
    $("action-msg").textContent = text;
    $("action-msg").className = ok ? "ok" : "bad";
  }

  async function post(path, body) {
    const headers = { "Content-Type": "application/json" };
    if (csrf) headers["X-CSRF-Token"] = csrf;
    let res, out;
    try {
      res = await fetch("actions/" + path, { method: "POST", headers, body: JSON.stringify(body), credentials: "same-origin" });
    } catch (e) {
      return { status: 0, error: String(e) };
    }
    try {
      out = await res.json();
    } catch (e) {
      out = { error: res.status + " " + res.statusText };
    }
    out.status = res.status;
    return out;
  }

  function signedIn(who, token) {
    csrf = token || "";
    $("actions-section").hidden = false;
    $("sign-in").hidden = !!csrf;
    $("signed-in").hidden = !csrf;
    $("actor").textContent = who || "";
    if (last) render(last);
  }

  async function act(path, body, what) {
    const out = await post(path, body);
    const ok = out.status === 200 && out.ok;
    message(ok, what + ": " + (ok ? out.result : (out.status || "no answer") + " " + (out.error || "")));
    if (out.status === 401) signedIn("", "");
    document.dispatchEvent(new CustomEvent("leasehold:action", { detail: out }));
    return out;
  }

  async function session(auto) {
    let s;
    try {
      const res = await fetch("actions/session", { credentials: "same-origin" });
      s = await res.json();
    } catch (e) {
      return;
    }
    if (!s.enabled) return;
    $("actions-section").hidden = false;
    if (s.csrf) {
      signedIn(s.who, s.csrf);
    } else if (s.proxy && !s.token && auto) {
      const out = await post("login", {});
      if (out.ok) signedIn(out.who, out.csrf);
      else message(false, "sign in: " + (out.error || out.status));
    } else {
      signedIn("", "");
    }
    document.dispatchEvent(new CustomEvent("leasehold:session"));
  }

  $("sign-in-button").addEventListener("click", async () => {
    const out = await post("login", { token: $("token").value, name: $("actor-name").value });
    $("token").value = "";
    if (out.ok) {
      signedIn(out.who, out.csrf);
      message(true, "signed in as " + out.who);
    } else {
      message(false, "sign in: " + (out.status || "") + " " + (out.error || ""));
    }
    document.dispatchEvent(new CustomEvent("leasehold:session"));
  });
  $("sign-out-button").addEventListener("click", async () => {
    await post("logout", {});
    signedIn("", "");
    message(true, "signed out");
  });
  $("cancel-button").addEventListener("click", () => {
    const ref = $("cancel-ref").value.trim();
    act("jobs/cancel", { ref }, "cancel job " + ref);
  });
  $("dead-letters").addEventListener("click", (ev) => {
    const b = ev.target.closest("button[data-action]");
    if (!b) return;
    const key = b.dataset.action + " " + b.dataset.stream + " " + b.dataset.seq;
    const body = { stream: b.dataset.stream, seq: Number(b.dataset.seq) };
    if (b.dataset.action === "purge" && armed !== key) {
      armed = key; // a purge is for good: a second click confirms it
      if (last) render(last);
      return;
    }
    armed = "";
    act(b.dataset.action === "purge" ? "dlq/purge" : "dlq/replay", body, b.dataset.action + " " + b.dataset.stream + " " + b.dataset.seq);
  });

  // The state the server read when it sent the page, so that the page
  // shows it from the start (a screenshot taken at load, say), before the
  // event stream delivers the next.
  const initial = $("initial-state");
  if (initial && initial.textContent.trim()) {
    try {
      render(JSON.parse(initial.textContent));
      $("conn").textContent = "connecting…";
    } catch (e) {
      // The event stream brings a state soon enough.
    }
  }

  session(true);
  const es = new EventSource("status/events");
  es.addEventListener("state", (ev) => {
    let st;
    try {
      st = JSON.parse(ev.data);
    } catch (e) {
      return;
    }
    $("conn").textContent = "live";
    $("conn").className = "ok";
    render(st);
  });
  es.onerror = () => {
    $("conn").textContent = "disconnected, retrying…";
    $("conn").className = "bad";
  };
})();
