#!/usr/bin/env python3
"""Golden files for candle-qlora's GRPO trainer, produced by TRL's own GRPOTrainer on a PEFT model.

Versions used for the committed files: torch 2.15.0, transformers 5.23.0, peft 0.21.2, trl 1.16.0, Python 3.11,
all run on the CPU, in float64 from end to end (`float64_reference.py`), so that the Rust test compares at ~1e-9.
    pip install torch==2.15.0 transformers==5.23.0 peft==0.21.2 trl==1.16.0 safetensors datasets

Usage:
    python3 scripts/golden_grpo.py generate     # (re)writes tests/data/grpo/

It reuses DPO's test model and adapter (tests/data/dpo/tiny-llama-chat, tests/data/dpo/adapter: r=4 on every
projection, B seeded non-zero) and writes into tests/data/grpo/:
    prompts.jsonl     4 text prompts.
    rollouts.jsonl    the same prompts with 4 completions each and their rewards (TRL's rollout form): some end
                      with the end-of-sequence token `</s>`, some do not (truncated); one group's rewards are all
                      equal (zero standard deviation); one reward is null (skipped).
    golden.json       the completions' tokens as TRL tokenizes them, and for each case the loss, grad_norm and TRL's
                      logged metrics at each of 3 optimizer steps.

TRL is fed the same completions and rewards: `_generate_single_turn` is replaced by one returning the rollouts'
tokens for each prompt (in order), and the one reward function (`rollouts`) looks each reward up by prompt and
completion tokens. TRL shuffles a generation batch with torch's generator before splitting it into micro-batches;
that shuffle is replaced by candle-qlora's seeded order (`generation_order` below, `grpo/generation.rs`), so both
split alike. Every case: PeftModel.from_pretrained(base, adapter, is_trainable=True) (TRL copies the adapter into a
frozen `ref` adapter when beta != 0), adamw_torch, learning_rate 5e-2 (linear decay, no warmup: large enough for the
ratios to leave the clipping range), weight_decay 0, max_grad_norm 1, float64, seed 0, shuffle_dataset False,
num_generations 4, per_device_train_batch_size 8 (two prompts), max_completion_length 6, gradient checkpointing
off. The loss is recorded by overriding compute_loss (transformers rounds the logged loss), summed over a step's
micro-batches as transformers sums them.
"""

import json
import os
import shutil
import sys

import torch

from float64_reference import float64_copy, float64_everywhere

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODEL = os.path.join(ROOT, "tests/data/dpo/tiny-llama-chat")
ADAPTER = os.path.join(ROOT, "tests/data/dpo/adapter")
OUT = os.path.join(ROOT, "tests/data/grpo")
SEED = 0

PROMPTS = ["t5 t6 t7", "t11 t12", "t20 t21 t22 t23", "t30"]
# Per prompt: 4 completions (as text, tokenized as they stand) and their rewards (dyadic: exact in float32 too).
ROLLOUTS = [
    (["t8 t9</s>", "t10</s>", "t8 t40 t41 t42 t43 t44", "t9 t9 t9</s>"], [1.0, 0.5, -0.25, 0.75]),
    (["t13 t14 t15</s>", "t16</s>", "t17 t18", "t13</s>"], [0.5, 0.5, 0.5, 0.5]),
    (["t24</s>", "t25 t26 t27 t28 t29 t30", "t24 t24</s>", "t31 t32</s>"], [2.0, -1.0, None, 0.0]),
    (["t33</s>", "t34 t35</s>", "t36 t37 t38</s>", "t39 t40 t41 t42 t43 t44"], [0.125, 1.0, 0.5, -0.5]),
]

CASES = {
    "dapo": dict(),
    "grpo": dict(loss_type="grpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "beta": dict(beta=0.04),
    "iterations": dict(num_iterations=2),
    "scale_batch": dict(scale_rewards="batch", num_iterations=2),
    "scale_none": dict(scale_rewards="none", loss_type="grpo"),
    "sequence": dict(importance_sampling_level="sequence", num_iterations=2, beta=0.04),
    "accumulation": dict(gradient_accumulation_steps=2, per_device_train_batch_size=4, num_iterations=2, beta=0.04),
    "clip_higher": dict(epsilon_high=0.28, delta=1.5, num_iterations=2, mask_truncated_completions=True),
    "bnpo_no_bias_kl": dict(loss_type="bnpo", beta=0.04, use_bias_correction_kl=False, num_iterations=2),
    "entropy_quantile": dict(top_entropy_quantile=0.5, num_iterations=2, loss_type="grpo"),
}

MASK64 = (1 << 64) - 1


def splitmix(z):
    """SplitMix64's finalizer (`crate::rng::splitmix`)."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def generation_order(n, seed, index):
    """candle-qlora's order of generation batch `index`'s `n` completions (`generation_order` in generation.rs)."""
    key = splitmix(seed ^ ((index * 0x9E3779B97F4A7C15) & MASK64))
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = splitmix(key ^ i) % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def write_data():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "prompts.jsonl"), "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": p}) + "\n")
    with open(os.path.join(OUT, "rollouts.jsonl"), "w") as f:
        for p, (completions, rewards) in zip(PROMPTS, ROLLOUTS):
            f.write(json.dumps({"prompt": p, "completions": completions, "rewards": rewards}) + "\n")


def run_case(settings):
    model_dir, adapter_dir = float64_copy(MODEL), float64_copy(ADAPTER)
    try:
        with float64_everywhere():
            return run_case_float64(model_dir, adapter_dir, settings)
    finally:
        shutil.rmtree(model_dir)
        shutil.rmtree(adapter_dir)


def run_case_float64(model_dir, adapter_dir, settings):
    import trl.trainer.grpo_trainer as grpo_module
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    completion_ids = {
        tuple(tokenizer(p)["input_ids"]): [tokenizer(c, add_special_tokens=False)["input_ids"] for c in cs]
        for p, (cs, _) in zip(PROMPTS, ROLLOUTS)
    }
    rewards = {
        (tuple(tokenizer(p)["input_ids"]), tuple(ids)): r
        for p, (cs, rs) in zip(PROMPTS, ROLLOUTS)
        for ids, r in zip([tokenizer(c, add_special_tokens=False)["input_ids"] for c in cs], rs)
    }

    def rollouts(prompts, completions, completion_ids, **kwargs):
        return [rewards[(tuple(tokenizer(p)["input_ids"]), tuple(ids))] for p, ids in zip(prompts, completion_ids)]

    generations = {"count": 0}

    def seeded_shuffle(seq_dict):
        n = len(next(v for v in seq_dict.values() if v is not None))
        order = generation_order(n, SEED, generations["count"])
        generations["count"] += 1
        index = torch.tensor(order)

        def permute(v):
            if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
                return v
            if isinstance(v, torch.Tensor):
                return v[index]
            return [v[i] for i in order]

        return {k: permute(v) for k, v in seq_dict.items()}

    grpo_module.shuffle_sequence_dict = seeded_shuffle
    recorded = []

    class Recording(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            seen = {}
            out = []
            for ids in prompt_ids:
                key = tuple(ids)
                k = seen.get(key, 0)
                seen[key] = k + 1
                out.append(completion_ids[key][k % len(completion_ids[key])])
            return out, None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if self.model.training:
                recorded.append(loss.item())
            return loss

    kwargs = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1)
    kwargs.update(settings)
    args = GRPOConfig(
        output_dir="/tmp/golden_grpo_run",
        max_steps=3,
        learning_rate=5e-2,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=SEED,
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        num_generations=4,
        max_completion_length=6,
        shuffle_dataset=False,
        disable_tqdm=True,
        **kwargs,
    )
    data = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    trainer = Recording(model=model, args=args, train_dataset=data, reward_funcs=[rollouts],
                        processing_class=tokenizer)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 3, logs
    micro = len(recorded) // 3
    steps = []
    for k, log in enumerate(logs):
        entry = {key: value for key, value in log.items() if key not in ("epoch", "step_time", "num_tokens")}
        entry["step"] = k + 1
        entry["loss"] = sum(recorded[k * micro:(k + 1) * micro])
        steps.append(entry)
    tokens = {" ".join(map(str, p)): c for p, c in completion_ids.items()}
    return tokens, steps


def generate():
    import peft
    import transformers
    import trl

    write_data()
    golden = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "trl": trl.__version__},
        "generation_order": {str(i): generation_order(8, SEED, i) for i in range(3)},
        "cases": {},
    }
    for name, settings in CASES.items():
        tokens, steps = run_case(settings)
        golden["completion_ids"] = tokens
        golden["cases"][name] = {"settings": settings, "steps": steps}
        print(name, [round(s["loss"], 6) for s in steps], [round(s["grad_norm"], 6) for s in steps],
              file=sys.stderr)
    json.dump(golden, open(os.path.join(OUT, "golden.json"), "w"), indent=1)
    shutil.rmtree("/tmp/golden_grpo_run", ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["generate"]:
        sys.exit(__doc__)
    generate()
