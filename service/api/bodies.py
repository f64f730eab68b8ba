"""Request bodies: access decided from the headers first, then the bytes read, then parsed off the event loop.

FastAPI reads and ``json.loads`` a declared body on the event loop before it solves a route's
dependencies, so an anonymous 32 MB body cost the loop (and every other client) its parse
before its 401, and a malformed one got a 422 instead. ``service.api.deps.AccessFirst`` routes
keep their declared bodies (the OpenAPI document is FastAPI's own) but wrap FastAPI's handler:

1. the route's access dependencies run on the headers alone (401/403 before a byte is read);
2. the body is read, and a ``service.api.rate_limit.BodyBudget`` share is held while it is parsed, so that
   concurrent large bodies cannot multiply the memory parsing needs;
3. in the thread pool: the UTF-8 checks, the body's shape checked on the bytes (``service.api.json_shape``:
   413 past the keys any object may hold, the items that may be read between two callbacks, or the
   longest string any field holds), ``json.loads`` with a Python callback at every number and object end
   (so that the parse lets go of the GIL between them) and the model's validation, with the errors
   FastAPI itself gives (same 422 locations and messages, since it is the same parse);
4. FastAPI's handler then finds the parsed model in place of the JSON (``ParsedRequest``); its
   own validation of a model instance returns it as is.

Between the parse and the validation, sizes that would be refused anyway are checked on the
parsed JSON (``BODY_SIZES``, top-level unknown keys): a 1 MB body of 333,333 empty trajectories
made pydantic list 10^6 errors, and the 422 renderer a 126 MB answer (+1.4 GB). A 422 lists at
most ``MAX_LISTED_ERRORS`` errors and counts them all (``BodyValidationError``), except in a batch's
trajectories, which are validated one at a time until that many errors are found (``ITEMWISE``).

A request holds about 6x a token-id body's size at its peak (``shared_ints``; docs/security.md
gives the measurement), and its ``BodyBudget`` share until its answer is built.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import AliasChoices, AliasPath, BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException

from service.api.json_shape import MAX_QUIET_ITEMS, check_shape
from service.errors import InvalidRequest
from service.ingest.limits import IngestLimits, check_size
from service.schemas.inputs import (
    MAX_TRAINER_FIGURES,
    BatchIn,
    FiguresIn,
    FilterRequest,
    MatrixBatchIn,
    TrajectoryIn,
)

M = TypeVar("M", bound=BaseModel)
MAX_LISTED_ERRORS = 20  # a 422 lists this many errors and counts the rest: its size is bounded, not the body's
MAX_SHARED_INTS = 1 << 18  # distinct numbers one body shares: every vocabulary we know has fewer tokens


def shared_ints() -> Callable[[str], int]:
    """A ``parse_int`` for one ``json.loads``: one int object per distinct number of the body, not one per occurrence.

    A token id parsed as its own int costs 28 bytes plus its list slot, ~6x its ~6 bytes of JSON;
    a body's ids come from one vocabulary, so sharing them cuts a request's peak from ~12x to ~6x
    its body (the values are the same ints). It is Python on purpose: the C parser alone holds the
    GIL for a whole body (~1 s for 30 MB, during which no other request was answered), while a
    Python call per number lets the event loop's thread in; the parse takes ~2x longer for it. At
    most ``MAX_SHARED_INTS`` are kept, so a body of all-distinct numbers costs no more than usual.
    """
    kept: dict[str, int] = {}

    def parse_int(number: str) -> int:
        value = kept.get(number)
        if value is None:
            value = int(number)
            if len(kept) < MAX_SHARED_INTS:
                kept[number] = value
        return value

    return parse_int


def checked_text(raw: bytes) -> str:
    """The body as text; it must be UTF-8 JSON (RFC 8259), without a byte order mark (400 otherwise)."""
    if raw.startswith(codecs.BOM_UTF8):
        raise InvalidRequest("the body starts with a UTF-8 byte order mark; send the JSON without it", field="body")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the body must be UTF-8 JSON; byte {e.start} is not UTF-8", field="body") from e


class BodyValidationError(RequestValidationError):
    """FastAPI's 422 with only the first ``MAX_LISTED_ERRORS`` errors kept, and how many there were."""

    def __init__(self, errors: list[Any], n_errors: int) -> None:
        super().__init__(errors[:MAX_LISTED_ERRORS])
        self.n_errors = n_errors


@dataclass(frozen=True)
class ListSize:
    """A top-level list of a body and the limit on its length, as its handler's 413 words it (``check_size``)."""

    field: str
    limit: str  # the IngestLimits field (named as in Settings)
    what: str
    unit: str


# The lists a handler refuses by length anyway, checked before the model is validated (a 200,000-row
# matrix took 1.3-3.3 s of a core to validate before its 413). Nested sizes stay with the handlers.
BODY_SIZES: dict[type[BaseModel], tuple[ListSize, ...]] = {
    BatchIn: (ListSize("trajectories", "max_trajectories", "a batch", "trajectories"),),
    MatrixBatchIn: (
        ListSize("row_group_ids", "max_matrix_rows", "a matrix", "rows (max_matrix_rows)"),
        ListSize("L_seq", "max_matrix_rows", "a matrix", "rows (max_matrix_rows)"),
    ),
    FilterRequest: (ListSize("rewards", "max_filter_groups", "a filter request", "groups (max_filter_groups)"),),
}


def check_rewards(data: dict[str, Any], limits: IngestLimits) -> None:
    """A filter request's rewards: 413 over ``max_filter_rewards``; 422 when more than ``MAX_LISTED_ERRORS``
    are not numbers (1,000,000 ``true`` made pydantic build 10^6 errors: 1.9 GB, 10-30 s)."""
    groups = [g for g in data.get("rewards") or () if isinstance(g, list)]
    n_rewards = sum(len(g) for g in groups)
    check_size(
        n_rewards,
        limits.max_filter_rewards,
        "a filter request",
        "rewards (max_filter_rewards)",
        "rewards",
        setting="max_filter_rewards",
    )
    listed: list[dict[str, Any]] = []
    n_bad = 0
    for i, group in enumerate(groups):
        for j, reward in enumerate(group):
            if type(reward) not in (int, float):  # strict: a bool is no number
                n_bad += 1
                if len(listed) < MAX_LISTED_ERRORS:
                    listed.append({"type": "float_type", "loc": ("body", "rewards", i, j), "msg": NOT_A_NUMBER})
    if n_bad > MAX_LISTED_ERRORS:  # fewer: pydantic words them (and any other error) itself
        raise BodyValidationError(listed, n_bad)


NOT_A_NUMBER = "Input should be a valid number"  # pydantic's words


def check_figures(data: dict[str, Any], _limits: IngestLimits) -> None:
    """A step's trainer figures: 422 over ``MAX_TRAINER_FIGURES`` before any is validated (pydantic checks a
    dict's length after its items: 1M bad figures, 16 MB, took 11 s and +150 MB, other requests waiting 9 s)."""
    figures = data.get("figures")
    if isinstance(figures, dict) and len(figures) > MAX_TRAINER_FIGURES:
        message = f"Dictionary should have at most {MAX_TRAINER_FIGURES} items after validation, not {len(figures)}"
        raise BodyValidationError([{"type": "too_long", "loc": ("body", "figures"), "msg": message}], 1)


# Checks of nested parts, before validation, for the models whose nested items are refused by the million.
NESTED_CHECKS: dict[type[BaseModel], Callable[[dict[str, Any], IngestLimits], None]] = {
    FilterRequest: check_rewards,
    FiguresIn: check_figures,
    BatchIn: check_figures,
}


# Bodies whose model holds little, refused by their size before they are read or parsed: json.loads holds the
# GIL for a whole parse, and a figures post of 1M keys (16 MB) held it 17 s, every other request waiting.
# A figures post holds at most MAX_TRAINER_FIGURES figures of ~110 bytes: 256 KiB leaves room for indentation.
MAX_BODY_BYTES: dict[type[BaseModel], tuple[int, str]] = {
    FiguresIn: (256 * 1024, f"a figures post ({MAX_TRAINER_FIGURES} figures at most)"),
}


def check_body_bytes(size: int | None, model: type[BaseModel]) -> None:
    """413 for a body over its model's ``MAX_BODY_BYTES`` (``size``: declared or read; None: not declared)."""
    limit, what = MAX_BODY_BYTES.get(model, (None, ""))
    if limit is not None and size is not None:
        check_size(size, limit, what, "bytes", "body")


def check_json_sizes(data: Any, model: type[BaseModel], limits: IngestLimits) -> None:
    """413 for a top-level list over its limit; 422 for top-level keys the model does not know, before
    pydantic validates anything (it would build one error per unknown key and per bad item)."""
    if not isinstance(data, dict):
        return
    for size in BODY_SIZES.get(model, ()):
        value = data.get(size.field)
        if isinstance(value, list):
            check_size(len(value), getattr(limits, size.limit), size.what, size.unit, size.field, setting=size.limit)
    nested = NESTED_CHECKS.get(model)
    if nested is not None:
        nested(data, limits)
    if model.model_config.get("extra") != "forbid":
        return
    known = _known_keys(model)
    unknown = [key for key in data if key not in known]
    if unknown:
        errors = [
            {"type": "extra_forbidden", "loc": ("body", key), "msg": "Extra inputs are not permitted", "input": None}
            for key in unknown[:MAX_LISTED_ERRORS]
        ]
        raise BodyValidationError(errors, len(unknown))


# Top-level lists of objects validated one item at a time, stopping at MAX_LISTED_ERRORS errors: within every
# count limit, 4,000 trajectories of 256 `{}` turns (3.2 MB) made pydantic build 10^6 errors, +2.3 GB and 41-55 s.
ITEMWISE: dict[type[BaseModel], tuple[str, TypeAdapter[Any]]] = {BatchIn: ("trajectories", TypeAdapter(TrajectoryIn))}


def validate_items(data: Any, model: type[BaseModel]) -> None:
    """Replaces the items of ``model``'s ``ITEMWISE`` list in ``data`` by their validated models (which the
    model's own validation then takes as they are), or raises the 422 of the first bad items.

    Validation stops after the item that brings the errors to ``MAX_LISTED_ERRORS``, so that a bad body
    costs the errors of a few items, not of all of them; ``n_errors`` then counts the errors found.
    """
    field, adapter = ITEMWISE.get(model, (None, None))
    items = data.get(field) if field is not None and isinstance(data, dict) else None
    if adapter is None or not isinstance(items, list):
        return
    errors: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        try:
            items[i] = adapter.validate_python(item)
        except ValidationError as e:  # one item's errors are bounded by its own limits (max_turns)
            found = e.errors(include_url=False, include_input=False)
            errors.extend({**d, "loc": ("body", field, i, *d["loc"])} for d in found)
            if len(errors) >= MAX_LISTED_ERRORS:
                break
    if errors:
        raise BodyValidationError(errors, len(errors))


def _known_keys(model: type[BaseModel]) -> set[str]:
    """The top-level keys ``model`` accepts: field names, aliases and every validation alias's first key."""
    known = set(model.model_fields)
    for field in model.model_fields.values():
        choices = field.validation_alias.choices if isinstance(field.validation_alias, AliasChoices) else []
        for alias in [field.alias, field.validation_alias, *choices]:
            key = alias.path[0] if isinstance(alias, AliasPath) else alias
            if isinstance(key, str):
                known.add(key)
    return known


def parse_body(raw: bytes, model: type[M], limits: IngestLimits) -> M:
    """``raw`` validated as ``model``, refused as FastAPI refuses a declared body (locations under ``body``).

    Runs in the thread pool. The text is dropped once parsed, so that it and the parsed objects
    and their validated copy are not all held at once. ``check_json_sizes`` first.
    """
    text = checked_text(raw)
    # A matrix's rows of empty token_entropy lists (2 quiet items a row, its columns' empty prompts fewer) are the
    # longest run of quiet items a valid body holds: the limit stays above them where max_matrix_rows is raised.
    # A string is read without a callback too (a 30 MB one of `\n` escapes: 0.17 s of json.loads on an idle core);
    # none may hold more characters than a text (max_text_chars) or a checkpoint's path (4096), 12 bytes each at
    # most once escaped (a surrogate pair's two \uXXXX for one character), and its quotes.
    longest_string = 12 * max(limits.max_text_chars, 4096) + 2
    check_shape(raw, max_quiet_items=max(MAX_QUIET_ITEMS, 4 * limits.max_matrix_rows), max_string_bytes=longest_string)
    try:
        data = json.loads(text, parse_int=shared_ints(), parse_float=_float, object_hook=_object)
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**error, "ctx": {"error": e.msg}}]) from e
    except (RecursionError, ValueError) as e:  # nested too deep, a number of over 4300 digits: FastAPI's 400
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e
    del text
    check_json_sizes(data, model, limits)
    validate_items(data, model)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        listed = e.errors(include_url=False, include_input=False)[:MAX_LISTED_ERRORS]
        raise BodyValidationError([{**d, "loc": ("body", *d["loc"])} for d in listed], e.error_count()) from e


def _float(number: str) -> float:
    """``json.loads``'s own float, from Python: like ``shared_ints``, a call per number lets other threads in
    (a C parse of 1M floats held the GIL 4 s under load)."""
    return float(number)


def _object(value: dict[str, Any]) -> dict[str, Any]:
    """The object as parsed, from Python: a call at each object's end lets other threads in (1M small turns,
    a valid 16 MB batch, held the GIL ~4 s under load). What is read between two callbacks is bounded before
    the parse (``check_shape``)."""
    return value


class ParsedRequest(Request):
    """The request as FastAPI's handler then sees it: the bytes already read, the JSON already the model."""

    def __init__(self, request: Request, raw: bytes, parsed: BaseModel) -> None:
        super().__init__(request.scope, request.receive)
        self.raw = raw
        self.parsed = parsed

    async def body(self) -> bytes:
        return self.raw

    async def json(self) -> Any:
        return self.parsed
