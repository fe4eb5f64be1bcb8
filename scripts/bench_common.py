"""Pieces the bench scripts share: what a benchmark ran on, the transformers (+ bitsandbytes) peer model, and the
line `qlora generate` ends with."""

import importlib.metadata
import os
import platform
import re

# The line `qlora generate` prints at its end: new tokens, seconds of its generation call, tokens/s.
OURS_GENERATE_LINE = re.compile(r"^(\d+) tokens in ([0-9.]+) s \(([0-9.]+) tokens/s\)$", re.M)


def machine_info(packages: tuple[str, ...]) -> dict:
    """The CPU's model name, the core count, the Python version and the installed versions of `packages`."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {}
    for pkg in packages:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "versions": versions}


def load_causal_lm(model_dir: str, nf4: bool):
    """The float32 folder `model_dir` in transformers (SDPA attention), quantized on load by bitsandbytes (NF4,
    double quantization, float32 compute, on the CPU) when `nf4`."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if nf4:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
        kwargs["device_map"] = "cpu"
    return AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
