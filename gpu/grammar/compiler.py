"""Grammar compilation: a GrammarSpec in, a CompiledGrammar out, once per distinct spec.

Compiling takes milliseconds (a cache hit microseconds), and xgrammar releases the GIL while it compiles,
so the worker's intake thread compiles each job's grammar before the job reaches the engine thread. A
grammar that cannot be compiled, or that would take too long, is a GrammarError: the job is rejected,
never left waiting.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import xgrammar as xgr

from gpu.engine_types import GrammarSpec
from gpu.grammar import GrammarError
from gpu.grammar.schema_check import check_enforceable
from gpu.grammar.vocab import tokenizer_info
from gpu.tokenizer import Tokenizer
from schemas.tool_calls import DIALECTS

KINDS = ("json_schema", "json_object", "regex", "choice", "tool_calls")
MAX_SOURCE_CHARS = 64 * 1024  # a schema or regex past this is refused before any work is done
COMPILE_TIMEOUT_S = 10.0  # a compile still running then is abandoned and its job rejected
MAX_ABANDONED = 2  # compiles past their timeout that may still be running before new ones are refused
CACHE_BYTES = 64 << 20  # compiled grammars kept, by their own size (a JSON schema's is 10-500 KB)
_OBJECT_SCHEMA = '{"type": "object"}'
_LOOSE_CHARACTER = r"[^\"\\\r\n]"  # what xgrammar lets into a string with maxLength or minLength
_JSON_CHARACTER = r"[^\0-\x1f\"\\\r\n]"  # what JSON lets in unescaped (xgrammar's own unbounded strings)
# xgrammar's `time`/`date-time` fraction of a second, `"." R` with R ::= one or more digits: unbounded, so a
# small greedy model can write zeros until max_tokens; bounded here at nanoseconds.
_DIGITS_RULE = re.compile(r"^(\S+) ::= \(\(\[0-9\] \1\) \| \(\[0-9\]\)\)$", re.MULTILINE)
MAX_FRACTION_DIGITS = 9
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")  # xgrammar's C++ prefix


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one compiler's vocabulary; a matcher per sequence is made from it."""

    spec: GrammarSpec
    compiled: xgr.CompiledGrammar
    compiler: GrammarCompiler  # the one it was compiled for: another vocabulary needs another compile

    def matcher(self) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compiled)


class GrammarCompiler:
    """Thread-safe: any thread may compile; the cache is shared and bounded by the grammars' sizes."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, eos_token_ids)
        # One thread per compile: compiles run on the intake thread next to the decode loop, and this
        # machine's cores belong to the model. The cache is ours, keyed by spec (xgrammar's is off).
        self._xgr = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._abandoned: list[threading.Thread] = []

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = CompiledGrammar(spec, self._bounded(spec.kind, self._compile_call(spec)), self)
        _check_can_start(compiled)
        self._remember(compiled)
        return compiled

    def _compile_call(self, spec: GrammarSpec) -> Callable[[], xgr.CompiledGrammar]:
        """What to run for the spec; checks that need no compile raise here."""
        kind, source = spec.kind, spec.source
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")
        if len(source) > MAX_SOURCE_CHARS:
            raise GrammarError(f"{kind} is {len(source)} characters long; the limit is {MAX_SOURCE_CHARS}")
        # any_whitespace=False: with free whitespace a small model can loop on spaces and never finish.
        if kind in ("json_schema", "json_object"):
            schema = source if kind == "json_schema" else _OBJECT_SCHEMA
            _parse_schema(schema)
            return lambda: self._xgr.compile_grammar(_json_ebnf(schema))
        if kind == "regex":
            if not source:
                raise GrammarError("regex is empty")
            return lambda: self._xgr.compile_regex(source)
        if kind == "tool_calls":
            grammar = tool_calls_grammar(source)
            return lambda: self._xgr.compile_grammar(grammar)
        # An EBNF alternation of string literals: JSON string escapes are the EBNF's, whatever the text.
        rule = "root ::= " + " | ".join(json.dumps(choice) for choice in _parse_choices(source))
        return lambda: self._xgr.compile_grammar(rule)

    def _bounded(self, kind: str, call: Callable[[], xgr.CompiledGrammar]) -> xgr.CompiledGrammar:
        """Run the compile on its own thread and wait at most COMPILE_TIMEOUT_S. A native compile cannot be
        interrupted, so one past its time is left to finish alone, and while MAX_ABANDONED such are still
        running new compiles are refused rather than piling up threads."""
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            if len(self._abandoned) >= MAX_ABANDONED:
                raise GrammarError("the grammar compiler is busy with grammars that took too long; retry")
        result: list[xgr.CompiledGrammar] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                result.append(call())
            except Exception as exc:  # reported on the caller's thread
                failure.append(exc)

        thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
        thread.start()
        thread.join(COMPILE_TIMEOUT_S)
        if thread.is_alive():
            with self._lock:
                self._abandoned.append(thread)
            raise GrammarError(f"grammar took longer than {COMPILE_TIMEOUT_S:g} s to compile; simplify it")
        if failure:
            raise GrammarError(f"invalid {kind}: {_reason(failure[0])}") from failure[0]
        return result[0]

    def _remember(self, compiled: CompiledGrammar) -> None:
        size = compiled.compiled.memory_size_bytes
        with self._lock:
            if compiled.spec in self._cache:
                return
            self._cache[compiled.spec] = compiled
            self._cache_bytes += size
            while self._cache_bytes > CACHE_BYTES and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.compiled.memory_size_bytes


@functools.lru_cache(maxsize=256)  # a batch file's lines mostly share one schema
def precheck(spec: GrammarSpec) -> None:
    """Raise the GrammarError compiling `spec` would, as far as that needs no vocabulary: for validators
    without a model (`inferq bulk submit`, a Batch file's lines), with the compiler's messages. Turning a
    schema or regex into a grammar is quick; matching it to a vocabulary, which may be slow, is not done."""
    kind, source = spec.kind, spec.source
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")
    if len(source) > MAX_SOURCE_CHARS:
        raise GrammarError(f"{kind} is {len(source)} characters long; the limit is {MAX_SOURCE_CHARS}")
    if kind == "choice":
        _parse_choices(source)
        return
    if kind == "tool_calls":
        tool_calls_grammar(source)
        return
    if kind == "regex" and not source:
        raise GrammarError("regex is empty")
    if kind == "json_schema":
        _parse_schema(source)
    try:
        if kind == "regex":
            xgr.Grammar.from_regex(source)
        else:
            _json_ebnf(source if kind == "json_schema" else _OBJECT_SCHEMA)
    except Exception as exc:  # xgrammar's own errors (RuntimeError, ValueError): the author's to fix
        raise GrammarError(f"invalid {kind}: {_reason(exc)}") from exc


def _check_can_start(compiled: CompiledGrammar) -> None:
    """Refuse a grammar that allows no first token, not even the end (`[^\\x00-\\U0010FFFF]`, a regex
    nothing matches): run, it could only end `rejected` at its first step. One mask, on a cache miss only.
    A grammar that dead-ends later is caught as it runs (gpu/engine.py, _advance_grammars)."""
    bitmask = xgr.allocate_token_bitmask(1, compiled.compiler.vocab_size)
    compiled.matcher().fill_next_token_bitmask(bitmask)
    if not bitmask.any():
        raise GrammarError(f"{compiled.spec.kind} allows no output at all: no text can satisfy it")


def _json_ebnf(schema: str) -> str:
    """The schema's grammar, with strings of bounded length kept to valid JSON (xgrammar 0.2.9 lets
    control characters, U+0000-U+001F, a tab say, into them raw, which JSON forbids and parsers reject)
    and fractions of a second bounded."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return _bound_fractions(ebnf.replace(_LOOSE_CHARACTER, _JSON_CHARACTER))


def _bound_fractions(ebnf: str) -> str:
    """Fractions of a second (a digits rule right after a "."), at most MAX_FRACTION_DIGITS digits long."""
    for rule in _DIGITS_RULE.finditer(ebnf):
        name = rule.group(1)
        if f'("." {name})' in ebnf:
            ebnf = ebnf.replace(rule.group(0), f"{name} ::= (([0-9]{{1, {MAX_FRACTION_DIGITS}}}))")
    return ebnf


def tool_calls_grammar(source: str) -> xgr.Grammar:
    """The grammar of forced tool calls: `source` is JSON {"dialect", "tools": [{"name", "parameters"}],
    "parallel"} (workers/serving/intake/sampling.py). Each call is written as the dialect writes it, its name
    one of the tools' and its arguments valid against that tool's schema (a JSON grammar as a json_schema
    constraint's); with `parallel`, one call or more, separated as the dialect separates them."""
    try:
        spec = json.loads(source)
        dialect = DIALECTS[spec["dialect"]]
        tools = [(str(t["name"]), t["parameters"]) for t in spec["tools"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise GrammarError(f"tool_calls must be JSON with dialect, tools and parallel: {exc}") from None
    if not tools:
        raise GrammarError("tool_calls needs at least one tool")
    calls = []
    try:
        for name, parameters in tools:
            schema = json.dumps(parameters)
            try:
                _parse_schema(schema)
            except GrammarError as exc:
                raise GrammarError(f"function {name}'s parameters: {exc}") from None
            calls.append(
                xgr.Grammar.concat(
                    _literal(dialect.call_prefix(name)),
                    xgr.Grammar.from_ebnf(_json_ebnf(schema)),
                    _literal(dialect.call_suffix),
                )
            )
        one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
        if not spec.get("parallel") or dialect.separator is None:
            return one
        # one call or more: the calls' grammar under a rule of its own, repeated (its root is referenced
        # nowhere: concat and union rename the roots they combine)
        ebnf = str(one)
        name = "tool_call"
        while re.search(rf"^{name} ::= ", ebnf, re.MULTILINE):
            name += "_"
        ebnf = re.sub(r"^root ::= ", f"{name} ::= ", ebnf, count=1, flags=re.MULTILINE)
        return xgr.Grammar.from_ebnf(f"root ::= {name} ({json.dumps(dialect.separator)} {name})*\n{ebnf}")
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar's own errors (RuntimeError, ValueError): the schema's author's to fix
        raise GrammarError(f"invalid tool_calls: {_reason(exc)}") from exc


def _literal(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")  # JSON's string escapes are EBNF's


def _parse_schema(source: str) -> None:
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"json_schema must be a JSON object, not {type(schema).__name__}")
    check_enforceable(schema)  # a keyword xgrammar would drop must not pass as met


def _parse_choices(source: str) -> list[str]:
    try:
        choices = json.loads(source)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"choice must be a JSON list of strings: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice must be a non-empty JSON list of strings")
    return choices


def _reason(exc: BaseException) -> str:
    """xgrammar's message without the C++ file and line it starts with."""
    text = str(exc).strip()
    first = _LOCATION.sub("", text.splitlines()[0] if text else type(exc).__name__)
    return first or text
