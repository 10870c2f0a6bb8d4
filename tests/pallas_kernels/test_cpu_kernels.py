"""The C++ CPU kernels (`pallas_kernels.cpu`) against independent oracles: the dense float64
attention oracle (batches with NaN in every unused page, slot and padding row, float32 and
bfloat16 caches), NumPy float64 products with the dequantized weights, and NumPy's scatter for
the cache write."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_cases import RaggedCase, dense_attention_oracle, make_case, random_lengths

from engine.models import layers, quant
from engine.models.quant import QuantizedWeight, dequantize
from engine.weights.quantize import quantize_int8, to_device
from pallas_kernels import cpu
from pallas_kernels.kv_cache_update import write_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.cpu import kernel_supports

# Skipped only without a compiler: a build that fails where one exists fails the tests (they
# would otherwise all skip, as `available()` is False after a failed build).
HAS_COMPILER = shutil.which(os.environ.get("CXX", "g++")) is not None
pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler to build the kernels")


def test_library_builds() -> None:
    cpu.build()  # raises with the compiler's message
    assert cpu.available()


@pytest.fixture(autouse=True, scope="module")
def registered() -> None:
    # The kernels' FFI targets, for any subset of these tests (-k), not only after the above.
    cpu.available()


# (kind, (Hq, Hkv), D, page_size, window, cap): GQA ratios 1, 3, 8; head dims 64-256.
CASES = [
    ("decode", (9, 3), 64, 16, None, None),
    ("decode", (8, 1), 128, 32, None, None),
    ("mixed", (4, 4), 256, 16, None, None),
    ("mixed", (9, 3), 64, 16, 24, None),
    ("decode", (6, 2), 64, 64, 40, 30.0),
    ("chunked", (16, 2), 128, 16, None, 5.0),
]


def assert_kernel_matches_oracle(
    case: RaggedCase, scale: float, window: int | None, cap: float | None = None
) -> None:
    """The kernel's real rows against the float64 dense oracle: float32 sums in another order,
    and exp a polynomial (~2e-7 relative). The kernel is called directly with q as float32 (a
    bfloat16 case's q holds bfloat16 values), so that the result is not rounded to bfloat16 on
    the way out as the `ragged_paged_attention` contract's would be."""
    q = case.q.astype(np.float32)
    arrays = (q, case.kv_pages, case.kv_lens, case.page_table, case.cu_q_lens, case.num_seqs)
    attend = jax.jit(
        lambda *a: cpu.ragged_attention(
            *a, sm_scale=scale, sliding_window=window, logit_soft_cap=cap
        )
    )
    got = case.real_rows(np.asarray(attend(*map(jnp.asarray, arrays))))
    want = case.real_rows(dense_attention_oracle(case, scale, window, cap))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("kind", "heads", "head_dim", "page_size", "window", "cap"), CASES)
def test_attention_matches_dense_oracle(
    dtype: jnp.dtype,
    kind: str,
    heads: tuple[int, int],
    head_dim: int,
    page_size: int,
    window: int | None,
    cap: float | None,
) -> None:
    rng = np.random.default_rng(zlib.crc32(repr((kind, heads, head_dim, window)).encode()))
    q_lens, kv_lens = random_lengths(rng, kind, num_seqs=7, max_context=300)
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        pad_tokens=5,
        pad_seqs=2,
        pages_per_seq=-(-max(kv_lens) // page_size) + 2,
    )
    assert kernel_supports(jnp.asarray(case.q), jnp.asarray(case.kv_pages), None)
    assert_kernel_matches_oracle(case, head_dim**-0.5, window, cap)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("kv_len", "window"), [(1, None), (37, None), (300, None), (300, 40)])
def test_a_lone_sequence_splits_its_keys_over_the_threads(
    kv_len: int, window: int | None, dtype: jnp.dtype
) -> None:
    # Fewer sequences than twice the threads: each one's keys are cut into ranges whose softmax
    # sums are merged afterwards (the path a single-stream decode takes).
    rng = np.random.default_rng(kv_len)
    case = make_case(
        rng, q_lens=[1], kv_lens=[kv_len], num_q_heads=9, num_kv_heads=3, head_dim=64,
        page_size=16, dtype=dtype, pad_tokens=3, pad_seqs=1, pages_per_seq=20,
    )  # fmt: skip
    assert_kernel_matches_oracle(case, 0.125, window)


@pytest.mark.parametrize("window", [None, 8])
def test_a_short_prefill_chunk_splits_each_row_over_the_threads(window: int | None) -> None:
    # Three rows in all (fewer than twice the threads on a 2-core machine): each prefill row's
    # keys are cut into ranges and merged, the path a short chunk of a long prompt takes.
    rng = np.random.default_rng(11)
    case = make_case(
        rng, q_lens=[3], kv_lens=[70], num_q_heads=8, num_kv_heads=2, head_dim=128,
        page_size=16, dtype=jnp.float32, pad_tokens=2, pad_seqs=1, pages_per_seq=6,
    )  # fmt: skip
    assert_kernel_matches_oracle(case, 0.09, window)


def test_prefill_and_decode_rows_and_padding_rows_zero() -> None:
    # Sequence 0 decodes (1 row), sequence 1 prefills 3 rows; the padding row after them is
    # zero, where the cache holds NaN.
    rng = np.random.default_rng(7)
    case = make_case(
        rng, q_lens=[1, 3], kv_lens=[20, 3], num_q_heads=2, num_kv_heads=1, head_dim=64,
        page_size=8, dtype=jnp.float32, pad_tokens=1, pad_seqs=1, pages_per_seq=4,
    )  # fmt: skip
    arrays = (case.q, case.kv_pages, case.kv_lens, case.page_table, case.cu_q_lens, case.num_seqs)
    out = np.asarray(
        jax.jit(
            lambda *a: cpu.ragged_attention(
                *a, sm_scale=0.25, sliding_window=None, logit_soft_cap=None
            )
        )(*map(jnp.asarray, arrays))
    )
    want = dense_attention_oracle(case, 0.25, None, None)
    np.testing.assert_allclose(out[:4], want[:4], atol=1e-5)
    assert not out[4:].any()


def test_unsupported_cache_falls_back_to_the_reference() -> None:
    rng = np.random.default_rng(3)
    case = make_case(
        rng,
        q_lens=[1, 4],
        kv_lens=[30, 9],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=8,
        page_size=8,
        dtype=jnp.float32,
        pad_tokens=2,
        pad_seqs=0,
        pages_per_seq=5,
    )  # fmt: skip  (head_dim 8: the kernel is built for 64, 128 and 256 only)
    assert not kernel_supports(jnp.asarray(case.q), jnp.asarray(case.kv_pages), None)
    arrays = (case.q, case.kv_pages, case.kv_lens, case.page_table, case.cu_q_lens, case.num_seqs)
    got = np.asarray(ragged_paged_attention(*map(jnp.asarray, arrays), sm_scale=0.3, impl="cpu"))
    want = dense_attention_oracle(case, 0.3, None, None)
    np.testing.assert_allclose(case.real_rows(got), case.real_rows(want), atol=2e-5)


def test_a_missing_compiler_is_named(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "CACHE", tmp_path)  # nothing built there yet
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler 'no-such-c\\+\\+' on PATH"):
        cpu.build()


def random_weight(
    rng: np.random.Generator, shape: tuple[int, int], bits: int, group: int, axis: int
) -> QuantizedWeight:
    """A quantized weight of random values, group scales and (int4) offsets."""
    values_shape = list(shape)
    values_shape[axis] //= 8 // bits
    scales_shape = list(shape)
    scales_shape[axis] //= group
    if bits == 8:
        values = rng.integers(-127, 128, values_shape).astype(np.int8)
    else:
        values = rng.integers(0, 256, values_shape).astype(np.uint8)
    scales = rng.uniform(0.001, 0.02, scales_shape).astype(np.float32)
    offsets = rng.uniform(-0.1, 0.1, scales_shape).astype(np.float32) if bits == 4 else None
    return QuantizedWeight(
        jnp.asarray(values), jnp.asarray(scales), None if offsets is None else jnp.asarray(offsets),
        bits, axis, "float32",
    )  # fmt: skip


# (bits, [In, Out] or [Out, In] shape, group, transposed): per-channel int8 (one group over In),
# GGUF-style groups of 32, int4 with offsets, an output width that is not a whole 128-tile.
PRODUCTS = [
    (8, (576, 1536), 576, False),
    (8, (1536, 576), 32, False),
    (4, (576, 192), 32, False),
    (4, (256, 640), 64, False),
    (8, (1000, 576), 576, True),
    (8, (303, 256), 32, True),  # a last block of 3 table rows
    (4, (1000, 576), 32, True),
]


@pytest.mark.parametrize(("bits", "shape", "group", "transposed"), PRODUCTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 13])
def test_quantized_matmul_matches_numpy(
    bits: int, shape: tuple[int, int], group: int, transposed: bool, rows: int
) -> None:
    rng = np.random.default_rng(zlib.crc32(repr((bits, shape, group, transposed, rows)).encode()))
    w = random_weight(rng, shape, bits, group, axis=1 if transposed else 0)
    dense = np.asarray(dequantize(w), np.float64)
    x = rng.standard_normal((rows, shape[1] if transposed else shape[0])).astype(np.float32)
    want = x @ (dense.T if transposed else dense)
    got = jax.jit(
        lambda x: cpu.quantized_matmul(
            x, w.values, w.scales, w.offsets, bits=bits, transposed=transposed
        )
    )(x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def round_activations(x: np.ndarray) -> np.ndarray:
    """Each row of x rounded to int8 in blocks of 32, as llama.cpp's Q8_0 (scale max|x| / 127,
    round half to even), returned dequantized in float64."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
    return (np.rint(blocks * inverse) * scale.astype(np.float64)).reshape(x.shape)


# ([In, Out] shape, group, offsets): GGUF-style groups of 32, int4 with wider groups, a down
# projection (K a multiple of the 256-wide stripes plus a rest), symmetric int4 (no offsets).
INT8_ACTIVATION_PRODUCTS = [
    ((576, 192), 32, True),
    ((256, 640), 64, True),
    ((1536, 576), 32, True),
    ((512, 1536), 128, False),
]


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize(("shape", "group", "offsets"), INT8_ACTIVATION_PRODUCTS)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 13, 64])
def test_int8_activation_product_matches_numpy(
    shape: tuple[int, int], group: int, offsets: bool, rows: int, scale_dtype: jnp.dtype
) -> None:
    # x rounded to int8 meets the int4 integers times their scales; the offsets meet the exact x.
    # Scales and offsets in float32 or float16 (what weights marked for int8 activations keep).
    rng = np.random.default_rng(zlib.crc32(repr((shape, group, offsets, rows)).encode()))
    w = random_weight(rng, shape, 4, group, axis=0)
    w = QuantizedWeight(
        w.values,
        w.scales.astype(scale_dtype),
        w.offsets.astype(scale_dtype) if offsets else None,
        4,
        0,
        "float32",
    )
    scaled = np.asarray(dequantize(QuantizedWeight(w.values, w.scales, None, 4, 0, "float32")))
    x = rng.standard_normal((rows, shape[0])).astype(np.float32)
    x[0, :32] = 0.0  # a block of zeros (scale 0)
    want = round_activations(x) @ scaled.astype(np.float64)
    if offsets:
        want += x.astype(np.float64) @ np.repeat(np.asarray(w.offsets, np.float64), group, axis=0)
    product = jax.jit(
        lambda x: cpu.quantized_matmul(
            x, w.values, w.scales, w.offsets, bits=4, transposed=False, int8_activations=True
        )
    )
    got = np.asarray(product(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # Each row alone gives its row of the batch bit for bit (the few-row and many-row paths).
    for i in {0, rows - 1}:
        np.testing.assert_array_equal(np.asarray(product(x[i : i + 1])), got[i : i + 1])


def int4_weight(rng: np.random.Generator, shape, group: int, scale_dtype, offsets: bool):
    w = random_weight(rng, shape, 4, group, axis=0)
    offsets = w.offsets.astype(scale_dtype) if offsets else None
    return QuantizedWeight(w.values, w.scales.astype(scale_dtype), offsets, 4, 0, "float32")


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize(
    ("widths", "group", "offsets"), [((1536, 1536), 32, True), ((64, 640, 128), 64, False)]
)
@pytest.mark.parametrize("rows", [1, 4, 5, 64])
def test_several_weights_in_one_call_match_numpy_and_one_call_each(
    widths: tuple[int, ...], group: int, offsets: bool, rows: int, scale_dtype: jnp.dtype
) -> None:
    # gate and up of an MLP in one call: each product as numpy's rounded-activation oracle
    # gives it, and bit for bit as the kernel gives it alone (the few-row and many-row paths).
    rng = np.random.default_rng(zlib.crc32(repr((widths, group, rows)).encode()))
    k = 576
    ws = [int4_weight(rng, (k, n), group, scale_dtype, offsets) for n in widths]
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[-1, 32:64] = 0.0  # a block of zeros (scale 0)
    got = jax.jit(
        lambda x: cpu.quantized_matmuls(x, [(w.values, w.scales, w.offsets) for w in ws])
    )(x)
    assert [g.shape for g in got] == [(rows, n) for n in widths]
    for w, y in zip(ws, got, strict=True):
        scaled = np.asarray(dequantize(dataclasses.replace(w, offsets=None)), np.float64)
        want = round_activations(x) @ scaled
        if offsets:
            want += x.astype(np.float64) @ np.repeat(
                np.asarray(w.offsets, np.float64), group, axis=0
            )
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        alone = cpu.quantized_matmul(
            x, w.values, w.scales, w.offsets, bits=4, transposed=False, int8_activations=True
        )
        np.testing.assert_array_equal(np.asarray(y), np.asarray(alone))


@pytest.mark.parametrize("flags", [(True, False, False), (False, True), (False, False, False)])
@pytest.mark.parametrize("rows", [1, 4, 5, 64])
def test_one_call_mixes_8_bit_and_float_activations(flags: tuple[bool, ...], rows: int) -> None:
    # q (8-bit activations, float16 scales) with k and v (float activations, float32 scales) in
    # one call: each product as numpy gives it (x rounded or not) and bit for bit as the kernel
    # gives it alone, in the few-row and many-row paths.
    rng = np.random.default_rng(zlib.crc32(repr((flags, rows)).encode()))
    widths = (576, 192, 192)[: len(flags)]
    ws = [
        int4_weight(rng, (576, n), 32, jnp.float16 if flag else jnp.float32, offsets=True)
        for n, flag in zip(widths, flags, strict=True)
    ]
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    parts = [(w.values, w.scales, w.offsets) for w in ws]
    got = jax.jit(lambda x: cpu.quantized_matmuls(x, parts, int8_activations=flags))(x)
    for w, flag, y in zip(ws, flags, got, strict=True):
        table = np.asarray(dequantize(w), np.float64)
        if flag:  # the rounded rows meet q * scale, the exact ones the offsets
            offsets = np.repeat(np.asarray(w.offsets, np.float64), 32, axis=0)
            want = round_activations(x) @ (table - offsets) + x.astype(np.float64) @ offsets
        else:
            want = x.astype(np.float64) @ table
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        alone = cpu.quantized_matmul(
            x, w.values, w.scales, w.offsets, bits=4, transposed=False, int8_activations=flag
        )
        np.testing.assert_array_equal(np.asarray(y), np.asarray(alone))


def test_several_weights_in_one_call_refuse_what_they_do_not_share() -> None:
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 576)), jnp.float32)
    a = int4_weight(rng, (576, 128), 32, jnp.float16, offsets=True)
    b = int4_weight(rng, (576, 128), 64, jnp.float16, offsets=True)
    with pytest.raises(ValueError, match="offsets for every weight or for none"):
        cpu.quantized_matmuls(x, [(a.values, a.scales, a.offsets), (a.values, a.scales, None)])
    with pytest.raises(ValueError, match="one int8_activations flag per weight"):
        cpu.quantized_matmuls(x, [(a.values, a.scales, a.offsets)] * 2, int8_activations=[True])
    with pytest.raises(ValueError, match="at most 62 weights in one call"):
        cpu.quantized_matmuls(x, [(a.values, a.scales, a.offsets)] * (cpu.MAX_WEIGHTS + 1))
    with pytest.raises(jax.errors.JaxRuntimeError, match="float32 without 8-bit activations"):
        jax.block_until_ready(  # float activations read float32 scales only
            cpu.quantized_matmuls(
                x, [(a.values, a.scales, a.offsets)] * 2, int8_activations=[True, False]
            )
        )
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape("need int4 [K, N] weights")):
        jax.block_until_ready(
            cpu.quantized_matmuls(
                x, [(a.values, a.scales, a.offsets), (b.values, b.scales, b.offsets)]
            )
        )


def poisoned_stack(ws: list[QuantizedWeight], layer: int) -> QuantizedWeight:
    """The weights stacked [L, ...] as `layers.layer_params` sees them, with NaN scales in
    every layer but `layer`: a kernel that read outside that layer's slice would show it."""
    nan = lambda w: dataclasses.replace(w, scales=jnp.full_like(w.scales, jnp.nan))
    layers = [w if i == layer else nan(w) for i, w in enumerate(ws)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


@pytest.mark.parametrize(
    ("bits", "shape", "group", "transposed", "int8_activations"),
    [
        (8, (1536, 576), 32, False, False),
        (4, (576, 192), 32, False, False),
        (4, (576, 192), 32, False, True),
        (8, (1000, 576), 576, True, False),
        (8, (1000, 576), 32, True, True),
        (4, (1000, 576), 32, True, False),
    ],
)
def test_a_layer_of_a_stack_is_read_in_place(
    bits: int, shape: tuple[int, int], group: int, transposed: bool, int8_activations: bool
) -> None:
    # A product with layer i of stacks [L, ...] equals, bit for bit, the product with that
    # layer's own arrays, and reads nothing of the other layers.
    rng = np.random.default_rng(zlib.crc32(repr((bits, shape, group, transposed)).encode()))
    ws = [random_weight(rng, shape, bits, group, axis=1 if transposed else 0) for _ in range(3)]
    x = rng.standard_normal((3, shape[1] if transposed else shape[0])).astype(np.float32)
    kw = dict(bits=bits, transposed=transposed, int8_activations=int8_activations)
    for i, w in enumerate(ws):
        own = cpu.quantized_matmul(x, w.values, w.scales, w.offsets, **kw)
        stack = poisoned_stack(ws, i)
        product = functools.partial(cpu.quantized_matmul, **kw, layer=i)
        got = jax.jit(lambda x, s, product=product: product(x, s.values, s.scales, s.offsets))(
            x, stack
        )
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(own))


def test_several_weights_of_a_stack_are_read_in_place() -> None:
    rng = np.random.default_rng(11)
    gates = [int4_weight(rng, (576, 1536), 32, jnp.float16, offsets=True) for _ in range(3)]
    ups = [int4_weight(rng, (576, 1536), 32, jnp.float16, offsets=True) for _ in range(3)]
    x = rng.standard_normal((2, 576)).astype(np.float32)
    parts = lambda *ws: [(w.values, w.scales, w.offsets) for w in ws]
    for i in range(3):
        own = cpu.quantized_matmuls(x, parts(gates[i], ups[i]))
        stacks = parts(poisoned_stack(gates, i), poisoned_stack(ups, i))
        got = cpu.quantized_matmuls(x, stacks, layer=i)
        for y, want in zip(got, own, strict=True):
            assert np.isfinite(np.asarray(y)).all()
            np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_a_stack_without_its_layer_is_refused() -> None:
    rng = np.random.default_rng(12)
    w = poisoned_stack([int4_weight(rng, (576, 128), 32, jnp.float32, True)] * 2, 0)
    x = jnp.ones((1, 576), jnp.float32)
    for layer in (None, 2):  # a stack read as one weight; a layer it does not have
        with pytest.raises(jax.errors.JaxRuntimeError, match="2-D weights, or 3-D ones and a"):
            jax.block_until_ready(
                cpu.quantized_matmul(
                    x, w.values, w.scales, w.offsets, bits=4, transposed=False, layer=layer
                )
            )


def test_q_k_and_v_take_one_call_as_the_model_makes_them() -> None:
    # layers.project_all_to_heads on weights as loaded ([D, N, H], grouped along D) of three
    # widths: one kernel call in the compiled step, the same values bit for bit as one
    # `project_to_heads` each, whether q is marked for int8 activations (k and v never are:
    # quant.FLOAT_ACTIVATIONS) or not. A float weight among them: one product each.
    rng = np.random.default_rng(22)
    shapes = ((576, 9, 64), (576, 3, 64), (576, 3, 64))
    ws = {
        name: random_weight(rng, (576, n * h), 4, 32, axis=0)
        for name, (_, n, h) in zip(("wq", "wk", "wv"), shapes, strict=True)
    }
    ws = {  # as the loader gives them: [D, N, H]
        name: jax.tree.map(lambda a, s=s: a.reshape(a.shape[0], s[1], -1), w)
        for (name, w), s in zip(ws.items(), shapes, strict=True)
    }
    x = jnp.asarray(rng.standard_normal((3, 576)), jnp.float32)
    marked = quant.with_int8_activations(ws)
    assert marked["wq"].int8_activations and not marked["wk"].int8_activations
    mixed = {**ws, "wv": quant.dequantize(ws["wv"])}
    for p, fused in ((marked, True), (ws, True), (mixed, False)):
        qkv = jax.jit(lambda x, p: layers.project_all_to_heads(x, (p["wq"], p["wk"], p["wv"])))
        hlo = qkv.lower(x, p).compile().as_text()
        assert hlo.count("xlaserve_quantized_matmuls") == (1 if fused else 0)
        assert hlo.count('xlaserve_quantized_matmul"') == (0 if fused else 2)
        each = [jax.jit(layers.project_to_heads)(x, p[name]) for name in ("wq", "wk", "wv")]
        got = qkv(x, p)
        assert [g.shape for g in got] == [(3, n, h) for _, n, h in shapes]
        for y, want in zip(got, each, strict=True):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_gate_and_up_take_one_call_as_the_model_makes_it() -> None:
    # layers.gated_mlp's gate and up, marked for int8 activations or not: one kernel call in
    # the compiled step, the same values as one `dense` each.
    rng = np.random.default_rng(21)
    gate, up, down = (
        random_weight(rng, s, 4, 32, axis=0) for s in ((576, 1536), (576, 1536), (1536, 576))
    )
    marked = quant.with_int8_activations({"w_gate": gate, "w_up": up, "w_down": down})
    x = jnp.asarray(rng.standard_normal((3, 576)), jnp.float32)
    for p in (marked, {"w_gate": gate, "w_up": up, "w_down": down}):
        both = jax.jit(lambda x, p: layers.dense_all(x, (p["w_gate"], p["w_up"])))
        hlo = both.lower(x, p).compile().as_text()
        assert hlo.count("xlaserve_quantized_matmuls") == 1
        assert hlo.count('xlaserve_quantized_matmul"') == 0
        each = [jax.jit(layers.dense)(x, p[name]) for name in ("w_gate", "w_up")]
        for y, want in zip(both(x, p), each, strict=True):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
        mlp = jax.jit(lambda x, p: layers.gated_mlp(x, p, jax.nn.silu))(x, p)
        want = jax.jit(layers.dense)(jax.nn.silu(each[0]) * each[1], p["w_down"])
        np.testing.assert_allclose(np.asarray(mlp), np.asarray(want), rtol=1e-5, atol=1e-6)


# ([Out, In] table shape, group): the output layer's Q8_0 groups of 32 with a last tile of 8
# table rows (tiles of 16), groups of 64, a last tile of 15 rows, and the widest In (4096).
INT8_ACTIVATION_TABLES = [((1000, 576), 32), ((256, 640), 64), ((303, 128), 32), ((40, 4096), 32)]


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize(("shape", "group"), INT8_ACTIVATION_TABLES)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 13, 64])
def test_int8_activation_table_matches_numpy(
    shape: tuple[int, int], group: int, rows: int, scale_dtype: jnp.dtype
) -> None:
    # An int8 table as the output layer: x rounded to int8 meets its integers times their
    # scales, as llama.cpp's Q8_0 x Q8_0 dot products do. The integers span all of int8
    # (the kernel flips them to unsigned bytes for VNNI and takes the difference off).
    rng = np.random.default_rng(zlib.crc32(repr((shape, group, rows, "table")).encode()))
    w = random_weight(rng, shape, 8, group, axis=1)
    values = np.asarray(w.values).copy()
    values[0, :64] = -128
    values[-1, :64] = 127
    w = QuantizedWeight(jnp.asarray(values), w.scales.astype(scale_dtype), None, 8, 1, "float32")
    dense = np.asarray(dequantize(w), np.float64)
    x = rng.standard_normal((rows, shape[1])).astype(np.float32)
    x[0, :32] = 0.0  # a block of zeros (scale 0)
    want = round_activations(x) @ dense.T
    product = jax.jit(
        lambda x: cpu.quantized_matmul(
            x, w.values, w.scales, None, bits=8, transposed=True, int8_activations=True
        )
    )
    got = np.asarray(product(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # Each row alone gives its row of the batch bit for bit.
    for i in {0, rows - 1}:
        np.testing.assert_array_equal(np.asarray(product(x[i : i + 1])), got[i : i + 1])


def test_weights_marked_for_int8_activations_take_them() -> None:
    # quant.product as the model calls it: a marked int4 [In, Out] weight and a marked int8
    # table get the kernel's rounded activations (not the float product); an int4 table keeps
    # float activations.
    rng = np.random.default_rng(12)
    w = random_weight(rng, (576, 192), 4, 32, axis=0)
    marked = quant.with_int8_activations({"w": w})["w"]
    assert marked.int8_activations and marked.values is w.values
    # Their scales and offsets are kept as float16 (llama.cpp's Q4_1 does the same).
    np.testing.assert_array_equal(marked.scales, np.asarray(w.scales).astype(np.float16))
    np.testing.assert_array_equal(marked.offsets, np.asarray(w.offsets).astype(np.float16))
    x = rng.standard_normal((3, 576)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x: quant.product(x, marked, transposed=False))(x))
    rounded = cpu.quantized_matmul(
        x,
        w.values,
        marked.scales,
        marked.offsets,
        bits=4,
        transposed=False,
        int8_activations=True,
    )
    np.testing.assert_array_equal(got, np.asarray(rounded))
    plain = np.asarray(jax.jit(lambda x: quant.product(x, w, transposed=False))(x))
    assert np.abs(got - plain).max() > 1e-4 * np.abs(plain).max()
    table = quant.with_int8_activations({"t": random_weight(rng, (256, 576), 4, 32, axis=1)})["t"]
    dense = np.asarray(dequantize(table), np.float64)
    got = jax.jit(lambda x: quant.product(x, table, transposed=True))(x)
    np.testing.assert_allclose(np.asarray(got), x @ dense.T, rtol=1e-4, atol=1e-3)
    int8_table = random_weight(rng, (256, 576), 8, 32, axis=1)
    marked_table = quant.with_int8_activations({"embed": int8_table})["embed"]
    np.testing.assert_array_equal(
        marked_table.scales, np.asarray(int8_table.scales).astype(np.float16)
    )
    got = np.asarray(jax.jit(lambda x: quant.product(x, marked_table, transposed=True))(x))
    rounded = cpu.quantized_matmul(
        x,
        marked_table.values,
        marked_table.scales,
        None,
        bits=8,
        transposed=True,
        int8_activations=True,
    )
    np.testing.assert_array_equal(got, np.asarray(rounded))
    dense = np.asarray(dequantize(int8_table), np.float64)
    assert np.abs(got - x @ dense.T).max() > 1e-4 * np.abs(got).max()
    # A token lookup reads the marked table's rows as the float16 scales give them.
    ids = jnp.asarray([0, 255, 7])
    np.testing.assert_allclose(
        np.asarray(quant.take_rows(marked_table, ids)), dense[np.asarray(ids)], rtol=1e-3, atol=1e-6
    )
    # float16 scales on a weight not marked: only the 8-bit path reads them, so the product
    # dequantizes (the float product of the same weight), where the kernel would refuse them.
    unmarked = dataclasses.replace(marked, int8_activations=False)
    dense = np.asarray(dequantize(unmarked), np.float64)
    got = jax.jit(lambda x: quant.product(x, unmarked, transposed=False))(x)
    np.testing.assert_allclose(np.asarray(got), x @ dense, rtol=1e-4, atol=1e-4)


def test_model_weights_take_the_kernel_on_cpu() -> None:
    # wq-shaped [D, N, H] int8 per channel and an int4 embedding table, through quant.product as
    # the model calls it: the kernel path (few rows) and the dequantized path (many) agree.
    rng = np.random.default_rng(11)
    float_wq = rng.standard_normal((576, 9, 64)).astype(np.float32) * 0.05
    wq = to_device(quantize_int8(float_wq, axis=0), axis=0, dtype="float32")
    matrix = quant.as_matrix(wq)
    assert matrix.values.shape == (576, 576) and quant._kernel_takes(matrix, transposed=False)
    table = random_weight(rng, (512, 576), 4, 32, axis=1)
    for w, transposed in ((matrix, False), (table, True)):
        dense = np.asarray(dequantize(w), np.float64)
        product = jax.jit(functools.partial(quant.product, w=w, transposed=transposed))
        for rows in (1, 5, quant.KERNEL_MAX_ROWS + 1):
            x = rng.standard_normal((rows, 576)).astype(np.float32)
            got = product(x)
            want = x @ (dense.T if transposed else dense)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-3)


def test_lowering_for_other_platforms_drops_the_kernel() -> None:
    # The product exports for TPU and CUDA (the dequantized branch): the CPU kernel is only
    # lowered where it runs.
    rng = np.random.default_rng(5)
    w = random_weight(rng, (256, 128), 8, 256, axis=0)
    fn = jax.jit(lambda x: quant.product(x, w, transposed=False))
    x = jax.ShapeDtypeStruct((2, 256), jnp.float32)
    for platform in ("tpu", "cuda"):
        text = jax.export.export(fn, platforms=[platform])(x).mlir_module()
        assert "xlaserve_quantized_matmul" not in text
    # (An FFI target has no serialization guarantee: exporting it for CPU must be allowed.)
    allow = [jax.export.DisabledSafetyCheck.custom_call("xlaserve_quantized_matmul")]
    cpu_text = jax.export.export(fn, platforms=["cpu"], disabled_checks=allow)(x).mlir_module()
    assert "xlaserve_quantized_matmul" in cpu_text


# ([In, Out] or [Out, In] shape, transposed): SmolLM2's MLP and k/v projections, its output
# table (a slice), a width that is no whole 64-column tile (80 = 64 + 16), odd table rows.
DENSE_PRODUCTS = [
    ((576, 1536), False),
    ((1536, 576), False),
    ((576, 192), False),
    ((64, 80), False),
    ((1003, 576), True),
    ((37, 48), True),
]


@pytest.mark.parametrize(("shape", "transposed"), DENSE_PRODUCTS)
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16])
def test_dense_matmul_matches_numpy_and_rows_do_not_interact(
    shape: tuple[int, int], transposed: bool, rows: int
) -> None:
    # Against a float64 product; and each row's result, bit for bit, as computed alone (what
    # makes a verification step's logits at a position equal a plain step's there).
    rng = np.random.default_rng(zlib.crc32(repr((shape, transposed, rows)).encode()))
    w = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal((rows, shape[1] if transposed else shape[0])).astype(np.float32)
    product = jax.jit(functools.partial(cpu.dense_matmul, transposed=transposed))
    got = np.asarray(product(x, w))
    want = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for r in {0, rows // 2, rows - 1}:
        np.testing.assert_array_equal(np.asarray(product(x[r : r + 1], w))[0], got[r])


def test_model_products_of_few_rows_take_the_dense_kernel() -> None:
    # layers.dense and layers.unembed hand 2..DENSE_MAX_ROWS float32 rows to the kernel (and
    # agree with XLA's product), one row and more rows to XLA; other platforms never see it.
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((100, 64)), jnp.float32)
    for fn, weight in ((layers.dense, w), (layers.unembed, table)):
        for rows in (1, 2, cpu.DENSE_MAX_ROWS, cpu.DENSE_MAX_ROWS + 1):
            x = jax.ShapeDtypeStruct((rows, 64), jnp.float32)
            f = jax.jit(lambda x, fn=fn, weight=weight: fn(x, weight))
            text = f.lower(x).as_text()
            assert ("xlaserve_dense_matmul" in text) == (2 <= rows <= cpu.DENSE_MAX_ROWS), rows
            xs = rng.standard_normal((rows, 64)).astype(np.float32)
            want = xs @ (np.asarray(weight).T if fn is layers.unembed else np.asarray(weight))
            np.testing.assert_allclose(np.asarray(f(xs)), want, rtol=1e-4, atol=1e-4)
        tpu = jax.export.export(
            jax.jit(lambda x, fn=fn, weight=weight: fn(x, weight)), platforms=["tpu"]
        )(jax.ShapeDtypeStruct((4, 64), jnp.float32))
        assert "xlaserve_dense_matmul" not in tpu.mlir_module()


def test_a_bfloat16_cache_is_written_in_place_by_the_kernel() -> None:
    # XLA:CPU's scatter copies a bfloat16 pool in and out on every call; the kernel writes the
    # new rows where they go, in the donated buffer. Against NumPy's scatter, bit for bit, with
    # NaN in every other slot and the padding tokens (slot -1) skipped.
    rng = np.random.default_rng(5)
    pages, page_size, kv_heads, dim, tokens = 32, 16, 2, 64, 9
    pool = np.full((pages, page_size, 2 * kv_heads, dim), np.nan, jnp.bfloat16)
    k = rng.standard_normal((tokens, kv_heads, dim)).astype(jnp.bfloat16)
    v = rng.standard_normal((tokens, kv_heads, dim)).astype(jnp.bfloat16)
    slots = rng.choice(pages * page_size, tokens, replace=False).astype(np.int32)
    slots[[2, 5]] = -1

    write = jax.jit(write_kv, donate_argnums=0)
    cache = jnp.asarray(pool)
    compiled = write.lower(cache, k, v, slots).compile().as_text()
    assert "xlaserve_write_kv" in compiled and "scatter" not in compiled
    out = write(cache, k, v, slots)
    assert cache.is_deleted()

    want = pool.reshape(pages * page_size, 2 * kv_heads, dim).copy()
    rows = np.stack([k, v], axis=2).reshape(tokens, 2 * kv_heads, dim)  # K0 V0 K1 V1
    want[slots[slots >= 0]] = rows[slots >= 0]
    got = np.asarray(out).reshape(want.shape)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
