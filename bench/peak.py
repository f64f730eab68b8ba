"""A child process's own peak memory.

On Linux, ``wait4``'s ``ru_maxrss`` for a child is at least the resident size of the process that
forked it: exec keeps the high-water mark of the address space it replaces, which for a fork (or
vfork) is the parent's. A ``follow`` started from a 2.4 GB pytest process read 2.4 GB though it used
a few dozen MB. So the child is started by a small Python shim, and the shim's ``wait4`` is what is
reported: the most the shim's own fresh address space held is ~10 MB, below any child worth measuring.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from typing import Any

_SHIM = (
    "import os, subprocess, sys\n"
    "child = subprocess.Popen(sys.argv[2:])\n"
    "_, status, usage = os.wait4(child.pid, 0)\n"
    "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
    "sys.exit(os.waitstatus_to_exitcode(status) % 256)\n"
)


def run_measured(command: list[str], **popen: Any) -> tuple[int, int]:
    """Run ``command`` to its end (``popen``: Popen's keywords, e.g. ``stdout``, ``env``); its exit status and
    its own peak RSS in MB."""
    with tempfile.NamedTemporaryFile(mode="r", suffix=".peak") as peak:
        code = subprocess.run([sys.executable, "-c", _SHIM, peak.name, *command], check=False, **popen).returncode
        return code, int(peak.read() or 0) // 1024
