// A DAG's "Leases" tab: the DAG's trend and skip share, then per lease key its current holder, its
// timeline and its trend (timeline.js). Read-only: force-release stays on the Leases page, behind its
// confirmation step.
"use strict";

(() => {
  const { api, el, name, airflowLink, runBlock, time, duration, badge, flash } = Lease;
  const $ = (id) => document.getElementById(id);
  const params = new URLSearchParams(window.location.search);
  const dagId = params.get("dag_id") || "";
  let range = params.get("range") || "7d";
  const REFRESH_MS = 30000;

  function holderLine(lease) {
    if (!lease) return el("p", { class: "holder-line muted" }, "Not acquired yet, or held by a DAG you may not read.");
    if (lease.held) {
      return el("p", { class: "holder-line" }, badge("held"), " by ", lease.holder_run ? runBlock(lease.holder_run) : el("span", { class: "mono" }, name(lease.owner)),
        ` · token ${lease.token} · expires in ${duration(lease.expires_in_seconds)} · acquired `, time(lease.acquired_at));
    }
    return el("p", { class: "holder-line" }, badge("free"), " last held by ",
      lease.holder_run ? runBlock(lease.holder_run) : el("span", { class: "mono" }, name(lease.owner)), ` · token ${lease.token}`);
  }

  // The legend once (on the first key); catch-up gaps are the DAG's, shown once above.
  function keyCard(item, index) {
    const data = item.timeline;
    return el("section", { class: "key-card", "data-key": item.key },
      el("h3", { class: "key-title" }, name(item.key)),
      holderLine(data.lease),
      LeaseTimeline.block(data, item.trend, { legend: index === 0, gaps: false }));
  }

  function render(data) {
    $("dag-title").textContent = `Leases of ${data.dag_id}`;
    const trend = data.trend;
    const trendBox = el("div", { class: "trend-chart" });
    $("dag-trend").replaceChildren(
      el("div", { class: "timeline-block" },
        el("div", { class: "trend-row" }, LeaseTimeline.share(trend, LeaseTimeline.RANGE_TEXT[trend.range] || trend.range), trendBox),
        el("h4", { class: "gaps-title" }, "Catch-up slots skipped per gap"),
        LeaseTimeline.gapList(trend)));
    requestAnimationFrame(() => LeaseTimeline.trendChart(trendBox, trend));
    const cards = data.keys.map(keyCard);
    if (data.more_keys) cards.push(el("p", { class: "muted" }, `${data.more_keys} more key(s): see the Leases page.`));
    $("dag-keys").replaceChildren(...(cards.length ? cards
      : [el("p", { class: "muted" }, "No lease events of this DAG in this range, and no lease held by its runs. " +
          "Leased tasks (LeasedOperator, @task.leased) show here once they run.")]));
  }

  function setButtons() {
    for (const button of $("dag-range").querySelectorAll("button")) {
      button.setAttribute("aria-pressed", String(button.dataset.range === range));
    }
  }

  async function load() {
    try {
      render(await api(`dag?dag_id=${encodeURIComponent(dagId)}&range=${range}`));
      flash("");
    } catch (error) {
      flash(`Could not load the leases of this DAG: ${error.message}`, true);
    }
  }

  $("dag-range").addEventListener("click", (event) => {
    const button = event.target.closest("button");
    if (!button || !button.dataset.range) return;
    range = button.dataset.range;
    const query = new URLSearchParams(window.location.search);
    query.set("range", range);
    history.replaceState(null, "", window.location.pathname + "?" + query.toString());
    setButtons();
    load();
  });
  $("all-leases").replaceWith(airflowLink("plugin/leases", "All leases (force-release is there, for admins)"));
  setButtons();
  load();
  setInterval(() => { if (!document.querySelector(".timeline-detail:not([hidden])")) load(); }, REFRESH_MS);
})();
