"""ScoringConfig: how the cross-scoring kernel runs (model, device, precision, budgets).

Built explicitly by the caller (CLI or service settings); this package never reads the environment.
Must not import service/.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Dtype = Literal["float32", "bfloat16", "float16", "float64"]
Attention = Literal["auto", "packed", "cascade"]
CACHE_DIR = Path("~/.cache/collapse-monitor").expanduser()  # converted GGUF models: every default cache folder


@dataclass(frozen=True)
class ScoringConfig:
    """Settings of one scorer.

    Attributes:
        model: a built-in name (``tiny-random``, ``smollm2-135m``), a local Hugging Face model
            folder, or a ``.gguf`` file.
        device: ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: weights and activations. Log-softmax always runs in at least float32.
        temperature: logits are divided by it before the log-softmax; RAGEN scores at the
            rollout temperature.
        max_batch_tokens: bound on every forward: sequences x (cached + new tokens).
        logits_chunk_tokens: hidden states projected onto the vocabulary per chunk, so no
            [pairs x length x vocab] tensor is ever held; fewer where the chunk's float32 logits
            would pass ``cross_scores.LOGITS_BYTES`` (128 MiB).
        attention: how a forward attends to shared keys and values (``scoring.cascade``):
            ``packed``, one FlexAttention call per layer; ``cascade``, one call per shared segment
            merged by log-sum-exp; ``auto``, packed on CUDA (where it is compiled) and cascade
            elsewhere (compiled FlexAttention on CPU costs ~26 s per compile and is no faster).
        head_tokens: reasoning budgets k for which the kernel also sums the log-probs of each
            reasoning's first min(T_r, k) tokens (``CrossScores.L_head``), at no extra forward:
            input dependence measured where a reasoning answers its prompt, whatever follows.
    """

    model: str = "tiny-random"
    device: str = "auto"
    dtype: Dtype = "float32"
    temperature: float = 1.0
    max_batch_tokens: int = 16384
    logits_chunk_tokens: int = 512
    attention: Attention = "auto"
    head_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.logits_chunk_tokens < 1:
            raise ValueError(f"logits_chunk_tokens must be >= 1, got {self.logits_chunk_tokens}")
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, float64; got {self.dtype!r}")
        if self.attention not in ("auto", "packed", "cascade"):
            raise ValueError(f"attention must be one of auto, packed, cascade; got {self.attention!r}")
        if any(k < 1 for k in self.head_tokens):
            raise ValueError(f"head_tokens must all be >= 1, got {self.head_tokens}")
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
