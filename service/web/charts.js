// Time-series charts over training steps (uPlot): one shared zoomable step axis, alert episodes
// shaded on every chart, a marker on the selected step. Only draws what the API returned.
"use strict";

const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2.5e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];
const PALETTE = ["#0969da", "#8250df", "#1a7f37", "#bc4c00", "#cf222e", "#0a7e8c", "#6e7781", "#bf3989"];

const charts = {
  // Aligns series given as {steps, values} onto one ascending step axis (nulls where a series has
  // no point), the layout uPlot draws from. No value is changed.
  align(seriesList) {
    const steps = new Set();
    for (const s of seriesList) for (const step of s.steps) steps.add(step);
    const xs = Float64Array.from(steps).sort();
    const index = new Map();
    xs.forEach((step, i) => index.set(step, i));
    const columns = seriesList.map((s) => {
      const out = new Array(xs.length).fill(null);
      s.steps.forEach((step, i) => (out[index.get(step)] = s.values[i]));
      return out;
    });
    return [Array.from(xs), ...columns];
  },

  // A group of charts that zoom together and share the cursor and the episode overlays.
  group(onStepClick) {
    const members = [];
    let syncing = false;
    const sync = uPlot.sync("steps");
    const state = { episodes: [], selectedStep: null, lastStep: null };

    const overlay = (u) => {
      const over = u.over;
      over.querySelectorAll(".alert-span, .alert-mark, .step-marker").forEach((n) => n.remove());
      const [lo, hi] = [u.scales.x.min, u.scales.x.max];
      if (lo === undefined || hi === undefined || lo === null) return;
      const px = (step) => u.valToPos(step, "x");
      const clampPx = (step) => Math.min(Math.max(px(step), 0), over.clientWidth);
      const span = (from, to, kind, episode) => {
        if (to < lo || from > hi) return;
        const left = clampPx(from);
        const width = Math.max(clampPx(to) - left, 2);
        over.append(
          ui.el("div", {
            class: `alert-span ${kind}`,
            style: `left:${left}px;width:${width}px`,
            title: `${episode.rule} ${kind} from step ${from}${to === from ? "" : ` to ${to}`}: ${episode.summary}`,
            dataset: { rule: episode.rule, kind, fromStep: from, toStep: to, alertId: episode.id },
          }),
        );
      };
      const mark = (step, kind, episode) => {
        if (step < lo || step > hi) return;
        over.append(
          ui.el("div", {
            class: `alert-mark ${kind}`,
            style: `left:${px(step)}px`,
            title: `${episode.rule} ${kind} at step ${step}`,
            dataset: { rule: episode.rule, kind, step },
          }),
        );
      };
      for (const e of state.episodes) {
        if (e.state === "dropped") {
          span(e.onset_step, e.step ?? e.onset_step, "dropped", e); // went pending, never fired
          mark(e.onset_step, "onset", e);
          continue;
        }
        // An episode still open runs to the newest step the page has.
        const end = e.resolved_step ?? Math.max(e.step ?? e.onset_step, state.lastStep ?? e.onset_step);
        const pendingEnd = e.fired_step ?? end;
        span(e.onset_step, pendingEnd, "pending", e);
        if (e.fired_step !== null && e.fired_step !== undefined) span(e.fired_step, end, "firing", e);
        mark(e.onset_step, "onset", e);
        if (e.resolved_step !== null && e.resolved_step !== undefined) mark(e.resolved_step, "resolved", e);
      }
      if (state.selectedStep !== null && state.selectedStep >= lo && state.selectedStep <= hi) {
        over.append(ui.el("div", { class: "step-marker", style: `left:${px(state.selectedStep)}px` }));
      }
    };

    const api = {
      members,
      state,

      // spec: {title, unit, series: [{name, sampler, label, color, dash, scale}], band: [hiIndex, loIndex]}
      add(container, spec, data) {
        const width = Math.max(container.clientWidth, 300);
        const series = [{ label: "step", value: (u, v) => (v === null ? "–" : v) }].concat(
          spec.series.map((s, i) => ({
            label: s.label,
            stroke: s.color || PALETTE[i % PALETTE.length],
            width: s.width ?? (s.dash ? 1 : 2),
            dash: s.dash,
            scale: s.scale || "y",
            spanGaps: true,
            points: { show: (u, si, i0, i1) => i1 - i0 < 60, size: 4 },
            value: (u, v) => (v === null ? "–" : ui.num(v)),
            show: s.show ?? true,
          })),
        );
        const axes = [
          // Steps are whole numbers: no tick at 2.5.
          { label: "training step", labelSize: 18, size: 36, incrs: STEP_INCRS, values: (u, ticks) => ticks.map(String) },
          { label: spec.unit, labelSize: 18, size: 56, scale: "y" },
        ];
        const scales = { x: { time: false }, y: { auto: true, range: spec.range } };
        if (spec.series.some((s) => s.scale === "ratio")) {
          scales.ratio = { auto: false, range: [0, 1] };
          axes.push({ label: "share", labelSize: 18, scale: "ratio", side: 1, size: 48, grid: { show: false } });
        }
        const opts = {
          width,
          height: spec.height || 220,
          title: spec.title,
          series,
          axes,
          scales,
          bands: spec.band ? [{ series: spec.band, fill: spec.bandFill || "rgba(9,105,218,0.14)" }] : [],
          cursor: { sync: { key: sync.key, setSeries: false }, drag: { x: true, y: false, setScale: true } },
          legend: { live: true },
          hooks: {
            setScale: [
              (u, key) => {
                if (key !== "x" || syncing) return;
                syncing = true;
                for (const other of members) {
                  if (other.u !== u) other.u.setScale("x", { min: u.scales.x.min, max: u.scales.x.max });
                }
                syncing = false;
              },
            ],
            draw: [overlay],
          },
        };
        const u = new uPlot(opts, data, container);
        u.over.addEventListener("click", () => {
          // A drag zooms; only a plain click picks the step under the cursor.
          if (u.select.width > 1 || u.cursor.idx === null || u.cursor.idx === undefined) return;
          onStepClick(u.data[0][u.cursor.idx]);
        });
        const member = { u, spec, container };
        members.push(member);
        return member;
      },

      setData(member, data) {
        const zoomed = member.u.scales.x.min !== undefined && api.isZoomed();
        const { min, max } = member.u.scales.x;
        member.u.setData(data, !zoomed);
        if (zoomed) member.u.setScale("x", { min, max });
      },

      // Zoomed in when the shown range is narrower than the data's.
      isZoomed() {
        const u = members[0]?.u;
        if (!u || !u.data[0].length) return false;
        const xs = u.data[0];
        return u.scales.x.min > xs[0] || u.scales.x.max < xs[xs.length - 1];
      },

      setEpisodes(episodes, lastStep) {
        state.episodes = episodes;
        state.lastStep = lastStep;
        members.forEach((m) => m.u.redraw(false, false));
      },

      select(step) {
        state.selectedStep = step;
        members.forEach((m) => m.u.redraw(false, false));
      },

      resize() {
        for (const m of members) m.u.setSize({ width: Math.max(m.container.clientWidth, 300), height: m.u.height });
      },

      destroy() {
        members.splice(0).forEach((m) => m.u.destroy());
      },
    };
    return api;
  },
};
