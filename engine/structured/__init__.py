"""Structured output: a request's output constrained to a JSON schema, regex, choice or
grammar by llguidance. `spec` says what a request asks for, `compiler` compiles it (worker
threads, LRU cache, timeout), `matchers` tracks each sequence's grammar state and writes the
token bitmask that the sampling tail applies on the device (engine/sampling.py)."""
