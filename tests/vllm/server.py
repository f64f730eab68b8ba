"""A real vLLM server on loopback, from the environment ``scripts/vllm-env`` builds (``.venv-vllm``).

SmolLM2 is served from the project's converted cache folder (``scoring.models.converted_folder``), so
the server and our kernel load the same weights. Used by ``tests/vllm`` and ``bench/vllm_vs_kernel.py``.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

from scoring.config import CACHE_DIR

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm"
READY = VENV / ".ready"  # written by scripts/vllm-env once the environment imports
LOCK = ROOT / ".cache" / "vllm-env.lock"  # held by scripts/vllm-env while it builds
SERVED_NAME = "smollm2"
# On 2 quiet cores vLLM's CPU backend was healthy in ~50 s; at load 7-10 its imports alone took 5 minutes.
START_SECONDS = 600.0


def environment_missing(wait_seconds: float = 0.0) -> str | None:
    """Why vLLM cannot run here, or None; waits up to ``wait_seconds`` for a build in progress to finish."""
    if READY.is_file():
        return None
    if LOCK.is_file() and wait_seconds > 0:
        with LOCK.open() as lock:
            deadline = time.monotonic() + wait_seconds
            while time.monotonic() < deadline:
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(2)
        if READY.is_file():
            return None
    return f"no vLLM environment at {VENV} (scripts/vllm-env builds it: ~3.5 GB, minutes)"


def smollm2_folder() -> Path:
    """The converted SmolLM2 folder, made on first use (as the kernel's scorer makes it)."""
    from scoring.models import converted_folder, smollm2_gguf_path

    return converted_folder(smollm2_gguf_path(), CACHE_DIR)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process group; ``spec`` names it in ``Settings.scorers``."""

    port: int
    dtype: str
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> str:
        return f"vllm+{self.url}?model={SERVED_NAME}&tokenizer=smollm2-135m&dtype={self.dtype}"

    def start(self, timeout: float = START_SECONDS) -> None:
        """Starts the server (a session of its own, so ``kill`` ends its engine processes too); waits for /health."""
        command = [
            str(VENV / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(smollm2_folder()),
            "--served-model-name",
            SERVED_NAME,
            "--dtype",
            self.dtype,
            "--enforce-eager",
            "--max-model-len",
            "2048",
            # On the CPU backend this is the share of the NUMA node's memory vLLM reserves; the default 0.92
            # refuses to start beside anything else (here: 6.9 of 9.2 GiB free).
            "--gpu-memory-utilization",
            "0.15",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
        env |= {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "INFO"}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        self.kill()
        raise RuntimeError(f"vLLM was not healthy within {timeout:.0f} s:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL to the server's whole process group (API server and engine), as a crash would."""
        if self.process is None:
            return
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None

    def completions_served(self) -> int:
        """``POST /v1/completions`` requests answered so far, from the server's access log."""
        return self.log.read_text(errors="replace").count('"POST /v1/completions HTTP/1.1" 200')

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@contextmanager
def running(dtype: str, log: Path, port: int | None = None) -> Iterator[VllmServer]:
    server = VllmServer(port=port or free_port(), dtype=dtype, log=log)
    server.start()
    try:
        yield server
    finally:
        server.kill()
