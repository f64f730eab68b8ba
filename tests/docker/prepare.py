"""Makes the Docker tests' downloads ahead of them: ``scripts/test`` runs this in the background while lint,
types and the other tiers run (the Debian base and the image's wheels take minutes of network waits).

    .venv/bin/python -m tests.docker.prepare

Safe to run beside the tests: both share a lock, and what is made once is found made.
"""

from __future__ import annotations

import shutil

from tests.docker.conftest import ensure_base_tarball, ensure_wheels

if __name__ == "__main__":
    if shutil.which("debootstrap") is not None:
        ensure_base_tarball()
    ensure_wheels()
