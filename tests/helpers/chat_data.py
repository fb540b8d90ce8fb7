"""A tiny byte-level BPE tokenizer with Qwen2's ChatML chat template, trained here with the
tokenizers library (no hub, no network), and seeded random conversations: what the SFT tests
prepare and train on."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen2 / Qwen2.5's chat template (ChatML, with its default system prompt)."""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "the context window grows when the rope base rises and documents stay apart "
    "a ring passes keys around while ulysses moves heads across ranks "
    "what is the loss of the assistant turn only please answer briefly "
    "long books code repositories and web pages fill the packed sequences "
    "über naïve café 東京 ✓"
).split()
VOCAB_SIZE = 320
"""The trained tokenizer's vocabulary (the 256 bytes, the specials and merges)."""


def write_chat_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer.json trained on WORDS, with tokenizer_config.json holding
    the chat template and the special tokens, in `directory` (returned)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = " ".join(WORDS) + "\nuser assistant system\n"
    tokenizer.train_from_iterator([text] * 20, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": QWEN2_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def conversations(count: int, seed: int = 0) -> list[list[dict[str, Any]]]:
    """Seeded conversations: an optional system turn, then one to three user / assistant
    exchanges of random words."""
    rng = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    out = []
    for _ in range(count):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.4:
            messages.append({"role": "system", "content": words(2, 6)})
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": words(3, 12)})
            messages.append({"role": "assistant", "content": words(2, 16)})
        out.append(messages)
    return out


def write_chat_jsonl(path: Path, chats: list[list[dict[str, Any]]]) -> Path:
    """One {"messages": [...]} line per conversation."""
    path.write_text(
        "".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in chats),
        encoding="utf-8",
    )
    return path
