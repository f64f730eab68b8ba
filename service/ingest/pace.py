"""Where ``service.ingest.batches`` has imported the pace read from; its home is ``service.reads.pace``.

Kept while batches.py (worked on elsewhere) still imports it from here; drop once it imports the read.
"""

from service.reads.pace import BACKLOG, RECENT, Pace, run_pace

__all__ = ["BACKLOG", "RECENT", "Pace", "run_pace"]
