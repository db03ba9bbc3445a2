"""Structured outputs: a request's JSON schema, JSON object, regex or choice turned into a token mask.

xgrammar does the work and is imported only inside this package, and only by its submodules (`compiler`,
`vocab`, `mask`): importing `gpu.grammar` itself is free, so the worker can catch GrammarError without
loading the grammar engine, and an engine that never sees a grammar never loads it.
"""


class GrammarError(ValueError):
    """A grammar the engine cannot enforce; the message says why, in words meant for the job's author."""


# Why a sequence ended `rejected` mid-generation: its grammar allowed no token at all (a regex no text
# matches, say), so the sampler drew from nothing and the grammar refused what came out.
DEAD_END = "the output constraint allows no token here: no text can satisfy it"
