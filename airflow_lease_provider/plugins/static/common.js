// Shared by the Leases page and the task instance's Lease tab. Plain JS, no build step.
"use strict";

const Lease = (() => {
  const meta = (name) => document.querySelector(`meta[name="${name}"]`).content;
  const AIRFLOW_BASE = meta("airflow-base");
  const PLUGIN_BASE = meta("plugin-base");

  // Follow Airflow's light/dark mode live. Airflow 3's UI (3.1-3.3) keeps it with next-themes: the class
  // "dark" or "light" on its <html>, the choice ("light", "dark" or "system") in localStorage "theme".
  // In Airflow's same-origin iframe the parent's <html> is watched (a MutationObserver); a change made
  // in another tab or window arrives as a "storage" event; "system" follows the OS setting.
  const THEME_KEY = "theme";
  const systemDark = window.matchMedia ? window.matchMedia("(prefers-color-scheme: dark)") : null;
  // Airflow's Chakra tokens, copied into the page's own variables so it uses Airflow's exact colours
  // and fonts (the values differ per mode: read again on every switch). Fallbacks are in lease.css.
  const TOKENS = {
    "--bg": "--chakra-colors-bg", "--fg": "--chakra-colors-fg", "--muted": "--chakra-colors-fg-muted",
    "--line": "--chakra-colors-border", "--head": "--chakra-colors-bg-subtle", "--panel": "--chakra-colors-bg-panel",
    "--font": "--chakra-fonts-body", "--mono": "--chakra-fonts-mono",
  };
  function parentRoot() {
    try {
      return window.parent !== window ? window.parent.document.documentElement : null;
    } catch (e) {
      return null;  // framed by another origin: no access, only the stored choice
    }
  }
  function storedMode() {
    try { return window.localStorage.getItem(THEME_KEY); } catch (e) { return null; }
  }
  function wantedMode() {
    const root = parentRoot();
    if (root && root.classList.contains("dark")) return "dark";
    if (root && root.classList.contains("light")) return "light";
    const stored = storedMode();
    if (stored === "dark" || stored === "light") return stored;
    return systemDark && systemDark.matches ? "dark" : "light";
  }
  function applyTheme() {
    const mode = wantedMode();
    const html = document.documentElement;
    html.classList.toggle("dark", mode === "dark");
    html.classList.toggle("light", mode !== "dark");
    html.dataset.theme = mode;
    const root = parentRoot();
    if (root) {
      const style = window.parent.getComputedStyle(root);
      for (const [ours, theirs] of Object.entries(TOKENS)) {
        const value = style.getPropertyValue(theirs).trim();
        if (value) html.style.setProperty(ours, value); else html.style.removeProperty(ours);
      }
    }
  }
  applyTheme();
  const watched = parentRoot();
  if (watched && window.MutationObserver) {
    new MutationObserver(applyTheme).observe(watched, { attributes: true, attributeFilter: ["class", "style", "data-theme"] });
  }
  window.addEventListener("storage", (event) => { if (event.key === null || event.key === THEME_KEY) applyTheme(); });
  if (systemDark && systemDark.addEventListener) systemDark.addEventListener("change", applyTheme);

  async function api(path, options = {}) {
    const response = await fetch(PLUGIN_BASE + "api/" + path, {
      credentials: "same-origin",
      headers: { Accept: "application/json", ...(options.body ? { "Content-Type": "application/json" } : {}) },
      ...options,
    });
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (!response.ok) {
      const detail = body && body.detail ? (typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail)) : response.statusText;
      const error = new Error(`${response.status}: ${detail}`);
      error.status = response.status;
      throw error;
    }
    return body;
  }

  // Characters that are invisible or reorder the text around them: controls, format characters (zero-width
  // spaces and joiners, bidi overrides and isolates, the BOM), line and paragraph separators. The store
  // refuses them in new keys, but rows written before may have them: they are shown as a visible code
  // point, never applied. In running text tabs and newlines stay as they are.
  const HIDDEN = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}]/u;
  const HIDDEN_IN_TEXT = /[^\P{Cc}\t\n\r]|[\p{Cf}\p{Zl}\p{Zp}]/u;

  function visible(text, hidden = HIDDEN) {
    if (!hidden.test(text)) return [document.createTextNode(text)];
    const nodes = [];
    let run = "";
    for (const ch of text) {
      if (!hidden.test(ch)) { run += ch; continue; }
      if (run) nodes.push(document.createTextNode(run));
      run = "";
      const mark = document.createElement("span");
      mark.className = "codepoint";
      mark.title = "an invisible or reordering character, shown by its code point";
      mark.textContent = `U+${ch.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}`;
      nodes.push(mark);
    }
    if (run) nodes.push(document.createTextNode(run));
    return nodes;
  }

  // ``text`` with its invisible and reordering characters written as their code points (for SVG text
  // and attributes, which take no markup).
  function plain(text) {
    return visible(String(text)).map((node) => node.textContent).join("");
  }

  // A key, resource or owner inside other text: isolated (its direction is its own, it never reorders
  // the sentence around it) and with its invisible characters shown.
  function name(value) {
    const node = document.createElement("bdi");
    node.setAttribute("dir", "auto");
    node.className = "name";
    node.append(...visible(String(value)));
    return node;
  }

  // Build DOM nodes without innerHTML: every value from the store is text, never markup.
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") node.className = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? "" : value);
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.append(...(child instanceof Node ? [child] : visible(String(child), HIDDEN_IN_TEXT)));
    }
    return node;
  }

  // One wrapper per cell, so the narrow layout's label/value grid sees a single value.
  function cell(label, ...children) {
    return el("td", { "data-label": label }, el("div", { class: "v" }, ...children));
  }

  // Links into the Airflow UI. Inside Airflow's sandboxed iframe a plain link would open the page inside
  // the frame; the sandbox forbids navigating the top window, but the frame is same-origin, so it can
  // ask Airflow's router to navigate (history entry + popstate), as the UI's own links do.
  function airflowLink(path, text, title) {
    const href = AIRFLOW_BASE + path;
    return el("a", {
      href, title: title || null,
      onclick: (event) => {
        if (event.button !== 0 || event.metaKey || event.ctrlKey || event.shiftKey || event.altKey) return;
        try {
          const top = window.top;
          if (top === window || top.location.origin !== window.location.origin) return;
          event.preventDefault();
          const state = top.history.state || {};
          const idx = typeof state.idx === "number" ? state.idx + 1 : 0;
          top.history.pushState({ usr: null, key: Math.random().toString(36).slice(2, 10), idx }, "", href);
          top.dispatchEvent(new PopStateEvent("popstate", { state: top.history.state }));
        } catch (e) { /* fall back to the plain link */ }
      },
    }, text);
  }

  function runLink(run) {
    if (!run) return null;
    return airflowLink(run.path, run.run_id, `DAG ${run.dag_id}, run ${run.run_id}`);
  }

  function runBlock(run, task) {
    if (!run) return [];
    return [
      el("span", { class: "mono" }, run.dag_id), " / ", runLink(run),
      run.map_index >= 0 ? ` [${run.map_index}]` : null,
      task ? el("span", { class: "small" }, "task ", airflowLink(task.path, task.task_id)) : null,
    ];
  }

  const pad = (n) => String(n).padStart(2, "0");
  // Times are shown in UTC, like Airflow's run ids; the full ISO value is in the tooltip.
  function time(iso, withDate = true) {
    if (!iso) return el("span", { class: "muted" }, "—");
    const d = new Date(iso);
    // Month-day is enough to place an event within the ledger's retention; the year is in the tooltip.
    const text = (withDate ? `${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ` : "") +
      `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}:${pad(d.getUTCSeconds())}`;
    return el("time", { datetime: iso, title: `${iso} (UTC)` }, text);
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    let s = Math.max(0, Math.round(seconds));
    if (s < 60) return `${s}s`;
    let m = Math.floor(s / 60); s %= 60;
    if (m < 60) return s ? `${m}m${pad(s)}s` : `${m}m`;
    let h = Math.floor(m / 60); m %= 60;
    if (h < 48) return m ? `${h}h${pad(m)}m` : `${h}h`;
    const d = Math.floor(h / 24); h %= 24;
    return h ? `${d}d${pad(h)}h` : `${d}d`;
  }

  function badge(kind, text) {
    return el("span", { class: `badge ${kind}` }, text || kind.replace(/_/g, " "));
  }

  // ``message``: text, or a list of text and nodes (e.g. a key as ``name(key)``).
  function flash(message, isError = false) {
    const box = document.getElementById("flash");
    if (!box) return;
    const parts = [message].flat(Infinity).filter((part) => part !== null && part !== undefined && part !== "");
    box.replaceChildren(...parts.flatMap((part) => (part instanceof Node ? [part] : visible(String(part), HIDDEN_IN_TEXT))));
    box.className = isError ? "flash error" : "flash";
    box.hidden = !parts.length;
  }

  function fill(tbody, rows, emptyText, columns) {
    tbody.replaceChildren(...(rows.length ? rows : [
      el("tr", {}, el("td", { colspan: columns, class: "muted full" }, emptyText)),
    ]));
  }

  return { api, el, name, plain, cell, airflowLink, runLink, runBlock, time, duration, badge, flash, fill, applyTheme, AIRFLOW_BASE };
})();
