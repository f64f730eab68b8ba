// Small DOM helpers shared by the pages: element building, number and time formats, sparklines.
"use strict";

const ui = {
  // el("td", {class: "num", title: "x"}, "text", childNode, ...)
  el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else if (key === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  },

  svg(tag, attrs, ...children) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value !== undefined && value !== null) node.setAttribute(key, value);
    }
    for (const child of children.flat()) {
      if (child !== undefined && child !== null && child !== false) node.append(child instanceof Node ? child : String(child));
    }
    return node;
  },

  num(value, digits = 3) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    const abs = Math.abs(value);
    if (abs !== 0 && (abs < 10 ** -digits || abs >= 1e5)) return value.toExponential(2);
    return value.toFixed(digits);
  },

  pct(value) {
    return value === null || value === undefined ? "–" : `${(100 * value).toFixed(1)}%`;
  },

  // "12 s ago", "5 min ago", ... with the ISO time kept for the title.
  ago(iso, now = Date.now()) {
    if (!iso) return "–";
    const seconds = Math.max(0, (now - Date.parse(iso)) / 1000);
    if (seconds < 60) return `${Math.round(seconds)} s ago`;
    if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
    if (seconds < 86400) return `${(seconds / 3600).toFixed(1)} h ago`;
    return `${(seconds / 86400).toFixed(1)} d ago`;
  },

  STATUS_TEXT: {
    healthy: "healthy: no pending or firing alert",
    pending: "pending: an alert condition holds, not yet long enough to fire",
    firing: "firing: an alert is firing",
    waiting: "waiting: no scored step yet",
  },

  statusLight(status) {
    return ui.el("span", { class: `light ${status}`, title: ui.STATUS_TEXT[status] || status, role: "img" }, status);
  },

  // An inline SVG line of `values` (nulls skipped), with an optional dashed reference line.
  sparkline(values, { reference, width = 120, height = 28, domain } = {}) {
    const finite = values.filter((v) => v !== null && Number.isFinite(v));
    const refs = (reference || []).filter((v) => v !== null && Number.isFinite(v));
    const box = ui.svg("svg", { class: "spark", width, height, viewBox: `0 0 ${width} ${height}` });
    if (finite.length < 2) return box;
    const all = finite.concat(refs);
    let [low, high] = domain || [Math.min(...all), Math.max(...all)];
    if (high - low < 1e-12) [low, high] = [low - 0.5, high + 0.5];
    const x = (i) => 1 + (i * (width - 2)) / (values.length - 1);
    const y = (v) => height - 2 - ((v - low) * (height - 4)) / (high - low);
    const path = (series) => {
      let d = "";
      let pen = "M";
      series.forEach((v, i) => {
        if (v === null || !Number.isFinite(v)) {
          pen = "M";
          return;
        }
        d += `${pen}${x(i).toFixed(1)},${y(v).toFixed(1)}`;
        pen = "L";
      });
      return d;
    };
    if (refs.length) box.append(ui.svg("path", { d: path(reference), class: "spark-ref" }));
    box.append(ui.svg("path", { d: path(values), class: "spark-line" }));
    const last = values.length - 1 - [...values].reverse().findIndex((v) => v !== null && Number.isFinite(v));
    box.append(ui.svg("circle", { cx: x(last), cy: y(values[last]), r: 2, class: "spark-dot" }));
    return box;
  },

  // Runs `task` now and every `seconds` while the page is visible; a failing call shows in `status`.
  poll(task, seconds, status) {
    let timer = null;
    const tick = async () => {
      clearTimeout(timer);
      try {
        await task();
        if (status) {
          status.textContent = `live · updated ${new Date().toLocaleTimeString()}`;
          status.classList.remove("stale");
        }
      } catch (error) {
        console.warn(error); // a failed poll is retried; it is not a page error
        if (status) {
          status.textContent = `not updated: ${error.message}`;
          status.classList.add("stale");
        }
      }
      if (!document.hidden) timer = setTimeout(tick, seconds * 1000);
    };
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) tick();
    });
    return tick();
  },
};
