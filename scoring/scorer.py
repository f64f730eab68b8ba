"""Scorer: a causal LM and its tokenizer, ready for cross-scoring; ModelLoadError.

Loading lives in ``scoring.models``, the load-time check in ``scoring.verification``; this module
only describes what a loaded scorer is, so the kernel can depend on it without pulling in either.
Must not import service/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class ModelLoadError(ValueError):
    """A scorer could not be loaded or verified; the message says what to install or fix."""


@dataclass
class Scorer:
    """A causal LM ready for cross-scoring (``scoring.verification.verify_scorer`` accepts it)."""

    name: str
    model: Any  # a transformers PreTrainedModel (causal LM), in eval mode
    tokenizer: Any  # a transformers tokenizer, or None for id-only test models

    @property
    def device(self) -> torch.device:
        return torch.device(next(self.model.parameters()).device)

    @property
    def dtype(self) -> torch.dtype:
        dtype: torch.dtype = next(self.model.parameters()).dtype
        return dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding: the token ids the scorer can score."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int | None:
        config = self.model.config
        for attr in ("max_position_embeddings", "n_positions"):
            value = getattr(config, attr, None)
            if isinstance(value, int):
                return value
        return None

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text`` without special tokens, as RAGEN tokenizes X and Z."""
        if self.tokenizer is None:
            raise ModelLoadError(f"scorer {self.name!r} has no tokenizer: send token ids")
        return tuple(int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"])
