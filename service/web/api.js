// The pages' only door to the server: JSON API calls with the user's bearer token, if one is set.
// Every number shown comes from these calls; the pages only pick, order and draw.
"use strict";

const TOKEN_KEY = "collapse-monitor.token";
const SERIES_LIMIT = 1000000; // the API's largest page of points
const OVERVIEW_MAX_RUNS = 1000; // the API's largest page of runs (the compare page lists them)

const api = {
  token() {
    return localStorage.getItem(TOKEN_KEY) || "";
  },

  setToken(token) {
    if (token) localStorage.setItem(TOKEN_KEY, token);
    else localStorage.removeItem(TOKEN_KEY);
  },

  // GET a JSON document; on 401/403 asks for a token once and retries with it.
  async get(path) {
    return (await api.getPage(path)).body;
  },

  // GET a JSON document and the `after` of its next page (its `Link: <...>; rel="next"`; null on the last page).
  async getPage(path) {
    for (let attempt = 0; ; attempt++) {
      const headers = { Accept: "application/json" };
      const token = api.token();
      if (token) headers.Authorization = `Bearer ${token}`;
      const response = await fetch(path, { headers });
      if ((response.status === 401 || response.status === 403) && attempt === 0) {
        const given = await askForToken(response.status, await errorText(response));
        if (given !== null) continue;
      }
      if (!response.ok) throw new ApiError(path, response.status, await errorText(response));
      const next = /<([^>]*)>;\s*rel="next"/.exec(response.headers.get("Link") || "");
      return { body: await response.json(), after: next ? new URL(next[1], location.href).searchParams.get("after") : null };
    }
  },

  // Query strings without empty values.
  query(params) {
    const kept = Object.entries(params).filter(([, v]) => v !== undefined && v !== null && v !== "");
    return kept.length ? "?" + new URLSearchParams(kept).toString() : "";
  },

  runPath(run) {
    return `/v1/runs/${encodeURIComponent(run)}`;
  },

  // The metric catalogue: stored name -> {prometheus, help}.
  async catalogue() {
    const body = await api.get("/v1/catalogue");
    return Object.fromEntries(body.metrics.map((m) => [m.stored, m]));
  },

  // Runs with what the runs page shows (status, latest figures, sparklines), in one request:
  // the first OVERVIEW_MAX_RUNS runs, or only those named.
  async overview(points, runs) {
    const params = { points, runs: runs && runs.join(","), limit: OVERVIEW_MAX_RUNS };
    return (await api.get("/v1/overview" + api.query(params))).runs;
  },

  // A page of `limit` runs after the run called `after` (the first page without it): {runs, after}, where
  // `after` opens the next page (null on the last).
  async overviewPage(points, limit, after) {
    const page = await api.getPage("/v1/overview" + api.query({ points, limit, after }));
    return { runs: page.body.runs, after: page.after };
  },

  async run(run) {
    return api.get(api.runPath(run));
  },

  // Series as columns: {series: [{name, sampler, steps, values}], truncated}, from `fromStep` on when given.
  async series(run, names, samplers, fromStep) {
    const params = { names: names.join(","), sampler: samplers.join(","), from_step: fromStep };
    return api.get(api.runPath(run) + "/metrics" + api.query({ ...params, format: "columns", limit: SERIES_LIMIT }));
  },

  seriesCsvUrl(run, names, sampler) {
    return api.runPath(run) + "/metrics" + api.query({ names: names.join(","), sampler, format: "csv" });
  },

  async alerts(run, state) {
    return api.get(api.runPath(run) + "/alerts" + (state ? `?state=${encodeURIComponent(state)}` : ""));
  },

  // One scored step: the cross-scoring matrix (rows grouped by prompt) and the per-prompt breakdown.
  async matrix(run, sampler, step) {
    return api.get(api.runPath(run) + "/matrix" + api.query({ sampler, step }));
  },
};

class ApiError extends Error {
  constructor(path, status, detail) {
    super(`${path}: ${status} ${detail}`);
    this.status = status;
    this.detail = detail;
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail ?? body);
  } catch {
    return response.statusText;
  }
}

// One prompt at a time, shared by every request that was refused while it is open.
let pendingPrompt = null;

function askForToken(status, detail) {
  if (pendingPrompt) return pendingPrompt;
  const dialog = document.getElementById("token-dialog");
  if (!dialog) return Promise.resolve(null);
  const reasons = {
    0: "The token this browser sends to the API.",
    401: `The server wants a token to read this (${detail}).`,
    403: `The token given may not read this (${detail}); give one with the read scope.`,
  };
  dialog.querySelector(".token-reason").textContent = reasons[status];
  const input = dialog.querySelector("input");
  input.value = api.token();
  pendingPrompt = new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => {
        pendingPrompt = null;
        if (dialog.returnValue === "save") {
          api.setToken(input.value.trim());
          resolve(input.value.trim());
        } else resolve(null);
      },
      { once: true },
    );
    dialog.showModal();
    input.focus();
  });
  return pendingPrompt;
}

// The header's "token" button opens the same dialog on demand.
function wireTokenButton() {
  const button = document.getElementById("token-button");
  if (!button) return;
  const label = () => (button.textContent = api.token() ? "token ✓" : "token");
  label();
  button.addEventListener("click", async () => {
    await askForToken(0, "");
    label();
    location.reload();
  });
}

document.addEventListener("DOMContentLoaded", wireTokenButton);

// A link to an API file (the charts' CSV) cannot carry a header: with a token set, fetch the file with
// it and save what came back, under the link's download name.
document.addEventListener("click", async (event) => {
  const link = event.target instanceof Element ? event.target.closest("a[href^='/v1/']") : null;
  if (!link || !api.token()) return;
  event.preventDefault();
  const response = await fetch(link.getAttribute("href"), { headers: { Authorization: `Bearer ${api.token()}` } });
  if (!response.ok) throw new ApiError(link.getAttribute("href"), response.status, await errorText(response));
  const saved = document.createElement("a");
  saved.href = URL.createObjectURL(await response.blob());
  saved.download = link.getAttribute("download") || "metrics.csv";
  saved.click();
  setTimeout(() => URL.revokeObjectURL(saved.href), 1000);
});
