#!/usr/bin/env python3
"""Reads a TensorBoard log folder with TensorBoard's own reader (the `tensorboard` package's EventAccumulator) and
prints its scalars as JSON: {tag: [[step, value], ...]}; with --texts, its texts instead (the text plugin's):
{tag: [[step, text], ...]}. Used by the Rust tests of `report_to = "tensorboard"`.

    pip install tensorboard
    python3 scripts/read_tensorboard.py [--texts] LOGDIR
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator

args = sys.argv[1:]
texts = args[:1] == ["--texts"]
if texts:
    args = args[1:]
if len(args) != 1:
    print(__doc__)
    sys.exit(2)
accumulator = EventAccumulator(args[0], size_guidance={SCALARS: 0, TENSORS: 0})
accumulator.Reload()
if texts:
    print(json.dumps({tag: [[e.step, e.tensor_proto.string_val[0].decode()] for e in accumulator.Tensors(tag)]
                      for tag in accumulator.Tags()["tensors"]}))
else:
    print(json.dumps({tag: [[e.step, e.value] for e in accumulator.Scalars(tag)]
                      for tag in accumulator.Tags()["scalars"]}))
