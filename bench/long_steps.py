"""Long reasoning on the embedded default: steps of 4 prompts x 2 rollouts whose reasoning is ~1.5k, ~5k and ~12k
tokens, posted to ``collapse-monitor serve`` (SmolLM2-135M, float32, SQLite), each timed until it is scored.

    python bench/long_steps.py                       # the default window (max_reasoning_tokens 512)
    python bench/long_steps.py --tokens 1500 --window 0   # whole reasonings (0: no window)
    python bench/long_steps.py --budget 0                 # no per-step scoring budget (the default is 60 s)

Before windows (issue 19): ~1.5k tokens took 255 s, ~5k failed at max_scoring_seconds=600, ~12k failed at once
(past the scorer's 8,192-token context). The reasoning is real SmolLM2 text: each prompt's healthy traces
from the committed corpus, joined until the length is reached, so it still depends on its prompt.
Prints one JSON object: per step, seconds from the POST to done, the status, the window's report and MI.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serving import served

CORPUS = Path(__file__).parent / "corpus" / "smollm2.json.gz"
CHARS_PER_TOKEN = 4.2  # SmolLM2's tokenizer on this English text (measured on the corpus traces)


def step_body(raw: dict[str, Any], step: int, tokens: int) -> dict[str, Any]:
    tasks = [c for c in raw["columns"] if c["kind"] == "task"][:4]
    trajectories = []
    for g, task in enumerate(tasks):
        texts = [t["text"] for t in raw["traces"] if t["kind"] == "healthy" and t["prompt"] == task["index"]]
        for k in range(2):
            reasoning, i = "", k
            while len(reasoning) < tokens * CHARS_PER_TOKEN:
                reasoning += texts[i % len(texts)] + "\n"
                i += 2
            response = f"<think>{reasoning}</think><answer>done</answer>"
            trajectories.append(
                {"group_id": g, "reward": float(k), "turns": [{"prompt": task["text"], "response": response}]}
            )
    return {"step": step, "trajectories": trajectories}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1500, 5000, 12000])
    parser.add_argument("--window", type=int, default=None, help="max_reasoning_tokens (default: the service's)")
    parser.add_argument("--budget", type=float, default=None, help="scoring_budget_seconds (default: the service's)")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    with gzip.open(CORPUS) as corpus:
        raw = json.load(corpus)
    settings = {"EMBEDDED_WORKER": "true", "MAX_SCORING_SECONDS": "600"}
    if args.window is not None:
        settings["MAX_REASONING_TOKENS"] = str(args.window)
    if args.budget is not None:
        settings["SCORING_BUDGET_SECONDS"] = str(args.budget)
    steps = []
    with tempfile.TemporaryDirectory() as folder:
        settings |= {"DATABASE_URL": f"sqlite:///{folder}/bench.db", "DATA_DIR": folder}
        with served(settings, ready_seconds=600) as base, httpx.Client(base_url=base, timeout=120) as client:
            assert (
                client.post("/v1/runs", json={"name": "long", "reasoning_extraction": "think_tags"}).status_code == 201
            )
            for step, tokens in enumerate(args.tokens, start=1):
                start = time.monotonic()
                accepted = client.post("/v1/runs/long/batches", json=step_body(raw, step, tokens))
                accepted.raise_for_status()
                while (status := client.get(f"/v1/batches/{accepted.json()['batch_id']}").json())["status"] not in (
                    "done",
                    "failed",
                ):
                    if time.monotonic() - start > args.timeout:
                        break
                    time.sleep(1)
                sampler = (status.get("results") or {}).get("samplers", {}).get("first_turn", {})
                steps.append(
                    {
                        "reasoning_tokens_target": tokens,
                        "status": status["status"],
                        "seconds_to_done": round(time.monotonic() - start, 1),
                        "scoring_seconds": status.get("scoring_seconds"),
                        "tokens_scored": status.get("tokens_scored"),
                        "error": status.get("error"),
                        "window": sampler.get("window"),
                        "plan": sampler.get("plan"),
                        "mi_estimate": sampler.get("metrics", {}).get("mi_estimate"),
                        "retrieval_accuracy": sampler.get("metrics", {}).get("retrieval_accuracy"),
                    }
                )
                print(json.dumps(steps[-1]), flush=True)
    print(json.dumps({"window_setting": args.window, "budget_setting": args.budget, "steps": steps}, indent=2))


if __name__ == "__main__":
    main()
