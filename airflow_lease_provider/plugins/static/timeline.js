// The lease timeline and the trend chart, drawn as SVG in the page. Plain JS, no build step.
// Colours come from CSS classes (lease.css), so a light/dark switch needs no redraw.
"use strict";

const LeaseTimeline = (() => {
  const { el, name, plain, airflowLink, time, duration, badge } = Lease;
  const SVG = "http://www.w3.org/2000/svg";
  const HOUR = 3600e3, DAY = 24 * HOUR;
  const OUTCOME_TEXT = {
    held: "held now", released: "released", expired: "expired", lost: "lost",
    force_released: "force-released", reentered: "re-entered by a retry", replaced: "replaced by a newer run",
  };
  const MARKER_TEXT = {
    skipped_overlap: "overlap skip", overlap_failed: "overlap failure", waiting: "waiting",
    skipped_buffer_full: "skip: waiting place taken",
    skipped_catchup: "catch-up skip", coalesced: "catch-up coalesced", fence_rejected: "fence rejection",
  };
  const LANES = [
    { name: "skips", label: "Skips", kinds: ["skipped_overlap", "overlap_failed", "waiting", "skipped_buffer_full"] },
    { name: "catchup", label: "Catch-up", kinds: ["skipped_catchup", "coalesced"] },
    { name: "fence", label: "Fence", kinds: ["fence_rejected"] },
  ];

  function svg(tag, attrs = {}, ...children) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value === null || value === undefined || value === false) continue;
      if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(plain(child)));
    }
    return node;
  }

  const pad = (n) => String(n).padStart(2, "0");
  const day = (d) => `${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())}`;
  const hm = (d) => `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}`;

  // "scheduled__2026-11-30T03:00:00+00:00" -> "scheduled 11-30 03:00"; anything else, shortened.
  function shortRun(runId) {
    const m = /^([a-z_]+?)__(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d)/.exec(runId || "");
    if (m) return `${m[1]} ${m[3]}-${m[4]} ${m[5]}:${m[6]}`;
    return runId && runId.length > 22 ? runId.slice(0, 21) + "…" : (runId || "");
  }

  // Tick marks: a step that leaves room for the labels at this width, on UTC hours or days.
  function ticks(since, until, width) {
    const span = until - since;
    const steps = [HOUR, 2 * HOUR, 3 * HOUR, 6 * HOUR, 12 * HOUR, DAY, 2 * DAY, 5 * DAY, 7 * DAY, 10 * DAY];
    const room = 64;  // px per label
    const step = steps.find((s) => (span / s) * room <= width) || steps[steps.length - 1];
    const first = step >= DAY ? Math.ceil(since / DAY) * DAY : Math.ceil(since / step) * step;
    const found = [];
    for (let t = first; t <= until; t += step) {
      const d = new Date(t);
      found.push({ t, label: step >= DAY || (d.getUTCHours() === 0 && d.getUTCMinutes() === 0) ? day(d) : hm(d) });
    }
    return found;
  }

  // The details of what was hovered, tapped or focused, in a box under the chart (readable on a phone).
  function showDetail(box, item) {
    if (!box) return;
    const parts = [];
    if (item.holding) {
      const h = item.holding;
      parts.push(el("p", { class: "detail-head" }, badge(`out-${h.outcome}`, OUTCOME_TEXT[h.outcome] || h.outcome),
        " ", el("span", { class: "mono" }, `token ${h.token}`)));
      parts.push(el("p", {}, h.start_known ? time(h.start) : "before the ledger's oldest event", " → ",
        h.outcome === "held" ? "now" : time(h.end), ` (${duration(h.held_seconds)}`,
        h.end_estimated ? (h.latest_end ? ["; renewed until ", time(h.latest_end), " at the latest"] : "; estimated") : "", ")"));
      parts.push(el("p", {}, "Run: ", h.run ? [el("span", { class: "mono" }, h.run.dag_id), " / ", airflowLink(h.run.path, h.run.run_id)]
        : el("span", { class: "mono" }, h.owner ? name(h.owner) : "unknown")));
    } else {
      const m = item.marker;
      parts.push(el("p", { class: "detail-head" }, badge(m.kind), " ", time(m.at),
        m.slots ? el("span", { class: "mono" }, ` ${m.slots} slot(s)`) : null));
      parts.push(el("p", { class: "wrap" }, m.summary));
      if (m.run) {
        parts.push(el("p", {}, "Run: ", el("span", { class: "mono" }, m.run.dag_id), " / ", airflowLink(m.run.path, m.run.run_id),
          m.task ? [" · task ", airflowLink(m.task.path, m.task.task_id)] : null));
      }
      if (m.blocked_by) parts.push(el("p", {}, "Held by run ", airflowLink(m.blocked_by.path, m.blocked_by.run_id)));
    }
    box.replaceChildren(...parts);
    box.hidden = false;
  }

  // One key's timeline: a lane of holdings (one bar per token) and lanes of markers.
  function render(container, data, detailBox) {
    const width = Math.max(280, Math.floor(container.clientWidth || 600));
    const since = Date.parse(data.since), until = Date.parse(data.until);
    const left = 8, right = 8;
    const x = (t) => left + ((Math.min(Math.max(t, since), until) - since) / (until - since)) * (width - left - right);
    // A semaphore (lease_slots=N): one bar lane per slot, slot 1 on top.
    const slotLanes = Math.max(1, ...data.holdings.map((h) => h.slot || 1));
    const axisH = 18, barY = axisH + 6, barH = 30, laneH = 20, barsH = slotLanes * (barH + 2) - 2, lanesY = barY + barsH + 8;
    const height = lanesY + LANES.length * laneH + 4;
    const root = svg("svg", {
      class: "timeline", width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
      "aria-label": `Lease timeline of ${plain(data.key)}: ${data.holdings.length} holding(s), ${data.markers.length} marker(s)`,
    });
    // Axis: tick lines through every lane, labels on top.
    for (const tick of ticks(since, until, width)) {
      const tx = x(tick.t);
      root.append(svg("line", { class: "tick", x1: tx, x2: tx, y1: axisH, y2: height }));
      root.append(svg("text", { class: "tick-label", x: tx, y: 12, "text-anchor": "middle" }, tick.label));
    }
    root.append(svg("rect", { class: "lane-bg", x: left, y: barY, width: width - left - right, height: barsH, rx: 4 }));
    LANES.forEach((lane, i) => {
      const y = lanesY + i * laneH;
      root.append(svg("line", { class: "lane-line", x1: left, x2: width - right, y1: y + laneH / 2, y2: y + laneH / 2 }));
      root.append(svg("text", { class: "lane-label", x: left + 2, y: y + laneH / 2 + 4 }, lane.label));
    });
    root.append(svg("line", { class: "now", x1: x(until), x2: x(until), y1: axisH, y2: height }));

    let selected = null;
    const select = (node, item) => {
      if (selected) selected.classList.remove("selected");
      selected = node;
      node.classList.add("selected");
      showDetail(detailBox, item);
    };
    const interactive = (node, item, title) => {
      node.setAttribute("tabindex", "0");
      node.append(svg("title", {}, title));
      node.addEventListener("click", () => select(node, item));
      node.addEventListener("mouseenter", () => select(node, item));
      node.addEventListener("focus", () => select(node, item));
      return node;
    };

    for (const h of data.holdings) {
      const x1 = x(Date.parse(h.start)), x2 = Math.max(x(Date.parse(h.end)), x1 + 3);
      const w = x2 - x1;
      const run = h.run ? shortRun(h.run.run_id) : (h.owner || "");
      // A semaphore's slot (lease_slots=N): "slot 2/3".
      const label = `#${h.token} ${run}${h.slots > 1 ? ` slot ${h.slot}/${h.slots}` : ""}`;
      const g = svg("g", { class: `holding out-${h.outcome}${h.end_estimated ? " estimated" : ""}`, "data-token": h.token, "data-outcome": h.outcome });
      const y = barY + ((h.slot || 1) - 1) * (barH + 2);
      g.append(svg("rect", { x: x1, y, width: w, height: barH, rx: 3 }));
      if (w > 34) {
        const fit = Math.floor((w - 8) / 6.3);
        const text = label.length > fit ? label.slice(0, Math.max(1, fit - 1)) + "…" : label;
        g.append(svg("text", { class: "bar-label", x: x1 + 4, y: y + barH / 2 + 4 }, text));
      }
      const ended = h.outcome === "held" ? "held now" : `${OUTCOME_TEXT[h.outcome] || h.outcome} ${hm(new Date(h.end))}`;
      root.append(interactive(g, { holding: h },
        `token ${h.token}${h.slots > 1 ? ` (slot ${h.slot} of ${h.slots})` : ""}, ${h.run ? h.run.run_id : h.owner}: ${hm(new Date(h.start))} → ${ended} (${duration(h.held_seconds)})`));
    }

    for (const m of data.markers) {
      const laneIndex = LANES.findIndex((lane) => lane.kinds.includes(m.kind));
      if (laneIndex < 0) continue;
      const cx = x(Date.parse(m.at)), cy = lanesY + laneIndex * laneH + laneH / 2;
      const g = svg("g", { class: `marker m-${m.kind}`, "data-kind": m.kind, "data-id": m.id });
      g.append(svg("rect", { class: "hit", x: cx - 9, y: cy - 9, width: 18, height: 18 }));  // a finger-sized target
      if (m.kind === "skipped_catchup" || m.kind === "coalesced") {
        g.append(svg("path", { d: `M${cx} ${cy - 6} L${cx + 6} ${cy} L${cx} ${cy + 6} L${cx - 6} ${cy} Z` }));
        if (m.slots) g.append(svg("text", { class: "marker-count", x: cx + 8, y: cy + 4 }, `${m.slots}`));
      } else if (m.kind === "fence_rejected") {
        g.append(svg("rect", { x: cx - 5, y: cy - 5, width: 10, height: 10, rx: 1 }));
        g.append(svg("path", { class: "cross", d: `M${cx - 3} ${cy - 3} L${cx + 3} ${cy + 3} M${cx + 3} ${cy - 3} L${cx - 3} ${cy + 3}` }));
      } else {
        g.append(svg("path", { d: `M${cx - 6} ${cy - 5} L${cx + 6} ${cy - 5} L${cx} ${cy + 6} Z` }));
      }
      root.append(interactive(g, { marker: m }, `${MARKER_TEXT[m.kind] || m.kind} ${day(new Date(m.at))} ${hm(new Date(m.at))}: ${m.summary}`));
    }
    container.replaceChildren(root);
    return root;
  }

  function legend() {
    const item = (cls, text) => el("span", { class: "legend-item" }, el("span", { class: `swatch ${cls}` }), text);
    return el("div", { class: "legend" },
      item("out-held", "held now"), item("out-released", "released"), item("out-expired", "expired"),
      item("out-lost", "lost"), item("out-force_released", "force-released"), item("out-reentered", "re-entered by a retry"),
      item("out-replaced", "replaced by a newer run"),
      item("m-skipped_overlap", "overlap skip"), item("m-skipped_catchup", "catch-up skip (slots)"),
      item("m-coalesced", "catch-up coalesced into one run (slots)"), item("m-fence_rejected", "fence rejection"));
  }

  // Runs vs skips per bucket, stacked: runs below, overlap skips and failures on top.
  function trendChart(container, trend) {
    const width = Math.max(240, Math.floor(container.clientWidth || 400));
    const height = 96, top = 14, bottom = 16, left = 4, right = 4;
    const buckets = trend.buckets;
    const peak = Math.max(1, ...buckets.map((b) => b.runs + b.skipped_overlap + b.overlap_failed));
    const slot = (width - left - right) / Math.max(1, buckets.length);
    const barW = Math.max(1, Math.min(28, slot - 2));
    const root = svg("svg", { class: "trend", width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
      "aria-label": `Runs and skips per ${trend.unit}` });
    root.append(svg("line", { class: "tick", x1: left, x2: width - right, y1: height - bottom, y2: height - bottom }));
    root.append(svg("text", { class: "tick-label", x: left, y: 10 }, `${peak} per ${trend.unit}`));
    const every = Math.ceil(buckets.length / Math.max(1, Math.floor(width / 56)));
    buckets.forEach((b, i) => {
      const bx = left + i * slot + (slot - barW) / 2;
      const d = new Date(b.start);
      const g = svg("g", { class: "bucket", "data-start": b.start });
      let base = height - bottom;
      for (const [cls, n] of [["t-runs", b.runs], ["t-skips", b.skipped_overlap], ["t-failed", b.overlap_failed]]) {
        if (!n) continue;
        const h = (height - top - bottom) * (n / peak);
        base -= h;
        g.append(svg("rect", { class: cls, x: bx, y: base, width: barW, height: Math.max(1, h) }));
      }
      if (b.catchup_slots) g.append(svg("path", { class: "t-catchup", d: `M${bx + barW / 2} ${base - 9} l4 4 l-4 4 l-4 -4 Z` }));
      g.append(svg("rect", { class: "hit", x: left + i * slot, y: top, width: slot, height: height - top - bottom }));
      g.append(svg("title", {}, `${trend.unit === "hour" ? `${day(d)} ${hm(d)}` : day(d)}: ${b.runs} run(s), ` +
        `${b.skipped_overlap} overlap skip(s), ${b.overlap_failed} overlap failure(s), ${b.catchup_slots} catch-up slot(s) skipped`));
      root.append(g);
      if (i % every === 0) {
        root.append(svg("text", { class: "tick-label", x: bx + barW / 2, y: height - 3, "text-anchor": "middle" },
          trend.unit === "hour" ? hm(d) : day(d)));
      }
    });
    container.replaceChildren(root);
  }

  // The one number: overlap skips / attempts.
  function share(trend, rangeText) {
    const t = trend.totals;
    const value = trend.skip_share === null ? "—" : `${(trend.skip_share * 100).toFixed(trend.skip_share < 0.1 ? 1 : 0)}%`;
    return el("div", { class: "share" },
      el("div", { class: "share-value", "data-share": trend.skip_share === null ? "" : trend.skip_share }, value),
      el("div", { class: "share-text" }, "skipped for overlap",
        el("span", { class: "small" }, `${t.skipped_overlap} of ${t.attempts} attempt(s) in ${rangeText}`),
        el("span", { class: "small" }, `${t.runs} run(s) took the lease` + (t.overlap_failed ? `, ${t.overlap_failed} failed` : "") +
          (t.lost ? `, ${t.lost} lost it` : "") + (t.force_released ? `, ${t.force_released} force-released` : ""))));
  }

  function gapList(trend) {
    if (!trend.catchup_gaps.length) return el("p", { class: "muted small-p" }, "No catch-up slots skipped in this range.");
    return el("ul", { class: "gaps" }, trend.catchup_gaps.map((g) => el("li", { "data-slots": g.slots },
      el("strong", {}, `${g.slots ?? "?"} slot(s)`), " skipped before ",
      g.run ? airflowLink(g.run.path, g.run.run_id) : "a run", " ", el("span", { class: "muted" }, g.summary))));
  }

  const RANGE_TEXT = { "24h": "24 hours", "7d": "7 days", "30d": "30 days" };

  // A whole block for one key: timeline, legend, detail box, trend with its share, catch-up gaps.
  function block(data, trend, options = {}) {
    const chart = el("div", { class: "timeline-chart" });
    const detail = el("div", { class: "timeline-detail", hidden: true, "aria-live": "polite" });
    const trendBox = el("div", { class: "trend-chart" });
    const parts = [
      chart,
      options.legend === false ? null : legend(),
      data.truncated ? el("p", { class: "small-p muted" }, `Busy key: showing the newest events, from ${data.covers_from}.`) : null,
      detail,
      el("div", { class: "trend-row" }, share(trend, RANGE_TEXT[trend.range] || trend.range), trendBox),
      options.gaps === false ? null : el("h4", { class: "gaps-title" }, "Catch-up slots skipped per gap"),
      options.gaps === false ? null : gapList(trend),
    ];
    const node = el("div", { class: "timeline-block", "data-key": data.key, "data-range": data.range }, ...parts);
    const draw = () => { render(chart, data, detail); trendChart(trendBox, trend); };
    // Drawn at its own width once in the page: on the next frame, or at once by a caller that puts it
    // in the page and calls node.draw() (so that a block replacing a drawn one is never seen empty).
    node.draw = draw;
    requestAnimationFrame(draw);
    if (window.ResizeObserver) {
      let last = 0;
      new ResizeObserver(() => {
        const w = chart.clientWidth;
        if (Math.abs(w - last) > 4) { last = w; draw(); }
      }).observe(chart);
    }
    return node;
  }

  return { render, trendChart, share, gapList, legend, block, shortRun, RANGE_TEXT };
})();
