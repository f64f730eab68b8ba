"""A real RL run that collapses, watched live (issue 20): ``python -m bench.real_run``."""
