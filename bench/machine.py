"""Facts about the machine and the process: CPU, threads, library versions, resident memory."""

from __future__ import annotations

import os
import platform
import resource
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, object]:
    import torch
    import transformers

    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def current_rss_bytes() -> int:
    return _status_kib("VmRSS:") * 1024


def peak_rss_bytes() -> int:
    """Peak RSS since the last successful reset_peak_rss() (else since process start)."""
    kib = _status_kib("VmHWM:")
    return kib * 1024 if kib else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_kib(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
