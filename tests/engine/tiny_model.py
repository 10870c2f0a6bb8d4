"""A tiny random Llama written as a complete HF checkpoint directory (weights, config and a
byte-level tokenizer), for engine tests that need a whole model but no real one."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from tests.engine.tiny_gguf import tiny_llama

SPECIALS = ["<s>", "</s>", "<pad>", "<|user|>"]
VOCAB_SIZE = 256 + len(SPECIALS)
EOS_ID = 257


def write_byte_tokenizer(directory: Path) -> None:
    """256 byte tokens (GPT-2's byte-to-unicode alphabet) and a few specials after them."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {char: i for i, char in enumerate(alphabet)}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "chat_template": "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def _byte_of(char: str) -> int:
    # GPT-2's map: printable bytes keep their code point, the others are shifted past 255.
    table = _bytes_to_unicode()
    return {v: k for k, v in table.items()}[char]


def _bytes_to_unicode() -> dict[int, str]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_tiny_checkpoint(directory: Path, **overrides: object) -> Path:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 kv heads) with a byte tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,
        bos_token_id=256,
        eos_token_id=EOS_ID,
        **overrides,
    )
    model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory
