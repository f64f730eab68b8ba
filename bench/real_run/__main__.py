"""A real RL run that collapses, watched live by collapse-monitor (issue 20).

    .venv/bin/python -m bench.real_run                             # the real run, both arms, ~45 min on 2 cores
    .venv/bin/python -m bench.real_run --smoke --out DIR           # tiny random policy, seconds

Starts ``collapse-monitor serve`` (a throwaway SQLite data folder, one scoring thread, the arms'
folder as its ``checkpoint_root``), trains the arms of ``bench/real_run/tasks.py`` from the same
start and seed as concurrent processes (``bench/real_run/train.py``, one torch thread each), each
feeding a reference-scored and a policy-scored run live through TRL's ``attach``; waits until every
scheduled step is scored, then writes ``results.json``: per arm and step the trainer's figures
(reward, task success, the text measures), the service's diagnostics for both scorer modes, every
alert, and when TemplateCollapse fired against when the text measure passed 50% and when task
success fell. Figures (``figures.py``) and page screenshots (``tests/e2e/browser.py``) follow
unless ``--smoke``. Prints the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.real_run import tasks, train
from bench.serving import served
from scoring.config import CACHE_DIR

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
DIAGNOSTICS = (  # (sampler, name) read back for every step
    ("first_turn", "mi_estimate"),
    ("first_turn", "mi_estimate_se"),
    ("first_turn", "retrieval_accuracy"),
    ("first_turn", "retrieval_chance_level"),
    ("first_turn", "retrieval_above_chance"),
    ("first_turn", "conditional_entropy_est"),
    ("first_turn", "token_entropy_mean"),
    ("all", "rollout/in_group_reward_std"),
    ("all", "zero_variance_group_ratio"),
)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a few steps of the tiny random policy")
    parser.add_argument("--arms", default="healthy,collapsing", help=f"comma-separated, of {', '.join(tasks.ARMS)}")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="results.json goes here")
    parser.add_argument("--work", type=Path, default=None, help="data, checkpoints, logs (default: a temp folder)")
    parser.add_argument("--jobs", type=int, default=2, help="arms trained at once")
    parser.add_argument("--images", type=Path, default=ROOT / "docs" / "images", help="figures and screenshots")
    parser.add_argument("--no-images", action="store_true", help="skip the figures and screenshots")
    parser.add_argument(
        "--collect",
        action="store_true",
        help="train nothing: serve --work's stored runs again, wait for their scoring, collect, draw",
    )
    parser.add_argument("--scoring-timeout", type=float, default=1800, help="seconds to wait for scoring to finish")
    train.add_options(parser)
    args = parser.parse_args()
    train.fill_options(args)
    if args.collect and args.work is None:
        parser.error("--collect needs the --work folder of an earlier run")
    args.arm_list = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(args.arm_list) - set(tasks.ARMS))
    if unknown:
        parser.error(f"--arms must name arms of {', '.join(tasks.ARMS)}; got {', '.join(unknown)}")
    return args


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds: trainers and the service are stopped


def main() -> None:
    args = parse()
    signal.signal(signal.SIGTERM, _stop)
    work = args.work or Path(tempfile.mkdtemp(prefix="real-run-"))
    arms_dir = work / "arms"
    arms_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = CACHE_DIR
    scorer = "tiny-random" if args.smoke else "smollm2-135m"
    settings = {
        "DATA_DIR": str(work / "data"),
        "CHECKPOINT_ROOT": str(arms_dir),
        "CACHE_DIR": str(cache_dir),
        "DEFAULT_SCORER": scorer,
        "THREADS": "1",  # the trainers hold the other core(s)
        "WORKER_POLL_SECONDS": "0.2",
        "MAX_LOADED_SCORERS": "3",  # the reference scorer stays loaded next to the arms' checkpoints
    }
    started = time.monotonic()
    with served(settings, ready_seconds=600) as url:
        print(json.dumps({"service": url, "work": str(work)}), flush=True)
        train_seconds = {} if args.collect else train_arms(args, url, arms_dir, cache_dir)
        runs = [f"real-run-{arm}{suffix}" for arm in args.arm_list for suffix in ("", "-policy")]
        wait_for_scoring(url, runs, args.scoring_timeout)
        results = collect(args, url, arms_dir, train_seconds, time.monotonic() - started)
        if not args.no_images and not args.smoke:
            results["screenshots"] = screenshots(url, args, work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    if not args.no_images and not args.smoke:
        from bench.real_run.figures import draw

        results["figures"] = [str(p) for p in draw(results, args.images)]
    print(json.dumps(summary(results), indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


def train_arms(args: argparse.Namespace, url: str, arms_dir: Path, cache_dir: Path) -> dict[str, float]:
    """Trains the arms, ``--jobs`` at a time; returns each one's wall time. Fails if one fails."""
    pending = list(args.arm_list)
    running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    seconds: dict[str, float] = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    try:
        _train(args, url, arms_dir, cache_dir, env, pending, running, seconds)
    finally:  # a failed arm, Ctrl-C or SIGTERM: no trainer outlives the run
        for process, _ in running.values():
            process.terminate()
            process.wait()
    return seconds


def _train(
    args: argparse.Namespace,
    url: str,
    arms_dir: Path,
    cache_dir: Path,
    env: dict[str, str],
    pending: list[str],
    running: dict[str, tuple[subprocess.Popen[bytes], float]],
    seconds: dict[str, float],
) -> None:
    while pending or running:
        while pending and len(running) < args.jobs:
            arm = pending.pop(0)
            folder = arms_dir / arm
            folder.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "bench.real_run.train", "--arm", arm, "--url", url, "--out", str(folder)]
            command += ["--cache-dir", str(cache_dir), "--threads", "1"] + (["--smoke"] if args.smoke else [])
            command += train.option_flags(args)
            with (folder / "train.log").open("wb") as log:
                running[arm] = (subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), 0.0)
            running[arm] = (running[arm][0], time.monotonic())
        for arm, (process, began) in list(running.items()):
            code = process.poll()
            if code is None:
                continue
            del running[arm]
            if code != 0:
                tail = (arms_dir / arm / "train.log").read_text(errors="replace")[-4000:]
                raise SystemExit(f"arm {arm} failed (exit code {code}):\n{tail}")
            seconds[arm] = round(time.monotonic() - began, 1)
            print(json.dumps({"arm": arm, "trained_seconds": seconds[arm]}), flush=True)
        time.sleep(0.5)


def wait_for_scoring(url: str, runs: list[str], timeout: float) -> None:
    """Until no batch of ``runs`` is queued or being scored (the trainers have sent everything)."""
    deadline = time.monotonic() + timeout
    while True:
        waiting = {}
        for run in runs:
            batches = httpx.get(f"{url}/v1/runs/{run}", timeout=30).json()["batches"]
            waiting[run] = batches.get("queued", 0) + batches.get("scoring", 0)
        if not any(waiting.values()):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"scoring did not finish within {timeout:g} s: {waiting}")
        time.sleep(2)


def read_run(url: str, run: str) -> tuple[dict[int, dict[str, float]], list[dict[str, Any]], dict[str, Any]]:
    """A run's diagnostics per step, its alerts and its batch counts, from the API."""
    points = httpx.get(f"{url}/v1/runs/{run}/metrics", params={"limit": 100000}, timeout=60).json()["points"]
    wanted = set(DIAGNOSTICS)
    per_step: dict[int, dict[str, float]] = {}
    for p in points:
        if (p["sampler"], p["name"]) in wanted:
            per_step.setdefault(p["step"], {})[p["name"]] = p["value"]
    alerts = httpx.get(f"{url}/v1/runs/{run}/alerts", timeout=30).json()
    info = httpx.get(f"{url}/v1/runs/{run}", timeout=30).json()
    return per_step, alerts, info["batches"]


def first_step(steps: list[dict[str, Any]], holds: Any) -> int | None:
    return next((s["step"] for s in steps if holds(s)), None)


def analyse(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """When the text measure passed 50% and when task success fell (below half its first 3 steps' mean)."""
    start = steps[:3]
    success0 = sum(s["task_success"] for s in start) / max(len(start), 1)
    operands0 = sum(s["mentions_operands"] for s in start) / max(len(start), 1)
    return {
        "opening_share_above_half_step": first_step(steps, lambda s: s["opening_share"] > 0.5),
        "slot_template_share_above_half_step": first_step(steps, lambda s: s.get("slot_template_share", 0) > 0.5),
        "task_success_start": round(success0, 3),
        "task_success_fell_step": first_step(steps, lambda s: s["step"] > 3 and s["task_success"] < success0 / 2)
        if success0 > 0
        else None,
        "mentions_operands_start": round(operands0, 3),
        "mentions_operands_fell_step": first_step(
            steps, lambda s: s["step"] > 3 and s["mentions_operands"] < operands0 / 2
        ),
    }


def at_firing(steps: list[dict[str, Any]], alerts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Token entropy and the text measures where the reference run's TemplateCollapse fired, against steps 1-3.

    None when it never fired. Token entropy is the reference scorer's ``token_entropy_mean`` and
    TRL's own ``entropy`` of the policy; "did not collapse" reads as a ratio to the start near 1 or above.
    """
    fired = next((a["fired_step"] for a in alerts if a["rule"] == "TemplateCollapse" and a["fired_step"]), None)
    at = next((s for s in steps if s["step"] == fired), None)
    if at is None:
        return None

    def start(value: Any) -> float | None:
        found = [v for v in (value(s) for s in steps[:3]) if v is not None]
        return sum(found) / len(found) if found else None

    figures: dict[str, Any] = {"fired_step": fired}
    for name, value in (
        ("scorer_token_entropy", lambda s: s["reference"].get("token_entropy_mean")),
        ("policy_entropy", lambda s: s["trl"].get("entropy")),
        ("mi_estimate", lambda s: s["reference"].get("mi_estimate")),
        ("opening_share", lambda s: s["opening_share"]),
        ("mentions_operands", lambda s: s["mentions_operands"]),
    ):
        first, now = start(value), value(at)
        figures[name] = {"start": first, "at_firing": now}
        if first and now is not None:
            figures[name]["ratio"] = round(now / first, 3)
    return figures


def collect(
    args: argparse.Namespace, url: str, arms_dir: Path, train_seconds: dict[str, float], wall_seconds: float
) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for arm in args.arm_list:
        lines = (arms_dir / arm / "steps.jsonl").read_text().splitlines()
        steps = [json.loads(line) for line in lines]
        runs = {}
        for mode, suffix in (("reference", ""), ("policy", "-policy")):
            per_step, alerts, batches = read_run(url, f"real-run-{arm}{suffix}")
            for s in steps:
                s[mode] = per_step.get(s["step"], {})
            runs[mode] = {
                "run": f"real-run-{arm}{suffix}",
                "batches": batches,
                "alerts": [
                    {
                        k: a[k]
                        for k in ("rule", "sampler", "state", "onset_step", "fired_step", "resolved_step", "summary")
                    }
                    for a in alerts
                ],
            }
        arms[arm] = {
            "trained_seconds": train_seconds.get(arm),
            "learning_rate": args.learning_rate or tasks.ARMS[arm].learning_rate,
            "trained_steps": len(steps),
            "stopped_early": len(steps) < args.steps,  # attach's stop_on acted
            "runs": runs,
            "text": analyse(steps),
            "at_template_collapse": at_firing(steps, runs["reference"]["alerts"]),
            "steps": steps,
        }
    return {
        "command": " ".join(["python -m bench.real_run", *sys.argv[1:]]),
        "smoke": args.smoke,
        "options": {name: getattr(args, name) for name in train.OPTIONS},
        "wall_seconds": round(wall_seconds, 1),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
        "arms": arms,
    }


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The headline: per arm and scorer mode, each alert's onset and firing step next to the text figures."""
    return {
        "wall_seconds": results["wall_seconds"],
        "loadavg": results["loadavg"],
        "arms": {
            arm: {
                "trained_seconds": a["trained_seconds"],
                "trained_steps": a["trained_steps"],
                "stopped_early": a["stopped_early"],
                "at_template_collapse": a["at_template_collapse"],
                **a["text"],
                **{
                    mode: [f"{x['rule']} onset {x['onset_step']} fired {x['fired_step']}" for x in r["alerts"]]
                    for mode, r in a["runs"].items()
                },
            }
            for arm, a in results["arms"].items()
        },
        "figures": results.get("figures", []),
        "screenshots": results.get("screenshots", []),
    }


def screenshots(url: str, args: argparse.Namespace, work: Path) -> list[str]:
    """The runs page and each arm's reference-scored run page, as docs/images/real-run-*.png."""
    sys.path.insert(0, str(ROOT))
    from tests.e2e.browser import chromium_missing

    missing = chromium_missing()
    if missing:
        print(json.dumps({"screenshots": f"skipped: {missing}"}), flush=True)
        return []
    args.images.mkdir(parents=True, exist_ok=True)
    saved = []
    for arm in args.arm_list:
        shots = work / "shots" / arm
        subprocess.run(
            [sys.executable, "-m", "tests.e2e.browser", "--url", url, "--run", f"real-run-{arm}", "--out", str(shots)],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        target = args.images / f"real-run-{arm}-page.png"
        shutil.copyfile(shots / "run-page.png", target)
        saved.append(str(target))
    target = args.images / "real-run-runs-page.png"
    shutil.copyfile(shots / "runs-page.png", target)
    saved.append(str(target))
    return saved


if __name__ == "__main__":
    main()
