#!/usr/bin/env python3
"""Golden file for candle-qlora's sampling filters (`src/models/sampling.rs`): transformers' own logits processors.

Versions used for the committed file: torch 2.15.0, transformers 4.57.6 (CPU only, Python 3.11).
    pip install torch==2.15.0 transformers==4.57.6

Usage:
    python3 scripts/golden_sampling.py generate      # writes tests/data/sampling/warpers.json

Each case is one row of float32 logits, the row's token history (prompt + generated so far) and the sampling
settings of TRL's GRPOTrainer (temperature, top_p, top_k with 0 = off, min_p, repetition_penalty). The processors are
the ones `GenerationMixin._get_logits_processor` builds for `GenerationConfig(do_sample=True, ...)` with those settings
(called on a stand-in model; the script checks the list holds only RepetitionPenalty, Temperature, TopK, TopP and
MinP, in that order), applied to `input_ids = [history]` and `scores = [logits]` as `_sample` applies them.

warpers.json: {"versions": {...}, "cases": [{"name", "logits", "history", "temperature", "top_p", "top_k", "min_p"
(null = off), "repetition_penalty", "kept" (ids whose processed score is finite, ascending), "scores" (processed
scores, null where removed)}]}. Floats are the float32 values written exactly (as Python floats).

Ties and boundaries: `top_k_ties*` have several tokens equal to the k-th largest value (TopK keeps every one: it
removes `scores < kth`); `top_p_boundary` has probabilities 1/2, 1/4, 1/8, 1/16, 1/16 (logits -j*ln 2, exact in
float32) and top_p = 0.75, so a cumulative sum equals 1 - top_p exactly (TopP removes `cumsum <= 1 - top_p`);
`top_p_tied_boundary` has four equal logits (probabilities exactly 1/4) split by top_p = 0.5, which depends on the
order of ties in torch's ascending sort (not stable by contract; on the CPU, for short rows, ties keep index order,
so the lower ids go first). Every other case is checked to stay clear of the top-p and min-p thresholds (by 1e-5),
so a float32 softmax computed in another order keeps the same tokens.
"""

import json
import math
import os
import sys

import numpy as np
import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.utils import GenerationMixin

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "sampling", "warpers.json")
EXPECTED = [RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper]
# Cases whose thresholds are met exactly on purpose.
BOUNDARY = {"top_p_boundary", "top_p_tied_boundary", "min_p_one_ties"}


class StandIn:
    """What `_get_logits_processor` reads of a model for these settings."""

    _merge_criteria_processor_list = GenerationMixin._merge_criteria_processor_list


def f32(values):
    return np.asarray(values, dtype=np.float32)


def case(name, logits, history=(), temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0):
    return dict(
        name=name,
        logits=[float(x) for x in f32(logits)],
        history=list(history),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
    )


def cases():
    rng = np.random.default_rng(20240617)
    r = lambda n, scale=2.0: f32(rng.standard_normal(n) * scale)
    ln2 = math.log(2.0)
    return [
        case("temperature_only", r(10), temperature=0.7),
        case("temperature_hot", r(10), temperature=1.7),
        case("top_k_ties", [1.0, 3.0, 2.0, 2.0, 2.0, 0.5, -1.0, 2.5], top_k=3),
        case("top_k_ties_temperature", [1.0, 3.0, 2.0, 2.0, 2.0, 0.5, -1.0, 2.5, 2.0], top_k=4, temperature=0.5),
        case("top_k_one_tied_max", [0.5, 4.0, -2.0, 4.0, 1.0], top_k=1),
        case("top_k_over_vocab", r(8), top_k=100),
        case("top_p_boundary", [0.0, -ln2, -2 * ln2, -3 * ln2, -3 * ln2], top_p=0.75),
        case("top_p_tied_boundary", [1.5, 1.5, 1.5, 1.5], top_p=0.5),
        case("top_p", r(12), top_p=0.9),
        case("top_k_then_top_p", r(12, 0.8), top_k=5, top_p=0.7, temperature=0.9),
        case("min_p", r(12), min_p=0.1),
        case("min_p_one_ties", [2.0, 5.0, -1.0, 5.0, 4.999], min_p=1.0),
        case(
            "repetition_penalty",
            [-2.0, 1.5, 0.0, -0.25, 3.0, 0.75, -1.0, 2.0],
            history=[0, 1, 2, 3, 1, 0, 7],
            repetition_penalty=1.3,
        ),
        case(
            "repetition_reward",
            [-2.0, 1.5, 0.0, -0.25, 3.0, 0.75, -1.0, 2.0],
            history=[6, 4, 4, 3],
            repetition_penalty=0.8,
        ),
        case(
            "all_combined",
            r(16, 0.6),
            history=[3, 7, 7, 11, 0, 15],
            repetition_penalty=1.2,
            temperature=0.8,
            top_k=8,
            top_p=0.8,
            min_p=0.05,
        ),
        case("vocab_256", r(256, 1.0), history=list(range(0, 256, 9)), repetition_penalty=1.1, top_k=40, top_p=0.9,
             temperature=1.2),
    ]


def processors(c):
    config = GenerationConfig(
        do_sample=True,
        temperature=c["temperature"],
        top_p=c["top_p"],
        top_k=c["top_k"],
        min_p=c["min_p"],
        repetition_penalty=c["repetition_penalty"],
    )
    input_ids = torch.tensor([c["history"] or [0]], dtype=torch.long)
    procs = GenerationMixin._get_logits_processor(
        StandIn(),
        generation_config=config,
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(),
        device="cpu",
    )
    kinds = [type(p) for p in procs]
    assert kinds == [k for k in EXPECTED if k in kinds], f"{c['name']}: unexpected processors {kinds}"
    return procs


def check_margins(c, procs, scores_in):
    """Every threshold top-p and min-p compare against is at least 1e-5 away, for cases not on a boundary."""
    scores = scores_in.clone()
    for p in procs:
        if isinstance(p, TopPLogitsWarper):
            probs = torch.sort(scores.double(), descending=False)[0].softmax(-1).cumsum(-1)
            gap = (probs[0, :-1] - (1 - p.top_p)).abs().min().item()
            assert gap > 1e-5, f"{c['name']}: a top-p cumulative sum is {gap} from the threshold"
        if isinstance(p, MinPLogitsWarper):
            probs = scores.double().softmax(-1)
            finite = probs[probs > 0]
            gap = (finite - p.min_p * probs.max()).abs().min().item()
            assert gap > 1e-5, f"{c['name']}: a min-p probability is {gap} from the threshold"
        scores = p(torch.tensor([c["history"] or [0]], dtype=torch.long), scores)


def generate():
    torch.set_num_threads(1)
    out = []
    for c in cases():
        if not c["history"] and c["repetition_penalty"] != 1.0:
            raise SystemExit(f"{c['name']}: repetition penalty needs a history")
        procs = processors(c)
        input_ids = torch.tensor([c["history"] or [0]], dtype=torch.long)
        scores = torch.tensor([c["logits"]], dtype=torch.float32)
        if c["name"] not in BOUNDARY:
            check_margins(c, procs, scores)
        processed = procs(input_ids, scores.clone())
        row = processed[0].tolist()
        kept = [i for i, s in enumerate(row) if math.isfinite(s)]
        if c["name"] == "top_p_boundary":
            probs = torch.sort(scores, descending=False)[0].softmax(-1).cumsum(-1)[0].tolist()
            assert probs[:3] == [0.0625, 0.125, 0.25], f"top_p_boundary: cumulative sums {probs} are not exact"
            assert kept == [0, 1], kept
        c["kept"] = kept
        c["scores"] = [s if math.isfinite(s) else None for s in row]
        out.append(c)
        print(f"{c['name']:>24}: kept {kept}")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    with open(OUT, "w") as f:
        f.write('{"versions": ' + json.dumps(versions) + ',\n "cases": [\n')
        f.write(",\n".join("  " + json.dumps(c) for c in out))
        f.write("\n ]}\n")
    print(f"wrote {os.path.normpath(OUT)}")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "generate":
        generate()
    else:
        print(__doc__)
        sys.exit(2)
