"""The keys of a JSON body's objects, counted on its bytes before it is parsed.

``json.loads`` holds the GIL for as long as it runs without calling back into Python, and it calls
back (``service.api.bodies.parse_body``'s hooks) only at a number and at the end of an object. The
keys of one object are read in one such stretch, and they are the dearest thing it reads: a batch
whose ``figures`` held 1,000,000 keys (16 MB) took 12-17 s of ``json.loads`` under load (the memo
and the dict of a million distinct strings; the same million keys of one name took 0.7 s), every
other request waiting. No object of any body may hold more than ``MAX_OBJECT_KEYS`` keys (a step's
figures hold the most; every other object is a model of a few dozen fields at most), so a longer
run of keys is refused here, at numpy's speed, a chunk at a time (the GIL let go between chunks).

A run of keys is the keys read between two braces: all the keys of an object none of whose values
is an object, else the keys between two of its object values (each of which ends with a callback).
Arrays, strings and numbers are skipped; a quote is a string's end unless an odd run of
backslashes precedes it. On malformed JSON the count may be off past the first error, which is
where ``json.loads`` stops too.
"""

from __future__ import annotations

import json
import re

import numpy as np
from numpy.typing import NDArray

from service.errors import TooLarge
from service.schemas.inputs import MAX_TRAINER_FIGURES

MAX_OBJECT_KEYS = MAX_TRAINER_FIGURES
CHUNK_BYTES = 1 << 20  # numpy's temporaries stay a few MB; a 32 MB body is 32 steps
QUOTE, BACKSLASH, COLON, OPEN = (ord(c) for c in '"\\:{')
_EVENTS = np.zeros(256, dtype=bool)
_EVENTS[list(b'"{}:')] = True
_BACKSLASHES = re.compile(rb"\\*")
MAX_NAMED_CHARS = 100  # a key named in a refusal is cut to this many characters


def check_object_keys(raw: bytes, limit: int = MAX_OBJECT_KEYS, chunk_bytes: int = CHUNK_BYTES) -> None:
    """413 ``too_large`` when an object of the JSON ``raw`` holds more than ``limit`` keys in a run, naming
    the key it is the value of (``body`` when it is none's)."""
    kinds, offsets = _tokens(raw, chunk_bytes)
    is_colon = kinds == COLON
    colons_before = np.concatenate(([0], np.cumsum(is_colon)))  # [n_tokens + 1]: colons in tokens[:i]
    edges = np.concatenate(([-1], np.flatnonzero(~is_colon), [len(kinds)]))  # the braces, and both ends
    runs = colons_before[edges[1:]] - colons_before[edges[:-1] + 1]  # [n_braces + 1] keys between two braces
    worst = int(np.argmax(runs))
    if runs[worst] <= limit:
        return
    brace = int(edges[worst])  # the brace before the run (-1: none)
    opens = brace >= 0 and kinds[brace] == OPEN
    is_value = opens and brace >= 1 and kinds[brace - 1] == COLON  # of a key, not an item of the key's array:
    is_value = is_value and not raw[int(offsets[brace - 1]) + 1 : int(offsets[brace])].strip()  # only blanks between
    key = _key_before(raw, int(offsets[brace - 1])) if is_value else None
    if key is not None:
        what = repr(key)
    elif opens:
        what = f"the object opened at byte {offsets[brace]}"
    else:
        what = f"an object (keys from byte {offsets[brace + 1]})"
    raise TooLarge(
        f"an object may hold at most {limit} keys (a step's figures hold the most), got {runs[worst]} in "
        f"{what}; refused before parsing",
        field="body" if key is None else key,
    )


def _tokens(raw: bytes, chunk_bytes: int) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """The braces and colons of ``raw`` outside its strings: their bytes and their offsets."""
    kinds: list[NDArray[np.uint8]] = []
    offsets: list[NDArray[np.int64]] = []
    in_string = 0
    start = 0
    while start < len(raw):
        end = _chunk_end(raw, start + chunk_bytes)
        data = np.frombuffer(raw, dtype=np.uint8, count=end - start, offset=start)
        events = np.flatnonzero(_EVENTS[data])  # quotes, braces and colons, in or out of strings
        kind = data[events]
        quotes = kind == QUOTE
        quotes[quotes] = ~_escaped(data, events[quotes])
        inside = (np.cumsum(quotes) + in_string) % 2 == 1  # in a string once a quote opened it (itself included)
        if len(events):
            in_string = int(inside[-1])
        kept = (kind != QUOTE) & ~inside
        kinds.append(kind[kept])
        offsets.append(events[kept] + start)
        start = end
    if not kinds:
        return np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.int64)
    return np.concatenate(kinds), np.concatenate(offsets)


def _chunk_end(raw: bytes, end: int) -> int:
    """``end``, moved past a run of backslashes it falls in and the byte they escape: a chunk holds every
    backslash that precedes a quote of it."""
    if end >= len(raw) or raw[end - 1] != BACKSLASH:
        return min(end, len(raw))
    match = _BACKSLASHES.match(raw, end)
    assert match is not None  # \\* matches the empty string
    return min(match.end() + 1, len(raw))


def _escaped(data: NDArray[np.uint8], quotes: NDArray[np.intp]) -> NDArray[np.bool_]:
    """Which of the quotes at ``quotes`` (offsets in ``data``) follow an odd run of backslashes."""
    escaped = quotes > 0
    escaped[escaped] = data[quotes[escaped] - 1] == BACKSLASH
    if not escaped.any():
        return escaped
    slashes = np.flatnonzero(data == BACKSLASH)
    run_starts = slashes[np.concatenate(([True], np.diff(slashes) != 1))]
    after = quotes[escaped]
    starts = run_starts[np.searchsorted(run_starts, after - 1, side="right") - 1]
    escaped[escaped] = (after - starts) % 2 == 1
    return escaped


def _key_before(raw: bytes, colon: int) -> str | None:
    """The key whose colon is at ``colon`` (None: not a string there), cut to ``MAX_NAMED_CHARS``."""
    close = raw.rfind(b'"', 0, colon)
    start = close
    while start > 0:
        start = raw.rfind(b'"', 0, start)
        n_backslashes = 0
        while start - n_backslashes > 0 and raw[start - n_backslashes - 1] == BACKSLASH:
            n_backslashes += 1
        if n_backslashes % 2 == 0:
            break
    if start < 0 or close <= start:
        return None
    try:
        key = json.loads(raw[start : close + 1])
    except ValueError:
        return None
    return key[:MAX_NAMED_CHARS] if isinstance(key, str) else None
