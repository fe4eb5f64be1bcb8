#!/usr/bin/env python3
"""Reads a TensorBoard log folder with TensorBoard's own reader (the `tensorboard` package's EventAccumulator) and
prints its scalars as JSON: {tag: [[step, value], ...]}. Used by the Rust test of `report_to = "tensorboard"`.

    pip install tensorboard
    python3 scripts/read_tensorboard.py LOGDIR
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

if len(sys.argv) != 2:
    print(__doc__)
    sys.exit(2)
accumulator = EventAccumulator(sys.argv[1], size_guidance={SCALARS: 0})
accumulator.Reload()
print(json.dumps({tag: [[e.step, e.value] for e in accumulator.Scalars(tag)]
                  for tag in accumulator.Tags()["scalars"]}))
