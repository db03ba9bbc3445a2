"""The one package that imports kafka-python: a group consumer, readers, a producer and admin helpers.

Everything above it works with the plain `Record` dataclass and (topic, partition) tuples, so the
bookkeeping (offsets, intake, loop) stays testable and independent of the client library. Every client
is built from a `KafkaConnection` (bootstrap servers + security settings).
"""

from workers.kafka_io.admin import group_client_ids, group_members
from workers.kafka_io.consumer import GroupConsumer, Membership, RebalanceEvent
from workers.kafka_io.lookup import KeyLookup
from workers.kafka_io.producer import Delivery, Placed, Producer
from workers.kafka_io.readers import BroadcastReader, PartitionReader, TopicReader
from workers.kafka_io.records import Coordinates, Partition, Record, partition_for_key

__all__ = [
    "BroadcastReader",
    "Coordinates",
    "Delivery",
    "GroupConsumer",
    "Membership",
    "KeyLookup",
    "Partition",
    "PartitionReader",
    "Placed",
    "Producer",
    "RebalanceEvent",
    "Record",
    "TopicReader",
    "group_client_ids",
    "group_members",
    "partition_for_key",
]
