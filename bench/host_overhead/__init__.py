"""The engine's host time per step with the forward stubbed (`inferq bench host-overhead`,
`python -m bench.host_overhead`)."""
