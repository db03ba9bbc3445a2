"""Token streaming: deltas coalesced per job, sent through a relay process that owns their producer.

Facade: `sender.TokenEventSender` (the `Worker` owns it); `stream.TokenStreamer` coalesces a job's
deltas into events; `relay` is the child process (`python -m workers.serving.streaming.relay`).
Nothing is re-exported here: the relay process imports this package and should stay light.
"""
