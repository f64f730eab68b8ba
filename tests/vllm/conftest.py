"""A real vLLM server (SmolLM2, float32) for the module's tests; skipped with the reason where no vLLM
environment was built (``scripts/vllm-env``), failed instead under CI=true, which builds it beside the suite."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.vllm.server import VllmServer, environment_missing, free_port

# scripts/test starts the build beside the suite; by the time the vLLM tests run (last but the Docker
# ones) it has usually finished. Longer than a cold build on a busy 2-core machine (~6 min).
BUILD_WAIT_SECONDS = 900.0


# Module-scoped: vLLM's CPU engine keeps its threads busy while idle, so it must not outlive its tests.
@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory) -> Iterator[VllmServer]:
    missing = environment_missing(BUILD_WAIT_SECONDS)
    if missing is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the vLLM tests must run under CI: {missing}")
        pytest.skip(missing)
    server = VllmServer(port=free_port(), dtype="float32", log=tmp_path_factory.mktemp("vllm") / "server.log")
    server.start()
    try:
        yield server
    finally:
        server.kill()
