"""Kafka's runtime jars, fetched once from Maven Central with Maven into a cache outside the repo.

No tarball: the broker artifact `kafka_2.13` holds `kafka.Kafka` and `kafka.tools.StorageTool`; Maven
resolves its runtime dependencies. The log4j2 SLF4J-1 binding is added because Kafka declares none (it
pins slf4j 1.7.36, so the slf4j-2 binding would be ignored) and the broker would log nothing.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import tempfile
from pathlib import Path

from workers.services import tools
from workers.services.process import ServiceError

KAFKA_VERSION = "4.3.0"  # kafka-python 3.0.x tests against 4.3.0 in its CI (avoid 4.0.0: no JoinGroup v0/v1)
LOG4J_VERSION = "2.25.4"  # the log4j-core that kafka 4.3.0 itself depends on
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
COMPLETE = ".complete"

POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>inferq.local</groupId><artifactId>kafka-runtime</artifactId><version>0</version>
  <packaging>pom</packaging>
  <dependencies>
    <!-- kafka first, so its slf4j-api version wins -->
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId>
      <version>{kafka}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId>
      <version>{log4j}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId>
      <version>{log4j}</version></dependency>
  </dependencies>
</project>
"""


def jar_dir(cache_dir: Path) -> Path:
    return cache_dir / f"kafka-{KAFKA_VERSION}"


def ensure_jars(cache_dir: Path, log=print) -> Path:
    """The folder of Kafka's runtime jars, fetching them first if the cache lacks them."""
    target = jar_dir(cache_dir)
    if (target / COMPLETE).exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Checkouts share the cache: one fetch at a time, the others wait and then find it done.
    with open(cache_dir / f"kafka-{KAFKA_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / COMPLETE).exists():
            log(f"fetching Kafka {KAFKA_VERSION} jars from Maven Central into {target} (once)")
            _fetch(target)
    return target


def _fetch(target: Path) -> None:
    mvn = tools.mvn()
    with tempfile.TemporaryDirectory(prefix="inferq-kafka-pom-") as work:
        pom = Path(work) / "pom.xml"
        pom.write_text(POM.format(kafka=KAFKA_VERSION, log4j=LOG4J_VERSION))
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        cmd = [
            mvn,
            "-B",
            "-q",
            "-f",
            str(pom),
            f"{DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={partial}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            out = (done.stdout + done.stderr)[-3000:]
            raise ServiceError(f"Maven could not fetch the Kafka jars (exit {done.returncode}):\n{out}")
    (partial / COMPLETE).write_text(KAFKA_VERSION + "\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
