"""OpenAI's and vLLM's structured-output fields -> the engine's StructuredOutputs.

Accepted, at most one of them per request: `response_format` (`json_object`, `json_schema`
with `{"name", "schema", "strict"}`, `structural_tag`; `text` is no constraint), vLLM's
`structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`,
`structural_tag`) and its older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. A malformed one is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from engine.structured.spec import StructuredOutputs
from serving.openai.errors import APIError
from serving.openai.protocol import ResponseFormat, StructuredOutputsBody, _Sampling

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_outputs(body: _Sampling) -> StructuredOutputs | None:
    """The request's constraint, or None; a 400 if it gives more than one."""
    given: list[tuple[str, StructuredOutputs]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        given.append(("response_format", _response_format(fmt)))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", _vllm(body.structured_outputs)))
    for name in GUIDED:
        value = getattr(body, name)
        if value is not None:
            given.append((name, _guided(name, value)))
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"give one structured-output option, not several: {names}",
                       param=given[1][0])  # fmt: skip
    return given[0][1] if given else None


def _response_format(fmt: ResponseFormat) -> StructuredOutputs:
    extra = fmt.model_extra or {}
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.type == "json_schema":
        spec = extra.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(
                400,
                "response_format json_schema needs a json_schema object with a schema object",
                param="response_format.json_schema",
            )
        # OpenAI's default when no schema is given: any JSON object.
        schema = spec.get("schema") or {"type": "object"}
        return StructuredOutputs.from_schema(schema)
    if fmt.type == "structural_tag":
        return StructuredOutputs(structural_tag=json.dumps(extra))
    raise APIError(
        400,
        f"response_format type {fmt.type!r} is not supported; use text, json_object, "
        "json_schema or structural_tag",
        param="response_format.type",
    )


def _vllm(body: StructuredOutputsBody) -> StructuredOutputs:
    values = body.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
    if "json" in values:
        json_value = values.pop("json")
        if values:
            names = ", ".join(["json", *values])
            raise APIError(400, f"structured_outputs takes one of its fields, got {names}",
                           param="structured_outputs")  # fmt: skip
        return StructuredOutputs.from_schema(json_value)
    if "choice" in values:
        values["choice"] = tuple(values["choice"])
    if "structural_tag" in values and not isinstance(values["structural_tag"], str):
        values["structural_tag"] = json.dumps(values["structural_tag"])
    return StructuredOutputs(**values)


def _guided(name: str, value: Any) -> StructuredOutputs:
    if name == "guided_json":
        return StructuredOutputs.from_schema(value)
    if name == "guided_regex":
        return StructuredOutputs(regex=value)
    if name == "guided_choice":
        return StructuredOutputs(choice=tuple(value))
    return StructuredOutputs(grammar=value)
