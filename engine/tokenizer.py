"""Tokenizers behind one interface, loaded from a Hugging Face directory or a GGUF file.

Two backends: SentencePiece (`tokenizer.model`, or a GGUF `llama` vocabulary rebuilt as a
SentencePiece model) and HF `tokenizers` (`tokenizer.json`, or a GGUF `gpt2` byte-level BPE).
`IncrementalDetokenizer` turns a stream of ids into text deltas for streaming.
"""

from __future__ import annotations

import dataclasses
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import sentencepiece as spm
import tokenizers
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from engine.errors import ModelLoadError

# `sentencepiece_model_pb2` is generated protobuf code without type stubs.
ModelProto: Any = sp_pb2.ModelProto  # type: ignore[attr-defined]


class TokenizerError(ModelLoadError, ValueError):
    """A tokenizer that is missing, unreadable, or of a kind xlaserve does not support."""


@dataclass(frozen=True)
class SpecialTokens:
    """The ids a tokenizer treats specially, and the ids `encode` puts around a text."""

    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    prefix_ids: tuple[int, ...] = ()  # e.g. (bos,) when the model config adds BOS
    suffix_ids: tuple[int, ...] = ()


class Tokenizer(ABC):
    """Text <-> token ids for one model, with its special tokens and chat template.

    Attributes: `vocab_size` (ids, added tokens included), `bos_token_id`, `eos_token_ids` (every
    id that ends generation: the tokenizer's EOS first, then generation_config's), `pad_token_id`,
    `all_special_ids` (what `decode(..., skip_special_tokens=True)` drops), `chat_template`.
    """

    def __init__(
        self,
        specials: SpecialTokens,
        chat_template: str | None,
        *,
        vocab_size: int,
        all_special_ids: frozenset[int],
    ) -> None:
        self._specials = specials
        self.bos_token_id = specials.bos_token_id
        self.eos_token_ids = specials.eos_token_ids
        self.pad_token_id = specials.pad_token_id
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self.all_special_ids = all_special_ids

    @abstractmethod
    def _encode_text(self, text: str) -> list[int]:
        """Ids of `text` alone; special tokens written in it are matched whole."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 at the end comes out as U+FFFD."""

    @abstractmethod
    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary entries (pieces) of `ids`, as the vocabulary spells them."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS/EOS as the model config asks if `add_special_tokens`."""
        ids = self._encode_text(text)
        if not add_special_tokens:
            return ids
        return [*self._specials.prefix_ids, *ids, *self._specials.suffix_ids]

    @property
    def bos_token(self) -> str | None:
        return self._token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None)

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.convert_ids_to_tokens([token_id])[0]


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; control, user-defined and added tokens are matched in text.

    Text between special tokens is encoded by SentencePiece piece by piece. Whether a piece after
    a special token gets the dummy-prefix space is `legacy`: True is llama.cpp's behaviour (and
    Llama 2's `tokenizer.json`), False is transformers' current default (`prepend_scheme="first"`).
    """

    def __init__(
        self,
        proto: Any,
        specials: SpecialTokens,
        chat_template: str | None,
        *,
        legacy: bool,
        added_tokens: Mapping[int, tuple[str, bool]] | None = None,  # id -> (text, special)
        source: str,
    ) -> None:
        self._sp = _processor(proto, source)
        self._sp_size = self._sp.get_piece_size()
        continuation = ModelProto.FromString(proto.SerializeToString())
        continuation.normalizer_spec.add_dummy_prefix = False
        self._sp_continuation = _processor(continuation, source)
        self._legacy = legacy
        # SentencePiece cannot match control/unknown pieces in text nor decode them as text.
        kinds = ModelProto.SentencePiece
        matched = {kinds.CONTROL, kinds.UNKNOWN, kinds.USER_DEFINED}
        self._added = {i: (p.piece, p.type != kinds.USER_DEFINED) for i, p in
                       enumerate(proto.pieces) if p.type in matched}  # fmt: skip
        self._added.update(added_tokens or {})
        self._ids_by_text = {text: i for i, (text, _) in self._added.items()}
        self._split = _alternation(self._ids_by_text)
        super().__init__(
            specials,
            chat_template,
            vocab_size=max([len(proto.pieces) - 1, *self._added]) + 1,
            all_special_ids=frozenset(i for i, (_, special) in self._added.items() if special),
        )

    def _encode_text(self, text: str) -> list[int]:
        parts = self._split.split(text) if self._split else [text]
        ids: list[int] = []
        # re.split with one group alternates text, special, text, ...; parts[0] starts the text.
        for index, part in enumerate(parts):
            if index % 2:
                ids.append(self._ids_by_text[part])
            elif part:
                sp = self._sp if index == 0 or self._legacy else self._sp_continuation
                ids.extend(sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        pieces: list[str] = []
        run: list[int] = []  # ids SentencePiece decodes itself, user-defined pieces included
        for token_id in ids:
            special = token_id in self.all_special_ids
            if special and skip_special_tokens:
                continue
            if special or token_id >= self._sp_size:
                text = self._added.get(token_id, ("", False))[0]  # ids past the vocab: nothing
                pieces += [self._decode_run(run, first=not pieces), text]
                run = []
            else:
                run.append(token_id)
        pieces.append(self._decode_run(run, first=not pieces))
        return "".join(pieces)

    def _decode_run(self, run: list[int], *, first: bool) -> str:
        # Only the very start of the text drops the dummy-prefix space, as transformers does.
        return (self._sp if first else self._sp_continuation).decode(run)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        added = self._added
        return [self._sp.id_to_piece(i) if i < self._sp_size else added[i][0] for i in ids]


class HFTokenizer(Tokenizer):
    """An HF `tokenizers` tokenizer; its added tokens are matched in text by the library."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, specials: SpecialTokens, chat_template: str | None
    ) -> None:
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        super().__init__(
            specials,
            chat_template,
            vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
            all_special_ids=frozenset(i for i, token in added.items() if token.special),
        )

    def _encode_text(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self._tokenizer.id_to_token(i) or "" for i in ids]


class IncrementalDetokenizer:
    """Text deltas for ids fed one at a time, for streaming.

    The deltas joined equal `tokenizer.decode(ids)` once `flush()` is called, and before that
    every prefix of it that ends on a whole character: a delta never ends in U+FFFD from a
    character whose bytes are still arriving. Each step decodes only a short window of recent
    ids: `_prefix` (already emitted, kept so spacing at the window start is right) and `_read`
    (first id whose text is not yet emitted), as vLLM does.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""  # decode of ids[_prefix:_read]

    def add(self, token_id: int) -> str:
        """Feed one id; returns the text it completes (possibly "")."""
        self._ids.append(token_id)
        text = self._window_text()
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""  # nothing new, or a character still incomplete: hold it back
        return self._advance(text)

    def flush(self) -> str:
        """Everything held back (an incomplete character comes out as U+FFFD)."""
        text = self._window_text()
        return self._advance(text) if len(text) > len(self._prefix_text) else ""

    def _window_text(self) -> str:
        return self._tokenizer.decode(self._ids[self._prefix :], self._skip)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        return delta


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint directory or of a `.gguf` file.

    A directory needs `tokenizer.json` (preferred) or `tokenizer.model`; `tokenizer_config.json`
    gives BOS/EOS, whether BOS is added and the chat template; `generation_config.json`, EOS ids.
    """
    path = Path(path)
    if path.suffix == ".gguf":
        return tokenizer_from_gguf(path)
    if not path.is_dir():
        raise TokenizerError(f"{path}: no such checkpoint directory or .gguf file")
    config = _read_json(path / "tokenizer_config.json")
    generation = _read_json(path / "generation_config.json")
    if (path / "tokenizer.json").is_file():
        return _from_tokenizer_json(path / "tokenizer.json", config, generation)
    if (path / "tokenizer.model").is_file():
        return _from_sentencepiece_file(path / "tokenizer.model", config, generation)
    raise TokenizerError(f"{path}: has neither tokenizer.json nor tokenizer.model")


def _from_tokenizer_json(file: Path, config: dict, generation: dict) -> HFTokenizer:
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception for any parse error
        raise TokenizerError(f"{file}: not a readable tokenizer.json ({_one_line(e)})") from e
    specials = _hf_specials(config, generation, tokenizer.token_to_id, add_bos_default=False)
    # transformers rebuilds the post-processor only when the config sets these flags.
    flags = "add_bos_token" in config or "add_eos_token" in config
    if not flags and tokenizer.post_processor is not None:
        prefix, suffix = _post_processor_ids(tokenizer)
        specials = dataclasses.replace(specials, prefix_ids=prefix, suffix_ids=suffix)
    return HFTokenizer(tokenizer, specials, _chat_template(config, file.parent))


def _from_sentencepiece_file(file: Path, config: dict, generation: dict) -> SentencePieceTokenizer:
    try:
        proto = ModelProto.FromString(file.read_bytes())
    except Exception as e:  # protobuf's DecodeError, or the file cannot be read
        raise TokenizerError(f"{file}: not a readable SentencePiece model ({_one_line(e)})") from e
    added = {
        int(i): (str(token["content"]), bool(token.get("special", False)))
        for i, token in config.get("added_tokens_decoder", {}).items()
    }
    ids = {p.piece: i for i, p in enumerate(proto.pieces)} | {t: i for i, (t, _) in added.items()}
    trainer = proto.trainer_spec
    defaults = {"bos": _piece(proto, trainer.bos_id), "eos": _piece(proto, trainer.eos_id)}
    # Without the flag BOS is added, as by sentencepiece-era LlamaTokenizer and llama.cpp
    # (transformers 5 adds none); `legacy` defaults to transformers' current False.
    specials = _hf_specials(config, generation, ids.get, add_bos_default=True, defaults=defaults)
    template, legacy = _chat_template(config, file.parent), bool(config.get("legacy", False))
    return SentencePieceTokenizer(
        proto, specials, template, legacy=legacy, added_tokens=added, source=str(file)
    )


def _hf_specials(
    config: dict[str, Any],
    generation: dict[str, Any],
    token_id: Callable[[str], int | None],
    *,
    add_bos_default: bool,
    defaults: Mapping[str, str | None] | None = None,
) -> SpecialTokens:
    """BOS/EOS/PAD from tokenizer_config.json (EOS also from generation_config.json)."""
    names = [_config_token(config, f"{n}_token") or (defaults or {}).get(n) for n in _NAMES]
    bos_id, eos_id, pad_id = (None if name is None else token_id(name) for name in names)
    extra = generation.get("eos_token_id")
    extra_ids = extra if isinstance(extra, list) else [] if extra is None else [extra]
    eos_ids = tuple(dict.fromkeys(i for i in [eos_id, *extra_ids] if i is not None))
    prefix = _ids_if(config.get("add_bos_token", add_bos_default), bos_id)
    suffix = _ids_if(config.get("add_eos_token", False), eos_id)
    return SpecialTokens(bos_id, eos_ids, pad_id, prefix, suffix)


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

_NAMES = ("bos", "eos", "pad")
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


def _alternation(texts: Iterable[str]) -> re.Pattern[str] | None:
    """One regex group matching any of `texts`, longest first so `<|a|>b` beats `<|a|>`."""
    ordered = sorted(texts, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None


def _processor(proto: Any, source: str) -> spm.SentencePieceProcessor:
    try:
        return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    except RuntimeError as e:
        raise TokenizerError(f"{source}: not a usable SentencePiece model ({_one_line(e)})") from e


def _post_processor_ids(tokenizer: tokenizers.Tokenizer) -> tuple[tuple[int, ...], ...]:
    """The ids the tokenizer.json post-processor puts before and after a text."""
    bare = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a").ids
    starts = [i for i in range(len(full)) if full[i : i + len(bare)] == bare]
    if not starts:  # a post-processor that rewrites the text's ids: leave it to the text
        return (), ()
    return tuple(full[: starts[0]]), tuple(full[starts[0] + len(bare) :])


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{file}: not readable JSON ({_one_line(e)})") from e
    if not isinstance(value, dict):
        raise TokenizerError(f"{file}: expected a JSON object")
    return value


def _config_token(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # a serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(config: dict[str, Any], directory: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")  # newer HF
    return template if isinstance(template, str) else None


def _ids_if(flag: object, token_id: int | None) -> tuple[int, ...]:
    return (token_id,) if flag and token_id is not None else ()


def _piece(proto: Any, index: int) -> str | None:
    return proto.pieces[index].piece if 0 <= index < len(proto.pieces) else None


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
