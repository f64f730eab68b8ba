"""The client's copy of the service's batch limits (``collapse_monitor.batches.BatchLimits``): a step it fits
to them must be one the service takes, so each default is the service's own (service/settings.py)."""

from __future__ import annotations

import pytest
from collapse_monitor.batches import BatchLimits

from service.settings import Settings


@pytest.mark.parametrize("name", ["max_body_bytes", "max_trajectories", "max_turns", "max_text_chars", "max_token_ids"])
def test_each_client_limit_is_the_services_default(name: str) -> None:
    assert getattr(BatchLimits(), name) == Settings.model_fields[name].default
