"""Large request bodies against a real `collapse-monitor serve` (SQLite, scoring paused): memory, time, waits.

Prints JSON: for one ~27 MB token-id batch, the server's RSS growth over the body's size, the
request's time and the longest a concurrent ``GET /v1/runs`` waited meanwhile; for four such
bodies sent at once, the growth over one body's size; for an anonymous 30 MB malformed body
sent to a server with tokens, the answer and its time. ``--pythonpath`` runs the server from
another checkout (e.g. ``git archive <commit> | tar -x -C /tmp/old``) to compare in one run.

    python bench/request_bodies.py [--pythonpath /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
JSON = {"content-type": "application/json"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def token_ids_body(step: int, seed: int) -> bytes:
    rng = random.Random(seed)
    trajectories = [
        {
            "group_id": g,
            "reward": 1.0,
            "turns": [
                {
                    "prompt_token_ids": [rng.randrange(50_000) for _ in range(8192)],
                    "reasoning_token_ids": [rng.randrange(50_000) for _ in range(65_536)],
                }
            ],
        }
        for g in range(64)
    ]
    return json.dumps({"step": step, "trajectories": trajectories}, separators=(",", ":")).encode()


class Server:
    def __init__(self, folder: str, pythonpath: str | None, **settings: str) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("COLLAPSE_MONITOR_")}
        if pythonpath:
            self.env["PYTHONPATH"] = pythonpath
        self.env.update(
            {
                "COLLAPSE_MONITOR_DATA_DIR": f"{folder}/data",
                "COLLAPSE_MONITOR_DEFAULT_SCORER": "tiny-random",
                "COLLAPSE_MONITOR_SCORING_PAUSED": "true",
                "COLLAPSE_MONITOR_RATE_LIMIT_PER_SECOND": "0",
                "COLLAPSE_MONITOR_MAX_SCORING_COST": str(10**12),
                **settings,
            }
        )
        self.folder = folder

    def cli(self, *args: str) -> None:
        subprocess.run([str(BIN / "collapse-monitor"), *args], env=self.env, capture_output=True, check=True)

    def __enter__(self) -> Server:
        port = free_port()
        with open(f"{self.folder}/serve.log", "ab") as log:
            self.process = subprocess.Popen(
                [str(BIN / "collapse-monitor"), "serve", "--port", str(port)], env=self.env, stdout=log, stderr=log
            )
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/readyz").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server did not start; see {self.folder}/serve.log")

    def __exit__(self, *_: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)

    def _status(self, key: str) -> int:
        line = next(x for x in Path(f"/proc/{self.process.pid}/status").read_text().splitlines() if x.startswith(key))
        return int(line.split()[1]) * 1024

    def reset_peak(self) -> int:
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")
        return self._status("VmRSS:")

    def peak(self) -> int:
        return self._status("VmHWM:")


def bodies(server: Server) -> dict[str, float]:
    httpx.post(f"{server.base}/v1/runs", json={"name": "r", "sampler": {"num_samples": 2}}).raise_for_status()
    payloads = [token_ids_body(step, seed=step) for step in range(1, 6)]
    size = len(payloads[0])
    waits: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.base, timeout=120) as client:
            while not stop.is_set():
                started = time.perf_counter()
                client.get("/v1/runs")
                waits.append(time.perf_counter() - started)
                time.sleep(0.02)

    httpx.post(f"{server.base}/v1/runs/r/batches", content=payloads[0][:2048], headers=JSON)  # lazy imports
    start = server.reset_peak()
    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.3)
    started = time.perf_counter()
    answer = httpx.post(f"{server.base}/v1/runs/r/batches", content=payloads[0], headers=JSON, timeout=300)
    seconds = time.perf_counter() - started
    stop.set()
    poller.join()
    one = (server.peak() - start) / size

    statuses: list[int] = []

    def send(body: bytes) -> None:
        while True:
            sent = httpx.post(f"{server.base}/v1/runs/r/batches", content=body, headers=JSON, timeout=300)
            if sent.status_code != 503:
                statuses.append(sent.status_code)
                return
            time.sleep(float(sent.headers.get("retry-after", "1")))

    start = server.reset_peak()
    started = time.perf_counter()
    senders = [threading.Thread(target=send, args=(body,)) for body in payloads[1:]]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    return {
        "body_mb": round(size / 1e6, 1),
        "one_status": answer.status_code,
        "one_seconds": round(seconds, 2),
        "one_growth_over_body": round(one, 2),
        "concurrent_get_max_wait_seconds": round(max(waits), 2),
        "four_statuses": statuses,
        "four_seconds": round(time.perf_counter() - started, 2),
        "four_growth_mb": round((server.peak() - start) / 1e6),
        "four_growth_over_one_body": round((server.peak() - start) / size, 2),
    }


def anonymous(server: Server) -> dict[str, float | str]:
    body = b'{"step": 1, "trajectories": [' + b"7," * (15 * 1024 * 1024)
    with httpx.Client(base_url=server.base, timeout=300) as client:
        started = time.perf_counter()
        answer = client.post("/v1/runs/r/batches", content=body, headers=JSON)
        return {
            "anonymous_malformed_mb": round(len(body) / 1e6, 1),
            "anonymous_answer": f"{answer.status_code} {answer.json()['error']}",
            "anonymous_seconds": round(time.perf_counter() - started, 2),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pythonpath", help="run the server from this checkout instead")
    args = parser.parse_args()
    result: dict[str, object] = {"loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    with tempfile.TemporaryDirectory() as folder, Server(folder, args.pythonpath) as server:
        result |= bodies(server)
    with tempfile.TemporaryDirectory() as folder:
        guarded = Server(folder, args.pythonpath)
        guarded.cli("tokens", "create", "--scope", "admin")
        with guarded as server:
            result |= anonymous(server)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
