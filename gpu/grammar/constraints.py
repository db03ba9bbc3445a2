"""The engine's output constraints: one compiler for its vocabulary, one matcher per constrained sequence.

Imports no xgrammar itself: the compiler (and with it xgrammar) is made on first use, so an engine that
never sees a grammar never loads it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from gpu.engine_types import GrammarSpec
from gpu.grammar.closing import CLOSING_KINDS, Closing
from scheduler.output import TokenUpdate
from scheduler.types import FinishReason

log = logging.getLogger(__name__)

DEAD_END_REASON = FinishReason.REJECTED  # a grammar with no way on (see `advance`)
_STOP = FinishReason.STOP


def has_closing(grammar: Any) -> bool:
    """Whether a grammar (a GrammarSpec or what `Constraints.compile` made) gets the closing window (JSON and
    tool calls: gpu/grammar/closing.py)."""
    spec = grammar if isinstance(grammar, GrammarSpec) else grammar.spec
    return spec.kind in CLOSING_KINDS


class Constraints:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._compiler: Any = None  # gpu.grammar.compiler.GrammarCompiler, made on first use
        self._lock = threading.Lock()
        # sequence id -> its grammar's matcher, for as long as it is live (what the runner masks with)
        self.matchers: dict[str, Any] = {}
        self.closing = Closing()  # the JSON ones and tool calls among them, closed before their budget ends

    def compile(self, spec: GrammarSpec) -> Any:
        """The spec compiled for this vocabulary. Any thread may call it (the worker's intake thread does,
        off the engine thread); raises gpu.grammar.GrammarError."""
        with self._lock:
            if self._compiler is None:
                from gpu.grammar.compiler import GrammarCompiler  # xgrammar loads only once a grammar is used

                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos)
                self.closing.set_vocabulary(self._compiler.info.decoded_vocab, self._eos)
            compiler = self._compiler
        return compiler.compile(spec)

    def matcher(self, grammar: Any) -> Any:
        """A fresh matcher for a request's grammar: a GrammarSpec, or what `compile` returned."""
        if isinstance(grammar, GrammarSpec):
            return self.compile(grammar).matcher()
        if grammar.compiler is not self._compiler:  # compiled for another engine's vocabulary
            return self.compile(grammar.spec).matcher()
        return grammar.matcher()

    def add(self, seq_id: str, grammar: Any, matcher: Any, closing_state: list[bool] | None = None) -> None:
        """Constrain a live sequence with a matcher of `grammar` (a GrammarSpec or what `compile` made).
        `closing_state`: a JSON one's state past the tokens the matcher already took (a resumed sample)."""
        self.matchers[seq_id] = matcher
        if has_closing(grammar):
            self.closing.add(seq_id)
            if closing_state is not None:
                self.closing.sequences[seq_id] = closing_state

    def drop(self, seq_id: str) -> None:
        self.matchers.pop(seq_id, None)
        self.closing.drop(seq_id)

    def advance(
        self, updates: list[TokenUpdate], finish: Callable[[str, FinishReason], object]
    ) -> list[TokenUpdate]:
        """Each constrained sequence's matcher takes its new token. A sequence whose grammar terminated
        (the token was a stop token the grammar allowed, which the scheduler did not end it for, as with
        ignore_eos) ends with STOP, like a stop string; `finish` ends it in the scheduler."""
        matchers, advanced = self.matchers, []
        for update in updates:
            matcher = matchers.get(update.seq_id)
            if matcher is not None and update.finish is None:
                if not matcher.accept_token(update.token_id):
                    # The mask allowed nothing (the grammar has no way on, e.g. a regex no text matches) and
                    # the sampler drew anyway, or (a bug) let a forbidden token by: end the sequence
                    # `rejected` with DEAD_END, without the token, never go on off-grammar.
                    log.warning("grammar of %s rejected token %d", update.seq_id, update.token_id)
                    finish(update.seq_id, DEAD_END_REASON)
                    update = TokenUpdate(update.seq_id, update.token_id, DEAD_END_REASON)
                elif matcher.is_terminated():
                    finish(update.seq_id, _STOP)
                    update = TokenUpdate(update.seq_id, update.token_id, _STOP)
                else:
                    self.closing.accept(update.seq_id, update.token_id)
            advanced.append(update)
        return advanced
