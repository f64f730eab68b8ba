// The run page: charts over steps for one sampler, alert episodes, and one step's cross-scoring matrix.
"use strict";

const RUN = decodeURIComponent(location.pathname.replace(/^\/runs\//, "").replace(/\/$/, ""));
const POLL_SECONDS = 3;
const ALERTS_EVERY_POLLS = 10; // notifications change state without new steps (retries, deliveries)
const ALL = "all"; // the sampler label of batch-level figures (rewards, coverage)
const TRAINER = "trainer"; // the sampler label of figures the trainer computed itself (its SNR filter's, its entropy)

// An estimate with its 95% interval (the service's `<name>_ci_high` and `<name>_ci_low` series): the bounds
// drawn thin in the estimate's colour and the band between them shaded, then any other series of the chart.
function withInterval(name, label, [r, g, b], ...others) {
  const faint = `rgba(${r},${g},${b},0.35)`;
  const bound = (side) => ({ name: `${name}_ci_${side}`, label: `95% ${side}`, color: faint, width: 1 });
  return {
    series: [{ name, label, color: `rgb(${r},${g},${b})` }, bound("high"), bound("low"), ...others],
    band: [`${name}_ci_high`, `${name}_ci_low`],
    bandFill: `rgba(${r},${g},${b},0.14)`,
  };
}

// One chart per concept. `sampler: ALL` marks batch-level figures, `sampler: TRAINER` the trainer's own; the rest
// follow the switch.
const CHARTS = [
  {
    id: "mi",
    title: "Mutual information I(X;Z), 95% interval",
    unit: "nats / token",
    ...withInterval("mi_estimate", "MI estimate", [9, 105, 218]),
  },
  {
    id: "retrieval",
    title: "Retrieval accuracy vs chance",
    unit: "share of rows",
    ...withInterval("retrieval_accuracy", "retrieval accuracy", [130, 80, 223], {
      name: "retrieval_chance_level",
      label: "chance",
      color: "#6e7781",
      dash: [6, 4],
    }),
  },
  {
    id: "dependence",
    title: "Input dependence, length-robust: MI of each reasoning's opening, MI over its permutation null",
    unit: "nats / token",
    series: [
      { name: "mi_head_estimate", label: "MI, first head_tokens tokens", color: "#0550ae" },
      { name: "mi_head_excess", label: "... over its null", color: "#8250df" },
      { name: "mi_excess", label: "MI over its null, all tokens", color: "#6e7781", dash: [6, 4] },
    ],
  },
  {
    id: "dependence-shares",
    title: "Input dependence as shares: retrieval from chance to all, reciprocal rank, MI of its ceiling ln N",
    unit: "share",
    series: [
      { name: "retrieval_chance_corrected", label: "retrieval, chance-corrected", color: "#8250df" },
      { name: "retrieval_mrr", label: "mean reciprocal rank", color: "#bf3989" },
      { name: "mi_seq_normalized", label: "sequence MI / ln N", color: "#0550ae" },
      { name: "mi_permutation_p", label: "p, no dependence", color: "#cf222e", dash: [2, 3], width: 1 },
    ],
  },
  {
    id: "entropy",
    title: "Reasoning entropy: H(Z|X) within input, H(Z) across inputs",
    unit: "nats / token",
    series: [
      { name: "conditional_entropy_est", label: "H(Z|X)", color: "#1a7f37" },
      { name: "reasoning_entropy_est", label: "H(Z)", color: "#bc4c00" },
    ],
  },
  {
    id: "token-entropy",
    title: "Token entropy: the policy's own (trainer) and the reference scorer's",
    unit: "nats / token",
    series: [
      { name: "actor/entropy", sampler: TRAINER, label: "policy entropy (trainer)", color: "#bf3989" },
      { name: "trainer_token_entropy_mean", sampler: ALL, label: "policy, token entropies sent", color: "#8250df" },
      { name: "token_entropy_mean", label: "reference scorer, matched pairs", color: "#0a7e8c", dash: [6, 4] },
    ],
  },
  {
    id: "reward",
    title: "Reward signal: in-group reward std, zero-variance groups",
    unit: "reward std",
    series: [
      { name: "rollout/in_group_reward_std", sampler: ALL, label: "mean in-group reward std", color: "#cf222e" },
      {
        name: "zero_variance_group_ratio",
        sampler: ALL,
        label: "zero-variance share",
        color: "#6e7781",
        scale: "ratio",
      },
    ],
  },
  {
    id: "snr-filter",
    title: "SNR filter in the trainer: kept groups, reward spread of kept and dropped groups",
    unit: "reward std",
    series: [
      { name: "rollout/filter_kept_ratio", sampler: TRAINER, label: "kept share (trainer)", color: "#1a7f37", scale: "ratio" },
      { name: "rollout/filter_engaged", sampler: TRAINER, label: "engaged", color: "#cf222e", scale: "ratio", dash: [2, 3] },
      // 1 on a step whose filter kept no group: the trainer skipped its optimizer step (RAGEN stops after 5 in a row).
      { name: "rollout/filter_skipped", sampler: TRAINER, label: "step skipped (no group kept)", color: "#8250df", scale: "ratio", dash: [1, 2] },
      { name: "rollout/filter_kept_ratio", sampler: ALL, label: "kept share (run's filter advice)", color: "#6e7781", scale: "ratio", dash: [6, 4] },
      { name: "rollout/chosen_in_group_reward_std", sampler: TRAINER, label: "reward std, kept", color: "#0969da" },
      { name: "rollout/dropped_in_group_reward_std", sampler: TRAINER, label: "reward std, dropped", color: "#bc4c00" },
    ],
  },
];

// Multi-turn runs scored with the per_turn sampler: one line per turn index (samplers turn_1 ... turn_8), so the
// turn that loses input dependence first shows first.
const TURN_COLORS = ["#0969da", "#8250df", "#bf3989", "#bc4c00", "#1a7f37", "#0a7e8c", "#6e7781", "#cf222e"];
const isTurn = (sampler) => /^turn_\d+$/.test(sampler);

function turnCharts() {
  const turns = (page.overview?.samplers || []).filter(isTurn).sort((a, b) => a.slice(5) - b.slice(5));
  if (!turns.length) return [];
  const lines = (name) =>
    turns.map((t, i) => ({ name, sampler: t, label: t.replace("_", " "), color: TURN_COLORS[i % TURN_COLORS.length] }));
  return [
    {
      id: "turn-retrieval",
      title: "Input dependence per turn: retrieval, chance-corrected",
      unit: "share",
      series: lines("retrieval_chance_corrected"),
    },
    { id: "turn-mi", title: "Mutual information per turn", unit: "nats / token", series: lines("mi_estimate") },
  ];
}

const allCharts = () => [...CHARTS, ...turnCharts()];

const page = {
  sampler: new URLSearchParams(location.search).get("sampler"),
  overview: null,
  catalogue: {},
  series: new Map(), // "sampler|name" -> {steps, values}
  group: null,
  chartKeys: "",
  alerts: [],
  followLatest: true,
  matrixStep: null,
};

const key = (sampler, name) => `${sampler}|${name}`;
const seriesSampler = (s) => s.sampler || page.sampler;

async function start() {
  document.title = `${RUN} · collapse-monitor`;
  document.getElementById("run-name").textContent = RUN;
  const catalogue = api.catalogue().then((c) => (page.catalogue = c));
  window.addEventListener("resize", () => page.group && page.group.resize());
  await ui.poll(() => refresh(catalogue), POLL_SECONDS, document.getElementById("live"));
  page.renderedAt = performance.now(); // read by bench/web_render.py
}

// One poll: the run's overview row; the rest is fetched only when it changed.
async function refresh(catalogue) {
  const [overview] = await api.overview(0, [RUN]);
  if (!overview) throw new Error(`run ${RUN} does not exist`);
  const changed =
    !page.overview ||
    overview.last_step !== page.overview.last_step ||
    JSON.stringify(overview.batches) !== JSON.stringify(page.overview.batches) ||
    JSON.stringify(overview.alerts) !== JSON.stringify(page.overview.alerts);
  const first = !page.overview;
  page.polls = (page.polls || 0) + 1;
  page.overview = overview;
  if (first) {
    if (!page.sampler || !overview.samplers.includes(page.sampler)) page.sampler = overview.sampler;
  }
  renderHeader(overview);
  if (!changed) {
    if (page.polls % ALERTS_EVERY_POLLS === 0) {
      // Figures a trainer logs after its step's batch move no overview figure: looked for now and then.
      await Promise.all([loadAlerts(), loadSeries(false)]);
      drawCharts();
    }
    return;
  }
  // A run whose first scored step just arrived: load its whole history for the new sampler.
  const samplerArrived = !page.sampler && overview.sampler;
  if (samplerArrived) page.sampler = overview.sampler;
  await Promise.all([loadSeries(first || samplerArrived), loadAlerts(), loadLag(), catalogue]);
  drawCharts();
  if (page.followLatest) await showStep(null);
}

function renderHeader(o) {
  const meta = document.getElementById("run-meta");
  const m = o.metadata || {};
  meta.replaceChildren(
    ...[
      ["project", o.project],
      ["model", m.model],
      ["algorithm", m.algorithm],
      ["environment", m.environment],
      ["scorer", o.scorer],
      ["scored every", o.score_every > 1 ? `${o.score_every} steps` : "step"],
    ]
      .filter(([, v]) => v)
      .map(([k, v]) => ui.el("span", { class: "chip" }, ui.el("b", {}, k), " ", v)),
    ...(m.tags || []).map((t) => ui.el("span", { class: "chip tag" }, t)),
  );
  document.getElementById("run-status").replaceChildren(ui.statusLight(o.status));
  const done = o.batches.done || 0;
  const waiting = (o.batches.queued || 0) + (o.batches.scoring || 0);
  document.getElementById("run-progress").replaceChildren(
    ui.el("span", {}, "last step ", ui.el("b", {}, o.last_step ?? "–")),
    ui.el("span", {}, `${done} batches done`, waiting ? `, ${waiting} waiting` : "", o.batches.failed ? `, ${o.batches.failed} failed` : ""),
    ui.el("span", { title: o.last_batch_at || "" }, "last batch ", ui.ago(o.last_batch_at)),
  );
  const switcher = document.getElementById("sampler-switch");
  const buttons = o.samplers.map((s) =>
    ui.el(
      "button",
      {
        type: "button",
        class: s === page.sampler ? "active" : null,
        "aria-pressed": s === page.sampler ? "true" : "false",
        dataset: { sampler: s },
        onclick: () => switchSampler(s),
      },
      s.replace("_", "-"),
    ),
  );
  switcher.replaceChildren(...(buttons.length ? buttons : [ui.el("span", { class: "muted" }, "no scored step yet")]));
}

async function switchSampler(sampler) {
  if (sampler === page.sampler) return;
  page.sampler = sampler;
  const url = new URL(location.href);
  url.searchParams.set("sampler", sampler);
  history.replaceState(null, "", url);
  renderHeader(page.overview);
  await loadSeries(true);
  drawCharts();
  renderAlerts();
  await showStep(page.followLatest ? null : page.matrixStep);
}

function wanted() {
  const names = new Set();
  const samplers = new Set([page.sampler, ALL, TRAINER]);
  for (const chart of allCharts()) for (const s of chart.series) names.add(s.name);
  names.add("distinct_prompts"); // not drawn: the few-prompts notice reads it
  for (const sampler of (page.overview?.samplers || []).filter(isTurn)) samplers.add(sampler);
  return { names: [...names], samplers: [...samplers].filter(Boolean) };
}

// The whole history on first load; then the steps from the sampler furthest behind on, each held series' points
// from there replaced by the service's. A sampler's points come with their own write (the scorer's when a step is
// scored, batch figures at ingest or scoring, the trainer's with its batch and after the step), so one sampler's
// newer step says nothing of another's: a step still being scored, or a figure the trainer logged after its batch.
async function loadSeries(full) {
  const { names, samplers } = wanted();
  let fromStep;
  if (!full && page.series.size) {
    const newest = new Map(); // sampler -> the newest step held of any of its series
    for (const [k, s] of page.series) {
      const sampler = k.slice(0, k.indexOf("|"));
      newest.set(sampler, Math.max(newest.get(sampler) ?? -1, s.steps[s.steps.length - 1] ?? -1));
    }
    fromStep = Math.max(0, Math.min(...newest.values()));
  }
  const { series: got, truncated } = await api.series(RUN, names, samplers, fromStep);
  page.truncated = truncated;
  if (fromStep === undefined) page.series.clear();
  for (const s of got) {
    const held = page.series.get(key(s.sampler, s.name));
    if (held && fromStep !== undefined) {
      let kept = held.steps.length;
      while (kept > 0 && held.steps[kept - 1] >= fromStep) kept--;
      held.steps.length = held.values.length = kept;
      held.steps.push(...s.steps);
      held.values.push(...s.values);
    } else page.series.set(key(s.sampler, s.name), { steps: s.steps.slice(), values: s.values.slice() });
  }
}

function chartSeries(chart) {
  return chart.series.filter((s) => page.series.has(key(seriesSampler(s), s.name)));
}

function drawCharts() {
  document.getElementById("notice").hidden = !page.truncated;
  showFewPrompts();
  const shown = allCharts();
  const present = shown.map((c) => chartSeries(c).map((s) => key(seriesSampler(s), s.name)).join(",")).join(";");
  const root = document.getElementById("charts");
  if (present !== page.chartKeys) {
    if (page.group) page.group.destroy();
    root.replaceChildren();
    page.group = charts.group((step) => pickStep(step));
    page.chartKeys = present;
    for (const chart of shown) {
      const series = chartSeries(chart);
      const card = ui.el("section", { class: "card chart", id: `chart-${chart.id}`, dataset: { chart: chart.id } });
      card.append(chartHeader(chart, series));
      const body = ui.el("div", { class: "chart-body" });
      card.append(body);
      root.append(card);
      if (!series.length) {
        body.append(ui.el("p", { class: "muted empty" }, "No points in this run yet."));
        continue;
      }
      const band = chart.band && chart.band.every((n) => series.some((s) => s.name === n))
        ? chart.band.map((n) => 1 + series.findIndex((s) => s.name === n))
        : undefined;
      const spec = { title: "", unit: chart.unit, series, band, bandFill: chart.bandFill };
      const member = page.group.add(body, spec, chartData(series));
      member.series = series.map((s) => ({ name: s.name, sampler: seriesSampler(s) }));
      member.chartId = chart.id;
    }
  } else {
    for (const member of page.group.members) {
      page.group.setData(member, chartData(member.spec.series));
    }
  }
  page.group.setEpisodes(episodesShown(), page.overview.last_step);
  page.group.select(page.matrixStep);
}

function chartData(series) {
  return charts.align(series.map((s) => page.series.get(key(seriesSampler(s), s.name))));
}

function chartHeader(chart, series) {
  const names = series.map((s) => s.name);
  const bySampler = new Map();
  for (const s of series) bySampler.set(seriesSampler(s), [...(bySampler.get(seriesSampler(s)) || []), s.name]);
  const csv = [...bySampler].map(([sampler, ns]) =>
    ui.el("a", { href: api.seriesCsvUrl(RUN, ns, sampler), class: "link", download: `${RUN}-${chart.id}-${sampler}.csv` }, bySampler.size > 1 ? `CSV (${sampler})` : "CSV"),
  );
  const queries = series
    .filter((s) => page.catalogue[s.name])
    .map((s) => `${page.catalogue[s.name].prometheus}{run="${RUN}",sampler="${seriesSampler(s)}"}`);
  const promql = queries.length
    ? ui.el(
        "details",
        { class: "promql" },
        ui.el("summary", {}, "PromQL"),
        ui.el("pre", {}, queries.join("\n")),
        ui.el("button", { type: "button", onclick: () => navigator.clipboard?.writeText(queries.join("\n")) }, "copy"),
      )
    : null;
  const help = names.map((n) => page.catalogue[n]?.help).filter(Boolean).join(" ");
  return ui.el(
    "header",
    {},
    ui.el("h3", { title: help }, chart.title),
    ui.el("div", { class: "chart-links" }, ...csv, promql),
  );
}

// Whether scoring keeps pace with the trainer (the run's scoring_lag, with the figures to change).
async function loadLag() {
  const run = await api.run(RUN);
  const notice = document.getElementById("lag");
  notice.textContent = run.scoring_lag || "";
  notice.hidden = !run.scoring_lag;
  page.minPrompts = run.alerts.min_prompts;
}

// A step of fewer distinct prompts than the run's min_prompts is not judged by TemplateCollapse: say so when the
// newest scored step of the shown sampler is one.
function showFewPrompts() {
  const held = page.series.get(key(page.sampler, "distinct_prompts"));
  const prompts = held && held.values.length ? held.values[held.values.length - 1] : null;
  const notice = document.getElementById("few-prompts");
  notice.hidden = !(prompts !== null && page.minPrompts && prompts < page.minPrompts);
  notice.textContent = notice.hidden
    ? ""
    : `The newest scored step of ${page.sampler} has ${prompts} distinct prompt${prompts === 1 ? "" : "s"}: ` +
      `TemplateCollapse does not judge steps of fewer than ${page.minPrompts} (one retrieval miss moves the ` +
      `signal by a third of its range there). Send rows of more prompts a step to be watched.`;
}

async function loadAlerts() {
  // Dropped episodes (pending ones whose condition broke before they fired) are records, asked for apart.
  const [counting, dropped] = await Promise.all([api.alerts(RUN), api.alerts(RUN, "dropped")]);
  page.alerts = [...counting, ...dropped].sort((a, b) => a.id - b.id);
  renderAlerts();
}

function episodesShown() {
  return page.alerts.filter((a) => a.sampler === page.sampler || a.sampler === ALL);
}

function renderAlerts() {
  const root = document.getElementById("alerts");
  const shown = episodesShown();
  if (page.group) page.group.setEpisodes(shown, page.overview.last_step);
  if (!page.alerts.length) {
    root.replaceChildren(ui.el("p", { class: "muted" }, "No alert episodes on this run."));
    return;
  }
  const rows = [...page.alerts].reverse().map((a) =>
    ui.el(
      "tr",
      {
        class: a.sampler === page.sampler || a.sampler === ALL ? null : "other-sampler",
        dataset: { alertId: a.id, onsetStep: a.onset_step },
        onclick: () => pickStep(a.onset_step),
        title: a.description,
      },
      ui.el("td", {}, ui.el("span", { class: `badge ${a.state}` }, a.state)),
      ui.el("td", {}, ui.el("b", {}, a.rule), ui.el("div", { class: "muted small" }, `${a.severity} · ${a.sampler}`)),
      ui.el("td", { class: "num" }, a.onset_step),
      ui.el("td", { class: "num" }, a.fired_step ?? "–"),
      ui.el("td", { class: "num" }, a.resolved_step ?? "–"),
      ui.el("td", { class: "summary" }, a.summary),
      ui.el("td", {}, deliveries(a.deliveries)),
    ),
  );
  root.replaceChildren(
    ui.el(
      "table",
      { class: "grid alerts-table" },
      ui.el(
        "thead",
        {},
        ui.el("tr", {}, ...["state", "rule", "onset", "fired", "resolved", "summary", "notifications"].map((h) => ui.el("th", {}, h))),
      ),
      ui.el("tbody", {}, rows),
    ),
  );
}

function deliveries(list) {
  if (!list.length) return ui.el("span", { class: "muted small" }, "no receiver configured");
  return ui.el(
    "ul",
    { class: "deliveries" },
    list.map((d) =>
      ui.el(
        "li",
        { title: d.last_error || d.url },
        ui.el("span", { class: `badge delivery ${d.status}` }, d.status),
        ` ${d.receiver} · ${d.event}`,
        d.attempts > 1 ? ` · ${d.attempts} tries` : "",
      ),
    ),
  );
}

// A click on a chart: the nearest scored step of this sampler.
function pickStep(step) {
  const scored = page.series.get(key(page.sampler, "mi_estimate"))?.steps || [];
  if (!scored.length) return;
  let best = scored[0];
  for (const s of scored) if (Math.abs(s - step) < Math.abs(best - step)) best = s;
  page.followLatest = false;
  showStep(best);
}

async function showStep(step) {
  const root = document.getElementById("step");
  if (!page.sampler || !page.series.has(key(page.sampler, "mi_estimate"))) {
    root.replaceChildren(ui.el("p", { class: "muted" }, "No scored step yet."));
    return;
  }
  let matrix;
  try {
    matrix = await api.matrix(RUN, page.sampler, step ?? undefined);
  } catch (error) {
    if (error.status !== 404) throw error;
    root.replaceChildren(ui.el("p", { class: "muted" }, error.detail));
    return;
  }
  page.matrixStep = matrix.step;
  if (page.group) page.group.select(matrix.step);
  renderStep(matrix);
}

function renderStep(m) {
  const root = document.getElementById("step");
  const follow = page.followLatest
    ? ui.el("span", { class: "muted small" }, "following the newest scored step; click a chart to pick one")
    : ui.el("button", { type: "button", onclick: () => ((page.followLatest = true), showStep(null)) }, "follow newest step");
  const metrics = m.metrics || {};
  root.replaceChildren(
    ui.el(
      "header",
      { class: "step-header" },
      ui.el(
        "h2",
        {},
        `Step ${m.step}`,
        ui.el("span", { class: "muted" }, ` · ${m.sampler} · ${m.rows} reasoning rows × ${m.columns} prompts`),
        m.scored_by
          ? ui.el("span", { class: "muted small", title: m.scored_by.server || "" }, ` · scored by ${m.scored_by.engine}, ${m.scored_by.model}, ${m.scored_by.dtype}`)
          : "",
        metrics.trainer_scorer_logprob_gap !== undefined
          ? ui.el(
              "span",
              { class: "muted small", title: "mean |trainer − scorer| log p per reasoning token, matched pairs (docs/scoring.md)" },
              ` · trainer gap ${ui.num(metrics.trainer_scorer_logprob_gap)} nats/token`,
            )
          : "",
      ),
      ui.el(
        "div",
        { class: "step-figures" },
        figure("MI", ui.num(metrics.mi_estimate), "nats"),
        figure("retrieval", ui.pct(metrics.retrieval_accuracy), `chance ${ui.pct(metrics.retrieval_chance_level)}`),
        figure("H(Z|X)", ui.num(metrics.conditional_entropy_est), "nats"),
        figure("H(Z)", ui.num(metrics.reasoning_entropy_est), "nats"),
      ),
      follow,
    ),
    ui.el(
      "div",
      { class: "step-body" },
      ui.el(
        "section",
        { class: "card heatmap-card" },
        ui.el("h3", {}, "Cross-scoring matrix, row-normalized"),
        ui.el("p", { class: "muted small" }, "Rows: reasoning samples z_i grouped by their own prompt; columns: prompts x_j."),
        heatmap(m),
      ),
      ui.el("section", { class: "card breakdown-card" }, ui.el("h3", {}, "Per prompt, worst first"), breakdown(m)),
    ),
  );
}

function figure(label, value, note) {
  return ui.el("div", { class: "figure" }, ui.el("div", { class: "muted small" }, label), ui.el("b", {}, value), ui.el("div", { class: "muted small" }, note));
}

// Viridis, sampled at 9 stops: dark for 0, bright yellow for 1.
const VIRIDIS = ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"];

function colour(p) {
  const x = Math.min(Math.max(p, 0), 1) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(x), VIRIDIS.length - 2);
  const mix = (a, b, t) => Math.round(a + (b - a) * t);
  const rgb = (h) => [1, 3, 5].map((o) => parseInt(h.slice(o, o + 2), 16));
  const [a, b] = [rgb(VIRIDIS[i]), rgb(VIRIDIS[i + 1])];
  return `rgb(${mix(a[0], b[0], x - i)},${mix(a[1], b[1], x - i)},${mix(a[2], b[2], x - i)})`;
}

function heatmap(m) {
  const R = m.rows;
  const N = m.columns;
  const cw = Math.max(4, Math.min(72, Math.floor(520 / N)));
  const ch = Math.max(2, Math.min(28, Math.floor(420 / R)));
  const left = 56;
  const top = 40;
  const width = left + N * cw + 8;
  const height = top + R * ch + 8;
  const svg = ui.svg("svg", { class: "heatmap", width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
  svg.append(ui.svg("title", {}, `Step ${m.step}: p(prompt | reasoning) for ${R} rows and ${N} prompts`));
  const label = (j) => m.column_group_ids[j];
  for (let j = 0; j < N; j++) {
    if (N <= 40 || j % Math.ceil(N / 40) === 0) {
      svg.append(ui.svg("text", { x: left + j * cw + cw / 2, y: top - 6, class: "axis", "text-anchor": "middle" }, label(j)));
    }
  }
  svg.append(ui.svg("text", { x: left, y: 12, class: "axis title" }, "prompt x_j (columns) →"));
  svg.append(ui.svg("text", { x: 4, y: top - 6, class: "axis title" }, "own ↓"));
  const cells = ui.svg("g", { class: "cells" });
  for (let i = 0; i < R; i++) {
    const own = m.row_columns[i];
    for (let j = 0; j < N; j++) {
      const p = m.row_normalized[i][j];
      const rect = ui.svg("rect", {
        x: left + j * cw,
        y: top + i * ch,
        width: cw,
        height: ch,
        fill: colour(p),
        class: j === own ? "cell own" : "cell",
      });
      rect.append(
        ui.svg("title", {}, `row ${i} (prompt ${label(own)}) under prompt ${label(j)}: p = ${p.toFixed(3)}, log p = ${ui.num(m.L_tok[i][j])} nats/token`),
      );
      cells.append(rect);
    }
  }
  svg.append(cells);
  // Group labels and separators: rows come grouped by their own prompt.
  let startRow = 0;
  for (let i = 1; i <= R; i++) {
    if (i === R || m.row_columns[i] !== m.row_columns[startRow]) {
      const mid = top + ((startRow + i) / 2) * ch;
      svg.append(ui.svg("text", { x: left - 6, y: mid + 4, class: "axis", "text-anchor": "end" }, label(m.row_columns[startRow])));
      if (i < R) svg.append(ui.svg("line", { x1: left, x2: left + N * cw, y1: top + i * ch, y2: top + i * ch, class: "sep" }));
      startRow = i;
    }
  }
  const legend = ui.el(
    "div",
    { class: "heat-legend" },
    ui.el("span", {}, "0"),
    ui.el("span", { class: "ramp", style: `background: linear-gradient(to right, ${VIRIDIS.join(",")})` }),
    ui.el("span", {}, "1"),
    ui.el("span", { class: "muted small" }, ` p(prompt | reasoning) per row; chance 1/${N} = ${(1 / N).toFixed(2)}. A healthy batch lights the diagonal blocks; a collapsed one is flat.`),
  );
  return ui.el("div", { class: "heatmap-wrap" }, svg, legend);
}

function breakdown(m) {
  if (!m.per_prompt.length) return ui.el("p", { class: "muted" }, "No per-prompt figures for this step.");
  const rows = m.per_prompt.map((c) =>
    ui.el(
      "tr",
      {},
      ui.el("td", { class: "num" }, c.group_id),
      ui.el("td", { class: "num" }, c.n_rows),
      ui.el("td", { class: "num" }, ui.num(c.mi_term)),
      ui.el("td", { class: "num" }, ui.pct(c.retrieval_rate)),
      ui.el("td", { class: "num" }, ui.num(c.conditional_entropy)),
      ui.el(
        "td",
        { class: "excerpts" },
        c.excerpts.length
          ? c.excerpts.map((text) => ui.el("q", { title: text }, text.length > 140 ? text.slice(0, 140) + "…" : text))
          : ui.el("span", { class: "muted small" }, "no text (matrix sent by the trainer)"),
      ),
    ),
  );
  return ui.el(
    "table",
    { class: "grid breakdown" },
    ui.el(
      "thead",
      {},
      ui.el(
        "tr",
        {},
        ui.el("th", {}, "prompt"),
        ui.el("th", {}, "rows"),
        ui.el("th", { title: "mean over the prompt's rows of log p(z|x) − log mean_j p(z|x_j), nats/token" }, "MI term"),
        ui.el("th", { title: "share of the prompt's rows whose own prompt scores highest" }, "retrieval"),
        ui.el("th", { title: "−mean log p(z|x) over the prompt's own rows, nats/token" }, "H(Z|X)"),
        ui.el("th", {}, "reasoning excerpts"),
      ),
    ),
    ui.el("tbody", {}, rows),
  );
}

document.addEventListener("DOMContentLoaded", () => {
  start().catch((error) => {
    console.error(error);
    document.getElementById("live").textContent = `failed: ${error.message}`;
  });
});

// The page's state, for tests and for poking at it from the console.
window.collapseMonitor = page;
page.pickStep = pickStep;
