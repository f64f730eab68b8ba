"""Database outages as clients see them: answers during the outage and the time to recover.

    python bench/outage.py [--kinds stop,freeze] [--stop-seconds 10] [--freeze-seconds 20]

For each kind, a throwaway PostgreSQL 15 cluster (initdb + pg_ctl in a temporary folder, loopback)
serves ``collapse-monitor serve`` (embedded worker, tiny-random scorer, the default timeouts:
connect 3 s, statement 10 s). A client streams one small batch a second, retrying a refused or
failed one every 0.25 s (not after Retry-After: the figure is the server's recovery, not the
client's patience); a prober reads /healthz, /readyz and a run every 0.25 s. While a batch is
being scored the database is stopped (``pg_ctl stop -m fast``, open connections terminated) or
frozen (SIGSTOP to every server process: a hung host, which refuses nothing), then brought back.
Prints one JSON object per kind: requests during the outage by what and status, 5xx other than
503, answers that were not the documented JSON, the slowest answers, seconds from the database
back to the first accepted batch and to the first scored one, batches lost or duplicated.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tests.e2e.conftest import Processes, service_env, start_service
from tests.e2e.outage_drill import Drill
from tests.e2e.pg_cluster import ThrowawayPostgres


def drill(kind: str, outage_seconds: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="cm-outage-bench-") as folder, ThrowawayPostgres() as database:
        tmp = Path(folder)
        processes = Processes(tmp)
        try:
            base = start_service(processes, service_env(tmp, database.url, COLLAPSE_MONITOR_RATE_LIMIT_PER_SECOND="0"))
            run = Drill(base, database, kind, outage_seconds=outage_seconds)
            run.run(timeout=outage_seconds + 150)
        finally:
            processes.stop_all()
        return run.figures()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="stop,freeze")
    parser.add_argument("--stop-seconds", type=float, default=10.0)
    parser.add_argument("--freeze-seconds", type=float, default=20.0, help="longer than connect + statement timeouts")
    args = parser.parse_args()
    for kind in args.kinds.split(","):
        seconds = args.stop_seconds if kind == "stop" else args.freeze_seconds
        print(json.dumps(drill(kind, seconds)), flush=True)


if __name__ == "__main__":
    main()
