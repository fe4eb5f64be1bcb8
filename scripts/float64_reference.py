"""Running a PyTorch reference in float64 from end to end, for the golden files the Rust tests compare at ~1e-9.

transformers, PEFT and TRL compute several steps in float32 whatever the model's dtype: RMSNorm upcasts with
`.to(torch.float32)`, RoPE forms its angles with `.float()`, eager attention takes its softmax with
`dtype=torch.float32`, the causal-LM loss calls `logits.float()`, routers take `softmax(..., dtype=torch.float)`.
A float64 model run as it is would round to float32 at each of those places, and a comparison with a float64 run of
ours could then not be tighter than float32 rounding (1e-7) — nor free of the CPU's matrix kernels, which is the
point of comparing in float64 at all.

`float64_everywhere()` is a TorchDispatchMode that sees every aten operation (forward and backward): a requested
dtype of float32 (or half) becomes float64, and an operation that still produces a float32 tensor is recorded;
`check()` fails naming them, so a reference that slipped back to float32 cannot pass unnoticed. Models and adapters
are read inside it from `float64_copy()` folders (their safetensors converted to float64, which holds every float32
value exactly), so that loading creates no float32 tensor either.
"""

import contextlib
import os
import shutil
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

NARROW = (torch.float32, torch.float16, torch.bfloat16)


def widen(a):
    """float64 for a narrower float dtype; anything else as it is."""
    return torch.float64 if isinstance(a, torch.dtype) and a in NARROW else a


# Reinterpreting bytes as another dtype is no arithmetic: left as it is.
REINTERPRET = ("aten.view.dtype",)


class Float64Everywhere(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.narrow_ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in REINTERPRET:
            out = func(*args, **(kwargs or {}))
            self.note(func, out)
            return out
        kwargs = {k: widen(v) for k, v in (kwargs or {}).items()}
        args = tree_map(widen, args)
        out = func(*args, **kwargs)
        self.note(func, out)
        return out

    def note(self, func, out):
        """Records `func` if it produced a narrow float tensor."""

        def narrow(t):
            if isinstance(t, torch.Tensor) and t.dtype in NARROW:
                self.narrow_ops.add(str(func))

        tree_map(narrow, out)

    def check(self):
        assert not self.narrow_ops, f"float32 results in a float64 reference: {sorted(self.narrow_ops)}"


@contextlib.contextmanager
def float64_everywhere():
    """Everything inside computes in float64 (new tensors default to it too); fails at the end if anything did not."""
    # torch caches, on first use, the factory functions a `with torch.device(...)` context redirects (torch.tensor
    # among them). Built while torch.tensor is replaced below, it would hold the replacement for the rest of the
    # process: torch.tensor would escape transformers' meta-device model construction from then on, and models loaded
    # afterwards (float32 ones too) would get uninitialized RoPE frequencies. So it is built first.
    torch.utils._device._device_constructors()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    # `torch.tensor(values, dtype=torch.float32)` rounds its values before any operation sees them (LongRoPE's
    # factors are made so): the dtype is widened where it is asked for.
    tensor = torch.tensor
    torch.tensor = lambda *args, **kwargs: tensor(*args, **{k: widen(v) for k, v in kwargs.items()})
    mode = Float64Everywhere()
    try:
        with mode:
            yield mode
    finally:
        torch.tensor = tensor
        torch.set_default_dtype(previous)
    mode.check()


def float64_copy(folder):
    """A temporary copy of `folder` (a model or adapter) whose safetensors files hold float64 tensors (exactly the
    stored values); other files are copied as they are. The caller removes it (`shutil.rmtree`)."""
    from safetensors.torch import load_file, save_file

    out = tempfile.mkdtemp(prefix="float64-")
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            tensors = load_file(path)
            save_file({k: v.double() if v.is_floating_point() else v for k, v in tensors.items()},
                      os.path.join(out, name), metadata={"format": "pt"})
        elif os.path.isfile(path):
            shutil.copy(path, os.path.join(out, name))
    return out
