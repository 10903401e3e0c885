#!/usr/bin/env python3
"""Reads the TensorBoard event files of a directory with TensorBoard's own reader
(EventAccumulator, which checks every record's CRC) and prints every scalar series as one
JSON object: {"tag": [[step, value], ...], ...}. Used by launcher/tests/eval.rs to check
what `logging.report_to: tensorboard` wrote.

Usage: read_tensorboard.py LOGGING_DIR
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
print(json.dumps({tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}))
