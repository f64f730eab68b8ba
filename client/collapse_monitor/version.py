"""The client release: sent as the user agent, reported by the CLI."""

__version__ = "0.1.0"
