#!/usr/bin/env python3
"""Golden renderings of real models' chat templates, made by transformers' own chat-template renderer.

candle-qlora renders chat templates with minijinja (`candle_qlora::models::tokenizer::render_chat_template`, which
`TextTokenizer::apply_chat_template` calls); `tests/integration/chat_templates.rs` checks that it gives exactly the
strings transformers gives for the templates in `tests/data/chat_templates/` (the models' own chat templates, sources
in the README there).

Versions used for the committed file: transformers 5.23.0, jinja2 3.1.6, tokenizers (any; only a one-token
placeholder vocabulary is built), Python 3.11.
    pip install transformers==5.23.0 jinja2==3.1.6

Usage:
    python3 scripts/golden_chat.py generate     # writes tests/data/chat_templates/golden.json
    python3 scripts/golden_chat.py check        # renders again and fails if golden.json differs

How it renders: each template is set as the `chat_template` of a `PreTrainedTokenizerFast` that has the model's
`bos_token` / `eos_token` (as in its tokenizer_config.json; Qwen3 has no BOS token), and the conversation goes
through `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` -- the path
`AutoTokenizer.from_pretrained(model).apply_chat_template` takes: it passes the tokenizer's special tokens and
calls `transformers.utils.chat_template_utils.render_jinja_template` (jinja2's ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks, loopcontrols, and the globals raise_exception, strftime_now, namespace, dict, tojson).
The result is cross-checked against calling `render_jinja_template` directly with the same variables.

The clock: transformers' `strftime_now(fmt)` is `datetime.now().strftime(fmt)` (local time); Llama 3.x templates
put `strftime_now("%d %b %Y")` into the system prompt as "Today Date". To keep the file deterministic the clock is
pinned to PINNED_NOW while rendering, and every format a template asked for is recorded with its pinned output
(`strftime_now` in golden.json). A renderer that implements strftime_now gives today's date there instead: the Rust
test formats the same formats with our renderer, checks them against the system clock, and puts them in place of
the pinned text before comparing.

Cases (every template gets every case; `add_generation_prompt` in brackets):
    single_user [true]            one user turn: the prompt a generation request renders
    system_multi_turn [true]      system + user + assistant + user, with leading/trailing whitespace in two
                                  messages (templates that `trim` show it): system-prompt placement (Gemma 3 folds
                                  it into the first user turn, Mistral into the last one, Llama 3 after the date
                                  header; Gemma 2 rejects it), multi-turn history, the generation header
    train_pair [false]            user + assistant: what a training example renders (end-of-turn and EOS handling,
                                  Qwen3's empty think block on the final assistant turn)
    reasoning_in_content [false]  user + assistant whose content holds a `<think>...</think>` block: Qwen3 splits and
                                  strips it (str.split / lstrip / rstrip / strip with arguments); others keep it
    reasoning_in_history [true]   the same assistant turn followed by a new user turn: Qwen3 drops the reasoning of
                                  turns before the last user query (messages[::-1], namespace, startswith/endswith)
    roles_not_alternating [true]  two user turns in a row: Gemma 2/3 and Mistral raise_exception; others render
A case whose rendering raises records `error` (the exception class and message) instead of `expected`; the Rust
test then requires our renderer to fail too, with the same raise_exception message.

Not covered: extra template kwargs (e.g. Qwen3's `enable_thinking=False`), tools, documents and structured content
(lists of parts): our public API renders `{"role", "content": str}` messages with add_generation_prompt, bos_token
and eos_token only.
"""

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

import transformers
import transformers.utils.chat_template_utils as ctu
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "chat_templates"
GOLDEN = DATA / "golden.json"

# Local time the clock is pinned to while rendering (a day whose "%d" needs its leading zero).
PINNED_NOW = _dt.datetime(2025, 3, 9, 14, 30, 0)

# Template file -> the special tokens of the model (bos_token / eos_token of its tokenizer_config.json).
TEMPLATES = {
    "meta-llama-Llama-3.2-3B-Instruct.jinja": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "Qwen-Qwen3-0.6B.jinja": {"bos_token": None, "eos_token": "<|im_end|>"},
    "google-gemma-2-2b-it.jinja": {"bos_token": "<bos>", "eos_token": "<eos>"},
    "google-gemma-3-it.jinja": {"bos_token": "<bos>", "eos_token": "<eos>"},
    "microsoft-Phi-3.5-mini-instruct.jinja": {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
    "microsoft-Phi-4-mini-instruct.jinja": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": {"bos_token": "<s>", "eos_token": "</s>"},
}


def msg(role, content):
    return {"role": role, "content": content}


CASES = [
    {
        "name": "single_user",
        "add_generation_prompt": True,
        "messages": [msg("user", "What does QLoRA quantize?")],
    },
    {
        "name": "system_multi_turn",
        "add_generation_prompt": True,
        "messages": [
            msg("system", "You are a terse assistant. Answer in one line."),
            msg("user", "What is 2 + 2?"),
            msg("assistant", "4.\n"),
            msg("user", "  And times 3? "),
        ],
    },
    {
        "name": "train_pair",
        "add_generation_prompt": False,
        "messages": [
            msg("user", "Summarize: NF4 stores weights in 4 bits with a per-block absmax scale."),
            msg("assistant", "Weights are 4-bit codes,\nscaled per block."),
        ],
    },
    {
        "name": "reasoning_in_content",
        "add_generation_prompt": False,
        "messages": [
            msg("user", "Is 91 prime?"),
            msg("assistant", "<think>\n91 = 7 * 13.\n</think>\n\nNo: 91 = 7 x 13."),
        ],
    },
    {
        "name": "reasoning_in_history",
        "add_generation_prompt": True,
        "messages": [
            msg("user", "Is 91 prime?"),
            msg("assistant", "<think>\n91 = 7 * 13.\n</think>\n\nNo: 91 = 7 x 13."),
            msg("user", "And 97?"),
        ],
    },
    {
        "name": "roles_not_alternating",
        "add_generation_prompt": True,
        "messages": [msg("user", "Hi."), msg("user", "Are you there?")],
    },
]


class _PinnedDatetime(_dt.datetime):
    """`datetime` whose now() is PINNED_NOW and whose strftime calls are logged."""

    calls = {}

    @classmethod
    def now(cls, tz=None):
        return cls(PINNED_NOW.year, PINNED_NOW.month, PINNED_NOW.day, PINNED_NOW.hour, PINNED_NOW.minute)

    def strftime(self, fmt):
        out = super().strftime(fmt)
        _PinnedDatetime.calls[fmt] = out
        return out


def placeholder_tokenizer(bos_token, eos_token, chat_template):
    vocab = {"<unk>": 0}
    for tok in (bos_token, eos_token):
        if tok is not None and tok not in vocab:
            vocab[tok] = len(vocab)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
        bos_token=bos_token,
        eos_token=eos_token,
        chat_template=chat_template,
    )
    return tok


def render(template, special, case):
    """(expected string or None, error dict or None) for one template and case."""
    tok = placeholder_tokenizer(special["bos_token"], special["eos_token"], template)
    try:
        out = tok.apply_chat_template(
            case["messages"], tokenize=False, add_generation_prompt=case["add_generation_prompt"]
        )
    except Exception as e:  # noqa: BLE001 -- the class and message are the golden data
        return None, {"class": type(e).__name__, "message": str(e)}
    # The same variables straight into transformers' renderer must give the same string.
    variables = {k: v for k, v in special.items() if v is not None}
    direct = ctu.render_jinja_template(
        conversations=[case["messages"]],
        chat_template=template,
        add_generation_prompt=case["add_generation_prompt"],
        **variables,
    )[0][0]
    if direct != out:
        raise SystemExit(f"apply_chat_template and render_jinja_template disagree:\n{out!r}\n{direct!r}")
    return out, None


def build():
    real_datetime = ctu.datetime
    ctu.datetime = _PinnedDatetime
    try:
        templates = []
        for name, special in TEMPLATES.items():
            template = (DATA / name).read_text(encoding="utf-8")
            _PinnedDatetime.calls = {}
            cases = []
            for case in CASES:
                expected, error = render(template, special, case)
                entry = {
                    "name": case["name"],
                    "messages": case["messages"],
                    "add_generation_prompt": case["add_generation_prompt"],
                    "template_kwargs": {},
                }
                if error is None:
                    entry["expected"] = expected
                else:
                    entry["error"] = error
                cases.append(entry)
            templates.append(
                {
                    "file": name,
                    "bos_token": special["bos_token"],
                    "eos_token": special["eos_token"],
                    "strftime_now": dict(sorted(_PinnedDatetime.calls.items())),
                    "cases": cases,
                }
            )
    finally:
        ctu.datetime = real_datetime
    return {
        "generator": "scripts/golden_chat.py",
        "transformers": transformers.__version__,
        "renderer": "PreTrainedTokenizerFast.apply_chat_template(tokenize=False), checked against "
        "transformers.utils.chat_template_utils.render_jinja_template",
        "pinned_now": PINNED_NOW.isoformat(),
        "templates": templates,
    }


def dumps(data):
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["generate", "check"])
    args = parser.parse_args()
    text = dumps(build())
    if args.command == "generate":
        GOLDEN.write_text(text, encoding="utf-8")
        print(f"wrote {GOLDEN.relative_to(ROOT)}")
    else:
        if GOLDEN.read_text(encoding="utf-8") != text:
            sys.exit(f"{GOLDEN.relative_to(ROOT)} differs from a fresh rendering: run `generate`")
        print(f"{GOLDEN.relative_to(ROOT)} is up to date")


if __name__ == "__main__":
    main()
