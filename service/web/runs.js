// The runs page: one row per run with its status light, latest MI and retrieval, sort and filter; a page of
// runs at a time (the overview's keyset pages, oldest run first), and only the shown page is polled.
"use strict";

const SPARK_POINTS = 60;
const PAGE_RUNS = 100; // the overview's default page; ?limit= in the page's URL changes it
const STATUS_ORDER = { firing: 0, pending: 1, healthy: 2, waiting: 3 };

const COLUMNS = [
  { id: "select", label: "", sortable: false },
  { id: "status", label: "status", value: (r) => STATUS_ORDER[r.status] ?? 9 },
  { id: "name", label: "run", value: (r) => r.name.toLowerCase() },
  { id: "metadata", label: "model · algorithm · environment", sortable: false },
  { id: "last_step", label: "last step", value: (r) => r.last_step ?? -1, numeric: true },
  { id: "mi", label: "MI (nats)", value: (r) => latest(r, "mi_estimate") ?? -Infinity, numeric: true },
  { id: "retrieval", label: "retrieval vs chance", value: (r) => latest(r, "retrieval_above_chance") ?? -Infinity, numeric: true },
  { id: "last_batch", label: "last batch", value: (r) => (r.last_batch_at ? Date.parse(r.last_batch_at) : 0), numeric: true },
];

const params = new URLSearchParams(location.search);
const view = {
  runs: [],
  filter: params.get("q") || "",
  sort: params.get("sort") || "last_batch",
  descending: params.get("order") ? params.get("order") === "desc" : true,
  selected: new Set(),
  limit: Math.min(Math.max(Math.trunc(Number(params.get("limit"))) || PAGE_RUNS, 1), 1000), // the API takes 1-1000
  after: params.get("after") || null, // the page shown: the runs after this one (null: the first page)
  next: null, // the `after` of the next page; null on the last
  earlier: [], // the `after` of the pages before the shown one, as they were followed
};

function latest(run, name) {
  return run.latest?.[name]?.value ?? null;
}

function keepInUrl() {
  const url = new URL(location.href);
  const order = view.descending ? "desc" : "asc";
  const limit = view.limit === PAGE_RUNS ? null : view.limit;
  url.search = api.query({ q: view.filter, sort: view.sort, order, limit, after: view.after });
  history.replaceState(null, "", url);
}

function shown() {
  const needle = view.filter.trim().toLowerCase();
  const column = COLUMNS.find((c) => c.id === view.sort) || COLUMNS[COLUMNS.length - 1];
  const rows = view.runs.filter((r) => !needle || r.name.toLowerCase().includes(needle));
  const sign = view.descending ? -1 : 1;
  return rows.sort((a, b) => {
    const [x, y] = [column.value(a), column.value(b)];
    if (x < y) return -sign;
    if (x > y) return sign;
    return a.name.localeCompare(b.name);
  });
}

function render() {
  const head = ui.el(
    "tr",
    {},
    COLUMNS.map((c) => {
      if (c.sortable === false) return ui.el("th", {}, c.label);
      const active = c.id === view.sort;
      return ui.el(
        "th",
        {
          class: `sortable${c.numeric ? " num" : ""}${active ? " sorted" : ""}`,
          "aria-sort": active ? (view.descending ? "descending" : "ascending") : "none",
          dataset: { sort: c.id },
          onclick: () => {
            view.descending = c.id === view.sort ? !view.descending : c.numeric || c.id === "status" ? c.id !== "status" : false;
            view.sort = c.id;
            keepInUrl();
            render();
          },
        },
        c.label,
        active ? (view.descending ? " ▾" : " ▴") : "",
      );
    }),
  );
  const runs = shown();
  const body = runs.map((r) => row(r));
  const table = document.getElementById("runs");
  table.replaceChildren(ui.el("thead", {}, head), ui.el("tbody", {}, body));
  const count = document.getElementById("run-count");
  const noun = view.runs.length === 1 ? "run" : "runs";
  count.textContent =
    runs.length === view.runs.length ? `${runs.length} ${noun}` : `${runs.length} of ${view.runs.length} ${noun}`;
  document.getElementById("empty").hidden = view.runs.length > 0 || view.after !== null;
  renderPager();
  renderCompare();
}

// Sorting and the filter work within the shown page; the pages follow the runs' creation order.
function renderPager() {
  const pager = document.getElementById("pager");
  pager.hidden = view.after === null && view.next === null;
  const previous = document.getElementById("previous-page");
  previous.disabled = view.after === null;
  previous.onclick = () => turnTo(view.earlier.length ? view.earlier.pop() : null);
  const next = document.getElementById("next-page");
  next.disabled = view.next === null;
  next.onclick = () => {
    view.earlier.push(view.after);
    turnTo(view.next);
  };
}

async function turnTo(after) {
  view.after = after;
  keepInUrl();
  await refresh().catch((error) => console.warn(error)); // the poll shows it, and tries again
}

function row(r) {
  const m = r.metadata || {};
  const spark = r.sparkline || { steps: [] };
  const chance = latest(r, "retrieval_chance_level");
  return ui.el(
    "tr",
    { dataset: { run: r.name, status: r.status } },
    ui.el(
      "td",
      {},
      ui.el("input", {
        type: "checkbox",
        "aria-label": `compare ${r.name}`,
        checked: view.selected.has(r.name),
        onchange: (e) => {
          if (e.target.checked) view.selected.add(r.name);
          else view.selected.delete(r.name);
          renderCompare();
        },
      }),
    ),
    ui.el("td", {}, ui.statusLight(r.status), r.alerts.firing + r.alerts.pending ? ui.el("span", { class: "muted small" }, ` ${alertText(r.alerts)}`) : null),
    ui.el(
      "td",
      { class: "run-name" },
      ui.el("a", { href: `/runs/${encodeURIComponent(r.name)}` }, r.name),
      r.project ? ui.el("div", { class: "muted small" }, r.project) : null,
    ),
    ui.el("td", { class: "small" }, [m.model, m.algorithm, m.environment].filter(Boolean).join(" · ") || ui.el("span", { class: "muted" }, "–")),
    ui.el("td", { class: "num" }, r.last_step ?? "–"),
    ui.el(
      "td",
      { class: "num metric", dataset: { metric: "mi_estimate" } },
      ui.el("span", { class: "value" }, ui.num(latest(r, "mi_estimate"))),
      ui.sparkline(spark.mi_estimate || []),
    ),
    ui.el(
      "td",
      { class: "num metric", dataset: { metric: "retrieval_accuracy" } },
      ui.el(
        "span",
        { class: "value", title: `retrieval accuracy ${ui.pct(latest(r, "retrieval_accuracy"))}, chance ${ui.pct(chance)}` },
        ui.pct(latest(r, "retrieval_accuracy")),
        ui.el("span", { class: "muted small" }, ` / ${ui.pct(chance)}`),
      ),
      ui.sparkline(spark.retrieval_accuracy || [], { reference: spark.retrieval_chance_level, domain: [0, 1] }),
    ),
    ui.el("td", { class: "num", title: r.last_batch_at || "" }, ui.ago(r.last_batch_at)),
  );
}

function alertText(alerts) {
  return [alerts.firing ? `${alerts.firing} firing` : "", alerts.pending ? `${alerts.pending} pending` : ""]
    .filter(Boolean)
    .join(", ");
}

function renderCompare() {
  const link = document.getElementById("compare-link");
  const names = [...view.selected]; // runs picked on other pages too
  link.href = "/compare" + api.query({ runs: names.join(",") });
  link.textContent = names.length ? `Compare ${names.length} selected` : "Compare runs";
}

async function refresh() {
  const after = view.after;
  let page;
  try {
    page = await api.overviewPage(SPARK_POINTS, view.limit, after);
  } catch (error) {
    if (error.status !== 404 || after === null || after !== view.after) throw error;
    [view.after, view.earlier] = [null, []]; // the run the page started after was deleted: the first page
    keepInUrl();
    return refresh();
  }
  if (after !== view.after) return; // the page was turned while this poll was out: its answer is the old page's
  [view.runs, view.next] = [page.runs, page.after];
  render();
}

document.addEventListener("DOMContentLoaded", () => {
  const filter = document.getElementById("filter");
  filter.value = view.filter;
  filter.addEventListener("input", () => {
    view.filter = filter.value;
    keepInUrl();
    render();
  });
  ui.poll(refresh, 5, document.getElementById("live")).then(() => (view.renderedAt = performance.now()));
});

// The page's state, for tests and benchmarks (bench/web_render.py reads renderedAt).
window.collapseMonitor = view;
