"""The GPU device check's parts (bench/device_check.sh runs them): the per-shape bench, the carried
wheels, the image's packages and the random-weight models."""
