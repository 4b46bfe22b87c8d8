"""Default lease keys are injective over the ids Airflow allows, and always valid keys (issue 23).

Airflow's DAG and task ids match ``^[\\w.-]+$`` (Unicode word characters, ``.``, ``-``), up to 250
characters; task group tasks have dotted task ids. The tests decode every readable default key back to
the identity it was made from (a left inverse: so no two identities share one), and check that a hashed
key carries the digest of its own identity.
"""

from __future__ import annotations

import hashlib
import json
import re

from hypothesis import example, given, settings
from hypothesis import strategies as st

from airflow_lease_provider.core import InvalidArgument, validation
from airflow_lease_provider.core.identity import RunRef

#: Airflow's own rule for DAG and task ids (airflow.sdk.definitions._internal.node.KEY_REGEX), whole.
AIRFLOW_ID = re.compile(r"[\w.-]+")
ID_LEN = 250

#: Ids from every script (letters and digits of any kind, '_', '.', '-'), and from a few characters
#: where look-alikes are likely ('.' everywhere, Angstrom and Ohm signs, which NFC changes).
word = st.characters(categories=["L", "N"], include_characters="_.-")
ids = st.one_of(
    st.text(word, min_size=1, max_size=ID_LEN),
    st.text(st.sampled_from("ab.-_\u212b\u00c5\u2126\u03a9"), min_size=1, max_size=8),
    st.text(st.sampled_from("xy."), min_size=200, max_size=ID_LEN),
).filter(lambda value: AIRFLOW_ID.fullmatch(value) is not None)
map_indexes = st.one_of(st.just(-1), st.integers(min_value=0, max_value=2**31 - 1))
refs = st.builds(
    lambda dag_id, task_id, map_index: RunRef(
        dag_id, "manual__2026-12-01T00:00:00+00:00", -1 if task_id is None else map_index, task_id=task_id
    ),
    ids, st.one_of(st.none(), ids), map_indexes,
)
TASK_PART = re.compile(r"(?P<task_id>[^\[\]/~]+?)(?:\[(?P<map_index>[0-9]+)\])?")


def identity(ref: RunRef) -> tuple[str, str | None, int]:
    return ref.dag_id, ref.task_id, ref.map_index


def decode(key: str) -> tuple[str, str | None, int] | str:
    """The identity a readable default key names, or the digest of a hashed one."""
    if "~" in key:
        return key.rsplit("~", 1)[1]
    if "/" in key:
        dag_id, rest = key.split("/", 1)
        assert "." in dag_id, key  # only DAG ids with a '.' take the '/' form
        if rest == "":
            return dag_id, None, -1
    elif "." not in key:
        return key, None, -1
    else:
        dag_id, rest = key.split(".", 1)
    match = TASK_PART.fullmatch(rest)
    assert match is not None, key
    index = match.group("map_index")
    return dag_id, match.group("task_id"), -1 if index is None else int(index)


def digest(ref: RunRef) -> str:
    scope = "task" if ref.task_id is not None else "run"
    payload = json.dumps([scope, ref.dag_id, ref.task_id, ref.map_index], ensure_ascii=True)
    return hashlib.sha256(payload.encode("ascii")).hexdigest()


@settings(max_examples=1500, deadline=None)
@given(ref=refs)
@example(ref=RunRef("etl.daily", "r", task_id="load"))
@example(ref=RunRef("etl", "r", task_id="daily.load"))
@example(ref=RunRef("etl.load", "r"))
@example(ref=RunRef("d" * 250, "r", 2**31 - 1, task_id="t" * 250))
@example(ref=RunRef("\u212b", "r", task_id="x"))
@example(ref=RunRef("\U0001d400" * 250, "r", task_id="\U0001d400" * 250))  # 4-byte letters: 2,000 bytes
def test_a_default_key_decodes_to_its_identity_and_is_a_valid_key_as_it_stands(ref: RunRef) -> None:
    key = ref.default_key()
    assert validation.name("key", key) == key  # within the limits, nothing refused, NFC already
    decoded = decode(key)
    assert decoded == (digest(ref) if "~" in key else identity(ref)), key


@settings(max_examples=1500, deadline=None)
@given(a=refs, b=refs)
@example(a=RunRef("etl.daily", "r", task_id="load"), b=RunRef("etl", "r", task_id="daily.load"))
@example(a=RunRef("etl.load", "r"), b=RunRef("etl", "r", task_id="load"))
@example(a=RunRef("\u212b", "r"), b=RunRef("\u00c5", "r"))  # Angstrom sign and A with ring: NFC makes one
def test_two_identities_never_share_a_default_key(a: RunRef, b: RunRef) -> None:
    if identity(a) != identity(b):  # compared as the store keeps them (NFC)
        assert validation.name("key", a.default_key()) != validation.name("key", b.default_key())


@given(ref=refs)
def test_ids_without_a_dot_in_the_dag_id_keep_the_keys_earlier_versions_gave(ref: RunRef) -> None:
    """Existing deployments: a DAG id without '.' (nor a long or NFC-changed key) keeps its keys."""
    if "." in ref.dag_id:
        return
    old = ref.dag_id if ref.task_id is None else f"{ref.dag_id}.{ref.task_id}" + (
        f"[{ref.map_index}]" if ref.map_index >= 0 else ""
    )
    if _valid_as_it_stands(old):
        assert ref.default_key() == old


def _valid_as_it_stands(key: str) -> bool:
    try:
        return validation.name("key", key) == key
    except InvalidArgument:
        return False


def test_the_collisions_of_issue_23_are_four_keys() -> None:
    keys = {
        RunRef("etl.daily", "r", task_id="load").default_key(),
        RunRef("etl", "r", task_id="daily.load").default_key(),
        RunRef("etl.load", "r").default_key(),
        RunRef("etl", "r", task_id="load").default_key(),
    }
    assert keys == {"etl.daily/load", "etl.daily.load", "etl.load/", "etl.load"}
