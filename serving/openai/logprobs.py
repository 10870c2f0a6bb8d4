"""The engine's per-token `{token_id: logprob}` entries in OpenAI's two logprobs shapes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.tokenizer import Tokenizer


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    # The entry has the top k and the sampled token (k + 1 entries when it was not among them).
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    entries: Sequence[dict[int, float]],
    k: int,
    text_offset: int,
) -> dict[str, Any]:
    """Completions' shape: parallel lists of tokens, their logprobs, top-k maps, offsets."""
    tokens = [_text(tokenizer, t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e[t] for t, e in zip(token_ids, entries, strict=False)],
        "top_logprobs": [_top_texts(tokenizer, e, k) if k else None for e in entries],
        "text_offset": offsets,
    }


def _top_texts(tokenizer: Tokenizer, entry: dict[int, float], k: int) -> dict[str, float]:
    # Tokens that decode alike (bytes of one character) share a key: keep the likelier.
    texts: dict[str, float] = {}
    for token_id, logprob in _top(entry, k):
        texts.setdefault(_text(tokenizer, token_id), logprob)
    return texts


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[dict[int, float]], k: int
) -> dict[str, Any]:
    """Chat's shape: `{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`."""
    return {
        "content": [
            {
                **_token(tokenizer, t, e[t]),
                "top_logprobs": [_token(tokenizer, tid, lp) for tid, lp in _top(e, k)],
            }
            for t, e in zip(token_ids, entries, strict=False)
        ]
    }


def _token(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = _text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
