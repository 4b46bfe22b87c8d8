// The Leases page: current leases, recent events, TTL advice, counts per key; force-release for admins.
"use strict";

(() => {
  const { api, el, name, cell, runBlock, time, duration, badge, flash, fill } = Lease;
  const $ = (id) => document.getElementById(id);
  const RANGES = { "1h": 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400 };
  const REFRESH_MS = 15000;

  const LEASE_PAGE = 100;
  let me = { user: "", can_force_release: false };
  let leasePages = 1;        // pages of leases shown: a refresh reloads as many (keyset cursors)
  let eventCursor = null;    // next_cursor of the events shown: "Show older events" continues there
  let countdowns = [];   // [{node, seconds, at}] ticking from the server's own "expires in"
  let timer = null;

  // -- filters live in this frame's query string, so a filtered view can be linked to --------------
  const form = $("filters");
  function readFilters() {
    const params = new URLSearchParams(window.location.search);
    for (const name of ["key", "kind", "range", "limit"]) {
      if (params.has(name)) form.elements[name].value = params.get(name);
    }
  }
  function writeFilters() {
    const params = new URLSearchParams(window.location.search);  // keeps the timeline's tkey/trange
    for (const name of ["key", "kind", "range", "limit"]) {
      params.delete(name);
      const value = form.elements[name].value;
      if (value && !(name === "range" && value === "7d") && !(name === "limit" && value === "100")) params.set(name, value);
    }
    const query = params.toString();
    history.replaceState(null, "", window.location.pathname + (query ? "?" + query : ""));
  }
  function eventQuery() {
    const params = new URLSearchParams();
    const key = form.elements.key.value.trim();
    if (key) params.set("key", key);
    if (form.elements.kind.value) params.set("kind", form.elements.kind.value);
    const range = RANGES[form.elements.range.value];
    if (range) params.set("since", new Date(Date.now() - range * 1000).toISOString());
    params.set("limit", form.elements.limit.value || "100");
    return params.toString();
  }

  // -- tables -----------------------------------------------------------------------------------------
  function cellKey(...children) {
    const td = cell("Key", ...children);
    td.classList.add("key");
    return td;
  }

  function renderLeases(data) {
    countdowns = [];
    const now = performance.now();
    $("more-leases").hidden = !data.next_cursor;
    const rows = data.leases.map((l) => {
      const expires = el("span", { class: "mono" }, l.held ? duration(l.expires_in_seconds) : "—");
      if (l.held) countdowns.push({ node: expires, seconds: l.expires_in_seconds, at: now });
      const action = l.held && me.can_force_release
        ? el("button", { type: "button", class: "danger-outline", onclick: () => openConfirm(l) }, "Force release…")
        : null;
      return el("tr", { class: l.held ? "held" : "free", "data-key": l.key },
        cellKey(el("a", { href: "#events", onclick: () => filterKey(l.key) }, name(l.key))),
        cell("State", badge(l.held ? "held" : "free", l.held ? "held" : "free"),
          // A semaphore's slot (lease_slots=N): "slot 2 of 3 of <key>".
          l.slots > 1 ? el("span", { class: "small slot-label" }, `${l.slot_label} of `, name(l.lease_key)) : null),
        cell("Holder", l.holder_run ? runBlock(l.holder_run) : el("span", { class: "mono" }, name(l.owner)),
          l.held ? null : el("span", { class: "small" }, "last holder"),
          // The runs holding a waiting place for the key (wait with max_waiting), oldest first.
          (l.waiting || []).length ? el("span", { class: "small waiting-runs" }, `${l.waiting.length} waiting: `,
            ...l.waiting.map((w) => (w.run ? runBlock(w.run) : el("span", { class: "mono" }, name(w.owner))))) : null),
        cell("Token", el("span", { class: "mono" }, l.token)),
        cell("Acquired", time(l.acquired_at)),
        cell("Expires in", expires),
        cell("Last renewal", time(l.renewed_at),
          l.since_renewal_seconds !== null ? el("span", { class: "small" }, `${duration(l.since_renewal_seconds)} ago`) : null),
        cell("TTL", duration(l.ttl_seconds)),
        el("td", { "data-label": "", class: action ? "" : "full" }, el("div", { class: "v" }, action)),
      );
    });
    fill($("leases").tBodies[0], rows, "No leases in the store yet.", 9);
    const store = data.store || {};
    if (store.schema) {
      $("store-line").textContent = `Lease store schema ${store.schema}${store.embedded ? " (embedded PostgreSQL: this host only)" : ""}` +
        ` · times in UTC · signed in as ${me.user}${me.can_force_release ? " (admin)" : ""}`;
    }
  }

  function eventRows(data) {
    return data.events.map((e) => el("tr", { "data-kind": e.kind },
      cell("When", time(e.at)),
      cell("Kind", badge(e.kind)),
      cellKey(el("a", { href: "#events", onclick: () => filterKey(e.key) }, name(e.key))),
      cell("Run / task", e.run ? runBlock(e.run, e.task) : (e.owner ? el("span", { class: "mono" }, name(e.owner)) : el("span", { class: "mono" }, "—"))),
      cell("What happened", el("span", { class: "wrap" }, e.summary),
        e.blocked_by ? el("span", { class: "small" }, e.kind === "replaced" ? "replaced by run " : "blocked by run ", runBlock(e.blocked_by)) : null),
    ));
  }

  function renderEvents(data, append = false) {
    eventCursor = data.next_cursor;
    $("more-events").hidden = !eventCursor;
    if (append) $("events").tBodies[0].append(...eventRows(data));
    else fill($("events").tBodies[0], eventRows(data), "No events match these filters.", 5);
  }

  function renderAdvice(data) {
    const rows = data.advice.map((a) => el("tr", { "data-verdict": a.verdict },
      cellKey(name(a.key)),
      cell("Verdict", badge(a.verdict, a.verdict.replace("_", " "))),
      cell("TTL", duration(a.ttl_seconds)),
      cell("Worst hold", duration(a.worst_hold_seconds)),
      cell("Holds", a.holds),
      cell("Recommended", a.recommended_min_seconds ? `${duration(a.recommended_min_seconds)}–${duration(a.recommended_max_seconds)}` : "—"),
      cell("Why", el("span", { class: "wrap" }, a.message),
        a.lost_7d ? el("span", { class: "small error" }, `${a.lost_7d} lost lease(s) in 7 days`) : null),
    ));
    fill($("advice").tBodies[0], rows, "No keys yet.", 7);
  }

  function renderCounts(data) {
    const used = data.kinds.filter((k) => data.counts.some((c) => c.kinds[k]));
    const head = $("counts").tHead.rows[0];
    head.replaceChildren(el("th", {}, "Key"), ...used.map((k) => el("th", {}, badge(k))));
    const rows = data.counts.map((c) => el("tr", {},
      cellKey(name(c.key)),
      ...used.map((k) => {
        const n = c.kinds[k] || { last_24h: 0, last_7d: 0 };
        return el("td", { "data-label": k.replace(/_/g, " "), class: "counts-cell" }, el("div", { class: "v" },
          el("span", { class: n.last_24h ? "" : "zero" }, n.last_24h), " / ",
          el("span", { class: n.last_7d ? "" : "zero" }, n.last_7d)));
      }),
    ));
    fill($("counts").tBodies[0], rows, "No events in the last 7 days.", used.length + 1);
    const kindSelect = form.elements.kind;
    if (kindSelect.options.length === 1) {
      for (const k of data.kinds) kindSelect.append(el("option", { value: k }, k.replace(/_/g, " ")));
      readFilters();
    }
  }

  function fillKeys(leases, counts) {
    const keys = new Set([...leases.leases.map((l) => l.key), ...counts.counts.map((c) => c.key)]);
    $("key-list").replaceChildren(...[...keys].sort().map((k) => el("option", { value: k })));
  }

  function filterKey(key) {
    form.elements.key.value = key;
    writeFilters();
    loadEvents();
    if ([...timelineKey.options].some((o) => o.value === key) && timelineKey.value !== key) {
      timelineKey.value = key;
      writeTimelineQuery();
      loadTimeline();
    }
  }

  // -- the timeline of one key (timeline.js) ------------------------------------------------------------
  const timelineKey = $("timeline-key");
  let timelineRange = new URLSearchParams(window.location.search).get("trange") || "7d";
  let wantedKey = new URLSearchParams(window.location.search).get("tkey") || "";

  function setRangeButtons() {
    for (const button of $("timeline-range").querySelectorAll("button")) {
      button.setAttribute("aria-pressed", String(button.dataset.range === timelineRange));
    }
  }

  function writeTimelineQuery() {
    const params = new URLSearchParams(window.location.search);
    if (timelineKey.value) params.set("tkey", timelineKey.value); else params.delete("tkey");
    if (timelineRange !== "7d") params.set("trange", timelineRange); else params.delete("trange");
    const query = params.toString();
    history.replaceState(null, "", window.location.pathname + (query ? "?" + query : ""));
  }

  // Keys to pick from: held ones first, then those with recent events; the one in the query string kept.
  function fillTimelineKeys(leases, counts) {
    const held = leases.leases.filter((l) => l.held).map((l) => l.key);
    const rest = [...new Set([...counts.counts.map((c) => c.key), ...leases.leases.map((l) => l.key)])]
      .filter((k) => !held.includes(k)).sort();
    const keys = [...held, ...rest];
    const current = timelineKey.value || wantedKey || keys[0] || "";
    if (current && !keys.includes(current)) keys.unshift(current);
    timelineKey.replaceChildren(...(keys.length ? keys.map((k) => el("option", { value: k }, held.includes(k) ? `${k} (held)` : k))
      : [el("option", { value: "" }, "no keys yet")]));
    timelineKey.value = current;
  }

  let timelineAsked = 0;  // the number of the last request: an older reply that arrives later is dropped

  async function loadTimeline() {
    const key = timelineKey.value;
    const box = $("timeline");
    const asked = ++timelineAsked;
    if (!key) { box.replaceChildren(el("p", { class: "muted" }, "No lease keys in the store yet.")); return; }
    try {
      const data = await api(`timeline?key=${encodeURIComponent(key)}&range=${timelineRange}`);
      if (asked !== timelineAsked) return;  // another key or range was asked for meanwhile
      const node = LeaseTimeline.block(data, data.trend);
      box.replaceChildren(node);
      node.draw();  // in the same task as the replacement: the page never shows this block undrawn
    } catch (error) {
      if (asked !== timelineAsked) return;
      box.replaceChildren(el("p", { class: "error" }, `Could not load the timeline: ${error.message}`));
    }
  }

  timelineKey.addEventListener("change", () => { writeTimelineQuery(); loadTimeline(); });
  $("timeline-range").addEventListener("click", (event) => {
    const range = event.target.closest("button") && event.target.closest("button").dataset.range;
    if (!range) return;
    timelineRange = range;
    setRangeButtons();
    writeTimelineQuery();
    loadTimeline();
  });
  setRangeButtons();

  // -- loading ----------------------------------------------------------------------------------------
  async function loadEvents() {
    try {
      renderEvents(await api("events?" + eventQuery()));
    } catch (error) {
      flash(`Could not load events: ${error.message}`, true);
    }
  }

  async function moreEvents() {
    if (!eventCursor) return;
    try {
      renderEvents(await api("events?" + eventQuery() + "&cursor=" + encodeURIComponent(eventCursor)), true);
    } catch (error) {
      flash(`Could not load events: ${error.message}`, true);
    }
  }

  // The first `leasePages` pages of leases, one after the other (each continues at the last one's cursor).
  async function loadLeases() {
    let page = await api(`leases?limit=${LEASE_PAGE}`);
    const all = { ...page, leases: [...page.leases] };
    for (let n = 1; n < leasePages && page.next_cursor; n++) {
      page = await api(`leases?limit=${LEASE_PAGE}&cursor=${encodeURIComponent(page.next_cursor)}`);
      all.leases.push(...page.leases);
      all.next_cursor = page.next_cursor;
    }
    if (!page.next_cursor) all.next_cursor = null;
    return all;
  }

  async function load() {
    try {
      const [leases, counts, advice] = await Promise.all([loadLeases(), api("counts"), api("ttl-advice")]);
      renderCounts(counts);
      renderLeases(leases);
      renderAdvice(advice);
      fillKeys(leases, counts);
      fillTimelineKeys(leases, counts);
      // A refresh redraws the timeline unless someone is reading a bar's or marker's details.
      const reading = document.querySelector("#timeline .timeline-detail:not([hidden])");
      await Promise.all([loadEvents(), reading ? null : loadTimeline()]);
      if ($("flash").classList.contains("error")) flash("");  // recovered; keep any notice
    } catch (error) {
      flash(`Could not load leases: ${error.message}`, true);
    }
  }

  function tick() {
    const now = performance.now();
    for (const c of countdowns) {
      const left = c.seconds - (now - c.at) / 1000;
      c.node.textContent = left > 0 ? duration(left) : "expired";
    }
  }

  function schedule() {
    clearInterval(timer);
    timer = $("auto").checked ? setInterval(load, REFRESH_MS) : null;
  }

  // -- force-release, with a confirmation step ---------------------------------------------------------
  let pending = null;
  const dialog = $("confirm");
  function openConfirm(lease) {
    pending = lease;
    const holder = lease.holder_run ? `run ${lease.holder_run.run_id} of DAG ${lease.holder_run.dag_id}` : lease.owner;
    $("confirm-text").replaceChildren(
      "Lease ", name(lease.key), " is held by ", name(holder), ` with token ${lease.token}. Force-releasing it frees it now.`);
    $("confirm-key").replaceChildren(name(lease.key));
    $("confirm-typed").value = "";
    $("confirm-reason").value = "";
    $("confirm-error").hidden = true;
    $("confirm-go").disabled = true;
    dialog.showModal();
    $("confirm-reason").focus();
  }
  $("confirm-typed").addEventListener("input", () => {
    $("confirm-go").disabled = !pending || $("confirm-typed").value !== pending.key;
  });
  $("confirm-cancel").addEventListener("click", () => { pending = null; dialog.close(); });
  $("confirm-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!pending || $("confirm-typed").value !== pending.key) return;
    $("confirm-go").disabled = true;
    try {
      const result = await api("force-release", {
        method: "POST",
        body: JSON.stringify({
          key: pending.key, confirm: $("confirm-typed").value, reason: $("confirm-reason").value,
          expected_token: pending.token,
        }),
      });
      dialog.close();
      pending = null;
      flash(["Lease ", name(result.key), " force-released by ", name(result.by), `; its token is now ${result.new_token}.`]);
      await load();
    } catch (error) {
      $("confirm-error").textContent = error.message;
      $("confirm-error").hidden = false;
      $("confirm-go").disabled = false;
    }
  });

  // -- start ---------------------------------------------------------------------------------------------
  form.addEventListener("submit", (event) => { event.preventDefault(); writeFilters(); loadEvents(); });
  $("clear-filters").addEventListener("click", () => { form.reset(); writeFilters(); loadEvents(); });
  $("refresh").addEventListener("click", load);
  $("more-leases").addEventListener("click", () => { leasePages += 1; load(); });
  $("more-events").addEventListener("click", moreEvents);
  $("auto").addEventListener("change", schedule);
  readFilters();
  api("me").then((who) => { me = who; }).catch(() => {}).finally(() => { load(); schedule(); });
  setInterval(tick, 1000);
})();
