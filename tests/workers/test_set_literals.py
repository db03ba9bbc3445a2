"""The set-based statements' array literals (workers.db.sets) carry every value PostgreSQL can store exactly
as a list would: text with quotes, backslashes, braces, commas, blanks, the word NULL and any Unicode; JSON;
64-bit integers; floats with their infinities; timestamps with their offsets; and NULL. Round trips through
the real server's `unnest`, so a mistake in the escaping fails here, not on a job's row."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from workers.db.sets import arrays, unnest

pytestmark = pytest.mark.services

FIELDS = (
    ("txt", "text[]"), ("js", "jsonb[]"), ("i32", "integer[]"), ("i64", "bigint[]"), ("f", "float8[]"),
    ("ts", "timestamptz[]"),
)  # fmt: skip
ROUND_TRIP = text(f"SELECT v.txt, v.js, v.i32, v.i64, v.f, v.ts FROM {unnest(FIELDS)}")

texts = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=30)
tricky = st.sampled_from(["", "NULL", "null", " ", " a ", '"', "\\", '\\"', "{}", "{a,b}", ",", "'", "\t\n"])
jsons = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)
floats = st.floats(allow_nan=False) | st.sampled_from([math.inf, -math.inf, -0.0, 5e-324])
offsets = st.integers(-14 * 60, 14 * 60).map(lambda m: timezone(timedelta(minutes=m)))
times = st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1), timezones=offsets)


def row():
    return st.tuples(
        st.none() | texts | tricky,
        st.none() | jsons,
        st.none() | st.integers(-(2**31), 2**31 - 1),
        st.none() | st.integers(-(2**63), 2**63 - 1),
        st.none() | floats,
        st.none() | times,
    )


def same_json(stored, sent) -> bool:
    # jsonb is read back decoded; None is JSON's null only inside a document (a top-level None is SQL NULL)
    return stored == json.loads(json.dumps(sent))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(row(), max_size=8))
def test_every_value_comes_back_as_it_was_sent(db_engine, rows):
    with db_engine.connect() as conn:
        back = conn.execute(ROUND_TRIP, arrays(FIELDS, rows)).all()
    assert len(back) == len(rows)
    for got, sent in zip(back, rows, strict=True):
        txt, js, i32, i64, f, ts = sent
        assert got.txt == txt and got.i32 == i32 and got.i64 == i64
        assert (got.js is None) if js is None else same_json(got.js, js)
        assert got.f == f and (f is None or math.copysign(1, got.f) == math.copysign(1, f))
        assert got.ts == ts


def test_nan_and_an_empty_batch(db_engine):
    with db_engine.connect() as conn:
        assert math.isnan(conn.execute(ROUND_TRIP, arrays(FIELDS, [(None,) * 4 + (math.nan, None)])).one().f)
        assert conn.execute(ROUND_TRIP, arrays(FIELDS, [])).all() == []


def test_a_naive_timestamp_reads_as_the_session_zone_does_for_a_list(db_engine):
    naive = datetime(2026, 12, 7, 7, 0, 0, 123456)
    with db_engine.connect() as conn:
        got = conn.execute(ROUND_TRIP, arrays(FIELDS, [(None,) * 5 + (naive,)])).one().ts
        by_list = conn.execute(text("SELECT unnest(CAST(:x AS timestamptz[]))"), {"x": [naive]}).scalar_one()
    assert got == by_list
