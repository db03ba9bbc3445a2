"""The engine loop: the `Worker`, each job's life in the engine, and what one step needs.

Facade: `worker.Worker`, the stage that wires every other one; `lifecycle.JobLifecycle` keeps each job
from its record to its terminal row (`inflight`, `choices`), `step_guard` isolates a failing sequence,
`clock` times the loop's phases.
"""
