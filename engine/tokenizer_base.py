"""Tokenizers behind one interface: SentencePiece (`tokenizer.model`, or a GGUF `llama`
vocabulary rebuilt as a SentencePiece model) and HF `tokenizers` (`tokenizer.json`, or a GGUF
`gpt2` byte-level BPE); loading from a Hugging Face directory. Import them from
`engine.tokenizer` (which also exports engine/detokenizer.py's `IncrementalDetokenizer`).
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

import sentencepiece as spm
import tokenizers
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

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

    @abstractmethod
    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for, by id (`vocab_size` entries): what it adds to the
        output as raw UTF-8 (a leading space included; a byte-fallback piece is its one byte),
        and for an added token its text. Grammar engines (engine/structured) match on these."""

    def decodes_piecewise(self) -> bool:
        """Whether `decode(ids + [t])` is `decode(ids)` followed by a text that depends on `t`
        alone, whenever `decode(ids)` is not empty and ends on a whole character (byte-level
        BPE, SentencePiece): what lets engine/detokenizer.py skip decoding most tokens. False
        unless the subclass knows its decoder does that."""
        return False

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

    def save(self, directory: Path) -> None:
        """Writes files that `load_tokenizer(directory)` reads back as this tokenizer: its model
        file, and tokenizer_config.json / generation_config.json with the special tokens, whether
        they are added, and the chat template (as for a tokenizer rebuilt from GGUF metadata)."""
        config: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self._token_text(self.pad_token_id),
            "add_bos_token": bool(self._specials.prefix_ids),
            "add_eos_token": bool(self._specials.suffix_ids),
            "chat_template": self.chat_template,
            **self._save_model(directory),
        }
        config = {key: value for key, value in config.items() if value is not None}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        generation = {"eos_token_id": list(self.eos_token_ids)}
        (directory / "generation_config.json").write_text(json.dumps(generation))

    @abstractmethod
    def _save_model(self, directory: Path) -> dict[str, Any]:
        """Writes the model file into `directory`; returns tokenizer_config.json entries."""


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

    def decodes_piecewise(self) -> bool:
        return True  # pieces are joined, '▁' read as a space; only the text's start is trimmed

    def _save_model(self, directory: Path) -> dict[str, Any]:
        (directory / "tokenizer.model").write_bytes(self._sp.serialized_model_proto())
        added = {
            str(i): {"content": text, "special": special}
            for i, (text, special) in self._added.items()
            if i >= self._sp_size
        }
        return {"legacy": self._legacy, "added_tokens_decoder": added}

    def _decode_run(self, run: list[int], *, first: bool) -> str:
        # Only the very start of the text drops the dummy-prefix space, as transformers does.
        return (self._sp if first else self._sp_continuation).decode(run)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        added = self._added
        return [self._sp.id_to_piece(i) if i < self._sp_size else added[i][0] for i in ids]

    def token_bytes(self) -> list[bytes]:
        pieces = self.convert_ids_to_tokens(range(self.vocab_size))
        return [
            piece.encode() if i in self._added else _sentencepiece_bytes(piece)
            for i, piece in enumerate(pieces)
        ]


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

    def decodes_piecewise(self) -> bool:
        decoder = self._tokenizer.decoder
        return decoder is not None and _piecewise(json.loads(decoder.__getstate__()))

    def token_bytes(self) -> list[bytes]:
        added = self._tokenizer.get_added_tokens_decoder()
        decoder = json.loads(self._tokenizer.to_str()).get("decoder") or {}
        spell = _byte_level_bytes if _has_decoder(decoder, "ByteLevel") else _sentencepiece_bytes
        pieces = self.convert_ids_to_tokens(range(self.vocab_size))
        return [
            added[i].content.encode() if i in added else spell(piece)
            for i, piece in enumerate(pieces)
        ]

    def _save_model(self, directory: Path) -> dict[str, Any]:
        self._tokenizer.save(str(directory / "tokenizer.json"))
        return {}


def tokenizer_from_directory(path: Path) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint directory: `tokenizer.json` (preferred) or
    `tokenizer.model`; `tokenizer_config.json` gives BOS/EOS, whether BOS is added and the chat
    template; `generation_config.json`, EOS ids."""
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


_NAMES = ("bos", "eos", "pad")


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


# ---- token bytes -----------------------------------------------------------------------------

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _sentencepiece_bytes(piece: str) -> bytes:
    """A SentencePiece-style piece: `<0xAB>` is that byte (byte fallback), `▁` a space."""
    byte = _BYTE_PIECE.fullmatch(piece)
    if byte:
        return bytes([int(byte.group(1), 16)])
    return piece.replace("\u2581", " ").encode()


def _gpt2_byte_of_char() -> dict[str, int]:
    """GPT-2's byte alphabet, inverted: printable bytes stand for themselves, the rest for
    chars from U+0100 on."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTE_OF_CHAR = _gpt2_byte_of_char()


def _byte_level_bytes(piece: str) -> bytes:
    """A byte-level BPE piece (GPT-2's alphabet, one char per byte)."""
    return bytes(_BYTE_OF_CHAR[c] for c in piece if c in _BYTE_OF_CHAR)


def _piecewise(decoder: dict[str, Any]) -> bool:
    """Whether a tokenizer.json decoder maps each token to text on its own (bytes joined before
    UTF-8 decoding, a one-character replacement, the text's first characters stripped), so that
    a token's text never depends on the tokens before it once those end on a whole character."""
    kind = decoder.get("type")
    if kind == "Sequence":
        return all(_piecewise(d) for d in decoder.get("decoders") or [])
    if kind == "Replace":
        return len(decoder.get("pattern", {}).get("String") or "") == 1
    if kind == "Strip":
        return decoder.get("stop") == 0
    return kind in ("ByteLevel", "ByteFallback", "Fuse", "Metaspace")


def _has_decoder(decoder: dict[str, Any], kind: str) -> bool:
    """Whether a tokenizer.json decoder is `kind` or a Sequence holding one."""
    if decoder.get("type") == kind:
        return True
    return any(_has_decoder(d, kind) for d in decoder.get("decoders") or [])
