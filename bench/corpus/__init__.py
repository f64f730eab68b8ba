"""The SmolLM2 trace corpus: generated once by ``generate.py``, read by ``load.py``."""
