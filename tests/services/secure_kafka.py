"""A real broker with a SASL_SSL (SCRAM-SHA-256) listener, and the certificates it needs, made here.

A CA and a server certificate for `localhost` / 127.0.0.1 are made with openssl; the broker reads them as
a PEM keystore; the SCRAM user is created when the storage is formatted. Inter-broker and controller
traffic stay on loopback PLAINTEXT listeners: only the client listener is secured.

With `tenants` (user -> password) the broker also authorizes: StandardAuthorizer, the admin user (USER)
a super user, and every other SCRAM user allowed only what an ACL grants. The loopback PLAINTEXT
listeners' principal (User:ANONYMOUS: the broker talking to itself) is a super user too; clients of the
tests use the SASL_SSL listener only.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.services.factories import free_port_pair
from workers.services import kafka, kafka_jars, process
from workers.settings import KafkaConnection, KafkaSecurity

USER, PASSWORD = "inferq-test", "scram-secret-for-tests"
JAAS = "org.apache.kafka.common.security.scram.ScramLoginModule required;"

PROPERTIES = """\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{controller}
listeners=INTERNAL://127.0.0.1:{internal},SECURE://localhost:{port},CONTROLLER://127.0.0.1:{controller}
advertised.listeners=INTERNAL://127.0.0.1:{internal},SECURE://localhost:{port}
listener.security.protocol.map=INTERNAL:PLAINTEXT,SECURE:SASL_SSL,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=INTERNAL
sasl.enabled.mechanisms=SCRAM-SHA-256
listener.name.secure.scram-sha-256.sasl.jaas.config={jaas}
ssl.keystore.type=PEM
ssl.keystore.location={keystore}
log.dirs={data}
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
"""
AUTHORIZER = """\
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:{admin};User:ANONYMOUS
allow.everyone.if.no.acl.found=false
"""


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(folder: Path) -> tuple[Path, Path]:
    """(CA certificate, broker keystore: PKCS#8 key + certificate chain), all PEM."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=inferq test CA", cwd=folder)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=localhost", cwd=folder)  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "san.ext", cwd=folder)  # fmt: skip
    _openssl("pkcs8", "-topk8", "-nocrypt", "-in", "server.key", "-out", "server.pk8", cwd=folder)
    keystore = folder / "keystore.pem"
    keystore.write_text("".join((folder / f).read_text() for f in ("server.pk8", "server.pem", "ca.pem")))
    return folder / "ca.pem", keystore


@dataclass
class SecureBroker:
    pid: int
    port: int
    ca: Path
    log: Path

    def connection(self, password: str = PASSWORD, user: str = USER) -> KafkaConnection:
        security = KafkaSecurity(
            protocol="SASL_SSL",
            sasl_mechanism="SCRAM-SHA-256",
            sasl_username=user,
            sasl_password=password,
            ssl_cafile=str(self.ca),
        )
        return KafkaConnection(f"localhost:{self.port}", security)

    def env(self) -> dict[str, str]:
        return {
            "INFERQ_KAFKA": f"localhost:{self.port}",
            "INFERQ_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "INFERQ_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
            "INFERQ_KAFKA_SASL_USERNAME": USER,
            "INFERQ_KAFKA_SASL_PASSWORD": PASSWORD,
            "INFERQ_KAFKA_SSL_CAFILE": str(self.ca),
        }

    def stop(self) -> None:
        if psutil.pid_exists(self.pid):
            proc = psutil.Process(self.pid)
            proc.kill()
            proc.wait(30)


def start_secure_broker(folder: Path, cache_dir: Path, tenants: dict[str, str] | None = None) -> SecureBroker:
    """`tenants`: more SCRAM users (name -> password), and an authorizer (see the module's doc)."""
    ca, keystore = make_certificates(folder / "tls")
    port, internal = free_port_pair(), free_port_pair()
    config = folder / "server.properties"
    data = folder / "data"
    properties = PROPERTIES.format(
        port=port, internal=internal, controller=internal + 1, keystore=keystore, data=data, jaas=JAAS
    )
    if tenants is not None:
        properties += AUTHORIZER.format(admin=USER)
    config.write_text(properties)
    jars = kafka_jars.ensure_jars(cache_dir, lambda _line: None)
    (folder / "log4j2.properties").write_text(kafka.LOG4J2)
    java = kafka.java_command(jars, folder / "log4j2.properties")
    users = {USER: PASSWORD, **(tenants or {})}
    scram = [
        arg
        for name, pw in users.items()
        for arg in ("--add-scram", f"SCRAM-SHA-256=[name={name},password={pw}]")
    ]
    kafka.format_storage(java, config, *scram)
    log = folder / "kafka.log"
    pid = process.spawn([*java, "kafka.Kafka", str(config)], log, cwd=folder)
    broker = SecureBroker(pid, port, ca, log)
    try:
        process.wait_ready(
            "secure kafka", pid, lambda: kafka.ping(broker.connection()), log, kafka.START_TIMEOUT_S
        )
    except Exception:
        broker.stop()
        raise
    return broker
