"""Imported by every Python child of the test run (tests/conftest.py puts this folder on PYTHONPATH): the pytest
workers' GC thresholds, for the converter, verify's measuring child, `loraship run` and the distributed ranks."""

import gc

gc.set_threshold(50_000, 20, 10)
