"""The zoo: real TRL runs that collapse and healthy controls, each recorded whole, then scored by the service.

    python -m bench.real_run.zoo train [--arms A,B] [--jobs 2]   # trains what is not recorded yet (~8 min an arm)
    python -m bench.real_run.zoo score                            # replays every record through the service

``train`` runs ``bench.real_run.train`` for each arm of ``tasks.ZOO`` with the zoo's sizes (``SIZES``)
and no service attached: each step's whole batch (prompts as the policy read them, completions,
rewards), TRL's figures and the words-only measures go to ``bench/real_run/zoo/<arm>.jsonl.gz``.
An arm already recorded is skipped, so an interrupted ``train`` picks up where it stopped.
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
from pathlib import Path

from bench.real_run import tasks

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
RECORDS = HERE / "zoo"
# Enough prompts per step to see (8 columns: MI's ceiling ln 8, a retrieval step of 1/24), and steps for
# the drivers to act: ~35 s a step on one core.
SIZES = {"steps": 14, "prompts": 8, "generations": 3, "max_completion_length": 48, "lora_rank": 16, "seed": 0}


def record_path(arm: str) -> Path:
    return RECORDS / f"{arm}.jsonl.gz"


def read_record(arm: str) -> list[dict[str, object]]:
    """An arm's steps, as ``bench.real_run.train`` wrote them."""
    with gzip.open(record_path(arm), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def train(arms: list[str], jobs: int, work: Path) -> None:
    """Trains the arms not recorded yet, ``jobs`` at a time, one torch thread each."""
    pending = [a for a in arms if not record_path(a).exists()]
    running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    RECORDS.mkdir(parents=True, exist_ok=True)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                arm = pending.pop(0)
                folder = work / arm
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
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
                if code != 0:
                    tail = (work / arm / "train.log").read_text(errors="replace")[-3000:]
                    print(json.dumps({"arm": arm, "failed": code, "log": tail}), flush=True)
                    continue
                with (work / arm / "steps.jsonl").open("rb") as src, gzip.open(record_path(arm), "wb") as dst:
                    shutil.copyfileobj(src, dst)
                print(json.dumps({"arm": arm, "trained_seconds": round(time.monotonic() - began, 1)}), flush=True)
            time.sleep(1)
    finally:  # Ctrl-C or SIGTERM: no trainer outlives the command
        for process, _ in running.values():
            process.terminate()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    trainer = commands.add_parser("train", help="train and record the arms not recorded yet")
    trainer.add_argument("--arms", default=",".join(tasks.ZOO), help="comma-separated, of tasks.ZOO")
    trainer.add_argument("--jobs", type=int, default=2, help="arms trained at once")
    trainer.add_argument("--work", type=Path, default=None, help="logs and checkpoints (default: a temp folder)")
    args = parser.parse_args()
    if args.command == "train":
        arms = [a for a in args.arms.split(",") if a]
        unknown = sorted(set(arms) - set(tasks.ZOO))
        if unknown:
            parser.error(f"--arms must name arms of tasks.ZOO; got {', '.join(unknown)}")
        work = args.work or Path(tempfile.mkdtemp(prefix="zoo-"))
        train(arms, args.jobs, work)


if __name__ == "__main__":
    main()
