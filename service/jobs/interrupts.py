"""Abandoning a scoring between layers: why (the Interrupted family), a checked model load, and leaving mid-load."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("collapse_monitor.worker")
T = TypeVar("T")


class Interrupted(Exception):
    """Raised between layers of a scoring to abandon it; the subclass says why."""


class ShuttingDown(Interrupted):
    """The worker was asked to stop: the batch goes back to the queue, no attempt counted."""


class LeaseLost(Interrupted):
    """Another worker holds the batch now (this one was presumed dead): nothing to write."""


class BatchDeleted(LeaseLost):
    """The batch's run was deleted after the claim: nothing to score or write."""


class ScorerUnavailable(Interrupted):
    """The scorer's server (vLLM) did not answer: the batch goes back to the queue, no attempt counted, and is
    scored whole once it answers again (nothing of the abandoned scoring is written)."""


class TimeLimit(Interrupted):
    """The batch ran past ``max_scoring_seconds``: it fails with this message."""


LOADER = "scorer-load"  # the name of a model-loading thread


def leave_if_loading() -> None:
    """Ends the process at once (status 0) when a model load abandoned at shutdown still runs.

    The load is inside torch's C++ code, and finalizing the interpreter under it aborts the
    process (std::terminate: status -6, seen under load when SIGTERM came during a load). Its
    result would be thrown away anyway; everything else is already stopped and written.
    """
    if any(thread.name == LOADER and thread.is_alive() for thread in threading.enumerate()):
        log.info("exiting without waiting for an abandoned model load")
        logging.shutdown()
        os._exit(0)


def checked(work: Callable[[], T], check: Callable[[], None]) -> T:
    """``work()``, run in a daemon thread while ``check`` is called every 0.1 s.

    Loading a model (seconds to a minute, converting a GGUF) has no layers to check between; an
    exception from ``check`` leaves the load to finish in the background (into the pool, where
    the next batch finds it) or to die with the process.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(work())
        except BaseException as e:  # handed to the caller's thread below
            error.append(e)

    thread = threading.Thread(target=target, name=LOADER, daemon=True)
    thread.start()
    while thread.is_alive():
        check()
        thread.join(0.1)
    if error:
        raise error[0]
    return result[0]
