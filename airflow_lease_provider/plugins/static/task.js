// A task instance's Lease tab: why it was skipped (the run that held the lease), and its lease events.
"use strict";

(() => {
  const { api, el, name, cell, runBlock, time, badge, flash, fill, airflowLink } = Lease;
  const params = new URLSearchParams(window.location.search);
  const query = new URLSearchParams();
  for (const name of ["dag_id", "run_id", "task_id", "map_index"]) {
    if (params.get(name) !== null) query.set(name, params.get(name));
  }

  function explain(data) {
    const box = document.getElementById("explain");
    const SKIPS = ["skipped_overlap", "overlap_failed", "skipped_buffer_full", "replaced"];
    const skip = data.events.find((e) => SKIPS.includes(e.kind));
    const catchup = data.events.find((e) => e.kind === "skipped_catchup");
    const coalesced = data.events.find((e) => e.kind === "coalesced");
    const parts = [];
    if (skip) {
      box.className = "explain skipped";
      // The first line is the skip reason itself, as the operator recorded it.
      const verb = { skipped_overlap: "Skipped", overlap_failed: "Failed (on_overlap=fail)",
        skipped_buffer_full: "Skipped (every waiting place taken)", replaced: "Replaced by a newer run, skipped" }[skip.kind];
      const reason = data.skip_reason || skip.detail.reason || ["lease ", name(skip.key), " was held by another run"];
      parts.push(el("h2", { class: "wrap", id: "skip-reason" }, `${verb}: `, reason));
      if (skip.kind === "replaced") {
        parts.push(el("p", { id: "replaced-by" }, "Replaced by: ", skip.blocked_by ? runBlock(skip.blocked_by) : name(skip.detail.by_owner || "unknown"),
          ` with token ${skip.detail.by_token}; this run's token ${skip.token} is refused by the fence from the takeover on.`));
      } else if ((skip.detail.holders || []).length) {
        // A semaphore (lease_slots=N): every slot was held, each by its own run.
        parts.push(el("p", { id: "slot-holders" }, `All ${skip.detail.slots} slots were held: `,
          ...skip.detail.holders.map((h) => el("span", { class: "mono" }, `slot ${h.slot}: `, name(h.owner), ` (token ${h.token}) `))));
      } else {
        parts.push(el("p", {}, skip.blocked_by ? ["Holder: ", runBlock(skip.blocked_by)] : ["Holder: ", skip.detail.holder_owner ? name(skip.detail.holder_owner) : "unknown"],
          skip.detail.holder_token ? ` with token ${skip.detail.holder_token}` : "",
          skip.detail.holder_expires_at ? [" until ", time(skip.detail.holder_expires_at)] : ""));
      }
      if (skip.waiting && skip.waiting.length) {
        parts.push(el("p", { id: "waiting-runs" }, "Waiting: ", ...skip.waiting.map((w) => runBlock(w))));
      }
      parts.push(el("p", { class: "muted" }, "A skip is not a failure: the two runs never overlapped, and no failure alert fired."));
    } else if (coalesced) {
      // CappedCatchupTimetable(coalesce=True): the missed range was folded into this run's data interval.
      box.className = "explain";
      parts.push(el("h2", {}, "This run came after a gap: the missed slots were coalesced into it"),
        el("p", {}, coalesced.summary),
        el("p", { class: "muted" }, "Data interval ", time(coalesced.detail.coalesced_start), " → ",
          time(coalesced.detail.coalesced_end), ": nothing of the missed range was dropped."));
    } else if (catchup) {
      box.className = "explain";
      parts.push(el("h2", {}, "This run came after a gap: older slots were skipped"), el("p", {}, catchup.summary));
    } else if (data.events.length) {
      box.className = "explain";
      parts.push(el("h2", {}, "This task instance ran under a lease"), el("p", { class: "muted" }, "Its lease events are below."));
      // A semaphore (lease_slots=N): which slot it held.
      const slotted = data.events.find((e) => e.kind === "acquired" && e.detail.slots > 1);
      if (slotted) {
        parts.push(el("p", { id: "lease-slot" }, `It held slot ${slotted.detail.slot} of ${slotted.detail.slots} of lease `,
          name(slotted.detail.lease_key || slotted.key), ` with token ${slotted.token}.`));
      }
    } else {
      box.className = "explain";
      parts.push(el("h2", {}, "No lease events for this task instance"),
        el("p", { class: "muted" }, "It is not a leased task, or its events are older than the ledger's retention."));
    }
    box.replaceChildren(...parts);
  }

  function render(data) {
    explain(data);
    const rows = data.events.map((e) => el("tr", {},
      cell("When", time(e.at)),
      cell("Kind", badge(e.kind)),
      cell("Key", name(e.key)),
      cell("Token", e.token === null ? "—" : e.token),
      cell("What happened", el("span", { class: "wrap" }, e.summary)),
    ));
    fill(document.querySelector("#events tbody"), rows, "None.", 5);
  }

  const all = document.getElementById("all-leases");
  all.replaceWith(airflowLink("plugin/leases", "All leases"));
  api("task-instance?" + query.toString()).then(render).catch((error) => {
    document.getElementById("explain").replaceChildren(el("p", { class: "error" }, error.message));
    flash("");
  });
})();
