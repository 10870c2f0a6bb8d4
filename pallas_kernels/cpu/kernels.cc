// CPU kernels for the parts of the step where XLA:CPU's generic code falls far short of the
// memory bandwidth: decode attention over the paged cache, and products of a few activation
// rows with int8/int4 weights. Registered with XLA through the FFI (see __init__.py); each has
// a pure-jnp twin that is its test oracle and the path on every other platform.
//
// C++ with the compiler's vector extensions (16 float lanes, built -O3 -march=native; AVX-512
// intrinsics only to widen bytes); work is split over XLA's own intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---- work splitting -------------------------------------------------------------------------

// Runs body(i) for i in [0, n) on the caller and XLA's intra-op pool. Items are claimed from an
// atomic counter, so a helper task that starts late finds nothing left and returns without
// touching `body`; the caller waits only for items already claimed, which are running.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const Body& body) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, &body] {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      body(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// ---- vectors --------------------------------------------------------------------------------

// 16 float lanes through the compiler's vector extensions (GCC, Clang): one AVX-512 register, two
// AVX2 ones, four NEON ones. Explicit, because auto-vectorisation picked the wrong loops here.
constexpr int kLanes = 16;
typedef float F16 __attribute__((vector_size(64)));
typedef int8_t I8x16 __attribute__((vector_size(16)));
typedef uint8_t U8x16 __attribute__((vector_size(16)));
typedef int32_t I32x16 __attribute__((vector_size(64)));

inline F16 Load(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, F16 v) { std::memcpy(p, &v, sizeof(v)); }
inline float Sum(F16 v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
// Bytes to floats. GCC scalarises the generic 8-bit -> float vector conversion, so with
// AVX-512 the widening is spelled out (one vpmovsxbd/vpmovzxbd, one vcvtdq2ps).
template <typename Bytes>
inline F16 ToFloat(Bytes v) {
#if defined(__AVX512F__)
  __m128i raw;
  std::memcpy(&raw, &v, sizeof(raw));
  __m512i wide;
  if constexpr (std::is_same_v<Bytes, I8x16>) wide = _mm512_cvtepi8_epi32(raw);
  else wide = _mm512_cvtepu8_epi32(raw);
  return reinterpret_cast<F16>(_mm512_cvtepi32_ps(wide));
#else
  return __builtin_convertvector(__builtin_convertvector(v, I32x16), F16);
#endif
}
inline F16 LoadI8(const int8_t* p) {
  I8x16 v;
  std::memcpy(&v, p, sizeof(v));
  return ToFloat(v);
}
inline U8x16 LoadU8(const uint8_t* p) {
  U8x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// ---- decode attention -----------------------------------------------------------------------

constexpr int kKeyBlock = kLanes;  // keys scored together: one score vector per query head
constexpr int64_t kMaxDim = 256, kMaxGroup = 8;
typedef int32_t Mask __attribute__((vector_size(64)));  // per lane: -1 true, 0 false

// out[j] = sum of the lanes of p[j]: a transposing tree of 15 adds instead of 16 reductions.
inline F16 TransposeSum(const F16 (&p)[kKeyBlock]) {
  F16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: key 2i, 8-15: key 2i+1
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // 4 lanes for each of keys 4i..4i+3
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // 2 lanes for each of keys 8i..8i+7
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// exp(x) for x <= 0 in float32 (relative error ~2e-7): 2^n * e^r with |r| <= ln2/2 and a
// degree-6 polynomial for e^r; x < -87 gives ~1e-38 (callers zero masked lanes themselves).
inline F16 Exp(F16 x) {
  const F16 low = F16{} - 87.0f, round = F16{} + 12582912.0f;  // 1.5 * 2^23: round to nearest
  x = x < low ? low : x;
  const F16 n = (x * 1.44269504f + round) - round;
  const F16 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  F16 p = F16{} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I32x16 bits = (__builtin_convertvector(n, I32x16) + 127) << 23;
  return p * reinterpret_cast<const F16&>(bits);
}

inline float Max(F16 v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

struct AttentionShape {
  int64_t tokens, num_q_heads, head_dim, page_size, combined, table_width, num_slots;
};

// The online-softmax state of one kv head's G query heads.
struct HeadState {
  F16 q[kMaxGroup][kMaxDim / kLanes], acc[kMaxGroup][kMaxDim / kLanes];
  float m[kMaxGroup], l[kMaxGroup];
};

// One 16-key block (n of them real, the rest repeats that are masked) into one head's state.
void AttendBlock(HeadState& st, const float* const (&keys)[kKeyBlock], int64_t n, int64_t group,
                 int64_t dim, float soft_cap) {
  const int64_t vectors = dim / kLanes;
  F16 partial[kMaxGroup][kKeyBlock], probs[kMaxGroup];
  for (int64_t j = 0; j < kKeyBlock; ++j) {
    F16 k[kMaxDim / kLanes];
    for (int64_t v = 0; v < vectors; ++v) k[v] = Load(keys[j] + v * kLanes);
    for (int64_t g = 0; g < group; ++g) {
      F16 dot{};
      for (int64_t v = 0; v < vectors; ++v) dot += st.q[g][v] * k[v];
      partial[g][j] = dot;
    }
  }
  const Mask lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const Mask valid = lane < static_cast<int32_t>(n);
  for (int64_t g = 0; g < group; ++g) {
    F16 scores = TransposeSum(partial[g]);
    for (int i = 0; soft_cap > 0 && i < kLanes; ++i)
      scores[i] = soft_cap * std::tanh(scores[i] / soft_cap);
    scores = valid ? scores : F16{} - INFINITY;
    const float new_max = std::max(st.m[g], Max(scores));
    const float alpha = Exp(F16{} + (st.m[g] - new_max))[0];  // ~0 on the first block
    probs[g] = valid ? Exp(scores - new_max) : F16{};
    st.l[g] = st.l[g] * alpha + Sum(probs[g]);
    st.m[g] = new_max;
    for (int64_t v = 0; v < vectors; ++v) st.acc[g][v] *= alpha;
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t v = 0; v < vectors; ++v) {
      const F16 value = Load(keys[j] + dim + v * kLanes);
      for (int64_t g = 0; g < group; ++g) st.acc[g][v] += probs[g][j] * value;
    }
  }
}

// Keys [k0, k1) of one sequence into the states of all its kv heads, 16 at a time, read
// through the page table; within a block every head is done before the next block, so the
// pages are swept in address order.
void AttendRange(const AttentionShape& d, const float* kv_pages, const int32_t* table,
                 int64_t k0, int64_t k1, float soft_cap, HeadState* states) {
  const int64_t group = d.num_q_heads / (d.combined / 2), dim = d.head_dim;
  const int64_t kv_heads = d.combined / 2;
  const float* slots[kKeyBlock];  // each key's slot: its 2*Hkv combined heads
  int64_t column = k0 / d.page_size, offset = k0 % d.page_size;  // of the next key
  for (int64_t start = k0; start < k1; start += kKeyBlock) {
    const int64_t n = std::min<int64_t>(kKeyBlock, k1 - start);
    for (int64_t j = 0; j < n; ++j) {  // walk the page table without a division per key
      slots[j] = kv_pages + (table[column] * d.page_size + offset) * d.combined * dim;
      if (++offset == d.page_size) offset = 0, ++column;
    }
    for (int64_t j = n; j < kKeyBlock; ++j) slots[j] = slots[n - 1];  // masked lanes
    // Ask for the next block's slots now (the hardware prefetcher stops at every 4 KiB page).
    for (int64_t j = 0, c = column, o = offset; j < kKeyBlock && start + n + j < k1; ++j) {
      const float* next = kv_pages + (table[c] * d.page_size + o) * d.combined * dim;
      for (int64_t x = 0; x < d.combined * dim; x += kLanes) __builtin_prefetch(next + x);
      if (++o == d.page_size) o = 0, ++c;
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* keys[kKeyBlock];
      for (int64_t j = 0; j < kKeyBlock; ++j) keys[j] = slots[j] + 2 * h * dim;
      AttendBlock(states[h], keys, n, group, dim, soft_cap);
    }
  }
}

void InitStates(const AttentionShape& d, const float* q, float sm_scale, HeadState* states) {
  const int64_t group = d.num_q_heads / (d.combined / 2), vectors = d.head_dim / kLanes;
  for (int64_t h = 0; h < d.combined / 2; ++h) {
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t v = 0; v < vectors; ++v) {
        states[h].q[g][v] = Load(q + ((h * group + g) * vectors + v) * kLanes) * sm_scale;
        states[h].acc[g][v] = F16{};
      }
      states[h].m[g] = -INFINITY;
      states[h].l[g] = 0.0f;
    }
  }
}

// The output row of one sequence from the states of its `parts` key ranges (flash-decoding's
// merge: each part's sums rescaled to the overall maximum).
void FinishRow(const AttentionShape& d, const HeadState* states, int64_t parts, float* out) {
  const int64_t kv_heads = d.combined / 2, group = d.num_q_heads / kv_heads;
  const int64_t vectors = d.head_dim / kLanes;
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t g = 0; g < group; ++g) {
      float m = -INFINITY, l = 0.0f;
      for (int64_t p = 0; p < parts; ++p) m = std::max(m, states[p * kv_heads + h].m[g]);
      F16 acc[kMaxDim / kLanes] = {};
      for (int64_t p = 0; p < parts; ++p) {
        const HeadState& st = states[p * kv_heads + h];
        if (st.l[g] == 0.0f) continue;  // an empty range
        const float w = Exp(F16{} + (st.m[g] - m))[0];
        l += st.l[g] * w;
        for (int64_t v = 0; v < vectors; ++v) acc[v] += st.acc[g][v] * w;
      }
      const float inv = l > 0 ? 1.0f / l : 0.0f;
      for (int64_t v = 0; v < vectors; ++v)
        Store(out + ((h * group + g) * vectors + v) * kLanes, acc[v] * inv);
    }
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> kv_pages, ffi::Buffer<ffi::S32> kv_lens,
                               ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cu_q_lens,
                               ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out,
                               float sm_scale, int64_t sliding_window, float logit_soft_cap) {
  const auto qd = q.dimensions(), kd = kv_pages.dimensions();
  const AttentionShape d{qd[0], qd[1], qd[2], kd[1], kd[2], page_table.dimensions()[1],
                         kv_lens.dimensions()[0]};
  const int64_t group = d.num_q_heads / (d.combined / 2);
  if (d.head_dim > kMaxDim || d.head_dim % kLanes != 0 || group > kMaxGroup ||
      kd[3] != d.head_dim) {
    return ffi::Error::InvalidArgument(
        "decode attention: head_dim a multiple of 16 up to 256, Hq/Hkv <= 8");
  }
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * d.tokens * d.num_q_heads * d.head_dim);
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t seqs = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, d.num_slots);
  const int64_t kv_heads = d.combined / 2;
  const int64_t row_size = d.num_q_heads * d.head_dim;
  // One work item per sequence when there are enough of them for every thread; otherwise each
  // sequence's keys are cut into one range per thread and the ranges merged (flash-decoding),
  // so that a lone sequence still uses every thread.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = seqs >= 2 * threads ? 1 : threads;
  std::unique_ptr<HeadState[]> states(new HeadState[seqs * parts * kv_heads]);
  const auto decodes = [&](int64_t seq) {
    return cu[seq + 1] - cu[seq] == 1 && cu[seq] >= 0 && cu[seq] < d.tokens && lens[seq] > 0;
  };
  ParallelFor(pool, seqs * parts, [&](int64_t item) {
    const int64_t seq = item / parts, part = item % parts;
    if (!decodes(seq)) return;
    const int64_t len = std::min<int64_t>(lens[seq], d.table_width * d.page_size);
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    const int64_t step = ((len - first + parts - 1) / parts + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    const int64_t k0 = std::min(len, first + part * step), k1 = std::min(len, k0 + step);
    HeadState* mine = states.get() + item * kv_heads;
    InitStates(d, q.typed_data() + cu[seq] * row_size, sm_scale, mine);
    AttendRange(d, kv_pages.typed_data(), page_table.typed_data() + seq * d.table_width, k0, k1,
                logit_soft_cap, mine);
    if (parts == 1) FinishRow(d, mine, 1, o + cu[seq] * row_size);
  });
  for (int64_t seq = 0; parts > 1 && seq < seqs; ++seq)
    if (decodes(seq)) FinishRow(d, states.get() + seq * parts * kv_heads, parts, o + cu[seq] * row_size);
  return ffi::Error::Success();
}

// ---- quantized matmul -----------------------------------------------------------------------

// y f32[T, N] = x f32[T, K] @ w, w[k, n] = q[k, n] * scale[k / G, n] (+ offset[k / G, n]), with
// q int8 [K, N], or unsigned 4-bit [K/2, N] (element 2j in the low nibble of byte j). Columns
// are cut into tiles of kTile (the last may be half as wide); a tile is one pass over its
// weights for up to kRows rows of x.
constexpr int64_t kTile = 128, kRows = 2, kPrefetch = 8;

template <int Bits, int Rows, int kVectors>
void KnTile(const float* x, int64_t k_size, const uint8_t* values, const float* scales,
            const float* offsets, int64_t group, int64_t n_size, int64_t n0, float* y) {
  F16 acc[Rows][kVectors] = {};
  for (int64_t g0 = 0; g0 < k_size; g0 += group) {
    // Each weight is dequantized (q * scale + offset) before it meets x, as `dequantize` does:
    // factoring the scale out of the group's sum would cancel large terms with offsets.
    F16 scale[kVectors], offset[kVectors] = {};
    for (int v = 0; v < kVectors; ++v) {
      scale[v] = Load(scales + (g0 / group) * n_size + n0 + v * kLanes);
      if (offsets) offset[v] = Load(offsets + (g0 / group) * n_size + n0 + v * kLanes);
    }
    for (int64_t k = g0; k < g0 + group; k += Bits == 4 ? 2 : 1) {
      // The tile's rows are kTile bytes a stride apart, which the hardware prefetcher follows
      // poorly (loads stalled on memory): ask for the row kPrefetch ahead (no fault past the end).
      const uint8_t* ahead = values + ((Bits == 8 ? k : k / 2) + kPrefetch) * n_size + n0;
      __builtin_prefetch(ahead);
      __builtin_prefetch(ahead + 64);
      F16 lo[kVectors], hi[kVectors];
      for (int v = 0; v < kVectors; ++v) {
        if constexpr (Bits == 8) {
          const auto* row = reinterpret_cast<const int8_t*>(values) + k * n_size + n0;
          lo[v] = LoadI8(row + v * kLanes) * scale[v] + offset[v];
        } else {
          const U8x16 b = LoadU8(values + (k / 2) * n_size + n0 + v * kLanes);
          lo[v] = ToFloat(b & 15) * scale[v] + offset[v];
          hi[v] = ToFloat(b >> 4) * scale[v] + offset[v];
        }
      }
      for (int r = 0; r < Rows; ++r) {
        const float a = x[r * k_size + k];
        for (int v = 0; v < kVectors; ++v) acc[r][v] += a * lo[v];
        if constexpr (Bits == 4) {
          const float b = x[r * k_size + k + 1];
          for (int v = 0; v < kVectors; ++v) acc[r][v] += b * hi[v];
        }
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < kVectors; ++v) Store(y + r * n_size + n0 + v * kLanes, acc[r][v]);
}

template <int Bits, int Vectors>
void KnColumns(const float* x, int64_t rows, int64_t k_size, const uint8_t* values,
               const float* scales, const float* offsets, int64_t group, int64_t n_size,
               int64_t n0, float* y) {
  for (int64_t r = 0; r < rows; r += kRows) {
    const float* xr = x + r * k_size;
    float* yr = y + r * n_size;
    if (rows - r >= 2)
      KnTile<Bits, 2, Vectors>(xr, k_size, values, scales, offsets, group, n_size, n0, yr);
    else
      KnTile<Bits, 1, Vectors>(xr, k_size, values, scales, offsets, group, n_size, n0, yr);
  }
}

template <int Bits>
void KnTileAt(const float* x, int64_t rows, int64_t k_size, const uint8_t* values,
              const float* scales, const float* offsets, int64_t group, int64_t n_size,
              int64_t tile, float* y) {
  const int64_t n0 = tile * kTile;
  if (n_size - n0 >= kTile)
    KnColumns<Bits, kTile / kLanes>(x, rows, k_size, values, scales, offsets, group, n_size, n0, y);
  else
    KnColumns<Bits, kTile / kLanes / 2>(x, rows, k_size, values, scales, offsets, group, n_size,
                                        n0, y);
}

// y f32[T, N] = x f32[T, K] @ w^T, w[n, k] = q[n, k] * scale[n, k / G] (+ offset[n, k / G]):
// an embedding table as the output layer. q int8 [N, K] (G a multiple of 16), or 4-bit
// [N, K/2] (G a multiple of 32) dotted with x's even and odd elements apart (`xe`, `xo`).
template <int Bits>
void NkRow(const float* x, const float* xe, const float* xo, int64_t rows, int64_t k_size,
           const uint8_t* values, const float* scales, const float* offsets, int64_t group,
           int64_t n_size, int64_t n, float* y) {
  const int64_t groups = k_size / group;
  const float* s = scales + n * groups;
  const float* o = offsets ? offsets + n * groups : nullptr;
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const int64_t count = std::min<int64_t>(4, rows - r0);
    F16 acc[4] = {};
    if constexpr (Bits == 8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(values) + n * k_size;
      for (int64_t g = 0; g < groups; ++g) {
        const float off = o ? o[g] : 0.0f;
        for (int64_t k = g * group; k < (g + 1) * group; k += kLanes) {
          const F16 w = LoadI8(q + k) * s[g] + off;
          for (int64_t r = 0; r < count; ++r) acc[r] += w * Load(x + (r0 + r) * k_size + k);
        }
      }
    } else {
      const int64_t half = k_size / 2;
      const uint8_t* q = values + n * half;
      for (int64_t g = 0; g < groups; ++g) {
        const float off = o ? o[g] : 0.0f;
        for (int64_t b = g * group / 2; b < (g + 1) * group / 2; b += kLanes) {
          const U8x16 bytes = LoadU8(q + b);
          const F16 lo = ToFloat(bytes & 15) * s[g] + off;
          const F16 hi = ToFloat(bytes >> 4) * s[g] + off;
          for (int64_t r = 0; r < count; ++r)
            acc[r] += lo * Load(xe + (r0 + r) * half + b) + hi * Load(xo + (r0 + r) * half + b);
        }
      }
    }
    for (int64_t r = 0; r < count; ++r) y[(r0 + r) * n_size + n] = Sum(acc[r]);
  }
}

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::AnyBuffer values, ffi::Buffer<ffi::F32> scales,
                               ffi::Buffer<ffi::F32> offsets, ffi::ResultBuffer<ffi::F32> y,
                               int64_t bits, int64_t transposed, int64_t has_offsets) {
  const int64_t rows = x.dimensions()[0], k_size = x.dimensions()[1];
  const int64_t n_size = y->dimensions()[1];
  const auto sd = scales.dimensions();
  const int64_t groups = transposed ? sd[1] : sd[0];
  const int64_t group = groups > 0 ? k_size / groups : 0;
  const int64_t group_multiple = !transposed ? bits / 4 : bits == 8 ? kLanes : 2 * kLanes;
  if (group <= 0 || group * groups != k_size || group % group_multiple != 0 ||
      (!transposed && n_size % (kTile / 2) != 0) || (bits != 8 && bits != 4)) {
    return ffi::Error::InvalidArgument("quantized matmul: unsupported shape (see __init__.py)");
  }
  const float* xp = x.typed_data();
  const auto* q = static_cast<const uint8_t*>(values.untyped_data());
  const float* s = scales.typed_data();
  const float* o = has_offsets ? offsets.typed_data() : nullptr;
  float* yp = y->typed_data();
  if (!transposed) {
    ParallelFor(pool, (n_size + kTile - 1) / kTile, [&](int64_t tile) {
      if (bits == 8) KnTileAt<8>(xp, rows, k_size, q, s, o, group, n_size, tile, yp);
      else KnTileAt<4>(xp, rows, k_size, q, s, o, group, n_size, tile, yp);
    });
    return ffi::Error::Success();
  }
  std::unique_ptr<float[]> split(new float[bits == 4 ? rows * k_size : 0]);
  float *xe = split.get(), *xo = xe + rows * k_size / 2;
  for (int64_t i = 0; bits == 4 && i < rows * k_size / 2; ++i) {
    xe[i] = xp[2 * i];
    xo[i] = xp[2 * i + 1];
  }
  constexpr int64_t kBlock = 512;  // table rows per work item
  ParallelFor(pool, (n_size + kBlock - 1) / kBlock, [&](int64_t item) {
    for (int64_t n = item * kBlock; n < std::min(n_size, (item + 1) * kBlock); ++n) {
      if (bits == 8) NkRow<8>(xp, xe, xo, rows, k_size, q, s, o, group, n_size, n, yp);
      else NkRow<4>(xp, xe, xo, rows, k_size, q, s, o, group, n_size, n, yp);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_pages [P, ps, 2Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table [S, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S+1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("logit_soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveQuantizedMatmul, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::AnyBuffer>()         // values i8|u8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // offsets (or a dummy)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, N]
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("transposed")
                                  .Attr<int64_t>("has_offsets"));
