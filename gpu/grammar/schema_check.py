"""Refuse JSON Schemas whose output xgrammar would not hold to.

xgrammar 0.2.9 drops what it does not understand without a word: `uniqueItems`, `contains`, `not`,
`if/then/else`, `dependentRequired`, `multipleOf` on numbers, `allOf` of several schemas, `oneOf`'s
exclusivity, keywords next to `$ref`/`anyOf`/`enum`, string lengths next to `pattern`/`format`, most
`format`s. A job with such a schema would succeed with output its schema does not accept, so it is
rejected instead, naming the keyword and where it is. The rules below were found by compiling each keyword
on its own and testing strings the schema forbids against the grammar (tests/gpu/test_schema_check.py keeps
them honest against the installed xgrammar).
"""

from __future__ import annotations

from gpu.grammar import GrammarError

# Bounds further apart (over 10,000 values), and xgrammar 0.2.9 drops multipleOf (measured).
MULTIPLE_SPAN = 9_999
MAX_DEPTH = 64  # schemas nest deeper than this only by accident or malice
# Annotations: JSON Schema says validation ignores them, so ignoring them is exact.
ANNOTATIONS = frozenset(
    {"title", "description", "examples", "default", "$comment", "$schema", "$id", "deprecated", "readOnly",
     "writeOnly", "contentEncoding", "contentMediaType"}
)  # fmt: skip
# Formats xgrammar turns into a grammar; any other `format` would be ignored, so it is refused.
FORMATS = frozenset(
    {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
     "uri-template", "uuid", "json-pointer", "relative-json-pointer"}
)  # fmt: skip
_BY_TYPE = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "uniqueItems"}),
    "object": frozenset(
        {
            "properties",
            "required",
            "additionalProperties",
            "patternProperties",
            "propertyNames",
            "minProperties",
            "maxProperties",
            "unevaluatedProperties",
        }
    ),  # fmt: skip
    "boolean": frozenset(),
    "null": frozenset(),
}
_COMBINATORS = ("anyOf", "oneOf", "allOf")
_TYPE_OF = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def check_enforceable(schema: object) -> None:
    """Raise GrammarError for the first keyword the grammar would not enforce, with its JSON path."""
    _check(schema, "$", 0)


def _check(node: object, path: str, depth: int) -> None:
    if isinstance(node, bool):
        return  # true: anything; false: xgrammar refuses it itself
    if not isinstance(node, dict):
        raise GrammarError(f"json_schema at {path} must be an object or a boolean")
    if depth > MAX_DEPTH:
        raise GrammarError(f"json_schema nests deeper than {MAX_DEPTH} levels at {path}")
    keys = set(node) - ANNOTATIONS
    for defs in ("$defs", "definitions"):
        if defs in keys:
            keys.discard(defs)
            for name, sub in _mapping(node[defs], f"{path}.{defs}").items():
                _check(sub, f"{path}.{defs}.{name}", depth + 1)
    if "$ref" in keys:
        _alone("$ref", keys, path)
        return
    for combinator in _COMBINATORS:
        if combinator in keys:
            _combinator(node, combinator, keys, path, depth)
            return
    for literal in ("enum", "const"):
        if literal in keys:
            _literal(node, literal, keys, path)
            return
    _typed(node, keys, path, depth)


def _combinator(node: dict, name: str, keys: set[str], path: str, depth: int) -> None:
    branches = node[name]
    if not isinstance(branches, list) or not branches:
        raise GrammarError(f"json_schema: {name} at {path} must be a non-empty list")
    if name == "oneOf" and len(branches) > 1:
        _refuse(
            "oneOf", path, "it is enforced as anyOf (a value matching several branches would pass); use anyOf"
        )
    if name == "allOf" and len(branches) > 1:
        _refuse("allOf", path, "only an allOf of one schema is enforced; merge its schemas into one")
    _alone(name, keys, path)
    for i, branch in enumerate(branches):
        _check(branch, f"{path}.{name}[{i}]", depth + 1)


def _literal(node: dict, name: str, keys: set[str], path: str) -> None:
    values = node[name] if name == "enum" else [node[name]]
    if not isinstance(values, list):
        raise GrammarError(f"json_schema: enum at {path} must be a list")
    extra = keys - {name, "type"}
    if extra:
        _refuse(sorted(extra)[0], f"{path}", f"keywords next to {name} are ignored; list only allowed values")
    if "type" in keys:
        types = _types(node["type"], path)
        for value in values:
            kind = _TYPE_OF.get(type(value), "null")
            if kind not in types and not (kind == "integer" and "number" in types):
                _refuse(
                    "type",
                    path,
                    f"{name} value {value!r} is not of that type, and the type is ignored next to {name}",
                )


def _typed(node: dict, keys: set[str], path: str, depth: int) -> None:
    types = _types(node["type"], path) if "type" in keys else None
    keys.discard("type")
    allowed = set().union(*(_BY_TYPE[t] for t in types)) if types else _BY_TYPE["object"]
    for key in sorted(keys):
        if key not in allowed:
            hint = 'add a "type" it applies to' if types is None and _known(key) else "it is not enforced"
            _refuse(key, path, hint)
    if "format" in keys and node["format"] not in FORMATS:
        _refuse(
            "format",
            path,
            f"format {node['format']!r} is not enforced (enforced: {', '.join(sorted(FORMATS))})",
        )
    if keys & {"pattern", "format"} and keys & {"minLength", "maxLength"}:
        _refuse(
            sorted(keys & {"minLength", "maxLength"})[0],
            path,
            "lengths are ignored next to pattern or format",
        )
    if {"pattern", "format"} <= keys:
        _refuse("format", path, "pattern and format together are not both enforced")
    if "multipleOf" in keys:
        if not (types == {"integer"} and _whole(node["multipleOf"])):
            _refuse("multipleOf", path, "only a whole multipleOf on type integer is enforced")
        if not _multiple_of_kept(node):
            _refuse(
                "multipleOf",
                path,
                f"it is enforced without bounds, or within both spanning <= {MULTIPLE_SPAN}",
            )
    if "uniqueItems" in keys and node["uniqueItems"] is not False:
        _refuse("uniqueItems", path, "it is not enforced")
    _children(node, path, depth)


def _multiple_of_kept(node: dict) -> bool:
    """xgrammar keeps multipleOf with no bounds, or with a lower and an upper one close enough to spell
    out the values; with one bound, or bounds far apart, it drops it."""
    low = node.get("minimum", node.get("exclusiveMinimum"))
    high = node.get("maximum", node.get("exclusiveMaximum"))
    if low is None and high is None:
        return True
    return low is not None and high is not None and high - low <= MULTIPLE_SPAN


def _children(node: dict, path: str, depth: int) -> None:
    for key in ("properties", "patternProperties"):
        if key in node:
            for name, sub in _mapping(node[key], f"{path}.{key}").items():
                _check(sub, f"{path}.{key}.{name}", depth + 1)
    names = node.get("propertyNames")
    if isinstance(names, dict) and "type" not in names:  # names are strings: their keywords need no type
        names = {**names, "type": "string"}
    if names is not None:
        _check(names, f"{path}.propertyNames", depth + 1)
    for key in ("additionalProperties", "unevaluatedProperties", "items", "unevaluatedItems"):
        if key in node:
            _check(node[key], f"{path}.{key}", depth + 1)
    if "prefixItems" in node:
        items = node["prefixItems"]
        if not isinstance(items, list):
            raise GrammarError(f"json_schema: prefixItems at {path} must be a list")
        for i, sub in enumerate(items):
            _check(sub, f"{path}.prefixItems[{i}]", depth + 1)


def _alone(name: str, keys: set[str], path: str) -> None:
    extra = keys - {name}
    if extra:
        _refuse(sorted(extra)[0], path, f"keywords next to {name} are ignored; move them into its schema")


def _types(value: object, path: str) -> set[str]:
    types = {value} if isinstance(value, str) else set(value) if isinstance(value, list) else set()
    if not types or not types <= set(_BY_TYPE):
        raise GrammarError(
            f"json_schema: type at {path} must be one of {', '.join(_BY_TYPE)} or a list of them"
        )
    return types


def _mapping(value: object, path: str) -> dict:
    if not isinstance(value, dict):
        raise GrammarError(f"json_schema: {path} must be an object")
    return value


def _known(key: str) -> bool:
    return any(key in allowed for allowed in _BY_TYPE.values())


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _refuse(keyword: str, path: str, why: str) -> None:
    raise GrammarError(f"json_schema keyword {keyword!r} at {path} cannot be enforced: {why}")
