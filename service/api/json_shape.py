"""A JSON body's shape, checked on its bytes before it is parsed: the keys of its objects, its runs of items
read without a callback and its strings' lengths.

``json.loads`` holds the GIL for as long as it runs without calling back into Python, and it calls
back (``service.api.bodies.parse_body``'s hooks) only at a number and at the end of an object. Three
things are read between two callbacks, and a large one held every other request:

- keys: the keys of one object are read in one such stretch, and they are the dearest thing it reads:
  a batch whose ``figures`` held 1,000,000 keys (16 MB) took 12-17 s of ``json.loads`` under load (the
  memo and the dict of a million distinct strings; the same million keys of one name took 0.7 s). No
  object of any body may hold more than ``MAX_OBJECT_KEYS`` keys (a step's figures hold the most;
  every other object is a model of a few dozen fields at most). A run of keys is the keys read between
  two braces: all the keys of an object none of whose values is an object, else the keys between two of
  its object values (each of which ends with a callback).
- quiet items: strings, ``true``/``false``/``null`` and arrays, between two numbers or object ends: a
  turn whose ``prompt_token_ids`` held 10,000,000 empty arrays (30 MB, within max_body_bytes) held the
  GIL 8.7 s under load, every other request waiting (7M short strings 0.2 s, 6M ``true`` 0.1 s). They
  are counted as the commas and ``[`` between two callbacks (an item of an array but its first follows
  a comma; an array, even an empty one, is a list made), at most ``MAX_QUIET_ITEMS``: a valid body's
  longest run is a matrix's ``token_entropy`` of empty rows (2 a row, ``bodies.parse_body`` scales the
  limit with max_matrix_rows); anything else holds a few dozen (a new run's 50 tags, an object's keys).
- a string: one of 30 MB of ``\\n`` escapes took 0.17 s on an idle core. None may be longer than
  ``max_string_bytes`` (``bodies.parse_body``: the longest text max_text_chars allows, escaped).

All are refused here (413), at numpy's speed, a chunk at a time (the GIL let go between chunks).
Strings are skipped (a quote is a string's end unless an odd run of backslashes precedes it); a digit
outside them is a number's. On malformed JSON the counts may be off past the first error, which is
where ``json.loads`` stops too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from service.errors import TooLarge
from service.schemas.inputs import MAX_TRAINER_FIGURES

MAX_OBJECT_KEYS = MAX_TRAINER_FIGURES
# Items read between two callbacks: 65,536 take 1-11 ms of json.loads on an idle core (`true` to empty arrays, which
# count 2 each), twice the items of a default matrix's token_entropy of empty rows.
MAX_QUIET_ITEMS = 1 << 16
CHUNK_BYTES = 1 << 20  # numpy's temporaries stay a few MB; a 32 MB body is 32 steps
QUOTE, BACKSLASH, COLON, OPEN, CLOSE, COMMA, ARRAY, ARRAY_CLOSE = (ord(c) for c in '"\\:{},[]')
KEY, QUIET, CALLBACK = 1, 2, 4  # classes of a byte outside strings: a key's run, a quiet item, a callback
_CLASSES = np.zeros(256, dtype=np.uint8)
_CLASSES[list(b"{}:")] |= KEY
_CLASSES[list(b",[")] |= QUIET
_CLASSES[list(b"}0123456789")] |= CALLBACK  # an object's end; a digit outside strings is a number's
_BACKSLASHES = re.compile(rb"\\*")
MAX_NAMED_CHARS = 100  # a key named in a refusal is cut to this many characters


def check_shape(
    raw: bytes,
    max_keys: int = MAX_OBJECT_KEYS,
    max_quiet_items: int = MAX_QUIET_ITEMS,
    max_string_bytes: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """413 ``too_large`` when an object of the JSON ``raw`` holds more than ``max_keys`` keys in a run, or more than
    ``max_quiet_items`` items are read between two callbacks, or a string is longer than ``max_string_bytes`` (None:
    any length), naming the key whose value they are in (``body`` when none is found).

    Quiet items are counted per block of ``max_quiet_items // 2`` bytes first, with whether a callback lies in
    the block: a run longer than the limit spans a block without any (a run between callbacks of the same or
    adjacent blocks holds at most two blocks' bytes), so only the stretches of such blocks whose items add up
    past the limit are counted item by item (``_check_quiet_run``). A token-id body has none, and costs its
    keys' scan and a few byte-wise passes.
    """
    block = max(1, max_quiet_items // 2)
    scanned = _scan(raw, block, chunk_bytes)
    _check_keys(raw, scanned.kinds, scanned.offsets, max_keys)
    if max_string_bytes is not None and scanned.longest_string > max_string_bytes:
        _refuse_string(raw, scanned.longest_string, scanned.longest_string_at, max_string_bytes, chunk_bytes)
    has_callback, n_quiet, in_string_at = scanned.has_callback, scanned.n_quiet, scanned.in_string_at
    del scanned  # a body of 333,333 `{}` holds 666,666 braces: ~6 MB of them
    edges = np.concatenate(([-1], np.flatnonzero(has_callback), [len(n_quiet)]))  # blocks with a callback, both ends
    sums = np.concatenate(([0, 0], np.cumsum(n_quiet), [n_quiet.sum()]))  # sums[b + 1]: items in blocks[:b]
    bounds = sums[edges[1:] + 2] - sums[edges[:-1] + 1]  # items from one callback block to the next, both included
    for i in np.flatnonzero(bounds > max_quiet_items):
        first = max(int(edges[i]), 0)
        stop = min((int(edges[i + 1]) + 1) * block, len(raw))
        _check_quiet_run(raw, first * block, stop, bool(in_string_at[first]), max_quiet_items, chunk_bytes)


@dataclass(frozen=True)
class _Scanned:
    """What one pass over a body finds: the braces and colons outside its strings (their bytes and offsets); per
    block of bytes, whether a callback lies in it, its quiet items and whether it starts in a string; its longest
    string (bytes, quotes included) and where that opens."""

    kinds: NDArray[np.uint8]
    offsets: NDArray[np.int64]
    has_callback: NDArray[np.bool_]
    n_quiet: NDArray[np.int64]
    in_string_at: NDArray[np.bool_]
    longest_string: int
    longest_string_at: int


def _scan(raw: bytes, block: int, chunk_bytes: int) -> _Scanned:
    """``raw`` scanned once, a chunk at a time, in blocks of ``block`` bytes."""
    n_blocks = -(-len(raw) // block)
    has_callback = np.zeros(n_blocks, dtype=bool)
    n_quiet = np.zeros(n_blocks, dtype=np.int64)
    in_string_at = np.zeros(n_blocks, dtype=bool)  # in a string before the block's first byte
    key_kinds: list[NDArray[np.uint8]] = [np.zeros(0, dtype=np.uint8)]
    key_offsets: list[NDArray[np.int64]] = [np.zeros(0, dtype=np.int64)]
    longest, longest_at, open_at = 0, 0, 0  # open_at: where the string open at a chunk's start opened
    for start, data, inside, in_string, quotes in _chunks(raw, 0, len(raw), False, chunk_bytes):
        opened = np.array([open_at] if in_string else [], dtype=np.intp)
        toggles = np.concatenate((opened, quotes + start, [start + len(data) - 1]))
        lengths = toggles[1::2] - toggles[0:-1:2] + 1  # [n_strings] of the chunk (the last one: so far)
        if len(lengths) and lengths.max() > longest:
            longest, longest_at = int(lengths.max()), int(toggles[0:-1:2][np.argmax(lengths)])
        open_at = int(toggles[-2]) if len(toggles) % 2 == 0 else open_at
        classes = np.take(_CLASSES, data) * ~inside  # [n_bytes] outside strings only
        keyed = np.flatnonzero(classes & KEY > 0)  # a bool mask: flatnonzero of the uint8 one took 10x longer
        key_kinds.append(data[keyed])
        key_offsets.append(keyed + start)
        firsts = np.arange(-(-start // block) * block, start + len(data), block) - start  # blocks starting here
        in_string_at[(start + firsts) // block] = np.concatenate(([in_string], inside))[firsts]
        cuts = np.unique(np.concatenate(([0], firsts)))
        blocks = (start + cuts) // block
        has_callback[blocks] |= np.logical_or.reduceat(classes & CALLBACK > 0, cuts)
        n_quiet[blocks] += [np.count_nonzero(part) for part in np.split(classes & QUIET, cuts[1:])]  # 4x add.reduceat's
    kinds, offsets = np.concatenate(key_kinds), np.concatenate(key_offsets)
    return _Scanned(kinds, offsets, has_callback, n_quiet, in_string_at, longest, longest_at)


def _check_quiet_run(raw: bytes, start: int, stop: int, in_string: bool, limit: int, chunk_bytes: int) -> None:
    """The quiet items of ``raw[start:stop]`` counted item by item: 413 at the first run of more than ``limit``."""
    n_quiet = 0  # quiet items since the last callback (of earlier chunks)
    since, since_in_string = start, in_string  # where that run starts
    for offset, data, inside, _, _ in _chunks(raw, start, stop, in_string, chunk_bytes):
        classes = np.take(_CLASSES, data) * ~inside
        tokens = np.flatnonzero(classes & (QUIET | CALLBACK) > 0)
        callbacks = np.flatnonzero(classes[tokens] & CALLBACK)
        quiet_before = np.concatenate(([0], np.cumsum(classes[tokens] & QUIET > 0)))  # in tokens[:i]
        edges = np.concatenate(([-1], callbacks, [len(tokens)]))
        runs = quiet_before[edges[1:]] - quiet_before[edges[:-1] + 1]  # [n_callbacks + 1] items between two
        runs[0] += n_quiet
        worst = int(np.argmax(runs))
        if runs[worst] > limit:
            if worst > 0:
                since, since_in_string = offset + int(tokens[callbacks[worst - 1]]) + 1, False
            end = offset + int(tokens[callbacks[worst]]) if worst < len(callbacks) else offset + len(data)
            _refuse_quiet(raw, since, end, since_in_string, int(runs[worst]), limit, chunk_bytes)
        n_quiet = int(runs[-1])
        if len(callbacks):
            since, since_in_string = offset + int(tokens[callbacks[-1]]) + 1, False


def _check_keys(raw: bytes, kinds: NDArray[np.uint8], offsets: NDArray[np.int64], limit: int) -> None:
    """The keys check of ``check_shape`` on the braces and colons of ``raw`` (``kinds`` at ``offsets``)."""
    is_colon = kinds == COLON
    colons_before = np.concatenate(([0], np.cumsum(is_colon, dtype=np.int32)))  # [n_tokens + 1]: colons in tokens[:i]
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


def _refuse_quiet(
    raw: bytes, start: int, end: int, in_string: bool, n_items: int, limit: int, chunk_bytes: int
) -> None:
    """413 for the run of ``n_items`` quiet items in ``raw[start:end]`` (at least that many: the count stops at the
    chunk where the run passes the limit), named by the key of the innermost array or object holding its middle
    item that is a key's value."""
    offsets = [tokens + offset for offset, tokens, _ in _outside(raw, start, end, in_string, b",[", chunk_bytes)]
    items = np.concatenate(offsets)
    key = _enclosing_key(raw, int(items[len(items) // 2]), chunk_bytes)
    where = repr(key) if key is not None else f"the body from byte {start}"
    raise TooLarge(
        f"at most {limit} items (strings, true/false/null, arrays: each comma and [ counts) may follow one another "
        f"with no number or object end between them, got {n_items} or more in {where}; refused before parsing",
        field="body" if key is None else key,
    )


def _refuse_string(raw: bytes, n_bytes: int, at: int, limit: int, chunk_bytes: int) -> None:
    """413 for the string of ``n_bytes`` that opens at ``at``, named by the key it is the value of, else by the key of
    the innermost array or object holding it that is a key's value."""
    before = raw[:at].rstrip()
    is_value = before.endswith(b":")
    key = _key_before(raw, len(before) - 1) if is_value else _enclosing_key(raw, at, chunk_bytes)
    where = repr(key) if key is not None else f"the body at byte {at}"
    raise TooLarge(
        f"a string may be at most {limit} bytes of JSON (the longest text max_text_chars allows, escaped), got "
        f"{n_bytes} in {where}; refused before parsing",
        field="body" if key is None else key,
    )


def _enclosing_key(raw: bytes, offset: int, chunk_bytes: int) -> str | None:
    """The key whose value is the innermost array or object of ``raw`` holding the byte at ``offset`` and is a key's
    value (None: none is)."""
    parts = [(data[tokens], tokens + at) for at, tokens, data in _outside(raw, 0, offset, False, b"{}[]:", chunk_bytes)]
    kinds = np.concatenate([kind for kind, _ in parts])
    offsets = np.concatenate([at for _, at in parts])
    is_open = (kinds == OPEN) | (kinds == ARRAY)
    depth = np.cumsum(is_open.astype(np.int64) - ((kinds == CLOSE) | (kinds == ARRAY_CLOSE)))  # after each token
    still_open = is_open & (np.minimum.accumulate(depth[::-1])[::-1] >= depth)  # never closed before ``offset``
    containers = np.flatnonzero(still_open[1:] & (kinds[:-1] == COLON)) + 1  # a key's value: a colon before it
    for container in containers[::-1]:
        colon = int(offsets[container - 1])
        if not raw[colon + 1 : int(offsets[container])].strip():  # only blanks between
            return _key_before(raw, colon)
    return None


def _outside(
    raw: bytes, start: int, stop: int, in_string: bool, chars: bytes, chunk_bytes: int
) -> Iterator[tuple[int, NDArray[np.intp], NDArray[np.uint8]]]:
    """The offsets of ``chars`` outside the strings of ``raw[start:stop]``, a chunk at a time: the chunk's offset,
    theirs in it, and its bytes."""
    wanted = np.zeros(256, dtype=bool)
    wanted[list(chars)] = True
    for offset, data, inside, _, _ in _chunks(raw, start, stop, in_string, chunk_bytes):
        yield offset, np.flatnonzero(np.take(wanted, data) & ~inside), data


def _chunks(
    raw: bytes, start: int, stop: int, in_string: bool, chunk_bytes: int
) -> Iterator[tuple[int, NDArray[np.uint8], NDArray[np.bool_], bool, NDArray[np.intp]]]:
    """``raw[start:stop]`` (``in_string``: whether ``start`` is in a string) a chunk at a time: its offset, its
    bytes, which are in a string (an opening quote included, a closing one not), whether its start is, and its
    quotes (their offsets in it, escaped ones left out)."""
    while start < stop:
        end = min(_chunk_end(raw, start + chunk_bytes), stop)
        data = np.frombuffer(raw, dtype=np.uint8, count=end - start, offset=start)
        quotes = np.flatnonzero(data == QUOTE)
        quotes = quotes[~_escaped(data, quotes)]
        lengths = np.diff(np.concatenate(([0], quotes, [len(data)])))  # the stretches between quotes: each toggles
        inside = np.repeat((np.arange(len(quotes) + 1) + in_string) % 2 == 1, lengths)
        yield start, data, inside, in_string, quotes
        in_string = bool(in_string) != (len(quotes) % 2 == 1)
        start = end


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
    escaped: NDArray[np.bool_] = (data[quotes - 1] == BACKSLASH) & (quotes > 0)  # one at 0 reads the last byte
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
