"""A body's shape checked on its bytes (the keys of its objects, its runs of quiet items), against a naive lexer,
in chunks of every size."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.serving import token_ids_body
from service.api.json_shape import MAX_OBJECT_KEYS, MAX_QUIET_ITEMS, check_shape
from service.errors import TooLarge
from service.schemas.inputs import BatchIn, CheckpointIn, FiguresIn, FilterRequest, MatrixBatchIn, RunCreate
from service.settings import Settings

TRICKY = ["a", '"', "\\", "{", "}", ":", ",", "[", "é", "\\u00e9"]


def outside_strings(text: str) -> Iterator[str]:
    """The characters of JSON ``text`` that are not inside a string (its quotes included), one at a time."""
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        else:
            yield c


def longest_run(text: str, counted: str, ends: Callable[[str], bool]) -> int:
    """The most ``counted`` characters read between two ``ends`` outside strings (the naive version)."""
    best = run = 0
    for c in outside_strings(text):
        if ends(c):
            run = 0
        elif c in counted:
            run += 1
            best = max(best, run)
    return best


def longest_key_run(text: str) -> int:
    """The most keys read between two braces."""
    return longest_run(text, ":", lambda c: c in "{}")


def longest_quiet_run(text: str) -> int:
    """The most commas and ``[`` read between two numbers or object ends."""
    return longest_run(text, ",[", lambda c: c == "}" or c.isdigit())


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """JSON whose strings and keys are full of quotes, backslashes, braces and colons."""
    r = rng.random()
    if depth > 2 or r < 0.3:
        text = "".join(rng.choice(TRICKY) for _ in range(rng.randrange(6)))
        return rng.choice([1, 0.5, None, True, text])
    if r < 0.6:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["".join(rng.choice(TRICKY) for _ in range(rng.randrange(5))) + str(k) for k in range(rng.randrange(12))]
    return {key: random_value(rng, depth + 1) for key in keys}


def longest_string(text: str) -> int:
    """The most bytes of one string, its quotes included, one character at a time."""
    best = 0
    opened: int | None = None
    escaped = False
    for i, c in enumerate(text.encode()):
        if opened is not None:
            if escaped:
                escaped = False
            elif c == ord("\\"):
                escaped = True
            elif c == ord('"'):
                best = max(best, i - opened + 1)
                opened = None
        elif c == ord('"'):
            opened = i
    return best


def refuses(
    raw: bytes, limit: int, chunk_bytes: int, quiet_limit: int = 1 << 40, string_limit: int | None = None
) -> bool:
    try:
        check_shape(raw, limit, quiet_limit, string_limit, chunk_bytes)
    except TooLarge:
        return True
    return False


@pytest.mark.parametrize("seed", range(2))
def test_the_longest_run_of_keys_is_the_naive_lexers_whatever_the_chunks(seed):
    rng = random.Random(seed)
    for _ in range(40):
        text = json.dumps(random_value(rng), ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        raw = text.encode()
        n_keys = longest_key_run(text)
        for chunk_bytes in (5, 64, 1 << 20):  # a byte at a time: the backslash test below
            assert not refuses(raw, n_keys, chunk_bytes), (text, chunk_bytes)
            assert n_keys == 0 or refuses(raw, n_keys - 1, chunk_bytes), (text, chunk_bytes)


def test_backslash_runs_across_chunks_end_strings_by_their_parity():
    for n_backslashes in range(1, 6):
        key = "\\" * n_backslashes + '"' if n_backslashes % 2 else "\\" * n_backslashes
        text = json.dumps({key: {"a": 1, "b": 2, "c": 3}, "d": 4})
        for chunk_bytes in range(1, len(text) + 1):
            assert refuses(text.encode(), 2, chunk_bytes), (text, chunk_bytes)
            assert not refuses(text.encode(), 3, chunk_bytes), (text, chunk_bytes)


@pytest.mark.parametrize("seed", range(2))
def test_the_longest_quiet_run_is_the_naive_lexers_whatever_the_chunks_and_blocks(seed):
    rng = random.Random(seed)
    for _ in range(40):
        value = [random_value(rng) for _ in range(rng.randrange(1, 4))]
        value += [rng.choice([True, None, "a", []])] * rng.randrange(30)  # a longer run, past several blocks
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        raw = text.encode()
        n_items = longest_quiet_run(text)
        for chunk_bytes in (5, 64, 1 << 20):
            assert not refuses(raw, 1 << 40, chunk_bytes, n_items), (text, chunk_bytes)  # blocks of n_items // 2
            assert refuses(raw, 1 << 40, chunk_bytes, n_items - 1), (text, chunk_bytes)
        n_bytes = longest_string(text)
        for chunk_bytes in (5, 64, 1 << 20):
            assert not refuses(raw, 1 << 40, chunk_bytes, string_limit=n_bytes), (text, chunk_bytes)
            assert n_bytes == 0 or refuses(raw, 1 << 40, chunk_bytes, string_limit=n_bytes - 1), (text, chunk_bytes)


@pytest.mark.parametrize("item", ["true", "null", '"a"', '"1"', "[]", "NaN"])
def test_a_run_of_quiet_items_is_refused_naming_the_key_of_its_array(item):
    """Issue 38 item 2: 10M empty arrays (30 MB) held json.loads, and every other request, 8.7 s under load."""
    items = ",".join([item] * MAX_QUIET_ITEMS)
    turn = '{"response": "r", "prompt_token_ids": [' + items + "]}"
    raw = ('{"step": 1, "trajectories": [{"group_id": 0, "reward": 0, "turns": [' + turn + "]}]}").encode()
    with pytest.raises(TooLarge) as refused:
        check_shape(raw)
    assert refused.value.field == "prompt_token_ids"
    # The commas between the items and their own [ (or each one's), and the 2 commas and 2 [ after the reward's 0.
    n_items = MAX_QUIET_ITEMS - 1 + 4 + (MAX_QUIET_ITEMS if item == "[]" else 0)
    assert refused.value.detail == (
        f"at most {MAX_QUIET_ITEMS} items (strings, true/false/null, arrays: each comma and [ counts) may follow one "
        f"another with no number or object end between them, got {n_items} or more in 'prompt_token_ids'; refused "
        "before parsing"
    )
    with pytest.raises(TooLarge) as refused:  # no key: the body, from the last callback
        check_shape(("[1, " + items + ", " + items + "]").encode())
    assert refused.value.field == "body"
    assert "in the body from byte 2;" in refused.value.detail
    with pytest.raises(TooLarge) as refused:  # the run starts inside the array (after its 1): named all the same
        check_shape(('{"step": 1, "figures": {"ids": [1, ' + items + ", " + items + "]}}").encode())
    assert refused.value.field == "ids"
    numbers = ",".join([item + ", 7"] * MAX_QUIET_ITEMS)  # a number between each two: any number of them
    check_shape(('{"prompt_token_ids": [' + numbers + "]}").encode())


def test_a_string_past_its_limit_is_refused_naming_its_key_or_the_key_holding_it():
    text = "\n" * 500  # escaped: 1,002 bytes with its quotes
    for body, field in [
        ({"step": 1, "trajectories": [{"turns": [{"prompt": text}]}]}, "prompt"),
        ({"name": "r", "metadata": {"tags": ["a", text]}}, "tags"),
        ([text], "body"),
    ]:
        raw = json.dumps(body).encode()
        for chunk_bytes in (64, 1 << 20):  # a string over several chunks, and in one
            check_shape(raw, max_string_bytes=1002, chunk_bytes=chunk_bytes)
            with pytest.raises(TooLarge) as refused:
                check_shape(raw, max_string_bytes=1001, chunk_bytes=chunk_bytes)
            assert refused.value.field == field
            assert "a string may be at most 1001 bytes of JSON" in refused.value.detail
            assert "got 1002 in" in refused.value.detail


def test_the_largest_valid_matrix_holds_fewer_quiet_items_than_the_limit():
    """A matrix whose every row's reasoning is empty sends a token_entropy of empty lists, 2 items a row."""
    rows = Settings().max_matrix_rows
    matrix = {
        "step": 1,
        "row_group_ids": [r % 2 for r in range(rows)],
        "column_prompt_tokens": [[], []],
        "reasoning_lengths": [0] * rows,
        "L_seq": [[-1.0, -2.0]] * rows,
        "token_entropy": [[]] * rows,
    }
    text = json.dumps(matrix)
    assert longest_quiet_run(text) <= MAX_QUIET_ITEMS // 2 + 10
    check_shape(text.encode())


def test_the_refusal_names_the_key_whose_object_has_too_many_keys():
    figures = {f"f{i}": 1.0 for i in range(MAX_OBJECT_KEYS + 1)}
    raw = json.dumps({"step": 1, "trajectories": [], "figures": figures}).encode()
    with pytest.raises(TooLarge) as refused:
        check_shape(raw)
    assert refused.value.field == "figures"
    assert refused.value.detail == (
        f"an object may hold at most {MAX_OBJECT_KEYS} keys (a step's figures hold the most), got "
        f"{MAX_OBJECT_KEYS + 1} in 'figures'; refused before parsing"
    )
    keys = {f"k{i}": 0 for i in range(MAX_OBJECT_KEYS + 1)}
    for body, what in [
        (keys, "the object opened at byte 0"),
        ({"trajectories": [{"turns": []}, keys]}, "the object opened at byte 33"),
        ({"x": {"y": {}, **keys}}, "an object (keys from byte 20)"),
        ({"trajectories": [keys]}, "the object opened at byte 18"),
    ]:
        with pytest.raises(TooLarge) as refused:
            check_shape(json.dumps(body).encode())
        assert refused.value.field == "body"
        assert what in refused.value.detail


def test_the_largest_valid_bodies_the_benchmarks_send_pass():
    turn = {"prompt": "p", "response": "r"}
    turns = {"step": 1, "trajectories": [{"group_id": 0, "reward": 0.0, "turns": [turn] * 256}] * 4096}
    for raw in (token_ids_body(1, 0), json.dumps(turns, separators=(",", ":")).encode()):  # 27 MB, 31 MB
        check_shape(raw)


@pytest.mark.parametrize("model", [BatchIn, FiguresIn, RunCreate, MatrixBatchIn, FilterRequest, CheckpointIn])
def test_no_model_of_a_body_has_more_fields_than_an_object_may_hold_keys(model):
    def field_counts(kind: Any) -> list[int]:
        fields = getattr(kind, "model_fields", None)
        if fields is None:
            return []
        nested = [count for field in fields.values() for arg in _types(field.annotation) for count in field_counts(arg)]
        return [len(fields), *nested]

    assert max(field_counts(model)) <= MAX_OBJECT_KEYS


def _types(annotation: Any) -> list[Any]:
    """``annotation`` and the types inside it (list[X], X | None, Annotated[X, ...])."""
    args = getattr(annotation, "__args__", ())
    return [annotation, *(t for arg in args for t in _types(arg))]
