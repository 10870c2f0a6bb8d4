"""What a request's output must match (`StructuredOutputs`, vLLM's names), and its llguidance
grammar. Host code: never imports jax.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher, StructTag, grammar_from

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from engine.errors import InvalidRequestError

# JSON is generated compactly: no whitespace between tokens, so a small model cannot pad its
# answer with newlines until max_tokens.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint on a request's output (vLLM's `StructuredOutputsParams`):
    `json` a JSON schema (serialized), `json_object` any JSON object, `regex` a regular
    expression the whole output matches, `choice` one of these strings, `grammar` a Lark (or
    GBNF) grammar, `structural_tag` vLLM's structural tag (serialized JSON: free text in which
    each `begin` ... `end` segment follows its schema). Hashable: the grammar cache's key."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {given or 'none'}",
                param="structured_outputs",
            )
        if self.choice is not None and not self.choice:
            raise InvalidRequestError("choice must list at least one string", param="choice")

    @classmethod
    def from_schema(cls, schema: dict[str, Any] | str) -> StructuredOutputs:
        """A JSON-schema constraint (a dict, or its text), serialized canonically so that equal
        schemas share one cache entry."""
        if isinstance(schema, str):
            schema = _json_value(schema, "json")
        return cls(json=json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @property
    def kind(self) -> str:
        """The constraint's field name (for messages and metrics)."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def to_grammar(self) -> str:
        """The llguidance grammar (its JSON form). Raises InvalidRequestError for text that is
        not even of the right form (a schema that is not a JSON object); whether the grammar is
        valid is the compiler's to say."""
        try:
            return self._grammar()
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise InvalidRequestError(f"{self.kind}: {e}", param=self.kind) from None

    def _grammar(self) -> str:
        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(
                _json_value(self.json, "json"), overrides=JSON_OPTIONS
            )
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            )
        if self.grammar is not None:
            return _lark(self.grammar)
        assert self.structural_tag is not None
        return structural_tag_grammar(_json_value(self.structural_tag, "structural_tag"))


def _lark(text: str) -> str:
    try:
        return grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise InvalidRequestError(f"grammar: {e}", param="grammar") from None


def _json_value(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{param} is not valid JSON: {e}", param=param) from None


def structural_tag_grammar(tag: dict[str, Any]) -> str:
    """vLLM's structural tag, `{"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`: free text, in which a segment that starts with a trigger is
    one of the structures whose `begin` starts with it, its body following `schema`."""
    try:
        structures, triggers = tag["structures"], tag["triggers"]
        tags = [
            StructTag(
                trigger=next(t for t in triggers if s["begin"].startswith(t)),
                begin=s["begin"],
                grammar=s.get("schema") or {},
                end=s["end"],
            )
            for s in structures
        ]
    except (KeyError, TypeError, StopIteration, AssertionError) as e:
        raise InvalidRequestError(
            f"structural_tag must have structures (begin, schema, end), each begin starting "
            f"with one of its triggers: {e!r}",
            param="structural_tag",
        ) from None
    if not tags:
        raise InvalidRequestError("structural_tag has no structures", param="structural_tag")
    return StructTag.to_grammar(tags, assume_special=False)
