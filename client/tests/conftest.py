"""Fixtures of the client tests: a real service on loopback, fresh run names, trajectories."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from running_service import RunningService

# Trackio reads TRACKIO_DIR once, when imported (a test module may import it while being collected): every
# Trackio project a test writes in this process goes to a folder of this session, never the user's own.
TRACKIO_DIR = os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="trackio-")


def pytest_sessionfinish() -> None:
    shutil.rmtree(TRACKIO_DIR, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is marked ``client`` (``-m client`` runs them alone; ``scripts/test --fast`` skips them)."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.client)


@pytest.fixture(scope="session")
def service(tmp_path_factory) -> Iterator[RunningService]:
    """One service shared by the tests that do not stop it (each uses its own run)."""
    folder = tmp_path_factory.mktemp("service")
    (folder / "checkpoints").mkdir()
    running = RunningService(folder, checkpoint_root=str(folder / "checkpoints"))
    running.start()
    yield running
    running.stop()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Trainer tests run torch on one thread: the CI machine has two cores and a service beside them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def run_name(request) -> str:
    return f"{request.node.name[:60].replace('[', '-').replace(']', '')}-{uuid.uuid4().hex[:6]}"
