"""What ``follow`` costs on a prime-rl traces file of long agentic traces: peak memory and the bodies it posts.

    python bench/follow_traces.py [--megabytes 1.1,2.2] [--episodes 1] [--client-path DIR] [--client-args ARGS]

Writes ``rollouts/step_1/train/effective/traces.jsonl`` of about ``--megabytes`` MB: ``--episodes``
episodes of one group, each one trainable trace of alternating assistant tool calls and tool results
(~1 KB a message) until the file reaches its size. Each turn's prompt is the conversation before it,
so what the file expands to grows with the square of a trace's length. Then runs
``collapse-monitor-client follow --once`` on it against a real ``collapse-monitor serve`` (tiny-random
scorer, scoring paused, SQLite in a throwaway folder) and reports the child's own peak RSS
(``bench/peak.py``), its seconds, the bodies the client refitted to the scoring cost the service refused them
for, what the service stored (each batch's body size), the size of each body it refused for good (from the
spool's ``rejected/``: the body kept, or its ``.error.json``'s ``bytes``) and the bodies kept.
``--client-path`` runs the client from another checkout's ``client/`` folder (``git archive <commit> |
tar -x -C /tmp/old``) to compare in one session; ``--client-args`` adds options to ``follow``
(``"--max-text-chars 8000"``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FILLER = "The grid is 8 by 8; the box is at (3, 4), the goal at (6, 1) and a hole blocks row five. "


def episode(index: int, target_bytes: int) -> dict[str, Any]:
    """One verifiers episode record (the fields prime_rl_traces reads) of about ``target_bytes`` of JSON."""
    nodes: list[dict[str, Any]] = [
        {"message": {"role": "system", "content": "You push boxes. " + FILLER * 4}, "sampled": False},
        {"parent": 0, "message": {"role": "user", "content": "Solve the level. " + FILLER * 4}, "sampled": False},
    ]
    size = len(json.dumps(nodes))
    while size < target_bytes:
        k = len(nodes)
        call = {"id": f"c{k}", "name": "move", "arguments": json.dumps({"direction": "up", "note": FILLER * 2})}
        assistant = {"role": "assistant", "content": f"Move {k}: " + FILLER * 3, "tool_calls": [call]}
        tool = {"role": "tool", "tool_call_id": f"c{k}", "content": f"Moved ({k}). " + FILLER * 3}
        nodes += [
            {"parent": k - 1, "message": assistant, "sampled": True},
            {"parent": k, "message": tool, "sampled": False},
        ]
        size += len(json.dumps(nodes[-2:]))
    trace = {
        "agent": {"name": "solver", "trainable": True},
        "nodes": nodes,
        "rewards": {"solved": {"score": float(index % 2), "weight": 1.0}},
    }
    return {"task": {"key": "level-1"}, "group": {"id": "g1"}, "traces": [trace]}


def write_traces(folder: Path, megabytes: float, episodes: int) -> Path:
    path = folder / "rollouts" / "step_1" / "train" / "effective" / "traces.jsonl"
    path.parent.mkdir(parents=True)
    with open(path, "w") as f:
        for i in range(episodes):
            f.write(json.dumps(episode(i, int(megabytes * 1e6 / episodes)), separators=(",", ":")) + "\n")
    return path


def follow_once(url: str, folder: Path, spool: Path, client_path: Path, extra: list[str]) -> dict[str, Any]:
    """``follow --once`` in a child process: its exit, seconds, peak RSS and what its stdout says."""
    from peak import run_measured  # here, as serving below: the tests import this module as bench.follow_traces

    command = [sys.executable, "-c", "import sys; from collapse_monitor.cli import main; sys.exit(main())"]
    command += ["follow", str(folder), "--run", "bench-traces", "--url", url, "--once", "--settle", "0"]
    command += ["--spool-dir", str(spool), "--settings", json.dumps({"schedule": {"every": 1}}), *extra]
    env = {**os.environ, "PYTHONPATH": str(client_path)}
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        code, peak_mb = run_measured(command, env=env, stdout=out, stderr=err)
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        result = json.loads(out.read() or b"{}")
        log = err.read().decode(errors="replace").strip().splitlines()
    stats = result.get("stats", {})
    return {
        "exit": code,
        "seconds": round(seconds, 2),
        "peak_rss_mb": peak_mb,
        "sent": stats.get("sent"),
        "rejected": stats.get("rejected"),
        "refitted": stats.get("refitted"),  # refused for the scoring cost, cut to it and sent again
        "log_tail": [line[:300] for line in log[-3:]],
    }


def measure(megabytes: float, episodes: int, client_path: Path, extra: list[str]) -> dict[str, Any]:
    from serving import served  # here: the tests import write_traces as bench.follow_traces

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "out"
        path = write_traces(folder, megabytes, episodes)
        settings = {
            "DATABASE_URL": f"sqlite:///{tmp}/monitor.db",
            "DATA_DIR": f"{tmp}/data",
            "CACHE_DIR": f"{tmp}/cache",
            "DEFAULT_SCORER": "tiny-random",
            "SCORING_PAUSED": "true",
        }
        with served(settings, ready_seconds=900) as url:  # a busy machine starts the service slowly
            followed = follow_once(url, folder, Path(tmp) / "spool", client_path, extra)
        with sqlite3.connect(f"{tmp}/monitor.db") as db:
            stored = [n for (n,) in db.execute("select length(cast(payload as blob)) from batches order by created_at")]
        rejected = Path(tmp) / "spool" / "bench-traces" / "rejected"
        kept = [p.stat().st_size for p in sorted(rejected.glob("*.json")) if not p.name.endswith(".error.json")]
        refused = [
            json.loads(p.read_text()).get("bytes") or p.with_name(p.name.replace(".error", "")).stat().st_size
            for p in sorted(rejected.glob("*.error.json"))
        ]
        return {
            "file_bytes": path.stat().st_size,
            "episodes": episodes,
            "turns_per_trace": _turns(path),
            **followed,
            "stored_body_bytes": stored,
            "refused_body_bytes": refused,
            "refused_bodies_kept_bytes": kept,
        }


def _turns(path: Path) -> int:
    with open(path) as f:
        first = json.loads(f.readline())
    return sum(1 for node in first["traces"][0]["nodes"] if node.get("sampled"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", default="1.1,2.2", help="comma-separated file sizes (MB)")
    parser.add_argument("--episodes", type=int, default=1, help="episodes (one trace each) per file")
    parser.add_argument("--client-path", type=Path, default=ROOT / "client", help="the client to run")
    parser.add_argument("--client-args", default="", help="further follow options, e.g. '--max-text-chars 8000'")
    args = parser.parse_args()
    extra = args.client_args.split()
    load_before = os.getloadavg()[0]
    points = [measure(float(mb), args.episodes, args.client_path, extra) for mb in args.megabytes.split(",")]
    result = {"client": str(args.client_path), "client_args": extra, "load_1min": [load_before, os.getloadavg()[0]]}
    print(json.dumps(result | {"points": points}, indent=1))


if __name__ == "__main__":
    main()
