"""Intake: records polled from Kafka, validated and tokenized into accepted jobs or rejections.

Facade: `thread.IntakeThread`, which the `Worker` wires with the consumer, the control reader and
`validation.Intake.decide` (run on that thread). `rejected.Rejected` is what intake (or admission)
decides about a record that can never run; `dead_letter` builds its dead-letter message.
"""
