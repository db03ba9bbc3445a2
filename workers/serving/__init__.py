"""The worker pipeline, in the order a job moves through it.

`intake_thread` polls Kafka beside the engine loop; `intake` turns a record into an engine request or a
rejection; `admission` and `admission_thread` make it a `queued` row before it runs; `cancels` reads the
control topic; `job_lifecycle` keeps each job's state from admission to conclusion; `loop` runs one
engine step per iteration; `offsets` commits only the unbroken run of finished records; `token_stream`,
`token_sender` and `token_relay` stream tokens (through a child process that owns their producer);
`writes`, `delivery` and `persister` store rows and publish results (the outbox); `metrics` and
`loop_clock` observe it all.
"""
