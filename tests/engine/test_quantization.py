"""Weight-only quantization: the host quantizers, int4 packing, dequantization inside jit, GGUF
blocks taken as stored (checked against the `gguf` package's own dequantization), and whole
tiny models loaded quantized against the float load of the same file."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine import naive
from engine.config import QuantizationConfig
from engine.models import quant
from engine.models.quant import QuantizedWeight, dequantize, take_rows, weight_bytes
from engine.weights import gguf_file, load_params, resolve_model
from engine.weights.quantize import (
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_params,
    to_device,
)
from tests.engine.tiny_gguf import tiny_llama, write_llama_gguf

Q = GGMLQuantizationType


def test_int8_per_channel_error_within_half_a_step() -> None:
    w = np.random.default_rng(0).normal(size=(64, 3, 8)).astype(np.float32)
    q = quantize_int8(w, axis=0)
    assert q.values.dtype == np.int8 and q.scales.shape == (1, 3, 8)
    step = np.abs(w).max(axis=0) / 127  # one scale per output element
    back = np.asarray(dequantize(to_device(q, 0, "float32")))
    assert np.all(np.abs(back - w) <= step / 2 + 1e-7)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_groups_error_within_half_a_step(group: int) -> None:
    w = np.random.default_rng(1).normal(size=(4, 256, 6)).astype(np.float32)
    q = quantize_int4(w, axis=1, group_size=group)
    assert q.scales.shape == (4, 256 // group, 6) and q.values.max() <= 15
    grouped = w.reshape(4, 256 // group, group, 6)
    step = np.repeat((grouped.max(2) - grouped.min(2)) / 15, group, axis=1)
    placed = to_device(q, 1, "float32")
    assert placed.values.shape == (4, 128, 6) and placed.values.dtype == jnp.uint8
    back = np.asarray(jax.jit(dequantize)(placed))
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6)


def test_int4_packing_is_two_nibbles_per_byte_along_the_axis() -> None:
    values = np.array([[1, 2], [3, 4], [15, 0], [7, 9]], np.uint8)  # axis 0: 4 -> 2 bytes
    # Byte j holds element 2j (low nibble) and 2j + 1 (high): 1 + 3*16, 2 + 4*16, ...
    np.testing.assert_array_equal(pack_int4(values, 0), [[49, 66], [127, 144]])
    w = QuantizedWeight(jnp.asarray(pack_int4(values, 0)), jnp.ones((1, 2)), None, 4, 0, "float32")
    np.testing.assert_array_equal(dequantize(w), values.astype(np.float32))


def test_take_rows_dequantizes_only_the_rows() -> None:
    table = np.random.default_rng(2).normal(size=(10, 64)).astype(np.float32)
    w = to_device(quantize_int4(table, 1, 32), 1, "float32")
    ids = jnp.array([3, 0, 3, 9])
    np.testing.assert_array_equal(take_rows(w, ids), np.asarray(dequantize(w))[[3, 0, 3, 9]])


# ---- GGUF blocks -------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_blocks_equal_gguf_dequantization(qtype: GGMLQuantizationType) -> None:
    w = np.random.default_rng(3).normal(size=(6, 96)).astype(np.float32)
    data = gguf_quantize(w, qtype)
    q = gguf_file.decode_blocks(data, qtype, 96)
    assert q.bits == (8 if qtype == Q.Q8_0 else 4) and q.scales.shape == (6, 3)
    expected = gguf_dequantize(data, qtype)  # the oracle: gguf-py's float dequantization
    got = np.asarray(dequantize(to_device(q.convert(np.transpose), 0, "float32"))).T
    np.testing.assert_array_equal(got, expected)


def test_gguf_q4_k_blocks_equal_gguf_dequantization() -> None:
    # gguf-py cannot quantize Q4_K: random super-blocks with finite f16 d and dmin instead.
    rng = np.random.default_rng(4)
    blocks = rng.integers(0, 256, size=(5, 2, 144), dtype=np.uint8)
    blocks[..., 0:4] = rng.uniform(0.001, 0.1, size=(5, 2, 2)).astype(np.float16).view(np.uint8)
    data = blocks.reshape(5, 288)
    q = gguf_file.decode_blocks(data, Q.Q4_K, 512)
    expected = gguf_dequantize(data, Q.Q4_K)
    got = np.asarray(dequantize(to_device(q.convert(np.transpose), 0, "float32"))).T
    np.testing.assert_array_equal(got, expected)


@pytest.fixture(scope="module")
def tiny_model():
    # hidden 128, mlp 96, head dim 32: every contraction axis is a whole number of 32-blocks.
    return tiny_llama(vocab_size=256, hidden_size=128, num_hidden_layers=2)


@pytest.mark.parametrize(
    ("qtype", "method", "bits"),
    [(Q.Q8_0, "int8", 8), (Q.Q4_0, "int4", 4), (Q.Q4_1, "int4", 4)],
    ids=["q8_0", "q4_0", "q4_1"],
)
def test_gguf_loads_blocks_without_a_float_copy(
    tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype, method: str, bits: int
) -> None:
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_model, qtype)
    cfg, float_params = load_params(resolve_model(str(path)))  # oracle: gguf-py dequantized
    widened = []
    real = gguf_file.dequantize

    def spy(data: np.ndarray, tensor_type: GGMLQuantizationType) -> np.ndarray:
        widened.append(tensor_type)
        return real(data, tensor_type)

    monkeypatch.setattr(gguf_file, "dequantize", spy)
    _, params = load_params(resolve_model(str(path)), quantization=QuantizationConfig(method))
    assert set(widened) <= {Q.F32}, "quantized blocks went through a float copy"
    wq = params["layers"][0]["wq"]
    assert isinstance(wq, QuantizedWeight) and wq.bits == bits and wq.group_size == 32
    for got, want in zip(params["layers"], float_params["layers"], strict=True):
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            np.testing.assert_array_equal(dequantize(got[name]), want[name])
    ids = np.arange(1, 33, dtype=np.int32)[None]
    np.testing.assert_allclose(
        naive.sequence_logits(params, ids, cfg=cfg),
        naive.sequence_logits(float_params, ids, cfg=cfg),
        atol=1e-4,
    )


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_load_time_quantization_of_a_float_checkpoint(tiny_model, tmp_path: Path, method) -> None:
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_model)  # F32 tensors
    cfg, float_params = load_params(resolve_model(str(path)))
    config = QuantizationConfig(method)
    _, params = load_params(resolve_model(str(path)), quantization=config)
    expected = quantize_params(float_params, config, "float32")  # the same quantizer, in memory
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(got, want)
    kinds = {type(x).__name__ for x in params["layers"][0].values()}
    assert kinds == {"QuantizedWeight", "ArrayImpl"}  # norms stay float
    assert weight_bytes(params) < weight_bytes(float_params) / (3 if method == "int8" else 4)
    # The quantized forward is the float forward of the dequantized weights (quality on a real
    # model: test_quantization_smollm2.py; this random one amplifies any change).
    dequantized = jax.tree.map(
        lambda x: dequantize(x) if isinstance(x, QuantizedWeight) else x,
        params,
        is_leaf=lambda x: isinstance(x, QuantizedWeight),
    )
    ids = np.arange(1, 33, dtype=np.int32)[None]
    np.testing.assert_allclose(
        naive.sequence_logits(params, ids, cfg=cfg),
        naive.sequence_logits(dequantized, ids, cfg=cfg),
        rtol=1e-5,
        atol=1e-4,
    )


def test_int8_activations_mark_every_quantized_weight(tiny_model, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_model)
    is_weight = lambda x: isinstance(x, QuantizedWeight)
    _, plain = load_params(resolve_model(str(path)), quantization=QuantizationConfig("int4"))
    config = QuantizationConfig("int4", int8_activations=True)
    _, marked = load_params(resolve_model(str(path)), quantization=config)
    for name, w in marked["layers"][0].items():
        if is_weight(w):
            assert w.int8_activations == (name not in quant.FLOAT_ACTIVATIONS), name
    # The same integers; the scales and offsets of the weights the kernel takes with int8
    # activations (not k, v) are kept as float16, the rest as they were.
    for got, want in zip(jax.tree.leaves(marked), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(got, np.asarray(want).astype(got.dtype))
    layer = marked["layers"][0]
    halves = {name for name, w in layer.items() if is_weight(w) and w.scales.dtype == np.float16}
    assert halves == {"wq", "wo", "w_gate", "w_up", "w_down"}
