// The compare page: one metric of several runs overlaid on one step axis.
"use strict";

const query = new URLSearchParams(location.search);
const state = {
  runs: (query.get("runs") || "").split(",").filter(Boolean),
  metric: query.get("metric") || "mi_estimate",
  sampler: query.get("sampler") || "", // "" = each run's primary sampler
  overview: [],
  catalogue: {},
  group: null,
};

function keepInUrl() {
  const url = new URL(location.href);
  url.search = api.query({ runs: state.runs.join(","), metric: state.metric, sampler: state.sampler });
  history.replaceState(null, "", url);
}

function controls() {
  const metric = document.getElementById("metric");
  metric.replaceChildren(
    ...Object.values(state.catalogue).map((m) =>
      ui.el("option", { value: m.stored, selected: m.stored === state.metric, title: m.help }, `${m.stored} — ${m.help}`),
    ),
  );
  metric.onchange = () => ((state.metric = metric.value), keepInUrl(), draw());
  const samplers = new Set();
  for (const r of state.overview) for (const s of r.samplers) samplers.add(s);
  const sampler = document.getElementById("sampler");
  sampler.replaceChildren(
    ui.el("option", { value: "", selected: !state.sampler }, "each run's main sampler"),
    ...[...samplers, "all"].map((s) => ui.el("option", { value: s, selected: s === state.sampler }, s)),
  );
  sampler.onchange = () => ((state.sampler = sampler.value), keepInUrl(), draw());
  const list = document.getElementById("run-list");
  list.replaceChildren(
    ...state.overview.map((r) =>
      ui.el(
        "label",
        { class: "run-choice" },
        ui.el("input", {
          type: "checkbox",
          value: r.name,
          checked: state.runs.includes(r.name),
          onchange: (e) => {
            state.runs = e.target.checked ? [...state.runs, r.name] : state.runs.filter((n) => n !== r.name);
            keepInUrl();
            draw();
          },
        }),
        ui.statusLight(r.status),
        " ",
        r.name,
      ),
    ),
  );
}

function samplerOf(run) {
  return state.sampler || state.overview.find((r) => r.name === run)?.sampler || "all";
}

async function draw() {
  const root = document.getElementById("chart");
  const links = document.getElementById("links");
  if (state.group) state.group.destroy();
  state.group = null;
  root.replaceChildren();
  links.replaceChildren();
  if (!state.runs.length) {
    root.append(ui.el("p", { class: "muted" }, "Pick runs on the left."));
    return;
  }
  // Batch-level figures are stored under the sampler "all": ask for both, keep what exists.
  const fetched = await Promise.all(
    state.runs.map(async (run) => (await api.series(run, [state.metric], [...new Set([samplerOf(run), "all"])])).series),
  );
  const series = [];
  const labels = [];
  fetched.forEach((list, i) => {
    const found = list.find((s) => s.sampler === samplerOf(state.runs[i])) || list[0];
    if (!found) return;
    series.push(found);
    labels.push({ name: state.metric, sampler: found.sampler, label: `${state.runs[i]} (${found.sampler})`, run: state.runs[i] });
  });
  const missing = state.runs.filter((run) => !labels.some((l) => l.run === run));
  if (missing.length) root.append(ui.el("p", { class: "muted" }, `No ${state.metric} points for: ${missing.join(", ")}`));
  if (!series.length) return;
  const body = ui.el("div", { class: "chart-body" });
  root.append(body);
  state.group = charts.group(() => {});
  const member = state.group.add(body, { unit: state.metric, series: labels, height: 380 }, charts.align(series));
  member.series = labels.map((l) => ({ name: l.name, sampler: l.sampler, run: l.run }));
  const prom = state.catalogue[state.metric]?.prometheus;
  links.append(
    ...labels.map((l) => ui.el("a", { class: "link", href: api.seriesCsvUrl(l.run, [state.metric], l.sampler) }, `CSV ${l.run}`)),
    prom
      ? ui.el("pre", { class: "promql-inline" }, `${prom}{run=~"${labels.map((l) => l.run).join("|")}",sampler=~"${[...new Set(labels.map((l) => l.sampler))].join("|")}"}`)
      : null,
  );
}

async function start() {
  [state.catalogue, state.overview] = await Promise.all([api.catalogue(), api.overview(0)]);
  controls();
  await draw();
  window.addEventListener("resize", () => state.group && state.group.resize());
}

document.addEventListener("DOMContentLoaded", () => {
  start().catch((error) => {
    console.error(error);
    document.getElementById("chart").textContent = `failed: ${error.message}`;
  });
});

window.collapseMonitor = state;
