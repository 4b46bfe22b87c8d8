"""Hypothesis strategies for the core's arguments: plausible values, values at the limits, and junk."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import strategies as st

from airflow_lease_provider.core.validation import MAX_NAME_LENGTH, MAX_TOKEN
from tests.reliability.injection_corpus import PAYLOADS

#: Anything a caller might pass by mistake.
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.binary(max_size=16),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.timedeltas(),
    st.datetimes(),
)

#: Keys, owners, resources, idempotency keys: short text (with NUL, controls, any script; hypothesis
#: leaves out lone surrogates, which have a test of their own), text around the length limit, payloads.
names = st.one_of(
    st.text(max_size=24),
    st.text(min_size=MAX_NAME_LENGTH - 3, max_size=MAX_NAME_LENGTH + 3),
    st.sampled_from(PAYLOADS),
    st.sampled_from(["", " ", "\t\n", "a\x00b", "\x00"]),
    junk,
)

ttls = st.one_of(
    st.timedeltas(min_value=timedelta(days=-1), max_value=timedelta(days=8)),
    st.sampled_from([
        timedelta(seconds=1), timedelta(microseconds=999_999), timedelta(days=7), timedelta(days=7, microseconds=1),
        timedelta(0), timedelta(seconds=-1),
    ]),
    junk,
)

tokens = st.one_of(
    st.integers(min_value=-3, max_value=2**64),
    st.sampled_from([0, 1, MAX_TOKEN, MAX_TOKEN + 1, -(2**63)]),
    junk,
)

durations = st.one_of(
    st.timedeltas(min_value=timedelta(days=-1), max_value=timedelta(days=400)),
    st.sampled_from([timedelta(0), timedelta(microseconds=1)]),
    junk,
)
