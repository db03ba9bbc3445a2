"""On PYTHONPATH with INFERQ_SIMULATE_IMAGE=1: this interpreter lacks what the GPU image lacks
(bench/device/image.py). Used by the device check's CI dry run (tests/bench/test_device_check.py)."""

import os

if os.environ.get("INFERQ_SIMULATE_IMAGE") == "1":
    from bench.device import image as device_image

    device_image.block()
