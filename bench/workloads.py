"""Benchmark prompts, generated offline from a fixed seed: `random`, `sharegpt` (synthetic
conversations shaped like ShareGPT's) and `shared-prefix` (SGLang's generated shared prefix).

Prompts are text, so that any OpenAI-compatible server can take them; each is built to a
target length in the benchmark's tokenizer and its real length is recorded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, in the benchmark's tokenizer
    output_len: int  # max_tokens


# A small vocabulary of plain words: synthetic conversations read like text, tokenize like
# text (several characters a token) and never hit a special token.
_WORD_LIST = (
    "the of and to in is that for it as with was on be by this are from at or an which have "
    "not but had one all were can their there more has when will would been what about if out "
    "so some into time only new other could these two may first then do any like my now over "
    "such our man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good "
    "very make world still own see work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came right "
    "used take three code model data server memory table system value number question answer"
)
_WORDS = tuple(_WORD_LIST.split())


def _lengths(rng: np.random.Generator, n: int, spec: tuple[int, int]) -> list[int]:
    low, high = spec
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def fit_tokens(tokenizer: TextTokenizer, ids: list[int], length: int) -> tuple[str, int]:
    """Text whose encoding is `length` tokens (or within a token or two: decoding and
    re-encoding random ids may merge some), made from `ids`; returns the text and its length."""
    text = tokenizer.decode(ids[:length])
    for _ in range(4):
        got = tokenizer.encode(text, add_special_tokens=False)
        if len(got) == length:
            break
        got = got[:length] if len(got) > length else got + ids[: length - len(got)]
        text = tokenizer.decode(got)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def random_requests(
    tokenizer: TextTokenizer,
    n: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """vLLM's `random`: prompts of random token ids (ids below 256 skipped in real vocabularies,
    where models keep their special tokens), lengths uniform in the given ranges."""
    # The lengths are part of the seed: workloads of other lengths never share a token stream,
    # so one run's prompts are no prefix-cache hits for another's on the same server.
    rng = np.random.default_rng([seed, *input_len, *output_len])
    low = 256 if vocab_size > 4096 else 32
    ins, outs = _lengths(rng, n, input_len), _lengths(rng, n, output_len)
    requests = []
    for size, out in zip(ins, outs, strict=True):
        ids = [int(i) for i in rng.integers(low, vocab_size, size=size + 8)]
        text, real = fit_tokens(tokenizer, ids, size)
        requests.append(BenchRequest(text, real, out))
    return requests


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


def _text(rng: random.Random, tokenizer: TextTokenizer, length: int) -> str:
    parts: list[str] = []
    while len(tokenizer.encode(" ".join(parts), add_special_tokens=False)) < length:
        parts.append(_sentence(rng, rng.randint(6, 18)))
    ids = tokenizer.encode(" ".join(parts), add_special_tokens=False)[:length]
    return tokenizer.decode(ids)


def sharegpt_requests(
    tokenizer: TextTokenizer, n: int, max_input: int, max_output: int, seed: int
) -> list[BenchRequest]:
    """Synthetic ShareGPT-shaped requests: a user turn and a reply length drawn from
    log-normal distributions near ShareGPT's (median prompt ~150 tokens, reply ~200, both
    long-tailed), clipped to the given maxima; the prompt is plain English-like words."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt_len = int(min(max(rng.lognormvariate(5.0, 1.0), 4), max_input))
        reply_len = int(min(max(rng.lognormvariate(5.3, 0.9), 4), max_output))
        prompt = f"User: {_text(rng, tokenizer, prompt_len)}\nAssistant:"
        real = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(BenchRequest(prompt, real, reply_len))
    return requests


def shared_prefix_requests(
    tokenizer: TextTokenizer,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[BenchRequest]:
    """SGLang's `generated-shared-prefix`: `num_groups` long system prompts, each followed by
    `prompts_per_group` distinct questions; requests are shuffled across groups."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_groups):
        system = _text(rng, tokenizer, system_prompt_len)
        for _ in range(prompts_per_group):
            prompt = f"{system}\n\nQuestion: {_text(rng, tokenizer, question_len)}\nAnswer:"
            real = len(tokenizer.encode(prompt, add_special_tokens=False))
            requests.append(BenchRequest(prompt, real, output_len))
    rng.shuffle(requests)
    return requests


def parse_range(text: str) -> tuple[int, int]:
    """'512' -> (512, 512); '128:512' -> (128, 512)."""
    low, _, high = text.partition(":")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"not a length or range LOW:HIGH of positive ints: {text!r}")
    return bounds
