"""A single-node Apache Kafka (KRaft, combined broker + controller) run from the cached Maven jars."""

from __future__ import annotations

import base64
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

from workers.kafka_io.admin import delete_topics as delete_topics  # noqa: F401 - a deployment's own topics
from workers.kafka_io.admin import ensure_topics as ensure_topics  # noqa: F401 - `inferq up` makes topics
from workers.kafka_io.admin import ping as ping  # noqa: F401 - health of the broker it starts
from workers.kafka_io.admin import topic_records as topic_records  # noqa: F401 - bench.pipeline's event count
from workers.kafka_io.admin import wait_for_members
from workers.naming import worker_group
from workers.services import process, tools
from workers.services.paths import PRIVATE_UMASK, ServicePaths, private_dir, write_private
from workers.settings import Settings

# A dev broker on a shared 2-core machine: small heap; C1 only and the serial GC start the JVM about twice
# as fast (CI starts it every run), and a dev broker's load needs no peak JIT throughput.
JVM_OPTIONS = [
    "-Xms128m",
    "-Xmx512m",
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseSerialGC",
    "-Djava.awt.headless=true",
]
START_TIMEOUT_S = 90.0

SERVER_PROPERTIES = """\
# Written by `inferq up` on every start; edit workers/services/kafka.py instead.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{controller_port}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
log.dirs={data}
num.partitions=1
# one node: every internal topic has one replica (min.isr defaults to 2 for some)
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# test consumer groups join at once instead of waiting 3 s for more members
group.initial.rebalance.delay.ms=0
# after a crash the restarted broker waits out its old session before it may register again (default 9 s)
broker.heartbeat.interval.ms=1000
broker.session.timeout.ms=4000
"""

LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
"""


def loopback_port(bootstrap: str) -> int | None:
    """The port if `bootstrap` names one broker on this machine (one `inferq up` manages), else None."""
    if "," in bootstrap:
        return None
    host, _, port = bootstrap.strip().rpartition(":")
    if host.strip("[]") not in ("127.0.0.1", "localhost", "::1") or not port.isdigit():
        return None
    return int(port)


def java_command(jars: Path, log4j_config: Path) -> list[str]:
    """`java ... -cp JARS/*`: what runs a Kafka main class from the cached jars."""
    return [tools.java(), *JVM_OPTIONS, f"-Dlog4j2.configurationFile={log4j_config}", "-cp", str(jars / "*")]


def format_storage(java: list[str], config: Path, *extra: str) -> None:
    """Format a KRaft log dir once (a fresh cluster id); `extra`, e.g. `--add-scram ...`."""
    cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
    fmt = [
        *java,
        "kafka.tools.StorageTool",
        "format",
        f"--cluster-id={cluster_id}",  # ids may start with "-": never read as an option
        "-c",
        str(config),
        "--ignore-formatted",
        *extra,
    ]
    done = subprocess.run(fmt, capture_output=True, text=True, stdin=subprocess.DEVNULL, umask=PRIVATE_UMASK)
    if done.returncode != 0:
        out = (done.stdout + done.stderr)[-3000:]
        raise process.ServiceError(f"formatting Kafka storage failed (exit {done.returncode}):\n{out}")


def start(paths: ServicePaths, jars: Path, port: int) -> int:
    """Write the config, format the storage on first use, and spawn the broker; return its pid."""
    config = _write_config(paths, port)
    java = java_command(jars, paths.kafka_dir / "log4j2.properties")
    if not (paths.kafka_data / "meta.properties").exists():
        format_storage(java, config)
    return process.spawn([*java, "kafka.Kafka", str(config)], paths.log("kafka"), cwd=paths.kafka_dir)


def wait_for_workers(
    settings: Settings, count: int, timeout_s: float, alive: Callable[[], None] | None = None
) -> None:
    """Until `count` workers of the deployment have joined its consumer group (TimeoutError if not)."""
    wait_for_members(settings.kafka_connection, worker_group(settings.topic_prefix), count, timeout_s, alive)


def _write_config(paths: ServicePaths, port: int) -> Path:
    private_dir(paths.kafka_data)
    write_private(paths.kafka_dir / "log4j2.properties", LOG4J2)
    config = paths.kafka_dir / "server.properties"
    write_private(
        config, SERVER_PROPERTIES.format(port=port, controller_port=port + 1, data=paths.kafka_data)
    )
    return config
