"""The zoo: real TRL runs that collapse and healthy controls, each recorded whole, then scored by the service.

    python -m bench.real_run.zoo train [--arms A,B] [--jobs 2]   # trains what is not recorded yet (~8 min an arm)
    python -m bench.real_run.zoo score [--arms A,B] [--threads 2] # scores every record as the service does


``train`` runs ``bench.real_run.train`` for each arm of ``tasks.ZOO`` with the zoo's sizes (``SIZES``)
and no service attached: each step's whole batch (prompts as the policy read them, completions,
rewards), TRL's figures and the words-only measures go to ``bench/real_run/zoo/<arm>.jsonl.gz``.
An arm already recorded is skipped, so an interrupted ``train`` picks up where it stopped.

``score`` runs each recorded step through the service's own scoring of a rollouts batch
(``service.jobs.rollouts.score_rollouts``: the reference scorer SmolLM2-135M, sampler first_turn,
every row, no step budget, the run defaults of ``POST /v1/runs``), exactly what a live run stores,
and writes ``bench/real_run/zoo/scored/<arm>.json.gz``: per step every stored series and the
cross-scoring matrices (L_seq, the head sums at ``HEADS``), so that signals can be compared
offline without scoring again (``bench.real_run.signals``). An arm already scored is skipped. A multi-turn arm
(three samplers, ~170,000 tokens a step: ~9 min a step on one core) keeps each scored step in
``scored/<arm>.partial.json.gz``, so an interrupted ``score`` resumes at the next step.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.real_run import envs, tasks
from scoring import estimators
from scoring.config import CACHE_DIR

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
RECORDS = HERE / "zoo"
HELD_OUT_RECORDS = HERE / "heldout"  # tasks.HELD_OUT's arms: scored only after the freeze (docs/evaluation.md)
REMEDY_RECORDS = HERE / "remedy"  # envs.REMEDY_ARMS: the remedy trial (docs/evaluation.md)
# Enough prompts per step to see (8 columns: MI's ceiling ln 8, a retrieval step of 1/24), and steps for
# the drivers to act: ~35 s a step on one core.
SIZES = {"steps": 14, "prompts": 8, "generations": 3, "max_completion_length": 48, "lora_rank": 16, "seed": 0}


HEADS = (8, 16, 32)  # head budgets k kept for the comparison (the service computes its own one)


def records_of(arm: str) -> Path:
    """The folder of an arm's record: the zoo's (development), the held-out arms' (multi-turn ones too), or
    the remedy trial's."""
    if arm in envs.REMEDY_ARMS:
        return REMEDY_RECORDS
    return HELD_OUT_RECORDS if arm in tasks.HELD_OUT or arm in envs.AGENT_ARMS else RECORDS


def is_agent(arm: str) -> bool:
    """A multi-turn arm (``envs.AGENT_ARMS``, trained by ``bench.real_run.agent``)."""
    return arm in envs.AGENT_ARMS


def record_path(arm: str) -> Path:
    return records_of(arm) / f"{arm}.jsonl.gz"


def asked_questions() -> frozenset[str]:
    """Every question of the zoo's records: held-out arms never ask one of them."""
    return frozenset(q for arm in tasks.ZOO for step in read_record(arm) for q in step["batch"]["questions"])


def read_record(arm: str) -> list[dict[str, Any]]:
    """An arm's steps, as ``bench.real_run.train`` wrote them."""
    with gzip.open(record_path(arm), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def train(arms: list[str], jobs: int, work: Path) -> None:
    """Trains the arms not recorded yet, ``jobs`` at a time, one torch thread each; several ``train`` commands
    share the work (an arm is claimed by a marker file while it trains)."""
    pending = [a for a in arms if not record_path(a).exists()]
    running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    for arm in pending:
        records_of(arm).mkdir(parents=True, exist_ok=True)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                arm = pending.pop(0)
                if record_path(arm).exists() or not claim(arm):  # recorded meanwhile, or another train has it
                    continue
                folder = work / arm
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                if is_agent(arm) or arm in envs.REMEDY_ARMS:  # its own sizes: bench.real_run.agent's defaults
                    command = [sys.executable, "-m", "bench.real_run.agent", "--arm", arm, "--out", str(folder)]
                else:
                    command = [sys.executable, "-m", "bench.real_run.train", "--arm", arm, "--out", str(folder)]
                    command += ["--save-on", "", "--stop-on", ""]
                    command += [flag for k, v in SIZES.items() for flag in (f"--{k.replace('_', '-')}", str(v))]
                with (folder / "train.log").open("wb") as log:
                    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                running[arm] = (process, time.monotonic())
            for arm, (process, began) in list(running.items()):
                code = process.poll()
                if code is None:
                    continue
                del running[arm]
                claimed(arm).unlink(missing_ok=True)
                if code != 0:
                    tail = (work / arm / "train.log").read_text(errors="replace")[-3000:]
                    print(json.dumps({"arm": arm, "failed": code, "log": tail}), flush=True)
                    continue
                with (work / arm / "steps.jsonl").open("rb") as src, gzip.open(record_path(arm), "wb") as dst:
                    shutil.copyfileobj(src, dst)
                print(json.dumps({"arm": arm, "trained_seconds": round(time.monotonic() - began, 1)}), flush=True)
            time.sleep(1)
    finally:  # Ctrl-C or SIGTERM: no trainer outlives the command
        for arm, (process, _) in running.items():
            process.terminate()
            process.wait()
            claimed(arm).unlink(missing_ok=True)


def claimed(arm: str) -> Path:
    return records_of(arm) / f".{arm}.training"


def claim(arm: str) -> bool:
    """Marks ``arm`` as being trained; False when another ``train`` marked it first (several can run at once)."""
    try:
        claimed(arm).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def scored_path(arm: str) -> Path:
    return records_of(arm) / "scored" / f"{arm}.json.gz"


def read_scored(arm: str) -> list[dict[str, Any]]:
    """An arm's scored steps, as ``score`` wrote them."""
    with gzip.open(scored_path(arm), "rt") as f:
        steps: list[dict[str, Any]] = json.load(f)["steps"]
    return steps


def batch_of(step: dict[str, Any]) -> dict[str, Any]:
    """A recorded step as the rollouts batch ``attach`` would have sent (``BatchIn``): a group per question;
    a multi-turn step as ``bench.real_run.agent`` sends it live (its turns as token ids)."""
    if "episodes" in step:
        from bench.real_run.agent import trajectories_of

        episodes = step["episodes"]
        return {"step": step["step"], "trajectories": trajectories_of(episodes, [e["reward"] for e in episodes])}
    batch = step["batch"]
    groups: dict[str, int] = {}
    trajectories = [
        {
            "group_id": groups.setdefault(question, len(groups)),
            "reward": reward,
            "turns": [{"prompt": prompt, "response": completion}],
        }
        for question, prompt, completion, reward in zip(
            batch["questions"], batch["prompts"], batch["completions"], batch["rewards"], strict=True
        )
    ]
    return {"step": step["step"], "trajectories": trajectories}


def score(arms: list[str], cache_dir: Path, threads: int = 1) -> None:
    """Scores every recorded step of ``arms`` through the service's own scoring (module docstring).

    Several ``score`` processes can run at once: each takes an arm under a lock file. One thread each suits
    two processes on 2 cores; a process alone scores a multi-turn step ~1.3x faster with two."""
    import torch

    from scoring import load_scorer

    settings = zoo_settings(cache_dir, threads)
    # The service's scorer pool applies ``threads``; load_scorer does not. Two threads beside a training job on
    # 2 cores ran a multi-turn step at ~70 scored tokens a second, one thread at ~115 beside two other jobs.
    torch.set_num_threads(settings.threads)
    scorer = load_scorer(settings.scoring_config("smollm2-135m"), cache_dir)
    for arm in arms:
        if scored_path(arm).exists() or not record_path(arm).exists():
            continue
        lock = scored_path(arm).with_suffix(".lock")
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            lock.touch(exist_ok=False)
        except FileExistsError:  # another score process has this arm
            continue
        try:
            started = time.monotonic()
            steps = score_arm(arm, scorer, settings)
            with gzip.open(scored_path(arm), "wt") as f:
                json.dump({"arm": arm, "steps": steps}, f)
            partial_path(arm).unlink(missing_ok=True)
            print(json.dumps({"arm": arm, "scored_seconds": round(time.monotonic() - started, 1)}), flush=True)
        finally:
            lock.unlink()


def partial_path(arm: str) -> Path:
    """The steps of an arm scored so far, with the EMA states after them: a multi-turn arm takes hours on a CPU
    (~9 min a step on one core), so ``score`` resumes from here (commit it to resume on another machine)."""
    return records_of(arm) / "scored" / f"{arm}.partial.json.gz"


def read_partial(arm: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(steps scored so far, EMA state per sampler after the last of them); nothing when none was kept."""
    from scoring.estimators import EmaState

    if not partial_path(arm).exists():
        return [], {}
    with gzip.open(partial_path(arm), "rt") as f:
        kept = json.load(f)
    return kept["steps"], {sampler: EmaState(**state) for sampler, state in kept["emas"].items()}


def write_partial(arm: str, steps: list[dict[str, Any]], emas: dict[str, Any]) -> None:
    """Keeps the steps scored so far (written whole, then renamed: a kill never leaves half a file)."""
    from dataclasses import asdict

    path = partial_path(arm)
    with gzip.open(path.with_suffix(".tmp"), "wt") as f:
        json.dump({"arm": arm, "steps": steps, "emas": {s: asdict(e) for s, e in emas.items()}}, f)
    path.with_suffix(".tmp").replace(path)


def run_snapshot(name: str, samplers: tuple[str, ...], num_samples: int | None) -> Any:
    """A run as ``POST /v1/runs`` makes it with its defaults (the reference scorer, scored every step)."""
    from service.schemas.alerts import AlertSettings
    from service.schemas.inputs import FilterSettings
    from service.snapshot import RunSnapshot

    return RunSnapshot(
        id=0,
        name=name,
        scorer="smollm2-135m",
        scorer_mode="reference",
        score_every=1,
        samplers=samplers,
        num_samples=num_samples,
        seed=0,
        temperature=1.0,
        filter=FilterSettings().model_dump(),
        alerts=AlertSettings(),
    )


def zoo_settings(cache_dir: Path, threads: int = 1) -> Any:
    """The service's settings for scoring a recorded run: no step budget, the zoo's head budgets."""
    from service.settings import Settings

    class ZooSettings(Settings):
        def scoring_config(self, model: str, temperature: float = 1.0) -> Any:
            config = super().scoring_config(model, temperature)
            return replace(config, head_tokens=tuple(sorted({*config.head_tokens, *HEADS})))

    return ZooSettings(_env_file=None, cache_dir=cache_dir, scoring_budget_seconds=0, threads=threads)


def score_arm(arm: str, scorer: Any, settings: Any) -> list[dict[str, Any]]:
    """One arm's recorded steps through ``score_rollouts``: per step its points and matrices."""
    import numpy as np

    from service.jobs import rollouts
    from service.schemas.inputs import BatchIn

    run = run_snapshot(
        f"zoo-{arm}",
        ("first_turn", "trajectory", "per_turn") if is_agent(arm) else ("first_turn",),
        64 if is_agent(arm) else None,  # a run's default; a single-turn step has 24 rows anyway
    )
    kernel = rollouts.score_with
    seen: list[tuple[Any, Any]] = []  # (batch, CrossScores) of each sampler of the step being scored

    def recording(scorer_: Any, batch: Any, config: Any, check: Any = None) -> Any:
        cross = kernel(scorer_, batch, config, check)
        seen.append((batch, cross))
        return cross

    def matrices(batch: Any, cross: Any) -> dict[str, Any]:
        signature = estimators.column_signatures(batch.column_prompts, batch.n_columns)
        return {
            "L_seq": np.round(cross.L_seq, 6).tolist(),
            "L_head": {str(k): np.round(cross.L_head[k], 6).tolist() for k in HEADS},
            "lengths": cross.reasoning_lengths.tolist(),
            "column_of_row": list(batch.column_of_row),
            "signature": signature.tolist(),
            "reasonings": [list(z) for z in batch.reasonings],
        }

    steps, emas = read_partial(arm)
    done = {step["step"] for step in steps}
    for record in read_record(arm):
        if record["step"] in done:
            continue
        seen.clear()
        rollouts.score_with = recording  # type: ignore[assignment]  # the bench keeps what the service drops
        try:
            scored = rollouts.score_rollouts(
                BatchIn.model_validate(batch_of(record)), run, emas, lambda: scorer, settings
            )
        finally:
            rollouts.score_with = kernel
        emas.update(scored.ema)
        points: dict[str, dict[str, float]] = {}
        for point in scored.points:
            points.setdefault(point.sampler, {})[point.name] = point.value
        # The samplers' matrices in the order they were scored: first_turn's at the top level (the zoo's
        # layout), the others (multi-turn: trajectory, turn_1 ...) under "samplers". A sampler scored without
        # metrics (a turn index one episode reached) keeps no matrix: each matrix takes the next scoring whose
        # scores it holds.
        scorings, by_sampler = iter(seen), {}
        for m in scored.matrices:
            same = (c for c in scorings if c[1].L_tok.shape == m.L_tok.shape)
            by_sampler[m.sampler] = matrices(
                *next(c for c in same if np.array_equal(c[1].L_tok, m.L_tok, equal_nan=True))
            )
        steps.append(
            {
                "step": record["step"],
                "points": points,
                **by_sampler.pop("first_turn"),
                **({"samplers": by_sampler} if by_sampler else {}),
            }
        )
        if is_agent(arm):  # hours a multi-turn arm: keep each step (a single-turn arm takes minutes)
            write_partial(arm, steps, emas)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    trainer = commands.add_parser("train", help="train and record the arms not recorded yet")
    trainer.add_argument("--arms", default=",".join(tasks.ZOO), help="comma-separated, of tasks.ZOO")
    trainer.add_argument("--jobs", type=int, default=2, help="arms trained at once")
    trainer.add_argument("--work", type=Path, default=None, help="logs and checkpoints (default: a temp folder)")
    scorer = commands.add_parser("score", help="score the recorded arms not scored yet, as the service does")
    scorer.add_argument("--arms", default=",".join(tasks.ZOO), help="comma-separated, of tasks.ZOO")
    scorer.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    scorer.add_argument("--threads", type=int, default=1, help="torch threads (2 for a process alone on 2 cores)")
    args = parser.parse_args()
    if args.command == "score":
        score([a for a in args.arms.split(",") if a], args.cache_dir, args.threads)
    if args.command == "train":
        arms = [a for a in args.arms.split(",") if a]
        unknown = sorted(set(arms) - {*tasks.ZOO, *tasks.HELD_OUT, *envs.AGENT_ARMS, *envs.REMEDY_ARMS})
        if unknown:
            known = "tasks.ZOO, tasks.HELD_OUT, envs.AGENT_ARMS or envs.REMEDY_ARMS"
            parser.error(f"--arms must name arms of {known}; got {', '.join(unknown)}")
        work = args.work or Path(tempfile.mkdtemp(prefix="zoo-"))
        train(arms, args.jobs, work)


if __name__ == "__main__":
    main()
