"""Tokenizers rebuilt from a GGUF file's `tokenizer.*` metadata, as llama.cpp reads them.

A `llama` vocabulary becomes a SentencePiece model (BPE over piece scores, byte fallback); a
`gpt2` vocabulary becomes an HF `tokenizers` byte-level BPE, split before merging as llama.cpp
does for the file's `tokenizer.ggml.pre`. Special ids come from the `tokenizer.ggml.*_token_id`
keys. `engine.tokenizer.load_tokenizer` dispatches `.gguf` paths here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from engine.chat_template import GEMMA_CHAT_TEMPLATE
from engine.tokenizer_base import (
    HFTokenizer,
    ModelProto,
    SentencePieceTokenizer,
    SpecialTokens,
    Tokenizer,
    TokenizerError,
    _ids_if,
    _one_line,
)


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The tokenizer described by a GGUF file's metadata (memory-mapped; tensors are not read)."""
    path = Path(path)
    meta = _gguf_tokenizer_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens")
    if kind == "llama":
        return _sentencepiece_from_gguf(meta, str(path))
    if kind == "gpt2":
        return _bpe_from_gguf(meta, str(path))
    raise TokenizerError(f"{path}: GGUF tokenizer model {kind!r} is not supported (llama, gpt2)")


def _gguf_tokenizer_metadata(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise TokenizerError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # a truncated or foreign file fails anywhere inside the parser
        raise TokenizerError(f"{path}: not a readable GGUF file ({_one_line(e)})") from e
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _sentencepiece_from_gguf(meta: dict[str, Any], source: str) -> SentencePieceTokenizer:
    # llama.cpp's SPM tokenizer: BPE over piece scores, no normalization, byte fallback.
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    kinds = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    proto = ModelProto()
    proto.trainer_spec.model_type = proto.trainer_spec.BPE
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.byte_fallback = _BYTE in kinds
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for token, score, kind in zip(tokens, scores, kinds, strict=True):
        proto.pieces.add(piece=token, score=score, type=kind)
    specials = _gguf_specials(meta, add_bos_default=True)
    template = meta.get("tokenizer.chat_template")
    if _GEMMA_TURN_END in tokens:  # Gemma: a turn ends generation; its GGUFs may lack a template
        end_of_turn = tokens.index(_GEMMA_TURN_END)
        eos_ids = tuple(dict.fromkeys([*specials.eos_token_ids, end_of_turn]))
        specials = dataclasses.replace(specials, eos_token_ids=eos_ids)
        template = template or GEMMA_CHAT_TEMPLATE
    # llama.cpp adds the dummy-prefix space after every special token: legacy.
    return SentencePieceTokenizer(proto, specials, template, legacy=True, source=source)


def _bpe_from_gguf(meta: dict[str, Any], source: str) -> HFTokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    kinds = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    vocab = {_byte_level_spelling(token): i for i, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges", [])]
    # Llama 3's tokenizer takes a whole word that is in the vocabulary before trying merges.
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3_PRES)
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(pre, source)
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens are special (dropped by decode); user-defined ones, like `<think>`, are
    # text matched whole. One spelled outside the byte alphabet is a mislabel: skip it.
    typed = [(t, k) for t, k in zip(tokens, kinds, strict=True) if set(t) <= _BYTE_ALPHABET]
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False) for t, k in typed if k == _CONTROL]
    )
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t, k in typed if k == _USER_DEFINED])
    specials = _gguf_specials(meta, add_bos_default=False)
    return HFTokenizer(tokenizer, specials, meta.get("tokenizer.chat_template"))


def _byte_level_pre_tokenizer(pre: str, source: str) -> pre_tokenizers.PreTokenizer:
    """How text is split before BPE, for a GGUF `tokenizer.ggml.pre` (as llama.cpp does)."""
    if pre in _GPT2_PRES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRES:  # StarCoder family: each digit alone, then GPT-2's regex
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    regex = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT if pre in _QWEN2_PRES else None
    if regex is None:
        raise TokenizerError(f"{source}: GGUF pre-tokenizer {pre!r} is not supported")
    split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([split, byte_level])


def _gguf_specials(meta: dict[str, Any], *, add_bos_default: bool) -> SpecialTokens:
    bos_id, eos_id, eot_id, eom_id, pad_id = (
        meta.get(f"tokenizer.ggml.{name}_token_id")
        for name in ("bos", "eos", "eot", "eom", "padding")
    )
    # llama.cpp ends generation on EOT and EOM as well as EOS.
    eos_ids = tuple(dict.fromkeys(i for i in (eos_id, eot_id, eom_id) if i is not None))
    prefix = _ids_if(meta.get("tokenizer.ggml.add_bos_token", add_bos_default), bos_id)
    suffix = _ids_if(meta.get("tokenizer.ggml.add_eos_token", False), eos_id)
    return SpecialTokens(bos_id, eos_ids, pad_id, prefix, suffix)


# GGUF token types (the same numbers as SentencePiece's piece types).
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6

_GEMMA_TURN_END = "<end_of_turn>"

_GPT2_PRES = frozenset({"gpt2", "mpt", "olmo", "jais"})
_DIGIT_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})
_LLAMA3_PRES = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "dbrx"})
_QWEN2_PRES = frozenset({"qwen2", "deepseek-r1-qwen", "megrez"})
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bytes_to_chars() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest for chars from 256."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


_BYTE_TO_CHAR = _bytes_to_chars()
_BYTE_ALPHABET = frozenset(_BYTE_TO_CHAR.values())


def _byte_level_spelling(token: str) -> str:
    # Some GGUFs store added tokens as raw UTF-8; the BPE vocabulary needs the byte spelling.
    if set(token) <= _BYTE_ALPHABET:
        return token
    return "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))
