#!/usr/bin/env python3
"""Golden files for candle-qlora's DPO trainer, produced by TRL's own DPOTrainer on a PEFT model.

Versions used for the committed files: torch 2.15.0, transformers 5.23.0, peft 0.21.2, trl 1.16.0, Python 3.11,
all run on the CPU, in float64 from end to end (`float64_reference.py`: also the steps transformers and TRL keep in
float32), so that the Rust test compares at ~1e-9 and neither side's rounding nor the CPU's matrix kernels can decide
a result.
    pip install torch==2.15.0 transformers==5.23.0 peft==0.21.2 trl==1.16.0 safetensors datasets

Usage:
    python3 scripts/golden_dpo.py generate     # (re)writes everything under tests/data/dpo/

No Hugging Face Hub access is needed. Everything lives in tests/data/dpo/:
    tiny-llama-chat/      tests/data/models/tiny-llama (config.json, model.safetensors: symbolic links) with a tokenizer
                          that knows `<s>` (id 1) and `</s>` (id 2, the EOS) as special tokens and a chat template
                          whose role markers are ordinary tokens (user t100, assistant t101, system t102).
    adapter/              a PEFT LoRA adapter on it (r=4, alpha=8, q/k/v/o/gate/up/down_proj) whose B matrices are
                          seeded non-zero (PEFT initializes B to zero; a frozen copy of a zero adapter would be the
                          base model, and the test would not tell the two references apart).
    pairs.jsonl           4 pairs, standard form with an explicit prompt (TRL's "prompt"/"chosen"/"rejected").
    pairs-implicit.jsonl  the same pairs with the prompt inside chosen and rejected (TRL extracts it).
    pairs-chat.jsonl      4 conversational pairs (lists of messages).
    golden.json           for each data file, TRL's tokenization (prompt_ids, chosen_ids, rejected_ids per pair), and
                          for each case the unrounded DPO loss and TRL's metrics at each of 3 optimizer steps (train)
                          and at the evaluation after each step.

Each case trains the adapter with DPOTrainer(model=PeftModel.from_pretrained(base, adapter, is_trainable=True)):
TRL copies the adapter into a frozen "ref" adapter and uses it as the reference. One batch holds every pair
(per_device_train_batch_size = 4), so the data order cannot differ; adamw_torch, learning_rate 5e-3 (linear decay,
no warmup), weight_decay 0, max_grad_norm 1, float64, dropout off, seed 0, max_length 1024, gradient checkpointing
off, evaluation on the same pairs after every step. The loss is recorded by overriding compute_loss (transformers
rounds the logged loss to 4 digits). Cases:
    sigmoid, hinge, ipo, robust (label_smoothing 0.1), bco_pair, sppo_hard, nca_pair, apo_zero, apo_down
                          loss_type = [name], beta 0.1 (ipo: 0.5), on pairs.jsonl
    rpo                   loss_type ["sigmoid", "sft"], loss_weights [1.0, 0.5]: the RPO objective (our rpo_alpha 0.5)
    precompute            sigmoid with precompute_ref_log_probs = True
    reference_free        sigmoid with the reference log-probabilities 0 (TRL 1.16 dropped `reference_free`; TRL's
                          precompute hook is replaced by one that writes zeros, which is what the old option did)
    implicit, chat        sigmoid on pairs-implicit.jsonl and pairs-chat.jsonl
"""

import json
import os
import shutil
import sys

import torch

from float64_reference import float64_copy, float64_everywhere

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BASE = os.path.join(ROOT, "tests/data/models/tiny-llama")
OUT = os.path.join(ROOT, "tests/data/dpo")
MODEL = os.path.join(OUT, "tiny-llama-chat")
ADAPTER = os.path.join(OUT, "adapter")

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}t100{% elif m['role'] == 'assistant' %}t101"
    "{% else %}t102{% endif %} {{ m['content'] }}</s> {% endfor %}{% if add_generation_prompt %}t101 {% endif %}"
)

PAIRS = [
    ("t5 t6 t7", " t8 t9", " t10"),
    ("t11 t12", " t13 t14 t15", " t16 t17"),
    ("t20 t21 t22 t23", " t24", " t25 t26 t27"),
    ("t30", " t31 t32", " t33"),
]

CHAT = [
    ([{"role": "user", "content": "t40 t41"}], "t42 t43", "t44"),
    ([{"role": "system", "content": "t50"}, {"role": "user", "content": "t51 t52"}], "t53", "t54 t55 t56"),
    ([{"role": "user", "content": "t60"}], "t61 t62 t63", "t64 t65"),
    (
        [{"role": "user", "content": "t70"}, {"role": "assistant", "content": "t71"}, {"role": "user", "content": "t72"}],
        "t73",
        "t74 t75",
    ),
]


def write_model_folder():
    os.makedirs(MODEL, exist_ok=True)
    for name in ["config.json", "model.safetensors"]:
        link = os.path.join(MODEL, name)
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(os.path.join("../../models/tiny-llama", name), link)
    tok = json.load(open(os.path.join(BASE, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    del vocab["t1"], vocab["t2"]
    vocab["<s>"], vocab["</s>"] = 1, 2
    tok["added_tokens"] = [
        {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, c in [(0, "<unk>"), (1, "<s>"), (2, "</s>")]
    ]
    json.dump(tok, open(os.path.join(MODEL, "tokenizer.json"), "w"), indent=1)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 256,
    }
    json.dump(config, open(os.path.join(MODEL, "tokenizer_config.json"), "w"), indent=1)


def write_data():
    with open(os.path.join(OUT, "pairs.jsonl"), "w") as f:
        for p, c, r in PAIRS:
            f.write(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n")
    with open(os.path.join(OUT, "pairs-implicit.jsonl"), "w") as f:
        for p, c, r in PAIRS:
            f.write(json.dumps({"chosen": p + c, "rejected": p + r}) + "\n")
    with open(os.path.join(OUT, "pairs-chat.jsonl"), "w") as f:
        for p, c, r in CHAT:
            f.write(json.dumps({
                "prompt": p,
                "chosen": [{"role": "assistant", "content": c}],
                "rejected": [{"role": "assistant", "content": r}],
            }) + "\n")


def base_model(folder=MODEL, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")


def write_adapter():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base_model(), config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(ADAPTER)
    cfg_path = os.path.join(ADAPTER, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    cfg["base_model_name_or_path"] = "tests/data/dpo/tiny-llama-chat"
    json.dump(cfg, open(cfg_path, "w"), indent=2, sort_keys=True)
    readme = os.path.join(ADAPTER, "README.md")
    if os.path.exists(readme):
        os.remove(readme)


def load_jsonl(name):
    from datasets import Dataset

    rows = [json.loads(line) for line in open(os.path.join(OUT, name))]
    return Dataset.from_list(rows)


def run_case(data_file, **kwargs):
    """One case, in float64 from end to end (the model is built inside too, so its RoPE frequencies are float64;
    it reads float64 copies of the model and the adapter)."""
    model_dir, adapter_dir = float64_copy(MODEL), float64_copy(ADAPTER)
    try:
        with float64_everywhere():
            return run_case_float64(model_dir, adapter_dir, data_file, **kwargs)
    finally:
        shutil.rmtree(model_dir)
        shutil.rmtree(adapter_dir)


def run_case_float64(model_dir, adapter_dir, data_file, loss_type, loss_weights=None, beta=0.1, label_smoothing=0.0,
                     precompute=False, reference_free=False, steps=3):
    from peft import PeftModel
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = PeftModel.from_pretrained(base_model(model_dir, torch.float64), adapter_dir, is_trainable=True)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    recorded = {"train": [], "eval": []}

    class Recording(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = out[0] if isinstance(out, tuple) else out
            recorded["train" if self.model.training else "eval"].append(loss.item())
            return out

        def _precompute_ref_logps(self, dataset, name, batch_size):
            if not reference_free:
                return super()._precompute_ref_logps(dataset, name, batch_size)
            zeros = [0.0] * len(dataset)
            return dataset.add_column("ref_chosen_logps", zeros).add_column("ref_rejected_logps", zeros)

    args = DPOConfig(
        output_dir="/tmp/golden_dpo_run",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=steps,
        learning_rate=5e-3,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        beta=beta,
        label_smoothing=label_smoothing,
        loss_type=loss_type,
        loss_weights=loss_weights,
        precompute_ref_log_probs=precompute or reference_free,
        max_length=1024,
        disable_tqdm=True,
    )
    data = load_jsonl(data_file)
    trainer = Recording(model=model, args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer)
    assert "ref" in model.peft_config, "TRL should have copied the adapter into a frozen 'ref' adapter"
    tokenized = [
        {k: trainer.train_dataset[i][k] for k in ["prompt_ids", "chosen_ids", "rejected_ids"]}
        for i in range(len(trainer.train_dataset))
    ]
    trainer.train()
    names = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected"]
    train = [e for e in trainer.state.log_history if "loss" in e and "eval_loss" not in e]
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert len(train) == steps and len(evals) == steps and len(recorded["train"]) == steps
    steps_out = []
    for k in range(steps):
        entry = {"step": k + 1, "loss": recorded["train"][k], "grad_norm": train[k]["grad_norm"],
                 "learning_rate": train[k]["learning_rate"]}
        entry.update({n: train[k][n] for n in names})
        entry["eval_loss"] = recorded["eval"][k]
        entry.update({"eval_" + n: evals[k]["eval_" + n] for n in names})
        steps_out.append(entry)
    return tokenized, steps_out


def generate():
    import peft
    import transformers
    import trl

    os.makedirs(OUT, exist_ok=True)
    write_model_folder()
    write_data()
    write_adapter()
    golden = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "trl": trl.__version__},
        "tokenized": {},
        "cases": {},
    }
    cases = {
        "sigmoid": ("pairs.jsonl", dict(loss_type=["sigmoid"])),
        "hinge": ("pairs.jsonl", dict(loss_type=["hinge"])),
        "ipo": ("pairs.jsonl", dict(loss_type=["ipo"], beta=0.5)),
        "robust": ("pairs.jsonl", dict(loss_type=["robust"], label_smoothing=0.1)),
        "bco_pair": ("pairs.jsonl", dict(loss_type=["bco_pair"])),
        "sppo_hard": ("pairs.jsonl", dict(loss_type=["sppo_hard"])),
        "nca_pair": ("pairs.jsonl", dict(loss_type=["nca_pair"])),
        "apo_zero": ("pairs.jsonl", dict(loss_type=["apo_zero"])),
        "apo_down": ("pairs.jsonl", dict(loss_type=["apo_down"])),
        "rpo": ("pairs.jsonl", dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])),
        "precompute": ("pairs.jsonl", dict(loss_type=["sigmoid"], precompute=True)),
        "reference_free": ("pairs.jsonl", dict(loss_type=["sigmoid"], reference_free=True)),
        "implicit": ("pairs-implicit.jsonl", dict(loss_type=["sigmoid"])),
        "chat": ("pairs-chat.jsonl", dict(loss_type=["sigmoid"])),
    }
    for name, (data_file, kwargs) in cases.items():
        tokenized, steps = run_case(data_file, **kwargs)
        golden["tokenized"][data_file] = tokenized
        settings = {k: v for k, v in kwargs.items()}
        golden["cases"][name] = {"data": data_file, "settings": settings, "steps": steps}
        print(name, [round(s["loss"], 6) for s in steps], file=sys.stderr)
    json.dump(golden, open(os.path.join(OUT, "golden.json"), "w"), indent=1)
    shutil.rmtree("/tmp/golden_dpo_run", ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["generate"]:
        generate()
    else:
        print(__doc__)
        sys.exit(1)
