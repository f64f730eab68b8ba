"""Policy checkpoint folders: under the allow-listed root, checked when announced and again just before loading."""

from __future__ import annotations

from pathlib import Path

from service.errors import InvalidRequest
from service.settings import Settings


def resolve_checkpoint(settings: Settings, path: str, kind: str) -> Path:
    """The checkpoint folder ``path`` names, if it lies under the allow-listed root and looks right."""
    root = _checkpoint_root(settings)
    folder = (root / path).resolve()
    if not folder.is_relative_to(root):
        raise InvalidRequest(f"path must lie under the checkpoint root {str(root)!r}, got {path!r}", field="path")
    _check_folder(root, folder, kind, f"{path!r}")
    return folder


def checkpoint_at_load(settings: Settings, folder: Path, kind: str) -> Path:
    """The announced checkpoint ``folder``, resolved and checked against the root again just before it is loaded.

    It was checked when announced, but a folder under the root can be replaced by a link to
    anywhere afterwards (or a file in it by one): loading follows links, so the check is redone
    on what would be read now, and the folder is loaded by its resolved path. 400-style
    ``InvalidRequest``: the worker fails the batch with this reason.
    """
    root = _checkpoint_root(settings)
    resolved = folder.resolve()
    if not resolved.is_relative_to(root):
        raise InvalidRequest(
            f"the {kind} checkpoint {str(folder)!r} now resolves to {str(resolved)!r}, outside the checkpoint root "
            f"{str(root)!r} (replaced by a link since it was announced); it was not loaded",
            field="path",
        )
    _check_folder(root, resolved, kind, f"{str(folder)!r}")
    return resolved


def _checkpoint_root(settings: Settings) -> Path:
    if settings.checkpoint_root is None:
        raise InvalidRequest(
            "checkpoints are disabled on this server: set checkpoint_root (COLLAPSE_MONITOR_CHECKPOINT_ROOT)",
            field="path",
        )
    return settings.checkpoint_root.resolve()


def _check_folder(root: Path, folder: Path, kind: str, named: str) -> None:
    """The folder holds its kind's marker file, and nothing in it is a link leading out of ``root``."""
    marker = "adapter_config.json" if kind == "lora" else "config.json"
    if not (folder / marker).is_file():
        raise InvalidRequest(
            f"a {kind} checkpoint folder must contain {marker}; {str(folder)!r} does not", field="path"
        )
    for entry in folder.iterdir():  # what a loader reads: config, weights, tokenizer files
        if not entry.resolve().is_relative_to(root):
            raise InvalidRequest(
                f"the checkpoint {named} holds {entry.name!r}, a link to {str(entry.resolve())!r} outside the "
                f"checkpoint root {str(root)!r}",
                field="path",
            )
