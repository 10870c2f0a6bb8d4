"""Request bodies of the OpenAI-compatible API, as pydantic models.

Field names, types and defaults follow OpenAI's API and vLLM's extensions. Schema errors become
400s naming the field (see errors.py); value checks (temperature >= 0, top_p in (0, 1], ...)
are SamplingParams' own, so the HTTP API and the engine agree on them. Booleans are strict, as
OpenAI's are: `"stream": "yes"` or `1` is refused, not read as true.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP = 16  # stop strings (each is searched for after every token)

Token = Annotated[int, Field(ge=0, lt=2**31)]


class _Body(BaseModel):
    # Unknown fields are ignored (as OpenAI and vLLM do); NaN and infinity are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        # JSON can spell lone surrogates ("\ud800"), which no tokenizer can encode.
        if _has_surrogate(value):
            raise ValueError("text must be valid Unicode (no lone surrogates)")
        return value


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    return False


class StreamOptions(_Body):
    include_usage: StrictBool = False


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # `json` is BaseModel's
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: dict[str, Any] | str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: `type` and, for json_schema, `json_schema`."""

    model_config = ConfigDict(extra="allow")
    type: str


class _Sampling(_Body):
    """Parameters shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None
    stream: StrictBool | None = False  # null: not streamed
    stream_options: StreamOptions | None = None
    best_of: int | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[Token] | None = None
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: StrictBool = True
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    # structured output (serving/openai/structured.py): OpenAI's, and vLLM's two spellings
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Token] | list[list[Token]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: StrictBool = False
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """Any other content part (images, audio): parsed so that the 400 can name it."""

    model_config = ConfigDict(extra="allow")
    type: str


class FunctionCallBody(_Body):
    name: str
    arguments: str  # JSON text of an object


class ToolCallBody(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    # Only an assistant's message may go without content (OpenAI's rule).
    content: str | list[TextPart | OtherPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message answers this call

    @field_validator("content", mode="after")
    @classmethod
    def _content_given(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is None and role in ("system", "user", "tool"):
            raise ValueError(f"a {role} message must have content")
        return value


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    parallel_tool_calls: StrictBool = True
    add_generation_prompt: StrictBool = True


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Token]


class LoadLoRAAdapterRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's POST /v1/unload_lora_adapter body (`lora_int_id` accepted, not used)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
