"""The ``collapse-monitor`` command line (the console script ``service.cli:main``).

``main`` holds the parser table; ``offline`` the tools that read a file (metrics, filter, score),
``server`` the long-running commands (serve, worker, migrate), ``admin`` the rest (tokens, purge,
demo, dashboards).
"""

from service.cli.main import main

__all__ = ["main"]
