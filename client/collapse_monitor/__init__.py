"""collapse-monitor-client: feed a collapse-monitor service from an RL trainer without slowing it.

    from collapse_monitor import Monitor

    monitor = Monitor("http://127.0.0.1:8000", "grpo-math-3")
    monitor.log(step, [{"group_id": g, "reward": r, "prompt": p, "response": c}, ...])

Integrations: ``collapse_monitor.integrations.trl`` (GRPOTrainer, RLOOTrainer),
``collapse_monitor.integrations.verl`` (DataProto batches, RAGEN) and
``collapse_monitor.integrations.slime`` (slime and miles, by one flag); TRL and verl can run the
SNR-aware filter (``SNRFilter``) in the trainer. Command line: ``collapse-monitor-client send|follow``
(the files of verl, TRL, prime-rl, AReaL, ROLL, slime). See docs/client.md.
"""

from collapse_monitor.alerts import AlertActions, AlertEvent
from collapse_monitor.batches import BatchLimits, TrajectoryError
from collapse_monitor.engagement import FilterEngagement
from collapse_monitor.monitor import Monitor, MonitorError, default_spool_dir
from collapse_monitor.sender import Stats
from collapse_monitor.snr_filter import SNRFilter
from collapse_monitor.version import __version__

__all__ = [
    "AlertActions",
    "AlertEvent",
    "BatchLimits",
    "FilterEngagement",
    "Monitor",
    "MonitorError",
    "SNRFilter",
    "Stats",
    "TrajectoryError",
    "__version__",
    "default_spool_dir",
]
