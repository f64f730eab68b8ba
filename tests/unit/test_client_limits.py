"""The client's copy of the service's batch limits (``collapse_monitor.batches.BatchLimits``): a step it fits
to them must be one the service takes, so each default is the service's own (service/settings.py)."""

from __future__ import annotations

import pytest
from collapse_monitor.batches import LIMIT_NAMES, MIN_BODY_BYTES, BatchLimits

from service.schemas.inputs import BatchLimits as ServiceLimits
from service.settings import Settings


@pytest.mark.parametrize("name", ["max_body_bytes", "max_trajectories", "max_turns", "max_text_chars", "max_token_ids"])
def test_each_client_limit_is_the_services_default(name: str) -> None:
    assert getattr(BatchLimits(), name) == Settings.model_fields[name].default


def test_the_service_tells_the_limits_the_client_fits_to() -> None:
    assert tuple(ServiceLimits.model_fields) == LIMIT_NAMES


def test_the_client_takes_a_body_limit_as_small_as_the_service_does() -> None:
    floor = [m.ge for m in Settings.model_fields["max_body_bytes"].metadata if hasattr(m, "ge")]
    assert floor == [MIN_BODY_BYTES]
