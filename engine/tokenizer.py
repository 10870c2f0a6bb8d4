"""Tokenizers behind one interface, loaded from a Hugging Face directory or a GGUF file.

The interface and the Hugging Face loaders are in `engine.tokenizer_base`; rebuilding a
tokenizer from GGUF metadata is in `engine.tokenizer_gguf`. This module is where callers import
them from, with engine/detokenizer.py's `IncrementalDetokenizer`.
"""

from __future__ import annotations

from pathlib import Path

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer_base import (
    HFTokenizer,
    SentencePieceTokenizer,
    SpecialTokens,
    Tokenizer,
    TokenizerError,
    tokenizer_from_directory,
)
from engine.tokenizer_gguf import tokenizer_from_gguf


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint directory or of a `.gguf` file."""
    path = Path(path)
    if path.suffix == ".gguf":
        return tokenizer_from_gguf(path)
    return tokenizer_from_directory(path)


__all__ = [
    "HFTokenizer",
    "IncrementalDetokenizer",
    "SentencePieceTokenizer",
    "SpecialTokens",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "tokenizer_from_gguf",
]
