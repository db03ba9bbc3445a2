"""Set-based statements: the values of many rows go as one array per column, unnested into one statement.

One statement text per shape (not one per batch size, as a multi-row VALUES would be), so neither SQLAlchemy
nor PostgreSQL builds anything per batch. Each column goes as one array literal (`{"a","b",NULL}`), built
here, rather than as a Python list: psycopg2 adapts a list element by element with the GIL held (4 ms for
the terminal rows of 256 jobs: most of the persister's share of the worker's GIL, time the engine loop
waited for), and PostgreSQL parses one literal faster than an ARRAY[...] of as many constants.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sqlalchemy import BigInteger, Column, DateTime, Float, Integer, String
from sqlalchemy.dialects.postgresql import JSONB


def array_type(column: Column) -> str:
    """The PostgreSQL array type that carries a column's values."""
    kind = column.type
    if isinstance(kind, JSONB):
        return "jsonb[]"
    if isinstance(kind, BigInteger):
        return "bigint[]"
    if isinstance(kind, Integer):
        return "integer[]"
    if isinstance(kind, Float):
        return "float8[]"
    if isinstance(kind, DateTime):
        return "timestamptz[]"
    if isinstance(kind, String):  # Text too
        return "text[]"
    raise TypeError(f"no array type for column {column.name} ({kind})")


def unnest(fields: Sequence[tuple[str, str]], alias: str = "v") -> str:
    """`unnest(CAST(:v_a AS t[]), ...) AS v(a, ...)` for (name, array type) fields."""
    args = ", ".join(f"CAST(:{alias}_{name} AS {kind})" for name, kind in fields)
    return f"unnest({args}) AS {alias}({', '.join(name for name, _ in fields)})"


def arrays(
    fields: Sequence[tuple[str, str]], rows: Sequence[Sequence[Any]], alias: str = "v"
) -> dict[str, str]:
    """The bind parameters of `unnest(fields)` for rows of values in the fields' order: one array literal
    per field."""
    out: dict[str, str] = {}
    for i, (name, kind) in enumerate(fields):
        out[f"{alias}_{name}"] = "{" + ",".join(_ELEMENTS[kind]([row[i] for row in rows])) + "}"
    return out


def _texts(values: list[Any]) -> Iterator[str]:
    """Elements that are any text: quoted, their quotes and backslashes escaped (NULL is the one unquoted
    word: a quoted "NULL" is that text)."""
    for v in values:
        yield "NULL" if v is None else '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _jsons(values: list[Any]) -> Iterator[str]:
    return _texts([None if v is None else json.dumps(v) for v in values])


def _integers(values: list[Any]) -> Iterator[str]:
    return ("NULL" if v is None else str(int(v)) for v in values)


def _floats(values: list[Any]) -> Iterator[str]:
    return ("NULL" if v is None else repr(float(v)) for v in values)  # nan, inf, -inf are read as such


def _timestamps(values: list[Any]) -> Iterator[str]:
    # formatted once per distinct value: isoformat is most of a literal's cost, and a flush's jobs share
    # many (the jobs of one step start together, a batch's leases run to the same time)
    formatted: dict[Any, str] = {}
    for v in values:
        if v is None:
            yield "NULL"
            continue
        text = formatted.get(v)
        if text is None:
            text = formatted[v] = '"' + v.isoformat() + '"'
        yield text


# each array type's elements in a literal
_ELEMENTS: dict[str, Callable[[list[Any]], Iterator[str]]] = {
    "text[]": _texts,
    "jsonb[]": _jsons,
    "integer[]": _integers,
    "bigint[]": _integers,
    "float8[]": _floats,
    "timestamptz[]": _timestamps,
}


# Many jobs named by key: `FROM jobs JOIN {KEYS} ON {KEYS_MATCH}`, with `key_arrays(keys)` bound. A row-value
# IN list, `(tenant, job_id) IN ((..), ..)`, is planned as one OR branch per key: 50 ms for 471 keys, where
# this join takes 3 ms (and one statement text serves any number of keys).
KEY_FIELDS = (("tenant", "text[]"), ("job_id", "text[]"))
KEYS = unnest(KEY_FIELDS, "k")
KEYS_MATCH = "jobs.tenant = k.tenant AND jobs.job_id = k.job_id"


def key_arrays(keys: Sequence[Sequence[str]]) -> dict[str, str]:
    """The bind parameters of KEYS for (tenant, job_id) keys."""
    return arrays(KEY_FIELDS, keys, "k")
