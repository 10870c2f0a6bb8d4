"""Incremental detokenization: a stream of token ids as text deltas, for streaming.

Most tokens of most outputs are whole pieces of text (a word, a space and a word) that follow
text ending on a whole character. For a tokenizer that decodes piece by piece
(`Tokenizer.decodes_piecewise`: byte-level BPE, SentencePiece) such a token's delta is its own
text, the same whatever came before: `PieceTexts` decodes it once per token id and remembers
it, and `IncrementalDetokenizer` hands it out without decoding anything (vLLM's fast
incremental detokenizer has the same aim). Every other token (a byte of a character still
incomplete, a special token skipped, the first text of a sequence) goes through the decoding
window, which gives exactly what the fast path gives where both apply.

Host code: plain Python, never imports jax.
"""

from __future__ import annotations

from engine.tokenizer_base import Tokenizer


class PieceTexts(dict[int, tuple[str, str] | None]):
    """For each token id, the text it adds after text that ends on a whole character, and its
    text decoded alone; None for a token that adds nothing or not a whole character (a byte of
    one, a special token skipped). Index it: an id not seen yet is computed on first use and
    remembered (`__missing__`), so a seen one costs a dict lookup. Valid only for a tokenizer
    that `decodes_piecewise`."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool) -> None:
        super().__init__()
        if not tokenizer.decodes_piecewise():
            raise ValueError(f"{type(tokenizer).__name__} does not decode piece by piece")
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Text to put the token after: it shows what a token adds after other text (a leading
        # space that a text's first token loses, for instance).
        self._probe = tokenizer.encode("a", add_special_tokens=False)
        self._probe_text = tokenizer.decode(self._probe, skip_special_tokens)

    def __missing__(self, token_id: int) -> tuple[str, str] | None:
        piece = self[token_id] = self._compute(token_id)
        return piece

    def _compute(self, token_id: int) -> tuple[str, str] | None:
        decode, skip = self._tokenizer.decode, self._skip
        after = decode([*self._probe, token_id], skip)
        if not self._probe_text or not after.startswith(self._probe_text):
            return None
        text, alone = after[len(self._probe_text) :], decode([token_id], skip)
        if not text or "\ufffd" in text or "\ufffd" in alone:
            return None
        return text, alone


class IncrementalDetokenizer:
    """Text deltas for ids fed one at a time, for streaming.

    The deltas joined equal `tokenizer.decode(ids)` once `flush()` is called, and before that
    every prefix of it that ends on a whole character: a delta never ends in U+FFFD from a
    character whose bytes are still arriving. Each step decodes only a short window of recent
    ids: `_prefix` (already emitted, kept so spacing at the window start is right) and `_read`
    (first id whose text is not yet emitted), as vLLM does. `pieces` (for the same tokenizer and
    `skip_special_tokens`): a token that completes nothing pending, after text that ends on a
    whole character, takes its remembered text instead of a decode, and leaves the same state
    as the window would.
    """

    # Touched for every running sequence every step: slots, not an instance dict.
    __slots__ = (
        "_ids",
        "_pieces",
        "_piecewise",
        "_prefix",
        "_prefix_text",
        "_read",
        "_skip",
        "_tokenizer",
        "_whole",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        pieces: PieceTexts | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._piecewise = pieces is not None
        self._pieces: dict[int, tuple[str, str] | None] = {} if pieces is None else pieces
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""  # decode of ids[_prefix:_read]
        # Whether the next id may take its piece's text: `pieces` are given, no id is pending
        # (_read == len(_ids)), and the emitted text is not empty and ends on a whole character.
        self._whole = False

    def add(self, token_id: int) -> str:
        """Feed one id; returns the text it completes (possibly "")."""
        ids = self._ids
        ids.append(token_id)
        if self._whole and (piece := self._pieces[token_id]) is not None:
            # what the window would give: decode(prefix + [id]) - prefix
            self._prefix, self._read, self._prefix_text = self._read, len(ids), piece[1]
            return piece[0]
        text = self._window_text()
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            self._whole = False  # the id is pending
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
        self._whole = (
            self._piecewise and bool(self._prefix_text) and not self._prefix_text.endswith("\ufffd")
        )
        return delta


class Detokenizers:
    """Makes a tokenizer's incremental detokenizers, sharing one `PieceTexts` per
    `skip_special_tokens` among them (none for a tokenizer that does not decode piecewise)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        piecewise = tokenizer.decodes_piecewise()
        self._pieces = {
            skip: PieceTexts(tokenizer, skip_special_tokens=skip) if piecewise else None
            for skip in (False, True)
        }

    def new(self, *, skip_special_tokens: bool) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=skip_special_tokens,
            pieces=self._pieces[skip_special_tokens],
        )
