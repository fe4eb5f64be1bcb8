#!/usr/bin/env python3
"""Reads a memory snapshot written by `qlora train` (`[training] memory_snapshot = true`) with PyTorch's own
`torch.cuda._memory_viz` and replays its trace; prints one JSON object.

    python3 scripts/read_memory_snapshot.py OUT/memory_snapshot.pickle

`_memory_viz.py` is a standard-library-only module of the torch wheel, loaded by file path (torch itself is not
imported): from $QLORA_MEMORY_VIZ when set, else from the installed torch package. Without either it exits with
status 3 and says so.

Output: {"segsum": <memory_viz's segment summary text>, "trace_lines": <lines of its trace printout>,
"segments": n, "events": n, "live_bytes": bytes in the segments, "replayed_peak": the highest live total during a
step's phases (forward, recompute, backward, optimizer; the trace replayed from the live total its start implies),
"frames": the first alloc's frames formatted as memory_viz formats them, "allocator_settings": as written,
"ooms": the allocations the device refused (size, device_free)}.
"""

import importlib.util
import json
import os
import pickle
import sys


STEP_PHASES = ("forward", "recompute", "backward", "optimizer")


def memory_viz():
    path = os.environ.get("QLORA_MEMORY_VIZ")
    if not path:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            print("neither $QLORA_MEMORY_VIZ nor the torch package is available", file=sys.stderr)
            sys.exit(3)
        path = os.path.join(list(spec.submodule_search_locations)[0], "cuda", "_memory_viz.py")
    module_spec = importlib.util.spec_from_file_location("_memory_viz", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def main():
    viz = memory_viz()
    with open(sys.argv[1], "rb") as f:
        data = pickle.load(f)
    segsum = viz.segsum(data)  # raises on an inconsistent segment
    trace = viz.trace(data)
    # The recorded device's trace (the heap's is device 0's; a GPU's is at its ordinal).
    events = max(data["device_traces"], key=len)
    live = sum(b["size"] for s in data["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    net = sum(e["size"] for e in events if e["action"] == "alloc") - sum(
        e["size"] for e in events if e["action"] == "free_completed")
    total = live - net
    peak = None
    for e in events:
        if e["action"] == "alloc":
            total += e["size"]
        elif e["action"] == "free_completed":
            total -= e["size"]
        else:
            continue
        in_step = any(f["name"] in STEP_PHASES and f["filename"].startswith("step ") for f in e["frames"])
        if in_step and (peak is None or total > peak):
            peak = total
    first = next(e for e in events if e["action"] == "alloc")
    print(json.dumps({
        "segsum": segsum,
        "trace_lines": trace.splitlines(),
        "segments": len(data["segments"]),
        "events": len(events),
        "live_bytes": live,
        "replayed_peak": peak,
        "frames": viz._frames_fmt(first["frames"]),
        "allocator_settings": data["allocator_settings"],
        "ooms": [{"size": e["size"], "device_free": e["device_free"]} for e in events if e["action"] == "oom"],
    }))


if __name__ == "__main__":
    main()
