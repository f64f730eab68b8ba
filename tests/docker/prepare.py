"""Makes the Docker tests' images ahead of them: ``scripts/test`` runs this in the background while lint,
types and the other tiers run (the Debian base, the image's wheels and the builds take minutes, mostly
network waits), and the Docker tests run last (``tests/conftest.py``), when the builds are in the cache.

    .venv/bin/python -m tests.docker.prepare

Safe to run beside the tests: the downloads and the engine each have a lock, and what is made once is
found made. A failure here only leaves the work to the Docker fixtures, which report it.
"""

from __future__ import annotations

import shutil
import signal
import sys

from tests.docker.conftest import build_images, ensure_base_tarball, ensure_wheels, running_engine

if __name__ == "__main__":
    # scripts/test stops this with SIGTERM when it ends first: stop the engine it started on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    if shutil.which("debootstrap") is not None:
        ensure_base_tarball()
    ensure_wheels()
    with running_engine() as engine:
        build_images(engine)
