"""The worker pipeline, as stage packages in the order a job moves through them.

`intake/` polls Kafka beside the engine loop (`thread`) and turns a record into an engine request or a
`Rejected` write item (`validation`, `rejected`, `dead_letter`); `admission/` makes an accepted job a
`queued` row before it runs (`admitter`, on its own `thread`) and remembers cancels; `loop/` runs one
engine step per iteration (`worker`) and keeps each job's state from admission to conclusion
(`lifecycle`); `streaming/` coalesces and sends token events through a child process that owns their
producer; `outbox/` stores rows, publishes results and releases offsets (`persister`, `writes`,
`delivery`). Beside them, shared by all: `offsets`, `errors` (describing and retrying failures),
`headers`, `failpoints`, `metrics` and its `health_server`.

Imports follow the stages (tests/test_layers.py): streaming ← outbox ← intake ← admission ← loop.
"""
