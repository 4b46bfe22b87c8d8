"""Asset lease keys are injective: no two (URI, partition key) pairs share a key (issue 38, defect 4).

Partition keys come from whoever creates the run (the REST API, asset events), so a pair is hostile: it
may hold ``#``, ``~``, ``asset:``, a digest copied from another key, text in another normal form, or be
empty. Two pairs on one key would exclude each other and share one token sequence (so one pair's runs
would make the other's asset events look stale). Pure functions: no database, no Airflow process.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata

from hypothesis import example, given, settings
from hypothesis import strategies as st

from airflow_lease_provider.assets import asset_lease_key
from airflow_lease_provider.core import validation

#: Texts built from the separators and their look-alikes, so that a random draw makes near-collisions
#: (the same characters split differently between URI and partition) often.
HOSTILE = st.lists(
    st.sampled_from(
        ["#", "~", ":", "/", "a", "b", "asset", "s3://bucket/", "e", "\u0301", "\u00e9", " ", "0", "f", "\u200b"]
    ),
    max_size=8,
).map("".join)
TEXTS = st.one_of(HOSTILE, st.text(max_size=20), st.text(min_size=500, max_size=520, alphabet="ab#~"))
PAIRS = st.tuples(TEXTS, st.one_of(st.none(), TEXTS))

HASHED = re.compile(r"[^~]*~([0-9a-f]{64})")


def digest(uri: str, partition: str | None) -> str:
    return hashlib.sha256(json.dumps(["asset", uri, partition], ensure_ascii=True).encode("ascii")).hexdigest()


def decode(key: str) -> tuple[str, str | None]:
    """The pair a readable key names (the first ``#`` after ``asset:`` separates URI and partition)."""
    assert key.startswith("asset:") and "~" not in key, key
    uri, sep, partition = key[len("asset:"):].partition("#")
    return uri, (partition if sep else None)


def twins(key: str) -> list[tuple[str, str | None]]:
    """Pairs whose readable form would be ``key`` if the key were taken for a readable one: what an attacker
    who sees a hashed key would send as a URI and partition to land on it."""
    if not key.startswith("asset:"):
        return []
    rest = key[len("asset:"):]
    found: list[tuple[str, str | None]] = [(rest, None)]
    for i, char in enumerate(rest):
        if char == "#":
            found.append((rest[:i], rest[i + 1:]))
    return found


def test_the_collision_of_the_issue() -> None:
    hashed = asset_lease_key("s3://bucket/~tmp", "p1")
    forged = hashed.removeprefix("asset:s3://bucket/tmp#")
    assert hashed.startswith("asset:s3://bucket/tmp#p1~")
    assert asset_lease_key("s3://bucket/tmp", forged) != hashed


@settings(max_examples=300, deadline=None)
@given(PAIRS)
@example(("s3://bucket/~tmp", "p1"))
@example(("s3://lake/\u00e9", None))
@example(("s3://lake/e\u0301", None))
@example(("s3://lake/t", ""))
@example(("s3://lake/t#", None))
@example(("s3://lake/t", "a#b"))
def test_every_key_names_its_pair(pair: tuple[str, str | None]) -> None:
    """A readable key gives back its pair exactly; every other key is hashed and carries the digest of the
    exact pair. Readable keys have no ``~`` and hashed ones end in ``~`` and 64 hex digits, so the two forms
    never meet: the key determines the pair (up to a SHA-256 collision)."""
    uri, partition = pair
    key = asset_lease_key(uri, partition)
    assert validation.name("key", key) == key  # always usable as it stands
    match = HASHED.fullmatch(key)
    if match is None:
        assert decode(key) == pair
    else:
        assert match.group(1) == digest(uri, partition)


@settings(max_examples=150, deadline=None)
@given(st.lists(PAIRS, min_size=2, max_size=12, unique=True))
def test_no_two_pairs_share_a_key(pairs: list[tuple[str, str | None]]) -> None:
    """Pairwise, over the drawn pairs, their NFC and NFD forms, and the twins an attacker would craft from
    each key."""
    candidates = set(pairs)
    for uri, partition in pairs:
        for form in ("NFC", "NFD"):
            candidates.add((unicodedata.normalize(form, uri),
                            None if partition is None else unicodedata.normalize(form, partition)))
        candidates.update(twins(asset_lease_key(uri, partition)))
    seen: dict[str, tuple[str, str | None]] = {}
    for pair in sorted(candidates, key=repr):
        key = asset_lease_key(*pair)
        assert seen.setdefault(key, pair) == pair, f"{pair!r} and {seen[key]!r} share the key {key!r}"
