"""Grammars compiled for one tokenizer: llguidance's tokenizer built from xlaserve's own token
bytes, and `GrammarCompiler`, which compiles a request's `StructuredOutputs` on worker threads
with a timeout and keeps the results in an LRU cache. Host code: never imports jax.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from engine.config import StructuredOutputConfig
from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutputs
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class _TokenSource:
    """What llguidance's `TokenizerWrapper` reads of a tokenizer: every id's bytes (padded
    with empty tokens to the model's vocabulary, which may be larger than the tokenizer's),
    EOS, BOS, the special ids (matched only as whole tokens, never as text) and an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        tokens = tokenizer.token_bytes()[:vocab_size]
        self.tokens = tokens + [b""] * (vocab_size - len(tokens))
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(i for i in tokenizer.all_special_ids if i < vocab_size)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper probes for bytes; this takes text
            raise TypeError("encodes text, not bytes")
        return self._tokenizer.encode(text, add_special_tokens=False)


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> LLTokenizer:
    """llguidance's tokenizer over `tokenizer`'s token bytes, `vocab_size` ids wide."""
    return LLTokenizer(TokenizerWrapper(_TokenSource(tokenizer, vocab_size)))


@dataclass(frozen=True)
class CompileStats:
    """Grammars compiled and found in the cache since start-up."""

    num_compiled: int = 0
    num_failed: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0  # summed over the compilations


class GrammarCompiler:
    """Compiles `StructuredOutputs` into llguidance matchers for one tokenizer.

    Compilation runs on `config.compile_threads` worker threads; `compile` hands out a future,
    so a server's request waits for its grammar while the engine loop keeps stepping. Each
    grammar is compiled once, whoever asks: the cache holds the futures of the last
    `config.cache_size` grammars (failures too: a bad schema stays bad). A grammar that is not
    ready within `config.compile_timeout_s` fails its request; its compilation goes on, and a
    later request may find it done. Any thread may call any method.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, config: StructuredOutputConfig):
        self.config = config
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(config.compile_threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._ll_tokenizer: Future[LLTokenizer] | None = None
        self._cache: OrderedDict[StructuredOutputs, Future[LLMatcher]] = OrderedDict()
        self._stats = CompileStats()
        self._stats_lock = threading.Lock()

    def prepare(self) -> None:
        """Builds llguidance's tokenizer now, on a worker thread, so that the first grammar
        need not wait for it (a server calls this at start; otherwise it is built on first
        use, and engines that never see a grammar never pay for it)."""
        self._pool.submit(self._tokenizer_now)

    @property
    def stats(self) -> CompileStats:
        return self._stats

    def compile(self, spec: StructuredOutputs) -> Future[None]:
        """Starts compiling `spec` unless it is cached. The future (a new one for each call:
        a caller may cancel it) is done when the grammar is, or fails with InvalidRequestError
        naming the problem, or the timeout."""
        source = self._entry(spec)
        result: Future[None] = Future()
        timer = threading.Timer(
            self.config.compile_timeout_s, _settle, (result, self._timeout_error(spec))
        )
        timer.daemon = True

        def done(f: Future[LLMatcher]) -> None:
            timer.cancel()
            _settle(result, f.exception())

        source.add_done_callback(done)
        if not result.done():
            timer.start()
        return result

    def matcher(self, spec: StructuredOutputs) -> LLMatcher:
        """A fresh matcher for `spec`, at the start of its grammar: a copy of the compiled one
        (waiting for it up to the timeout). Raises InvalidRequestError as `compile` fails."""
        try:
            template = self._entry(spec).result(self.config.compile_timeout_s)
        except FutureTimeout:
            raise self._timeout_error(spec) from None
        return template.deep_copy()

    def grammar_seconds(self, spec: StructuredOutputs) -> float:
        """Compiles `spec` now, on this thread, uncached; returns the seconds it took (for
        benchmarks: the first-compile time of a schema)."""
        start = time.perf_counter()
        self._compile(spec, self._tokenizer_now())
        return time.perf_counter() - start

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- workers -----------------------------------------------------------------------------

    def _entry(self, spec: StructuredOutputs) -> Future[LLMatcher]:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                self._count(cache_hits=1)
                return future
            future = self._pool.submit(self._timed_compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
            return future

    def _tokenizer_now(self) -> LLTokenizer:
        """llguidance's tokenizer, built on first use (a fraction of a second for a large
        vocabulary; engines that never see a grammar never pay it)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = Future()
                build = True
            else:
                build = False
            future = self._ll_tokenizer
        if build:
            try:
                future.set_result(ll_tokenizer(self._tokenizer, self.vocab_size))
            except BaseException as e:
                future.set_exception(e)
        return future.result()

    def _timed_compile(self, spec: StructuredOutputs) -> LLMatcher:
        start = time.perf_counter()
        try:
            matcher = self._compile(spec, self._tokenizer_now())
        except InvalidRequestError as e:
            self._count(num_failed=1)
            log.info("structured output refused (%s): %s", spec.kind, e)
            raise
        seconds = time.perf_counter() - start
        self._count(num_compiled=1, compile_seconds=seconds)
        log.debug("compiled a %s grammar in %.1f ms", spec.kind, seconds * 1e3)
        return matcher

    def _compile(self, spec: StructuredOutputs, tokenizer: LLTokenizer) -> LLMatcher:
        """The matcher at the start of `spec`'s grammar; InvalidRequestError if the grammar
        does not compile, or allows no output at all (a regex that matches nothing)."""
        grammar = spec.to_grammar()
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"{spec.kind}: invalid {_WHAT[spec.kind]}: {_first_line(matcher.get_error())}",
                param=spec.kind,
            )
        probe = matcher.deep_copy()
        mask = np.frombuffer(probe.compute_bitmask(), np.uint32)
        if probe.is_error() or not mask.any():
            reason = _first_line(probe.get_error()) or "no token can start it"
            raise InvalidRequestError(
                f"{spec.kind}: the {_WHAT[spec.kind]} matches no output ({reason})",
                param=spec.kind,
            )
        return matcher

    def _timeout_error(self, spec: StructuredOutputs) -> InvalidRequestError:
        return InvalidRequestError(
            f"{spec.kind}: the {_WHAT[spec.kind]} did not compile within "
            f"{self.config.compile_timeout_s:g} s",
            param=spec.kind,
        )

    def _count(self, **increments: float) -> None:
        with self._stats_lock:
            stats = self._stats.__dict__
            self._stats = CompileStats(**{k: v + increments.get(k, 0) for k, v in stats.items()})


_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else ""


def _settle(future: Future[None], error: BaseException | None) -> None:
    """Resolves `future` once (the compilation and the timeout race for it)."""
    try:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    except Exception:  # concurrent.futures.InvalidStateError: the other one won
        pass
