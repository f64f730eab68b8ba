"""The README's Trackio screenshot: a tiny real GRPO run reports to Trackio with ``attach`` against a live
service, and Trackio's own dashboard shows the reward next to the ``collapse/`` figures.

``python -m bench.trackio_page --out docs/images/trackio-page.png`` starts ``collapse-monitor serve`` on
its embedded defaults (SQLite, the SmolLM2-135M scorer, one in-process worker) with a throwaway data
folder on loopback, trains the tiny random policy (the client tests' one) for ``--steps`` GRPO steps
with ``report_to=["trackio"]`` into a throwaway ``TRACKIO_DIR``, serves Trackio's dashboard on
127.0.0.1 (``trackio.show``) and photographs its metrics page in headless Chromium (tests/e2e/browser.py),
the reward and the ``collapse/`` figures filtered onto one page. Prints JSON: what Trackio holds.

``--scorer tiny-random`` (the tests' scorer) made the README's picture: about 12 minutes on 2 cores shared
with other jobs, most of it starting the service and importing TRL; with SmolLM2 the service took
over 5 minutes to be ready there, and one step of 16 rows over 5 minutes to score.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from bench.serving import service_env, start_serve, wait_ready, wait_until

PROMPTS = [[{"role": "user", "content": f"You are in room {i}. Which door leads out?"}] for i in range(64)]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The plots photographed: the trainer's reward and three scored figures (the dashboard's metric filter is a regex).
SHOWN = (
    "train/reward",
    "collapse/trajectory/mi_estimate",
    "collapse/trajectory/retrieval_chance_corrected",
    "collapse/trajectory/conditional_entropy_est",
)
RUN = "grpo-rooms"


def length(completions: list[list[dict[str, str]]], **_kwargs: Any) -> list[float]:
    """Reward: the completion's length in characters (something the tiny policy can learn in a few steps)."""
    return [float(len(c[0]["content"])) for c in completions]


def train(url: str, folder: Path, steps: int) -> None:
    import datasets
    import torch
    from collapse_monitor import Monitor
    from collapse_monitor.integrations.trl import attach
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from scoring.models import build_tiny_random

    torch.set_num_threads(1)
    model, tokenizer = build_tiny_random(seed=1)
    tokenizer.chat_template = TEMPLATE
    args = GRPOConfig(
        output_dir=str(folder / "out"),
        per_device_train_batch_size=8,  # 4 prompts, 2 completions each: the fewest the default alert rule judges
        num_generations=2,
        max_completion_length=16,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=["trackio"],
        project=RUN,
        run_name=RUN,
        bf16=False,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[length],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    monitor = Monitor(url, RUN, spool_dir=folder / "spool")

    class Pace(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
        """Each step waits until the service has scored it: a tiny CPU step is quicker than its scoring,
        a real step is not, and the figures should reach Trackio while training runs, as in a real run."""

        def on_step_end(self, _args: Any, state: Any, _control: Any, **_kwargs: Any) -> None:
            def scored() -> bool:
                batches = monitor.run_info().get("batches", {})
                return int(batches.get("done", 0)) + int(batches.get("failed", 0)) >= int(state.global_step)

            wait_until(scored, 900, f"step {state.global_step} scored ({monitor.stats()})")

    attach(trainer, monitor, tracker_poll_seconds=0.2)
    trainer.add_callback(Pace())
    with contextlib.redirect_stdout(sys.stderr):  # the trainer prints its logs; stdout is for the JSON
        trainer.train()
    monitor.close()


def held(project_db: Path) -> dict[str, Any]:
    """What the Trackio project holds: its rows, the training steps with a reward, those with collapse figures."""
    with sqlite3.connect(project_db) as db:
        rows = [json.loads(metrics) for (metrics,) in db.execute("SELECT metrics FROM metrics ORDER BY id")]
    return {
        "rows": len(rows),
        "reward_steps": [row["train/global_step"] for row in rows if "train/reward" in row],
        "collapse_steps": [row["collapse/step"] for row in rows if "collapse/step" in row],
        "collapse_names": sorted({name for row in rows for name in row if name.startswith("collapse/")}),
    }


def photograph(dashboard: str, out: Path) -> None:
    from tests.e2e.browser import launched

    with launched() as browser:
        # tall enough that every plot is on screen: Trackio draws a plot only once it is in view
        page = browser.new_page(viewport={"width": 1200, "height": 900}, device_scale_factor=1)
        page.set_default_timeout(300_000)  # slow on 2 busy cores: the app fetches the logs, then Vega draws
        try:
            page.goto(dashboard, wait_until="commit")
            page.wait_for_function(f"() => document.querySelectorAll('.plot-container canvas').length >= {len(SHOWN)}")
            time.sleep(3)  # Vega's first frame
            page.screenshot(path=str(out), full_page=True)
        finally:
            page.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--scorer", default="smollm2-135m", help="the service's scorer (default: its embedded default)")
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="trackio-page-"))
    # Trackio reads TRACKIO_DIR once, when imported: the project goes to the throwaway folder, never the user's own.
    os.environ["TRACKIO_DIR"] = str(folder / "trackio")
    env = service_env({"data_dir": str(folder / "data"), "default_scorer": options.scorer})
    log = open(folder / "serve.log", "wb")  # noqa: SIM115 - open as long as the service runs
    url, server = start_serve(env, log=log)
    try:
        wait_ready(url, 900, server)  # SmolLM2 loads in minutes on 2 busy cores
        train(url, folder, options.steps)
        import trackio
        from trackio.sqlite_storage import SQLiteStorage

        app, local_url, _, _ = trackio.show(
            project=RUN, open_browser=False, block_thread=False, host="127.0.0.1", share=False
        )
        try:
            # the page a user opens, with the sidebar folded, no smoothing, plot titles as logged
            view = {
                "project": RUN,
                "metric_filter": "|".join(f"^{re.escape(name)}$" for name in SHOWN),
                "sidebar": "hidden",
                "smoothing": 0,
                "accordion": "hidden",
            }
            query = urlencode(view)
            photograph(f"{local_url.rstrip('/')}/?{query}", options.out)
        finally:
            app.close()
        print(json.dumps(held(Path(SQLiteStorage.get_project_db_path(RUN))) | {"png": str(options.out)}))
    except BaseException:
        sys.stderr.write((folder / "serve.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        server.terminate()
        server.wait(30)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
