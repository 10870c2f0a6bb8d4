"""Render a model's chat template (jinja2, sandboxed) as transformers' `apply_chat_template` does.

The template comes from `tokenizer_config.json` (`chat_template`) or a GGUF's
`tokenizer.chat_template`. It is untrusted code from a model repository, so it runs in jinja2's
immutable sandbox, with the same helpers transformers gives it: `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML, `namespace`, loop controls and the
`{% generation %}` tag.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from engine.errors import XlaserveError

if TYPE_CHECKING:
    from engine.tokenizer_base import Tokenizer


# Gemma's template (as in Gemma 3's tokenizer_config.json, text parts only), for Gemma GGUFs
# that ship none: a system message is prefixed to the first user turn; `assistant` is `model`.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


class ChatTemplateError(XlaserveError, ValueError):
    """A model without a chat template, or a template that fails on the given messages."""


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """The prompt text for `messages` (dicts with `role` and `content`) under `template`.

    `extra` are further template variables, e.g. `tools`, `documents` or `enable_thinking`.
    Raises ChatTemplateError if there is no template, it does not parse, or it fails.
    """
    if not template:
        raise ChatTemplateError("the model has no chat template; send a plain prompt instead")
    compiled = _compile(template)
    tokens = {"bos_token": bos_token, "eos_token": eos_token}
    variables = {
        "messages": [dict(message) for message in messages],
        "add_generation_prompt": add_generation_prompt,
        **{name: value for name, value in tokens.items() if value is not None},
        **extra,
    }
    try:
        return compiled.render(variables)
    except jinja2.TemplateError as e:  # raise_exception(), sandbox refusals, undefined names
        raise ChatTemplateError(f"chat template failed: {_one_line(e)}") from e
    except (TypeError, ValueError, KeyError, IndexError) as e:  # e.g. content None + str
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from e


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """`render_chat` with the template and BOS/EOS text of `tokenizer`'s model."""
    return render_chat(
        tokenizer.chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        **extra,
    )


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"chat template does not parse: line {e.lineno}: {_one_line(e)}"
        ) from e


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks/lstrip_blocks: templates are written for transformers' settings.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        namespace=_namespace,
        dict=_dict,
    )
    return env


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it for
    training masks; for serving the body renders as is."""

    tags = {"generation"}  # noqa: RUF012  (jinja2 declares it a plain set attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace()`, refusing underscore names that could reach Python internals."""

    def __setitem__(self, name: str, value: Any) -> None:
        _refuse_private(name)
        super().__setitem__(name, value)


def _namespace(*args: Any, **kwargs: Any) -> _Namespace:
    attrs = dict(*args, **kwargs)
    for name in attrs:
        _refuse_private(name)
    return _Namespace(attrs)


def _refuse_private(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template may not set the private name {name!r}")


def _dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    # A plain function, not the `dict` type, so the template cannot reach the type object.
    return dict(*args, **kwargs)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
