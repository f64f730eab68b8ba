"""Worker names: stable across restarts, never shared by two living workers of one data folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.loops import lease_owner, worker_identity
from service.settings import Settings


def test_living_workers_get_distinct_slots_and_a_freed_slot_is_taken_again(tmp_path):
    host = socket.gethostname()
    first, first_lock = worker_identity(tmp_path, "")
    second, second_lock = worker_identity(tmp_path, "")
    assert (first, second) == (f"{host}:0", f"{host}:1")
    assert first_lock is not None
    os.close(first_lock)  # the first worker's process ended
    again, again_lock = worker_identity(tmp_path, "")
    assert again == f"{host}:0"
    for fd in (second_lock, again_lock):
        assert fd is not None
        os.close(fd)


def test_a_killed_process_frees_its_slot(tmp_path):
    # A child takes slot 0 and is killed: the lock dies with it, whatever the signal.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from service.loops import worker_identity as w; from pathlib import Path; "
            f"w(Path({str(tmp_path)!r}), ''); print('held', flush=True); import time; time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == b"held"
    held, lock = worker_identity(tmp_path, "")
    assert held.endswith(":1")
    assert lock is not None
    os.close(lock)
    child.kill()
    child.wait()
    child.stdout.close()
    name, lock = worker_identity(tmp_path, "")
    assert name.endswith(":0")
    assert lock is not None
    os.close(lock)


def test_a_configured_name_is_used_as_is_and_each_process_leases_under_its_own_owner(tmp_path):
    assert worker_identity(tmp_path, "gpu-worker-3") == ("gpu-worker-3", None)
    assert not (tmp_path / "worker-slots").exists()
    a, b = lease_owner("gpu-worker-3"), lease_owner("gpu-worker-3")
    assert a != b
    assert a.startswith("gpu-worker-3#")


def test_a_worker_name_may_not_hold_the_owner_separator():
    with pytest.raises(ValidationError, match="worker_name"):
        Settings(_env_file=None, worker_name="a#b")


LOADING = """
import threading, time
import torch
from service.jobs.interrupts import LOADER, leave_if_loading
started = threading.Event()
def load():
    a = torch.randn(256, 256)
    started.set()
    while True:  # a model load still inside torch when the worker stops
        a = torch.tanh(a @ a)
threading.Thread(target=load, name=LOADER, daemon=True).start()
started.wait()
leave_if_loading()
print("not reached")
"""


def test_a_worker_stopping_during_a_model_load_exits_cleanly_without_waiting_for_it():
    done = subprocess.run([sys.executable, "-c", LOADING], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "not reached" not in done.stdout
