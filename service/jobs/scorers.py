"""ScorerPool: loads the models that score batches, keeps the most recently used ones in memory.

A scorer is always chosen on the server: a name from ``Settings.scorers`` (a model our kernel runs
here, or a vLLM server, ``service.jobs.vllm``), or a checkpoint a trainer announced under
``Settings.checkpoint_root`` (full weights, or a LoRA adapter applied to the run's named scorer).
Clients never send a model path that gets loaded unchecked.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from scoring import Scorer, load_scorer
from scoring.scorer import ModelLoadError
from service.errors import InvalidRequest
from service.jobs.budget import ScoringRates
from service.jobs.checkpoints import checkpoint_at_load
from service.jobs.interrupts import ScorerUnavailable
from service.jobs.vllm import AnyScorer, VllmScorer, load_vllm_scorer
from service.settings import Settings, VllmEndpoint

Key = tuple[str, str | None]  # (scorer name, "kind:checkpoint folder" or None)


class ScorerPool:
    """Thread-safe LRU of loaded scorers keyed by (scorer name, temperature-free checkpoint).

    A load (seconds to minutes: a checkpoint on a slow disk, a GGUF conversion) holds only its
    own key's lock: a batch needing another scorer is served meanwhile, and two batches needing
    the same one load it once. The LRU's own lock is held only to look up, insert and evict, so at
    most ``max_loaded_scorers`` stay loaded (loads in flight are not counted until they land).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        if settings.threads is not None:
            import torch  # the pool lives in the scoring process, which loads torch anyway

            torch.set_num_threads(settings.threads)
        self._loaded: OrderedDict[Key, AnyScorer] = OrderedDict()
        self._lock = threading.Lock()  # guards _loaded and _loading; never held across a load
        self._loading: dict[Key, threading.Lock] = {}  # one lock per key being loaded
        self.rates = ScoringRates()  # the measured throughput of the scorers, which the step budget plans with

    def get(self, name: str, checkpoint: Path | None = None, kind: str = "full") -> AnyScorer:
        key = (name, f"{kind}:{checkpoint}" if checkpoint else None)
        with self._lock:
            if key in self._loaded:
                self._loaded.move_to_end(key)
                return self._loaded[key]
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            with self._lock:  # loaded by the thread this one waited for
                if key in self._loaded:
                    self._loaded.move_to_end(key)
                    return self._loaded[key]
            try:
                scorer = self._load_reporting(name, checkpoint, kind)
            finally:
                with self._lock:
                    self._loading.pop(key, None)
            with self._lock:
                self._loaded[key] = scorer
                while len(self._loaded) > self.settings.max_loaded_scorers:
                    self._loaded.popitem(last=False)
            return scorer

    def close(self) -> None:
        """Closes the HTTP connections of the vLLM scorers loaded (the models of the others go with the pool)."""
        with self._lock:
            for scorer in self._loaded.values():
                if isinstance(scorer, VllmScorer):
                    scorer.close()

    def loaded(self) -> list[str]:
        with self._lock:
            return [name if ckpt is None else f"{name}@{ckpt}" for name, ckpt in self._loaded]

    def _load_reporting(self, name: str, checkpoint: Path | None, kind: str) -> AnyScorer:
        """``_load``, with what went wrong said in the batch's terms."""
        try:
            return self._load(name, checkpoint, kind)
        except (ModelLoadError, InvalidRequest, ScorerUnavailable):
            raise
        except (OSError, RuntimeError, ValueError) as e:  # missing or mismatched files: the batch's reason
            what = f"the {kind} checkpoint {str(checkpoint)!r} of scorer {name!r}" if checkpoint else f"scorer {name!r}"
            raise ModelLoadError(f"{what} could not be loaded: {type(e).__name__}: {e}") from e

    def _load(self, name: str, checkpoint: Path | None, kind: str) -> AnyScorer:
        if name not in self.settings.scorers:
            raise InvalidRequest(f"scorer must be one of {', '.join(self.settings.scorers)}, got {name!r}")
        base_model = self.settings.scorers[name]
        endpoint = VllmEndpoint.parse(base_model)
        if endpoint is not None:
            if checkpoint is not None:
                raise InvalidRequest(
                    f"scorer {name!r} is served by vLLM at {endpoint.url}: it scores the weights its server loaded, "
                    "not a checkpoint a trainer announces; announce checkpoints on runs of an in-process scorer"
                )
            return load_vllm_scorer(name, endpoint, self.settings.cache_dir, self.settings.vllm_client)
        if checkpoint is None:
            return load_scorer(self.settings.scoring_config(base_model), self.settings.cache_dir)
        # Checked again now: the folder may have been swapped for a link out of the root since it was announced.
        folder = checkpoint_at_load(self.settings, checkpoint, kind)
        if kind == "full":
            scorer = load_scorer(self.settings.scoring_config(str(folder)), self.settings.cache_dir)
            if scorer.tokenizer is None:  # pragma: no cover - folders always carry a tokenizer here
                scorer.tokenizer = load_scorer(
                    self.settings.scoring_config(base_model), self.settings.cache_dir
                ).tokenizer
            return scorer
        return _with_lora(load_scorer(self.settings.scoring_config(base_model), self.settings.cache_dir), folder)


def _with_lora(base: Scorer, adapter: Path) -> Scorer:
    """The base scorer with a LoRA adapter merged into a fresh copy of its weights."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(base.model, str(adapter)).merge_and_unload()
    merged.eval()
    return Scorer(name=f"{base.name}+lora:{adapter.name}", model=merged, tokenizer=base.tokenizer)
