"""The checkpoints a TRL rollback returns to: the trainer's own saves, the few newest kept, and the newest
before an open alert's onset kept with them.

A rollback returns to the newest checkpoint whose policy generated a batch before the episode's
onset step: ``checkpoint-S`` holds the weights after S optimizer steps, which generated step S+1's
batch, so it qualifies when S + 1 < onset (the policy of ``checkpoint-{onset - 1}`` generated the
first batch the rule judged collapsed). The alert comes ``window`` scored steps or more after its
onset, so saves happen between the two; the keeper deletes the trainer's checkpoints beyond the
``keep`` newest, as TRL's ``save_total_limit`` would, except the newest one before the onset of an
alert still open (pending or firing), which a rollback may need. Must not import torch.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections import deque
from collections.abc import Iterable

from collapse_monitor.alerts import OPEN_STATES, AlertEvent

logger = logging.getLogger("collapse_monitor")

ROLLBACK_KEEP = 3  # checkpoints kept besides the one a rollback needs: a few, so disk stays bounded
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR folders


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """The trainer's checkpoint folders in ``output_dir`` as ``(step, path)``, oldest first."""
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in names if (m := CHECKPOINT.match(name))]
    return sorted(p for p in found if os.path.isdir(p[1]))


def checkpoint_before(output_dir: str, onset_step: int) -> str | None:
    """The newest checkpoint whose policy generated a batch before ``onset_step`` (step + 1 < onset), or None."""
    before = [path for step, path in checkpoints(output_dir) if step + 1 < onset_step]
    return before[-1] if before else None


class CheckpointKeeper:
    """An alert callback that knows the open episodes' onsets, and prunes the trainer's checkpoints.

    Subscribed to the monitor's alerts on the main process (``Monitor.on_alert``): the watcher's thread
    queues the events of ``rules``, ``update()`` reads them on the training thread.
    """

    def __init__(self, output_dir: str, keep: int = ROLLBACK_KEEP) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"rollback_keep must be a whole number of checkpoints >= 1, got {keep!r}")
        self.output_dir = output_dir
        self.keep = keep
        self._queue: deque[AlertEvent] = deque()  # appended by the watcher thread, read by the training thread
        self._onsets: dict[tuple[int, str, str, int], int] = {}  # open episode -> its onset step

    def __call__(self, event: AlertEvent) -> None:
        self._queue.append(event)

    def update(self) -> None:
        while self._queue:
            event = self._queue.popleft()
            if event.state in OPEN_STATES:
                self._onsets[event.episode] = event.onset_step
            else:
                self._onsets.pop(event.episode, None)

    def prune(self, protected: Iterable[str | None] = ()) -> None:
        """Deletes the checkpoints beyond the ``keep`` newest, but the newest before an open onset and ``protected``."""
        self.update()
        found = checkpoints(self.output_dir)
        kept: list[str | None] = [*(path for _, path in found[-self.keep :]), *protected]
        if self._onsets:
            kept.append(checkpoint_before(self.output_dir, min(self._onsets.values())))
        kept_paths = {os.path.normpath(p) for p in kept if p is not None}
        for _, path in found:
            if os.path.normpath(path) not in kept_paths:
                logger.info("collapse-monitor: deleting %s (rollback_keep=%d)", path, self.keep)
                shutil.rmtree(path, ignore_errors=True)
