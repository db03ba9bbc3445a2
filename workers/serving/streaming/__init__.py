"""Token streaming: deltas coalesced per job, sent through a relay process that owns the worker's producer
(token events, and the results the outbox publishes).

Facade: `sender.TokenEventSender` (the `Worker` owns it; its `link` is the relay) and `sender.RelayProducer`
(results through that relay); `stream.TokenStreamer` coalesces a job's deltas into events; `relay` is the
child process (`python -m workers.serving.streaming.relay`).
Nothing is re-exported here: the relay process imports this package and should stay light.
"""
