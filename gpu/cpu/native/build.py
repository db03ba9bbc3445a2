"""Compile a C kernel once per machine and load it: the shared object is cached under a name made of the
source, the flags and the CPU's identity, so a changed kernel or another CPU never loads a stale build.

-march=native is safe because the build happens on the machine that runs it (and the CPU is part of the
cache key). OpenMP links libgomp.so.1, the same runtime torch's CPU wheels load, so one thread pool and
one thread count (torch.set_num_threads) govern both.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared")
COMPILE_TIMEOUT_S = 120


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "inferq" / "kernels"


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))


def _compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


@cache
def load(name: str, extra_flags: tuple[str, ...] = (), cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The compiled `native/<name>.c` (FLAGS plus `extra_flags`), or None (with the reason logged) when it
    cannot be built here."""
    source = SOURCE_DIR / f"{name}.c"
    compiler = _compiler()
    if compiler is None:
        log.info("native kernel %s: no C compiler found; using the torch path", name)
        return None
    text = source.read_bytes()
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256(text + repr((flags, compiler, _cpu_identity())).encode()).hexdigest()[:16]
    # The user's cache first; a temporary directory where the home directory is read-only.
    for directory in (cache_dir or default_cache_dir(), Path(tempfile.gettempdir()) / "inferq-kernels"):
        target = directory / f"{name}-{key}.so"
        try:
            if not target.exists():
                _compile(compiler, flags, source, target)
            return ctypes.CDLL(str(target))
        except subprocess.SubprocessError as error:
            log.warning("native kernel %s: build failed (%s); using the torch path", name, error)
            return None
        except OSError as error:
            log.info("native kernel %s: %s unusable (%s)", name, directory, error)
    log.warning("native kernel %s: no writable cache directory; using the torch path", name)
    return None


def _compile(compiler: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    """Build into a temporary file, then rename: concurrent workers never load a half-written object."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *flags, str(source), "-o", partial, "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr.strip()[-2000:])
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def load_versioned(
    name: str, abi_symbol: str, abi_version: int, extra_flags: tuple[str, ...] = ()
) -> ctypes.CDLL | None:
    """`load`, kept only when the library's `abi_symbol()` returns the version its Python side expects (a
    stale or foreign build of the same name is never called with the wrong arguments)."""
    library = load(name, extra_flags)
    if library is None or getattr(library, abi_symbol)() != abi_version:
        return None
    return library


_ARG_TYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "f": ctypes.c_float}


def function(library: ctypes.CDLL, name: str, signature: str, restype: Any = None) -> Any:
    """The library's function `name`, typed: `signature` has one letter per argument (p: pointer,
    i: int64, f: float)."""
    fn = getattr(library, name)
    fn.argtypes = [_ARG_TYPES[c] for c in signature]
    fn.restype = restype
    return fn
