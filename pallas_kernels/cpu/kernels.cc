// CPU kernels for the parts of the step where XLA:CPU's generic code falls far short of the
// machine: ragged attention over the paged cache (decode and prefill rows), and products of up
// to a decode batch of activation rows with int8/int4 weights. Registered with XLA through the
// FFI (see __init__.py); each has a pure-jnp twin that is its test oracle and the path on every
// other platform.
//
// C++ with the compiler's vector extensions (8 or 16 float lanes, built -O3 -march=native;
// AVX-512 intrinsics only to widen bytes); work is split over XLA's own intra-op thread pool.

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

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
// A vector's sum by halving (4 shuffles and adds): a lane-by-lane loop cost as much as the dot
// products of a table row.
inline float Sum(F16 v) {
  typedef float F8h __attribute__((vector_size(32)));
  typedef float F4h __attribute__((vector_size(16)));
  const F8h a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const F4h b =
      __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
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

// Attention works in 8 float lanes (one AVX2 register, half an AVX-512 one): with 16 lanes, GCC
// turned the cross-lane shuffles below into scalar inserts on AVX2 machines (~3x slower there);
// at 8 lanes they are plain in-register shuffles everywhere, and decode attention is bound by
// memory more than by vector width.
constexpr int kALanes = 8;
#if defined(__AVX512F__)
constexpr int kVectorRegisters = 32;  // EVEX encodes 32 of them, 8-lane ones included
#else
constexpr int kVectorRegisters = 16;
#endif
typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I32x8 __attribute__((vector_size(32)));  // also a lane mask: -1 true, 0 false

inline F8 Load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store8(float* p, F8 v) { std::memcpy(p, &v, sizeof(v)); }

// Vector v of a cache row (a key's or a value's D elements). float: elements 8v .. 8v+7. A
// bfloat16 cache (uint16_t bits) is read 16 values at a time as 8 pairs: a bfloat16 is the top
// half of a float32, so the pairs' low halves shifted up are the even elements and their high
// halves masked the odd ones, 2 integer operations per 16 values (widening 8 at a time costs 2
// per 8). So for bfloat16 the kernel's vectors 2b and 2b+1 hold the even and odd elements of
// 16b .. 16b+15; q and the accumulators are kept in that order too (`ElementOf`).
inline F8 LoadVector(const float* row, int v) { return Load8(row + v * kALanes); }
inline F8 LoadVector(const uint16_t* row, int v) {
  I32x8 pairs;
  std::memcpy(&pairs, row + (v / 2) * 2 * kALanes, sizeof(pairs));
  const I32x8 bits = v % 2 == 0 ? pairs << 16 : pairs & static_cast<int32_t>(0xFFFF0000u);
  return reinterpret_cast<const F8&>(bits);
}
// The element of a row that lane i of vector v holds.
template <typename T>
constexpr int64_t ElementOf(int64_t v, int64_t i) {
  if constexpr (std::is_same_v<T, float>) return v * kALanes + i;
  return (v / 2) * 2 * kALanes + 2 * i + v % 2;
}
inline F8 Splat(float x) { return F8{x, x, x, x, x, x, x, x}; }

inline float Sum8(F8 v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return v[0] + v[1];
}
inline F8 Max(F8 a, F8 b) { return a > b ? a : b; }
inline float Max8(F8 v) {
  v = Max(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = Max(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  return std::max(v[0], v[1]);
}

constexpr int kKeyBlock = kALanes;  // keys scored together: one score vector per query head
constexpr int kChunk = 4 * kKeyBlock;  // keys per online-softmax update
constexpr int64_t kMaxDim = 256, kMaxGroup = 8;

// out[j] = sum of the lanes of p[j]: a transposing tree of 7 adds instead of 8 reductions. The
// shuffles stay within 128-bit halves until the last step (AVX2's cross-half ones are slower).
inline F8 TransposeSum(const F8 (&p)[kKeyBlock]) {
  F8 a[4], b[2];
  for (int i = 0; i < 4; ++i)  // in each half: keys 2i, 2i+1, 2i, 2i+1
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  for (int i = 0; i < 2; ++i)  // in each half: keys 4i .. 4i+3
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// exp(x) for x <= 0 in float32 (relative error ~2e-7): 2^n * e^r with |r| <= ln2/2 and a
// degree-6 polynomial for e^r; x < -87 gives ~1e-38 (callers zero masked lanes themselves).
inline F8 Exp(F8 x) {
  const F8 low = Splat(-87.0f), round = Splat(12582912.0f);  // 1.5 * 2^23: round to nearest
  x = x < low ? low : x;
  const F8 n = (x * 1.44269504f + round) - round;
  const F8 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  F8 p = Splat(1.0f / 720);
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I32x8 bits = (__builtin_convertvector(n, I32x8) + 127) << 23;
  return p * reinterpret_cast<const F8&>(bits);
}
inline float Exp(float x) { return Exp(Splat(x))[0]; }

struct AttentionShape {
  int64_t tokens, num_q_heads, head_dim, page_size, combined, table_width, num_slots;
};

// The online-softmax state of one kv head's G query heads.
struct HeadState {
  F8 q[kMaxGroup][kMaxDim / kALanes], acc[kMaxGroup][kMaxDim / kALanes];
  float m[kMaxGroup], l[kMaxGroup];
};

// One chunk of kChunk keys into the states of R query rows of one kv head (G query heads each,
// D = 8V): row r takes the keys in [lo[r], hi[r]) of the chunk (its window start and causal end;
// a row with none is left as it is). Three passes: the scores of every (row, head) against the
// chunk's keys, 8 keys at a time, each vector of a key converted once for the group's G heads
// (converted once per head, one decode row over 576 keys in 30 layers took 0.82 ms on one core
// of the AMD EPYC, best of 200 with the pages in cache; now 0.71); one online-softmax update
// per (row, head) for the whole chunk, so its rescaling is paid once per 32 keys rather than
// per 8; then the values weighted into the accumulators, several output vectors per
// probability broadcast.
// G, V and R are template arguments so that the loops have constant bounds and the
// accumulators live in registers (with runtime bounds GCC kept reloading and storing them).
// On the AVX2 machine this took one layer's attention for 118 decodes and a 394-token prefill
// chunk from 9.1 to 7.8 ms (bench/RESULTS.md has the engine's numbers).
//
// A decode row (R = 1) reads each key once, and alone would wait on memory: its score pass
// prefetches this head's K and V of the next chunk (`ahead`), a key's lines between that key's
// loads, so that requests stream at an even pace while the scores are computed. One layer of
// 128 decodes at ~400 keys, in alternating runs: 2.4-3.2 -> 1.8-2.4 ms (25-32 -> 33-44 GB/s;
// a plain two-thread sum over the same pages ran at ~36). Asking for a whole chunk at once, before it or before each head's pass,
// had never been faster: a burst of hundreds of lines overflows the queue of misses. Prefill
// blocks (R > 1) reread each chunk from cache for many rows and do not prefetch.
template <typename T, int G, int V, int R>
void AttendChunk(HeadState* const (&st)[R], const T* const (&keys)[kChunk],
                 const T* const (&ahead)[kChunk], const int (&lo)[R], const int (&hi)[R],
                 float soft_cap) {
  int last = 0;  // keys past every row's end are not read
  for (int r = 0; r < R; ++r) last = std::max(last, hi[r]);
  const int blocks = (last + kKeyBlock - 1) / kKeyBlock;
  alignas(32) float scores[R][G][kChunk];  // then the probabilities
  for (int r = 0; r < R; ++r) {
    const auto& q = st[r]->q;
    for (int b = 0; b < blocks; ++b) {
      F8 partial[G][kKeyBlock];
      for (int j = 0; j < kKeyBlock; ++j) {
        const T* k = keys[b * kKeyBlock + j];
        if (R == 1) {  // this head's K and V of the next chunk's key j
          const char* next = reinterpret_cast<const char*>(ahead[b * kKeyBlock + j]);
          for (int byte = 0; byte < 2 * V * kALanes * int{sizeof(T)}; byte += 64)
            __builtin_prefetch(next + byte);
        }
        // Each vector of the key is converted once and meets every query head of the group.
        F8 dot[G];
        const F8 k0 = LoadVector(k, 0);
        for (int g = 0; g < G; ++g) dot[g] = q[g][0] * k0;
        for (int v = 1; v < V; ++v) {
          const F8 kv = LoadVector(k, v);
          for (int g = 0; g < G; ++g) dot[g] += q[g][v] * kv;
        }
        for (int g = 0; g < G; ++g) partial[g][j] = dot[g];
      }
      for (int g = 0; g < G; ++g)
        Store8(&scores[r][g][b * kKeyBlock], TransposeSum(partial[g]));
    }
  }
  const I32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  float alpha[R][G];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) {
      alpha[r][g] = 1.0f;
      float* s = scores[r][g];
      if (lo[r] >= hi[r]) {  // no key of this chunk for this row
        for (int b = 0; b < blocks; ++b) Store8(s + b * kKeyBlock, F8{});
        continue;
      }
      F8 top = Splat(-INFINITY);
      for (int b = 0; b < blocks; ++b) {
        F8 x = Load8(s + b * kKeyBlock);
        for (int i = 0; soft_cap > 0 && i < kALanes; ++i)
          x[i] = soft_cap * std::tanh(x[i] / soft_cap);
        const I32x8 key = lane + b * kKeyBlock;
        x = (key >= lo[r]) & (key < hi[r]) ? x : Splat(-INFINITY);
        Store8(s + b * kKeyBlock, x);
        top = Max(top, x);
      }
      HeadState& state = *st[r];
      const float new_max = std::max(state.m[g], Max8(top));
      alpha[r][g] = Exp(state.m[g] - new_max);  // ~0 on the row's first chunk
      F8 sum = {};
      for (int b = 0; b < blocks; ++b) {
        const F8 x = Load8(s + b * kKeyBlock);
        const F8 p = x > Splat(-INFINITY) ? Exp(x - new_max) : F8{};
        Store8(s + b * kKeyBlock, p);
        sum += p;
      }
      state.l[g] = state.l[g] * alpha[r][g] + Sum8(sum);
      state.m[g] = new_max;
    }
  }
  // The values: VB output vectors of every row and head at a time, so that the R * G * VB
  // accumulators, VB loaded values and the broadcast probability fit the vector registers (one
  // more, and GCC spilled an accumulator to the stack in the loop over the keys): AVX2's 16, or
  // AVX-512's 32 (which hold 8 lanes too). With 32, a decode row of 3 query heads per kv head
  // sweeps the chunk's values in 2 passes instead of 4. One layer's attention over 512 keys on
  // the 2-core AMD EPYC, alternating runs: one decode row 0.062-0.075 -> 0.047-0.073 ms (median
  // 0.062 -> 0.051), 64 of them 4.0-4.1 -> 3.6-3.9 ms.
  constexpr int VB = R * G * 4 + 5 <= kVectorRegisters   ? 4
                     : R * G * 2 + 3 <= kVectorRegisters ? 2
                                                         : 1;
  for (int v0 = 0; v0 < V; v0 += VB) {
    F8 acc[R][G][VB];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g)
        for (int u = 0; u < VB; ++u) acc[r][g][u] = st[r]->acc[g][v0 + u] * alpha[r][g];
    for (int j = 0; j < last; ++j) {
      const T* value = keys[j] + V * kALanes;
      for (int r = 0; r < R; ++r) {
        for (int g = 0; g < G; ++g) {
          const F8 p = Splat(scores[r][g][j]);
          for (int u = 0; u < VB; ++u) acc[r][g][u] += p * LoadVector(value, v0 + u);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g)
        for (int u = 0; u < VB; ++u) st[r]->acc[g][v0 + u] = acc[r][g][u];
  }
}

// Consecutive query rows of one prefill chunk attended together (a decode row goes alone): they
// share the chunk's K and V from L1. 2 and 4 rows were equally fast, 1 row 15% slower.
constexpr int kRowBlock = 2;

template <typename T, int R>
using BlockFn = void (*)(HeadState* const (&)[R], const T* const (&)[kChunk],
                         const T* const (&)[kChunk], const int (&)[R], const int (&)[R], float);

template <typename T, int R, int V, int... Gs>
constexpr std::array<BlockFn<T, R>, sizeof...(Gs)> BlocksFor(std::integer_sequence<int, Gs...>) {
  return {&AttendChunk<T, Gs + 1, V, R>...};
}

// The block function for `group` query heads per kv head and head_dim `dim` (64, 128 or 256),
// or nullptr.
template <typename T, int R>
BlockFn<T, R> PickBlock(int64_t group, int64_t dim) {
  using Groups = std::make_integer_sequence<int, kMaxGroup>;
  static constexpr auto d64 = BlocksFor<T, R, 64 / kALanes>(Groups{});
  static constexpr auto d128 = BlocksFor<T, R, 128 / kALanes>(Groups{});
  static constexpr auto d256 = BlocksFor<T, R, 256 / kALanes>(Groups{});
  if (group < 1 || group > kMaxGroup) return nullptr;
  if (dim == 64) return d64[group - 1];
  if (dim == 128) return d128[group - 1];
  if (dim == 256) return d256[group - 1];
  return nullptr;
}

// Keys [first[r], end[r]) of one sequence into the states of R rows (each row's kv heads at
// states[r], kv_heads of them), kChunk keys at a time, read through the page table; within a
// chunk every head is done before the next chunk, so the pages are swept nearly in order.
template <typename T, int R>
void AttendRange(const AttentionShape& d, BlockFn<T, R> block, const T* kv_pages,
                 const int32_t* table, const int64_t (&first)[R], const int64_t (&end)[R],
                 float soft_cap, HeadState* const (&states)[R]) {
  const int64_t dim = d.head_dim, kv_heads = d.combined / 2;
  const int64_t k0 = *std::min_element(first, first + R), k1 = *std::max_element(end, end + R);
  if (k0 >= k1) return;
  int64_t column = k0 / d.page_size, offset = k0 % d.page_size;  // of the next key
  const auto chunk_slots = [&](int64_t start, const T* (&slots)[kChunk]) {
    const int64_t n = std::min<int64_t>(kChunk, k1 - start);
    for (int64_t j = 0; j < n; ++j) {  // walk the page table without a division per key
      slots[j] = kv_pages + (table[column] * d.page_size + offset) * d.combined * dim;
      if (++offset == d.page_size) offset = 0, ++column;
    }
    for (int64_t j = n; j < kChunk; ++j) slots[j] = slots[n - 1];  // masked lanes
  };
  const T* slots[kChunk];  // each key's slot: its 2*Hkv combined heads
  const T* next[kChunk];   // the next chunk's (the last chunk's own at the end)
  chunk_slots(k0, slots);
  for (int64_t start = k0; start < k1; start += kChunk) {
    if (start + kChunk < k1) chunk_slots(start + kChunk, next);
    else std::copy(slots, slots + kChunk, next);
    int lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      lo[r] = static_cast<int>(std::clamp<int64_t>(first[r] - start, 0, kChunk));
      hi[r] = static_cast<int>(std::clamp<int64_t>(end[r] - start, 0, kChunk));
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T *keys[kChunk], *ahead[kChunk];
      for (int64_t j = 0; j < kChunk; ++j) {
        keys[j] = slots[j] + 2 * h * dim;
        ahead[j] = next[j] + 2 * h * dim;
      }
      HeadState* heads[R];
      for (int r = 0; r < R; ++r) heads[r] = states[r] + h;
      block(heads, keys, ahead, lo, hi, soft_cap);
    }
    std::copy(next, next + kChunk, slots);
  }
}

// q's vectors are in the cache's element order (`ElementOf`).
template <typename T>
void InitStates(const AttentionShape& d, const float* q, float sm_scale, HeadState* states) {
  const int64_t group = d.num_q_heads / (d.combined / 2), vectors = d.head_dim / kALanes;
  for (int64_t h = 0; h < d.combined / 2; ++h) {
    for (int64_t g = 0; g < group; ++g) {
      const float* head = q + (h * group + g) * d.head_dim;
      for (int64_t v = 0; v < vectors; ++v) {
        for (int64_t i = 0; i < kALanes; ++i)
          states[h].q[g][v][i] = head[ElementOf<T>(v, i)] * sm_scale;
        states[h].acc[g][v] = F8{};
      }
      states[h].m[g] = -INFINITY;
      states[h].l[g] = 0.0f;
    }
  }
}

// The output row of one sequence from the states of its `parts` key ranges (flash-decoding's
// merge: each part's sums rescaled to the overall maximum), back in the row's element order.
template <typename T>
void FinishRow(const AttentionShape& d, const HeadState* states, int64_t parts, float* out) {
  const int64_t kv_heads = d.combined / 2, group = d.num_q_heads / kv_heads;
  const int64_t vectors = d.head_dim / kALanes;
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t g = 0; g < group; ++g) {
      float m = -INFINITY, l = 0.0f;
      for (int64_t p = 0; p < parts; ++p) m = std::max(m, states[p * kv_heads + h].m[g]);
      F8 acc[kMaxDim / kALanes] = {};
      for (int64_t p = 0; p < parts; ++p) {
        const HeadState& st = states[p * kv_heads + h];
        if (st.l[g] == 0.0f) continue;  // an empty range
        const float w = Exp(st.m[g] - m);
        l += st.l[g] * w;
        for (int64_t v = 0; v < vectors; ++v) acc[v] += st.acc[g][v] * w;
      }
      const float inv = l > 0 ? 1.0f / l : 0.0f;
      float* head = out + (h * group + g) * d.head_dim;
      for (int64_t v = 0; v < vectors; ++v)
        for (int64_t i = 0; i < kALanes; ++i) head[ElementOf<T>(v, i)] = acc[v][i] * inv;
    }
  }
}

// Every query row of the ragged batch: row t of sequence s sits at position
// kv_len - q_len + (t - cu_q_lens[s]) and sees the keys up to it (within the window), so a
// decode and each row of a prefill chunk are the same work item. Rows past the real sequences
// are zero. T is the cache's element: float, or uint16_t holding bfloat16 bits.
template <typename T>
ffi::Error RaggedAttention(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pages,
                           ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                           ffi::ResultBuffer<ffi::F32> out, float sm_scale, int64_t sliding_window,
                           float logit_soft_cap) {
  const auto qd = q.dimensions(), kd = kv_pages.dimensions();
  const AttentionShape d{qd[0], qd[1], qd[2], kd[1], kd[2], page_table.dimensions()[1],
                         kv_lens.dimensions()[0]};
  const T* pages = static_cast<const T*>(kv_pages.untyped_data());
  const int64_t group = d.num_q_heads / (d.combined / 2);
  const BlockFn<T, 1> single = PickBlock<T, 1>(group, d.head_dim);
  const BlockFn<T, kRowBlock> multi = PickBlock<T, kRowBlock>(group, d.head_dim);
  if (single == nullptr || kd[3] != d.head_dim) {
    return ffi::Error::InvalidArgument("ragged attention: head_dim 64, 128 or 256, Hq/Hkv <= 8");
  }
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * d.tokens * d.num_q_heads * d.head_dim);
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t seqs = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, d.num_slots);
  const int64_t kv_heads = d.combined / 2, row_size = d.num_q_heads * d.head_dim;
  const int64_t max_len = d.table_width * d.page_size;
  // A work item: up to kRowBlock consecutive rows of one sequence (`rows` of them from `row`,
  // the first seeing `len` keys, each next one a key more).
  struct Item {
    int64_t row, seq, len, rows;
  };
  std::vector<Item> items;
  int64_t num_rows = 0;
  for (int64_t seq = 0; seq < seqs; ++seq) {
    const int64_t begin = std::max<int64_t>(cu[seq], 0);
    const int64_t end = std::min<int64_t>(cu[seq + 1], d.tokens);
    for (int64_t t = begin; t < end; t += kRowBlock) {
      const int64_t len = lens[seq] - (cu[seq + 1] - t) + 1;  // keys up to row t's position
      const int64_t rows = std::min<int64_t>(kRowBlock, end - t);
      if (len + rows - 1 <= 0 || len > max_len) continue;  // inconsistent metadata: left zero
      items.push_back({t, seq, len, rows});
      num_rows += rows;
    }
  }
  // With enough rows for every thread, one work item per block of rows; otherwise one per row,
  // each row's keys cut into one range per thread and the ranges merged (flash-decoding), so
  // that a lone decoding sequence still uses every thread.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = num_rows >= 2 * threads ? 1 : threads;
  const auto window_start = [&](int64_t len) {
    return sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : int64_t{0};
  };
  if (parts == 1) {
    ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
      const Item& it = items[i];
      thread_local std::vector<HeadState> scratch;
      scratch.resize(std::max<size_t>(scratch.size(), kRowBlock * kv_heads));
      const int32_t* table = page_table.typed_data() + it.seq * d.table_width;
      if (it.rows == 1) {
        HeadState* const states[1] = {scratch.data()};
        const int64_t first[1] = {window_start(it.len)}, end[1] = {it.len};
        InitStates<T>(d, q.typed_data() + it.row * row_size, sm_scale, states[0]);
        AttendRange<T, 1>(d, single, pages, table, first, end, logit_soft_cap, states);
        FinishRow<T>(d, states[0], 1, o + it.row * row_size);
        return;
      }
      HeadState* states[kRowBlock];
      int64_t first[kRowBlock], end[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) {  // a short block repeats its last row
        const int64_t row = std::min<int64_t>(r, it.rows - 1);
        states[r] = scratch.data() + r * kv_heads;
        end[r] = std::min(it.len + row, max_len);
        first[r] = window_start(end[r]);
        InitStates<T>(d, q.typed_data() + (it.row + row) * row_size, sm_scale, states[r]);
      }
      AttendRange<T, kRowBlock>(d, multi, pages, table, first, end, logit_soft_cap, states);
      for (int64_t r = 0; r < it.rows; ++r) FinishRow<T>(d, states[r], 1, o + (it.row + r) * row_size);
    });
    return ffi::Error::Success();
  }
  struct Row {
    int64_t row, seq, len;
  };
  std::vector<Row> rows;  // few rows: one by one, each one's keys split into `parts` ranges
  for (const Item& it : items)
    for (int64_t r = 0; r < it.rows; ++r)
      if (it.len + r > 0) rows.push_back({it.row + r, it.seq, std::min(it.len + r, max_len)});
  std::unique_ptr<HeadState[]> split(new HeadState[rows.size() * parts * kv_heads]);
  ParallelFor(pool, static_cast<int64_t>(rows.size()) * parts, [&](int64_t item) {
    const Row& r = rows[item / parts];
    const int64_t part = item % parts, from = window_start(r.len);
    const int64_t step =
        ((r.len - from + parts - 1) / parts + kChunk - 1) / kChunk * kChunk;
    const int64_t k0 = std::min(r.len, from + part * step), k1 = std::min(r.len, k0 + step);
    HeadState* const states[1] = {split.get() + item * kv_heads};
    const int64_t first[1] = {k0}, end[1] = {k1};
    InitStates<T>(d, q.typed_data() + r.row * row_size, sm_scale, states[0]);
    AttendRange<T, 1>(d, single, pages, page_table.typed_data() + r.seq * d.table_width, first,
                      end, logit_soft_cap, states);
  });
  for (size_t i = 0; i < rows.size(); ++i)
    FinishRow<T>(d, split.get() + i * parts * kv_heads, parts, o + rows[i].row * row_size);
  return ffi::Error::Success();
}

ffi::Error RaggedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::AnyBuffer kv_pages, ffi::Buffer<ffi::S32> kv_lens,
                               ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cu_q_lens,
                               ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out,
                               float sm_scale, int64_t sliding_window, float logit_soft_cap) {
  const auto attend = [&](auto element) {
    using T = decltype(element);
    return RaggedAttention<T>(pool, q, kv_pages, kv_lens, page_table, cu_q_lens, num_seqs, out,
                              sm_scale, sliding_window, logit_soft_cap);
  };
  switch (kv_pages.element_type()) {
    case ffi::DataType::F32: return attend(float{});
    case ffi::DataType::BF16: return attend(uint16_t{});
    default: return ffi::Error::InvalidArgument("ragged attention: a float32 or bfloat16 cache");
  }
}

// ---- cache write ----------------------------------------------------------------------------

// Copies row t of `rows` [T, 2*Hkv, Dp] into slot slots[t] of the pages [P, page_size, 2*Hkv,
// Dp], in place: the result aliases the pages (`input_output_aliases`). Slots outside the pool
// (padding rows, -1) are skipped. XLA:CPU's own scatter copies a bfloat16 pool in and out on
// every call (pallas_kernels/kv_cache_update/layout.py): 23 ms for a 50 MB pool here.
ffi::Error WriteKVImpl(ffi::AnyBuffer pages, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> slots,
                       ffi::Result<ffi::AnyBuffer> out) {
  const auto pd = pages.dimensions();
  const int64_t tokens = slots.dimensions()[0], num_slots = pd[0] * pd[1];
  const size_t slot_bytes = pages.size_bytes() / std::max<int64_t>(num_slots, 1);
  if (rows.element_type() != pages.element_type() || rows.size_bytes() != tokens * slot_bytes) {
    return ffi::Error::InvalidArgument("write kv: rows must be [T, 2*Hkv, Dp] of the pages' dtype");
  }
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pages.untyped_data()) std::memcpy(dst, pages.untyped_data(), pages.size_bytes());
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < tokens; ++t)
    if (slot[t] >= 0 && slot[t] < num_slots)
      std::memcpy(dst + slot[t] * slot_bytes, src + t * slot_bytes, slot_bytes);
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
      // The next group's scales and offsets, two more rows a stride apart: without this each
      // group began with misses on them (one row of a 576x49152 int4 product on the 2-core AMD
      // EPYC: 1.55-1.7 ms without, 1.06-1.2 ms with).
      if (k == g0 && g0 + group < k_size) {
        const int64_t next = (g0 / group + 1) * n_size + n0;
        for (int64_t line = 0; line < kVectors * kLanes; line += 16) {
          __builtin_prefetch(scales + next + line);
          if (offsets) __builtin_prefetch(offsets + next + line);
        }
      }
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

// Many rows (more than kFewRows): a pass per pair of rows would dequantize each weight rows / 2
// times. Instead each chunk of kWeightChunk weight rows of the tile is dequantized once into a
// buffer that stays in L1, and every row of x meets it there, kBlockRows rows by kBlockVectors
// vectors of outputs at a time (16 accumulators), the tile's outputs summed in y across chunks.
constexpr int64_t kFewRows = 2, kWeightChunk = 32, kBlockRows = 4, kBlockVectors = 4;

template <int Rows>
void KnBlock(const float* x, int64_t k_size, const float* w, int64_t width, int64_t chunk,
             float* y, int64_t n_size) {
  F16 acc[Rows][kBlockVectors];
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < kBlockVectors; ++v) acc[r][v] = Load(y + r * n_size + v * kLanes);
  for (int64_t k = 0; k < chunk; ++k) {
    F16 wk[kBlockVectors];
    for (int v = 0; v < kBlockVectors; ++v) wk[v] = Load(w + k * width + v * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const float a = x[r * k_size + k];
      for (int v = 0; v < kBlockVectors; ++v) acc[r][v] += a * wk[v];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int v = 0; v < kBlockVectors; ++v) Store(y + r * n_size + v * kLanes, acc[r][v]);
}

template <int Bits>
void KnTileManyRows(const float* x, int64_t rows, int64_t k_size, const uint8_t* values,
                    const float* scales, const float* offsets, int64_t group, int64_t n_size,
                    int64_t n0, int64_t width, float* y) {
  alignas(64) float w[kWeightChunk * kTile];
  const int64_t chunk = std::min(group, kWeightChunk);  // the caller checked group % chunk == 0
  for (int64_t r = 0; r < rows; ++r) std::fill_n(y + r * n_size + n0, width, 0.0f);
  for (int64_t k0 = 0; k0 < k_size; k0 += chunk) {
    const int64_t g = k0 / group;
    for (int64_t v = 0; v < width / kLanes; ++v) {
      const int64_t n = n0 + v * kLanes;
      const F16 scale = Load(scales + g * n_size + n);
      const F16 offset = offsets ? Load(offsets + g * n_size + n) : F16{};
      float* out = w + v * kLanes;
      for (int64_t k = 0; k < chunk; k += Bits == 4 ? 2 : 1) {
        if constexpr (Bits == 8) {
          const auto* row = reinterpret_cast<const int8_t*>(values) + (k0 + k) * n_size + n;
          Store(out + k * width, LoadI8(row) * scale + offset);
        } else {
          const U8x16 b = LoadU8(values + ((k0 + k) / 2) * n_size + n);
          Store(out + k * width, ToFloat(b & 15) * scale + offset);
          Store(out + (k + 1) * width, ToFloat(b >> 4) * scale + offset);
        }
      }
    }
    for (int64_t r = 0; r < rows; r += kBlockRows) {
      const float* xr = x + r * k_size + k0;
      for (int64_t v = 0; v < width / kLanes; v += kBlockVectors) {
        float* yr = y + r * n_size + n0 + v * kLanes;
        const float* wv = w + v * kLanes;
        switch (std::min(kBlockRows, rows - r)) {
          case 4: KnBlock<4>(xr, k_size, wv, width, chunk, yr, n_size); break;
          case 3: KnBlock<3>(xr, k_size, wv, width, chunk, yr, n_size); break;
          case 2: KnBlock<2>(xr, k_size, wv, width, chunk, yr, n_size); break;
          default: KnBlock<1>(xr, k_size, wv, width, chunk, yr, n_size);
        }
      }
    }
  }
}

template <int Bits, int Vectors>
void KnColumns(const float* x, int64_t rows, int64_t k_size, const uint8_t* values,
               const float* scales, const float* offsets, int64_t group, int64_t n_size,
               int64_t n0, float* y) {
  if (rows > kFewRows && group % std::min(group, kWeightChunk) == 0) {
    KnTileManyRows<Bits>(x, rows, k_size, values, scales, offsets, group, n_size, n0,
                         Vectors * kLanes, y);
    return;
  }
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
// an embedding table as the output layer, q int8 [N, K] (G a multiple of 16) or 4-bit [N, K/2]
// (G a multiple of 32). kTableRows table rows at a time are dequantized into a buffer in L1
// (int4: even elements, then odd ones, as in `xs`) and dotted with every row of x, 4 x rows by
// kTableRows table rows at a time (16 accumulators). Even for one row of x this beats dotting
// each table row's integers with x in place: four independent sums in flight in place of one
// chain, one output layer of SmolLM2 (576x49152 int4) on the 2-core AMD EPYC 1.4-1.7 ms against
// 2.3-2.9 ms.
constexpr int64_t kTableRows = 4;

template <int Rows>
void NkDots(const float* xs, const float* w, int64_t k_size, int64_t count, int64_t n_size,
            float* y) {
  F16 acc[Rows][kTableRows] = {};
  for (int64_t k = 0; k < k_size; k += kLanes) {
    F16 wk[kTableRows];
    for (int j = 0; j < kTableRows; ++j) wk[j] = Load(w + j * k_size + k);
    for (int r = 0; r < Rows; ++r) {
      const F16 a = Load(xs + r * k_size + k);
      for (int j = 0; j < kTableRows; ++j) acc[r][j] += a * wk[j];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int64_t j = 0; j < count; ++j) y[r * n_size + j] = Sum(acc[r][j]);
}

template <int Bits>
void NkTableRows(const float* xs, int64_t rows, int64_t k_size, const uint8_t* values,
                const float* scales, const float* offsets, int64_t group, int64_t n_size,
                int64_t n0, int64_t count, float* w, float* y) {
  const int64_t groups = k_size / group, half = k_size / 2;
  std::fill_n(w + count * k_size, (kTableRows - count) * k_size, 0.0f);
  for (int64_t j = 0; j < count; ++j) {
    const int64_t n = n0 + j;
    const float* s = scales + n * groups;
    const float* o = offsets ? offsets + n * groups : nullptr;
    float* out = w + j * k_size;
    for (int64_t g = 0; g < groups; ++g) {
      const float off = o ? o[g] : 0.0f;
      if constexpr (Bits == 8) {
        const int8_t* q = reinterpret_cast<const int8_t*>(values) + n * k_size;
        for (int64_t k = g * group; k < (g + 1) * group; k += kLanes)
          Store(out + k, LoadI8(q + k) * s[g] + off);
      } else {
        for (int64_t b = g * group / 2; b < (g + 1) * group / 2; b += kLanes) {
          const U8x16 bytes = LoadU8(values + n * half + b);
          Store(out + b, ToFloat(bytes & 15) * s[g] + off);
          Store(out + half + b, ToFloat(bytes >> 4) * s[g] + off);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; r += 4) {
    const float* xr = xs + r * k_size;
    float* yr = y + r * n_size + n0;
    switch (std::min<int64_t>(4, rows - r)) {
      case 4: NkDots<4>(xr, w, k_size, count, n_size, yr); break;
      case 3: NkDots<3>(xr, w, k_size, count, n_size, yr); break;
      case 2: NkDots<2>(xr, w, k_size, count, n_size, yr); break;
      default: NkDots<1>(xr, w, k_size, count, n_size, yr);
    }
  }
}

// ---- int4 products with 8-bit activations ---------------------------------------------------

// y f32[T, N] = x̂ @ (q * scale) + x @ offset for int4 [In, Out] weights in groups of G (a
// multiple of 32), where x̂ is each row of x rounded to int8 in blocks of kQBlock = 32 elements as
// llama.cpp's Q8_0 does (xs = max |x| / 127, xq = round-half-even(x / xs), x̂ = xs * xq), and the
// offsets meet the exact x. The integer products are summed exactly in int32, with AVX-512 VNNI
// 64 of them per instruction (vpdpbusd: 16 columns, 4 k each), where the float path spends a
// dequantizing and a dot multiply-add per weight: SmolLM2's products for 8 or 64 decode rows
// take 2.2x less time on the 2-core AMD EPYC; for one row the weights' reading bounds both.
//
// Each block of 32 k (16 byte rows) of up to kQWidth columns is unpacked into L1 (`UnpackBlock`),
// each 32-bit lane holding 4 nibbles of one column, and every row of x meets it there, 4 rows
// at a time. The k axis is cut into stripes of kQStripe blocks, each summed on its own and the
// stripes then added in order, for any number of rows: a row's result does not depend on the
// rows that share the call. Up to kQFewRows rows, a work item is one stripe of one column range
// (its 16 byte rows are runs of kQWidth bytes, which stream; column tiles over all of k would
// read one line a stripe apart); with more rows, it is a column tile over all stripes, since
// the partial sums of every stripe would outgrow the caches.
constexpr int64_t kQBlock = 32, kQTile = 64, kQWidth = 512, kQStripe = 8, kQFewRows = 4;
constexpr int64_t kQAhead = 16;  // byte rows between a load and its prefetch (into L2)
typedef int8_t I8x32 __attribute__((vector_size(32)));

// Each row of x as int8 in the order the dots take it: for int4 weights (`nibble_order`), per 8
// consecutive k, first the even ones (they meet the low nibbles of 4 byte rows), then the odd
// ones; for int8 tables, k's own order. One scale and the integers' sum per block, and the
// exact sum of x over each weight group (for the offsets).
struct Int8Rows {
  int64_t k_size, blocks, groups;
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> scale, group_sum;
  std::unique_ptr<int32_t[]> q_sum;

  Int8Rows(const float* x, int64_t rows, int64_t k_size, int64_t group, bool nibble_order)
      : k_size(k_size), blocks(k_size / kQBlock), groups(k_size / group),
        q(new int8_t[rows * k_size]), scale(new float[rows * blocks]),
        group_sum(new float[rows * groups]()), q_sum(new int32_t[rows * blocks]) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + r * k_size + b * kQBlock;
        const F16 v0 = Load(xb), v1 = Load(xb + kLanes);
        const F16 a0 = v0 < 0 ? -v0 : v0, a1 = v1 < 0 ? -v1 : v1;
        const F16 a = a0 > a1 ? a0 : a1;
        float amax = 0.0f;
        for (int i = 0; i < kLanes; ++i) amax = std::max(amax, a[i]);
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        scale[r * blocks + b] = d;
        // The products rounded to float first, then to integers, half to even (a rounding by
        // adding 1.5 * 2^23 would be contracted into a multiply-add with them).
        const F16 t0 = v0 * id, t1 = v1 * id;
        I8x16 q0, q1;
        for (int i = 0; i < kLanes; ++i) {
          q0[i] = static_cast<int8_t>(__builtin_rintf(t0[i]));
          q1[i] = static_cast<int8_t>(__builtin_rintf(t1[i]));
        }
        const I8x32 ordered =
            nibble_order
                ? __builtin_shufflevector(
                      q0, q1, 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,  //
                      16, 18, 20, 22, 17, 19, 21, 23, 24, 26, 28, 30, 25, 27, 29, 31)
                : __builtin_shufflevector(q0, q1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                          14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26,
                                          27, 28, 29, 30, 31);
        std::memcpy(q.get() + r * k_size + b * kQBlock, &ordered, sizeof(ordered));
        int32_t sum = 0;
        for (int i = 0; i < kLanes; ++i) sum += q0[i] + q1[i];
        q_sum[r * blocks + b] = sum;
        group_sum[r * groups + b * kQBlock / group] += Sum(v0) + Sum(v1);
      }
  }
  int64_t group() const { return k_size / groups; }
};

// Byte rows [j0, j0 + 16) of columns [n0, n0 + width) as, per 64 columns, 32 vectors of 64
// bytes: for each 4 byte rows (8 k), their low nibbles then their high ones, each as 4 vectors
// of 16 columns whose 32-bit lanes hold the 4 rows' nibbles of one column. Read 4 rows at a time
// along the columns.
inline void UnpackBlock(const uint8_t* values, int64_t n_size, int64_t j0, int64_t n0,
                        int64_t width, uint8_t* out) {
#if defined(__AVX512VBMI__)
  // vpermt2b indices: byte p of a pair vector is column p / 2 of row p % 2 (the second operand
  // counts from 64); byte p of a quad vector, column p / 4's pair p % 4 / 2 (from the first or
  // second pair vector). The high halves take columns 32-63.
  alignas(64) uint8_t pairs[64], quads[64];
  for (int p = 0; p < 64; ++p) {
    pairs[p] = p / 2 + (p % 2) * 64;
    quads[p] = 2 * (p / 4) + p % 2 + (p % 4 / 2) * 64;
  }
  const __m512i half = _mm512_set1_epi8(32), nibble = _mm512_set1_epi8(15);
  const __m512i pairs_lo = _mm512_load_si512(pairs), quads_lo = _mm512_load_si512(quads);
  const __m512i pairs_hi = _mm512_add_epi8(pairs_lo, half);
  const __m512i quads_hi = _mm512_add_epi8(quads_lo, half);
  for (int c = 0; c < 4; ++c)
    for (int64_t tile = 0; tile < width; tile += kQTile) {
      const uint8_t* p = values + (j0 + 4 * c) * n_size + n0 + tile;
      uint8_t* o = out + tile / kQTile * 32 * 64;
      __m512i row[4];
      for (int t = 0; t < 4; ++t) {
        __builtin_prefetch(p + (kQAhead + t) * n_size, 0, 2);
        row[t] = _mm512_loadu_si512(p + t * n_size);
      }
      const __m512i p01[2] = {_mm512_permutex2var_epi8(row[0], pairs_lo, row[1]),
                              _mm512_permutex2var_epi8(row[0], pairs_hi, row[1])};
      const __m512i p23[2] = {_mm512_permutex2var_epi8(row[2], pairs_lo, row[3]),
                              _mm512_permutex2var_epi8(row[2], pairs_hi, row[3])};
      for (int m = 0; m < 4; ++m) {
        const __m512i w =
            _mm512_permutex2var_epi8(p01[m / 2], m % 2 ? quads_hi : quads_lo, p23[m / 2]);
        _mm512_store_si512(o + (8 * c + m) * 64, _mm512_and_si512(w, nibble));
        _mm512_store_si512(o + (8 * c + 4 + m) * 64,
                           _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble));
      }
    }
#else
  for (int c = 0; c < 4; ++c)
    for (int t = 0; t < 4; ++t)
      for (int64_t col = 0; col < width; ++col) {
        const uint8_t b = values[(j0 + 4 * c + t) * n_size + n0 + col];
        uint8_t* o = out + col / kQTile * 32 * 64 + (col % kQTile / 16) * 64 + (col % 16) * 4 + t;
        o[8 * c * 64] = b & 15;
        o[(8 * c + 4) * 64] = b >> 4;
      }
#endif
}

// acc's 32-bit lane i += the 4 products of w's bytes 4i..4i+3 (unsigned) with x4's (signed).
inline I32x16 Dot4(I32x16 acc, const uint8_t* w, int32_t x4) {
#if defined(__AVX512VNNI__)
  const __m512i sum = _mm512_dpbusd_epi32(reinterpret_cast<const __m512i&>(acc),
                                          _mm512_load_si512(w), _mm512_set1_epi32(x4));
  return reinterpret_cast<const I32x16&>(sum);
#else
  int8_t x[4];
  std::memcpy(x, &x4, sizeof(x));
  for (int i = 0; i < kLanes; ++i)
    for (int t = 0; t < 4; ++t) acc[i] += w[4 * i + t] * x[t];
  return acc;
#endif
}

// Scales and offsets are float32, or IEEE float16 (`Half`), as llama.cpp's Q4_1 blocks store
// them: 4 bytes per 32 weights instead of 8, a sixth of what one token reads of an int4 weight.
struct Half {
  uint16_t bits;
};
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = sign | (exponent == 0x1f ? 0x7f800000u | (mantissa << 13)  // inf, nan
                                                 : ((exponent + 112) << 23) | (mantissa << 13));
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline F16 LoadScales(const float* p) { return Load(p); }
inline F16 LoadScales(const Half* p) {
#if defined(__AVX512F__)
  __m256i half;
  std::memcpy(&half, p, sizeof(half));
  return reinterpret_cast<F16>(_mm512_cvtph_ps(half));
#else
  F16 out;
  for (int i = 0; i < kLanes; ++i) out[i] = HalfToFloat(p[i].bits);
  return out;
#endif
}

// Block b of x's rows [r0, r0 + Rows) against 64 unpacked columns, into y (row stride
// `stride`): y += (xs * scale) * (xq . q), and + offset * the group's sum of x on the group's
// first block (offset null otherwise).
template <int Rows, typename S>
void DotBlock(const Int8Rows& xr, int64_t r0, int64_t b, const uint8_t* block, const S* scale,
              const S* offset, float* y, int64_t stride) {
  I32x16 acc[Rows][4] = {};
  for (int s = 0; s < 8; ++s) {  // 4 times 8 k: the low nibbles, then the high ones
    int32_t x4[Rows];
    for (int r = 0; r < Rows; ++r)
      std::memcpy(&x4[r], xr.q.get() + (r0 + r) * xr.k_size + b * kQBlock + 4 * s, 4);
    for (int m = 0; m < 4; ++m)
      for (int r = 0; r < Rows; ++r) acc[r][m] = Dot4(acc[r][m], block + (4 * s + m) * 64, x4[r]);
  }
  for (int r = 0; r < Rows; ++r) {
    const float xs = xr.scale[(r0 + r) * xr.blocks + b];
    const float sum = xr.group_sum[(r0 + r) * xr.groups + b * kQBlock / xr.group()];
    float* yr = y + r * stride;
    for (int m = 0; m < 4; ++m) {
      F16 out = Load(yr + m * kLanes) +
                __builtin_convertvector(acc[r][m], F16) * (LoadScales(scale + m * kLanes) * xs);
      if (offset) out += LoadScales(offset + m * kLanes) * sum;
      Store(yr + m * kLanes, out);
    }
  }
}

// Stripe s's blocks of columns [c0, c0 + width) (width <= kQWidth, a multiple of kQTile) for
// every row, summed into p (zeroed by the caller; row stride `stride`).
template <typename S>
void Stripe(const Int8Rows& xr, int64_t rows, const uint8_t* values, const S* scales,
            const S* offsets, int64_t n_size, int64_t s, int64_t c0, int64_t width, float* p,
            int64_t stride) {
  alignas(64) uint8_t block[kQWidth / kQTile * 32 * 64];
  const int64_t group = xr.group();
  for (int64_t b = s * kQStripe; b < std::min(xr.blocks, (s + 1) * kQStripe); ++b) {
    const int64_t k0 = b * kQBlock, g = k0 / group;
    if (k0 % group == 0)  // the next group's scales and offsets, rows a stride apart
      for (int64_t line = 0; line < width; line += 16) {
        __builtin_prefetch(scales + (g + 1) * n_size + c0 + line, 0, 2);
        if (offsets) __builtin_prefetch(offsets + (g + 1) * n_size + c0 + line, 0, 2);
      }
    UnpackBlock(values, n_size, k0 / 2, c0, width, block);
    for (int64_t t = 0; t < width; t += kQTile) {
      const uint8_t* unpacked = block + t / kQTile * 32 * 64;
      const S* scale = scales + g * n_size + c0 + t;
      const S* offset = offsets && k0 % group == 0 ? offsets + g * n_size + c0 + t : nullptr;
      for (int64_t r = 0; r < rows; r += 4) {
        float* pr = p + r * stride + t;
        switch (std::min<int64_t>(4, rows - r)) {
          case 4: DotBlock<4>(xr, r, b, unpacked, scale, offset, pr, stride); break;
          case 3: DotBlock<3>(xr, r, b, unpacked, scale, offset, pr, stride); break;
          case 2: DotBlock<2>(xr, r, b, unpacked, scale, offset, pr, stride); break;
          default: DotBlock<1>(xr, r, b, unpacked, scale, offset, pr, stride);
        }
      }
    }
  }
}

// An int4 [K, N] weight of an int4 x int8 product, and where its result goes.
template <typename S>
struct Int4Product {
  const uint8_t* values;
  const S* scales;
  const S* offsets;  // or nullptr
  int64_t n_size;
  float* y;  // [rows, n_size]
};

// The products of the same rows of x with one or more weights (gate and up) in one parallel
// loop: their column ranges (or tiles) are work items of one ParallelFor, so the pool's helper
// is woken once and the rows are rounded once. `extra` more items, `more(i)` for i in
// [0, extra), join the loop (the float-activation products of a call that has both: q, k and
// v). A product's result is the same alone or with others, bit for bit.
template <typename S, typename More = void (*)(int64_t)>
void Int4Int8Matmul(ffi::ThreadPool& pool, const Int8Rows& xr, int64_t rows,
                    const std::vector<Int4Product<S>>& products, int64_t extra = 0,
                    const More& more = nullptr) {
  const int64_t stripes = (xr.blocks + kQStripe - 1) / kQStripe;
  const int64_t unit = rows <= kQFewRows ? kQWidth : kQTile;
  struct Columns {
    const Int4Product<S>* product;
    int64_t c0, at;  // the first column, and where the product's columns start in `partial`
  };
  std::vector<Columns> columns;
  int64_t n_total = 0;
  for (const Int4Product<S>& w : products) {
    for (int64_t c0 = 0; c0 < w.n_size; c0 += unit) columns.push_back({&w, c0, n_total});
    n_total += w.n_size;
  }
  const int64_t ranges = static_cast<int64_t>(columns.size());
  if (rows <= kQFewRows) {
    std::unique_ptr<float[]> partial(new float[stripes * rows * n_total]);
    ParallelFor(pool, stripes * ranges + extra, [&](int64_t item) {
      if (item >= stripes * ranges) return more(item - stripes * ranges);
      const int64_t s = item / ranges;
      const Columns& c = columns[item % ranges];
      const Int4Product<S>& w = *c.product;
      const int64_t width = std::min(kQWidth, w.n_size - c.c0);
      float* p = partial.get() + s * rows * n_total + c.at + c.c0;
      for (int64_t r = 0; r < rows; ++r) std::fill_n(p + r * n_total, width, 0.0f);
      Stripe(xr, rows, w.values, w.scales, w.offsets, w.n_size, s, c.c0, width, p, n_total);
    });
    int64_t at = 0;
    for (const Int4Product<S>& w : products) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < w.n_size; i += kLanes) {
          const float* p = partial.get() + r * n_total + at + i;
          F16 sum = Load(p);
          for (int64_t s = 1; s < stripes; ++s) sum += Load(p + s * rows * n_total);
          Store(w.y + r * w.n_size + i, sum);
        }
      at += w.n_size;
    }
    return;
  }
  ParallelFor(pool, ranges + extra, [&](int64_t item) {
    if (item >= ranges) return more(item - ranges);
    const Int4Product<S>& w = *columns[item].product;
    const int64_t c0 = columns[item].c0, n_size = w.n_size;
    float* y = w.y;
    std::unique_ptr<float[]> p(new float[rows * kQTile]);
    for (int64_t r = 0; r < rows; ++r) std::fill_n(y + r * n_size + c0, kQTile, 0.0f);
    for (int64_t s = 0; s < stripes; ++s) {
      std::fill_n(p.get(), rows * kQTile, 0.0f);
      Stripe(xr, rows, w.values, w.scales, w.offsets, n_size, s, c0, kQTile, p.get(), kQTile);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t v = 0; v < kQTile; v += kLanes) {
          float* out = y + r * n_size + c0 + v;
          Store(out, Load(out) + Load(p.get() + r * kQTile + v));
        }
    }
  });
}

// ---- int8 tables with 8-bit activations -----------------------------------------------------

// y f32[T, N] = x̂ @ w^T for an int8 table w[n, k] = q[n, k] * scale[n, k / G] (G a multiple of
// 32, K of 64): the output layer as llama.cpp computes it from Q8_0 blocks, each row of x
// rounded as for the int4 products (in k's own order). kQTableRows table rows at a time are
// transposed into L1 so that lane j of a vector holds table row j's 4 consecutive k
// (`TransposeTile`), and every row of x meets them there through `Dot4`: 16 outputs of 4 k per
// instruction with VNNI, where the float path dequantizes each weight and then spends a
// multiply-add per weight and row. vpdpbusd multiplies unsigned bytes by signed ones, so the
// table's bytes are flipped to q + 128 on the way (an xor) and 128 times each block's sum of
// x̂'s integers is taken off. A row's blocks are summed in order, whatever the other rows.
constexpr int64_t kQTableRows = 16, kQTableBlock = 512;  // table rows per tile, per work item
constexpr int64_t kMaxTableGroups = 128;  // K / 32 for K <= 4096
constexpr int64_t kTableAhead = 2;  // tiles

// One stage of a 16 x 16 transpose of 32-bit elements: rows i and i + B (bit B of i clear)
// swap their off-diagonal B x B blocks. Stages B = 1, 2, 4, 8 transpose the whole.
template <int B, int... E>
inline void SwapBlocks(I32x16& a, I32x16& b, std::integer_sequence<int, E...>) {
  const I32x16 lo = __builtin_shufflevector(a, b, ((E & B) ? 16 + E - B : E)...);
  const I32x16 hi = __builtin_shufflevector(a, b, ((E & B) ? 16 + E : E + B)...);
  a = lo;
  b = hi;
}
template <int B>
inline void TransposeStage(I32x16 (&m)[16]) {
  for (int i = 0; i < 16; ++i)
    if (!(i & B)) SwapBlocks<B>(m[i], m[i + B], std::make_integer_sequence<int, 16>{});
}

inline float ScaleToFloat(float s) { return s; }
inline float ScaleToFloat(Half s) { return HalfToFloat(s.bits); }

template <typename T>
inline I32x16 LoadI32(const T* p) {
  I32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Transpose(I32x16 (&m)[16]) {
  TransposeStage<1>(m);
  TransposeStage<2>(m);
  TransposeStage<4>(m);
  TransposeStage<8>(m);
}

// Table rows [n0, n0 + 16) as tile[k / 4]: a vector whose 32-bit lane j holds bytes
// 4(k/4) .. 4(k/4) + 3 of row n0 + j, each q + 128; and scales[g]: group g's scales of the 16
// rows. The last tile of a table may have fewer rows (`count`); its lanes past them repeat the
// last row.
template <typename S>
void TransposeTile(const int8_t* rows, const S* row_scales, int64_t k_size, int64_t groups,
                   int64_t count, I32x16* tile, F16* scales) {
  const I32x16 flip = I32x16{} + static_cast<int32_t>(0x80808080u);
  I32x16 m[16];
  // The tile kTableAhead tiles on, 16 of its lines per 64 k, and its scales, asked for ahead
  // (no fault past the end): the hardware prefetcher does not foresee 16 loads a stride apart.
  // SmolLM2's output layer (49152 x 576, float16 scales) on the 2-core AMD EPYC: one row
  // 4.1-4.2 -> 1.4-1.5 ms (its 30 MB at the machine's 33 GB/s would take 0.9), 64 rows
  // 11-13 -> 8-9 ms (how they were timed is not recorded). A timing that rereads one table
  // finds it mostly in the 32 MB L3 (1.05-1.15 ms a row); read from memory, one row takes
  // 2.0-2.4 ms where a plain two-thread read of 30 MB takes 1.4-1.5, and neither the
  // transposes (left out: no faster) nor a longer prefetch distance are what holds it
  // (bench/RESULTS.md, the AMD step breakdown).
  const int8_t* ahead = rows + kTableAhead * 16 * k_size;
  const auto* ahead_scales = reinterpret_cast<const char*>(row_scales + kTableAhead * 16 * groups);
  for (int64_t byte = 0; byte < 16 * groups * int64_t{sizeof(S)}; byte += 64)
    __builtin_prefetch(ahead_scales + byte);
  for (int64_t k0 = 0; k0 < k_size; k0 += 64) {
    for (int64_t line = 0; line < 16; ++line) __builtin_prefetch(ahead + k0 * 16 + line * 64);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      m[j] = LoadI32(rows + std::min<int64_t>(j, count - 1) * k_size + k0) ^ flip;
    Transpose(m);
    std::copy(m, m + 16, tile + k0 / 4);
  }
  // The scales: as floats in rows of `groups` (one past the last for the loads below), then
  // transposed 16 groups at a time.
  float flat[16 * (kMaxTableGroups + 1)];
  if (count == 16) {  // 16 rows of scales lie together: 16 * groups, a multiple of 16
    for (int64_t i = 0; i < 16 * groups; i += kLanes) Store(flat + i, LoadScales(row_scales + i));
  } else {
    for (int j = 0; j < 16; ++j)
      for (int64_t g = 0; g < groups; ++g)
        flat[j * groups + g] =
            ScaleToFloat(row_scales[std::min<int64_t>(j, count - 1) * groups + g]);
  }
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) m[j] = LoadI32(flat + j * groups + g0);
    Transpose(m);
    for (int64_t g = g0; g < std::min(groups, g0 + 16); ++g)
      std::memcpy(&scales[g], &m[g - g0], sizeof(F16));
  }
}

// Rows [r0, r0 + Rows) of x against one transposed tile (`scales[g]`: group g's scales of its
// rows), their `count` outputs stored into y.
template <int Rows>
void TableDots(const Int8Rows& xr, int64_t r0, const I32x16* tile, const F16* scales, float* y,
               int64_t n_size, int64_t count) {
  F16 out[Rows] = {};
  for (int64_t b = 0; b < xr.blocks; ++b) {
    I32x16 acc[Rows][2];  // 2 chains of 4 instructions, not one of 8
    for (int r = 0; r < Rows; ++r) {
      acc[r][0] = I32x16{} + -128 * xr.q_sum[(r0 + r) * xr.blocks + b];
      acc[r][1] = I32x16{};
    }
    for (int s = 0; s < kQBlock / 4; ++s) {
      const auto* w = reinterpret_cast<const uint8_t*>(tile + b * kQBlock / 4 + s);
      for (int r = 0; r < Rows; ++r) {
        int32_t x4;
        std::memcpy(&x4, xr.q.get() + (r0 + r) * xr.k_size + b * kQBlock + 4 * s, 4);
        acc[r][s % 2] = Dot4(acc[r][s % 2], w, x4);
      }
    }
    const F16 scale = scales[b * kQBlock / xr.group()];
    for (int r = 0; r < Rows; ++r)
      out[r] += __builtin_convertvector(acc[r][0] + acc[r][1], F16) *
                (scale * xr.scale[(r0 + r) * xr.blocks + b]);
  }
  for (int r = 0; r < Rows; ++r) std::memcpy(y + (r0 + r) * n_size, &out[r], count * sizeof(float));
}

template <typename S>
void Int8TableMatmul(ffi::ThreadPool& pool, const Int8Rows& xr, int64_t rows,
                     const int8_t* values, const S* scales, int64_t n_size, float* y) {
  const int64_t k_size = xr.k_size, groups = xr.groups;
  ParallelFor(pool, (n_size + kQTableBlock - 1) / kQTableBlock, [&](int64_t item) {
    std::unique_ptr<I32x16[]> tile(new I32x16[k_size / 4]);
    std::unique_ptr<F16[]> tile_scales(new F16[groups]);
    const int64_t end = std::min(n_size, (item + 1) * kQTableBlock);
    for (int64_t n0 = item * kQTableBlock; n0 < end; n0 += kQTableRows) {
      const int64_t count = std::min(kQTableRows, end - n0);
      TransposeTile(values + n0 * k_size, scales + n0 * groups, k_size, groups, count,
                    tile.get(), tile_scales.get());
      for (int64_t r = 0; r < rows; r += 4) {
        float* yr = y + n0;
        switch (std::min<int64_t>(4, rows - r)) {
          case 4: TableDots<4>(xr, r, tile.get(), tile_scales.get(), yr, n_size, count); break;
          case 3: TableDots<3>(xr, r, tile.get(), tile_scales.get(), yr, n_size, count); break;
          case 2: TableDots<2>(xr, r, tile.get(), tile_scales.get(), yr, n_size, count); break;
          default: TableDots<1>(xr, r, tile.get(), tile_scales.get(), yr, n_size, count);
        }
      }
    }
  });
}

// One layer's matrix of a weight: the buffer itself ([R, C], layer < 0), or the layer-th [R, C]
// of a stack [L, R, C] of every layer's weight (one array for all layers: one argument for XLA to
// pass instead of L). `data` is null when the buffer is neither.
struct Matrix {
  const void* data;
  int64_t rows, cols;
};

Matrix LayerMatrix(const ffi::AnyBuffer& buffer, int64_t layer) {
  const auto d = buffer.dimensions();
  const auto* data = static_cast<const uint8_t*>(buffer.untyped_data());
  if (layer < 0) return d.size() == 2 ? Matrix{data, d[0], d[1]} : Matrix{nullptr, 0, 0};
  if (d.size() != 3 || layer >= d[0]) return {nullptr, 0, 0};
  const int64_t bytes = d[1] * d[2] * static_cast<int64_t>(ffi::ByteWidth(buffer.element_type()));
  return {data + layer * bytes, d[1], d[2]};
}

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::AnyBuffer values, ffi::AnyBuffer scales,
                               ffi::AnyBuffer offsets, ffi::ResultBuffer<ffi::F32> y,
                               int64_t bits, int64_t transposed, int64_t has_offsets,
                               int64_t int8_activations, int64_t layer) {
  const int64_t rows = x.dimensions()[0], k_size = x.dimensions()[1];
  const int64_t n_size = y->dimensions()[1];
  const Matrix qm = LayerMatrix(values, layer), sm = LayerMatrix(scales, layer);
  const Matrix om = has_offsets ? LayerMatrix(offsets, layer) : Matrix{nullptr, 0, 0};
  if (!qm.data || !sm.data || (has_offsets && !om.data))
    return ffi::Error::InvalidArgument("quantized matmul: 2-D weights, or 3-D ones and a layer");
  const int64_t groups = transposed ? sm.cols : sm.rows;
  const int64_t group = groups > 0 ? k_size / groups : 0;
  const int64_t group_multiple = !transposed ? bits / 4 : bits == 8 ? kLanes : 2 * kLanes;
  if (group <= 0 || group * groups != k_size || group % group_multiple != 0 ||
      (!transposed && n_size % (kTile / 2) != 0) || (bits != 8 && bits != 4)) {
    return ffi::Error::InvalidArgument("quantized matmul: unsupported shape (see __init__.py)");
  }
  const ffi::DataType scale_type = scales.element_type();
  if ((scale_type != ffi::DataType::F32 && scale_type != ffi::DataType::F16) ||
      (has_offsets && offsets.element_type() != scale_type)) {
    return ffi::Error::InvalidArgument("quantized matmul: scales and offsets of one float dtype");
  }
  const float* xp = x.typed_data();
  const auto* q = static_cast<const uint8_t*>(qm.data);
  float* yp = y->typed_data();
  const auto run_with = [&](auto&& matmul) {  // with the scales' element type
    if (scale_type == ffi::DataType::F16) matmul(static_cast<const Half*>(sm.data));
    else matmul(static_cast<const float*>(sm.data));
  };
  if (int8_activations && transposed) {
    if (bits != 8 || has_offsets || group % kQBlock != 0 || k_size % 64 != 0 ||
        k_size / kQBlock > kMaxTableGroups)
      return ffi::Error::InvalidArgument("quantized matmul: 8-bit activations need an int8 "
                                         "table without offsets, groups of 32k, K of 64k <= 4096");
    const Int8Rows xr(xp, rows, k_size, group, /*nibble_order=*/false);
    run_with([&](const auto* s) {
      Int8TableMatmul(pool, xr, rows, reinterpret_cast<const int8_t*>(q), s, n_size, yp);
    });
    return ffi::Error::Success();
  }
  if (int8_activations) {
    if (bits != 4 || group % kQBlock != 0 || n_size % kQTile != 0)
      return ffi::Error::InvalidArgument("quantized matmul: 8-bit activations need int4 [In, Out] "
                                         "weights, groups of 32k and 64k outputs");
    const Int8Rows xr(xp, rows, k_size, group, /*nibble_order=*/true);
    run_with([&](const auto* s) {
      using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
      const S* o = has_offsets ? static_cast<const S*>(om.data) : nullptr;
      Int4Int8Matmul<S>(pool, xr, rows, {{q, s, o, n_size, yp}});
    });
    return ffi::Error::Success();
  }
  if (scale_type != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("quantized matmul: float16 scales need 8-bit activations");
  const float* s = static_cast<const float*>(sm.data);
  const float* o = has_offsets ? static_cast<const float*>(om.data) : nullptr;
  if (!transposed) {
    ParallelFor(pool, (n_size + kTile - 1) / kTile, [&](int64_t tile) {
      if (bits == 8) KnTileAt<8>(xp, rows, k_size, q, s, o, group, n_size, tile, yp);
      else KnTileAt<4>(xp, rows, k_size, q, s, o, group, n_size, tile, yp);
    });
    return ffi::Error::Success();
  }
  constexpr int64_t kBlock = 512;  // table rows per work item
  // int4: each row of x as its even elements, then its odd ones (the bytes' low, high nibbles)
  std::unique_ptr<float[]> split(new float[bits == 4 ? rows * k_size : 0]);
  for (int64_t r = 0; bits == 4 && r < rows; ++r)
    for (int64_t i = 0; i < k_size / 2; ++i) {
      split[r * k_size + i] = xp[r * k_size + 2 * i];
      split[r * k_size + k_size / 2 + i] = xp[r * k_size + 2 * i + 1];
    }
  const float* xs = bits == 4 ? split.get() : xp;
  ParallelFor(pool, (n_size + kBlock - 1) / kBlock, [&](int64_t item) {
    std::unique_ptr<float[]> w(new float[kTableRows * k_size]);
    for (int64_t n = item * kBlock; n < std::min(n_size, (item + 1) * kBlock); n += kTableRows) {
      const int64_t count = std::min(kTableRows, n_size - n);
      if (bits == 8)
        NkTableRows<8>(xs, rows, k_size, q, s, o, group, n_size, n, count, w.get(), yp);
      else
        NkTableRows<4>(xs, rows, k_size, q, s, o, group, n_size, n, count, w.get(), yp);
    }
  });
  return ffi::Error::Success();
}

// The same rows of x against several int4 [K, N_i] weights in the same groups (q, k and v; gate
// and up) in one parallel loop. Bit i of `int8_activations` marks weight i for 8-bit activations
// (x rounded once for all of them, their scales of one float dtype); the others take x as it is,
// with float32 scales, tile by tile as `quantized_matmul` does. Args after x: values, scales and
// offsets (or a dummy) of each weight; one result per weight.
constexpr int64_t kMaxWeights = 62;  // MAX_WEIGHTS in __init__.py

ffi::Error QuantizedMatmulsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                ffi::RemainingArgs weights, ffi::RemainingRets ys,
                                int64_t has_offsets, int64_t int8_activations, int64_t layer) {
  const int64_t rows = x.dimensions()[0], k_size = x.dimensions()[1];
  const int64_t count = static_cast<int64_t>(ys.size());
  const auto invalid = [](const char* what) {
    return ffi::Error::InvalidArgument(std::string("quantized matmuls: ") + what);
  };
  if (count == 0 || static_cast<int64_t>(weights.size()) != 3 * count)
    return invalid("need values, scales and offsets for each result");
  if (count > kMaxWeights) return invalid("at most 62 weights (a bit of int8_activations each)");
  struct Parts {
    Matrix values, scales, offsets;
    float* y;
    bool int8;
  };
  std::vector<Parts> parts;
  ffi::DataType int8_scales = ffi::DataType::INVALID;  // the 8-bit-activation weights' dtype
  for (int64_t i = 0; i < count; ++i) {
    const auto values = weights.get<ffi::AnyBuffer>(3 * i);
    const auto scales = weights.get<ffi::AnyBuffer>(3 * i + 1);
    const auto offsets = weights.get<ffi::AnyBuffer>(3 * i + 2);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!values || !scales || !offsets || !y) return invalid("arguments are not buffers");
    const Matrix v = LayerMatrix(*values, layer), s = LayerMatrix(*scales, layer);
    const Matrix o = has_offsets ? LayerMatrix(*offsets, layer) : Matrix{nullptr, 0, 0};
    if (!v.data || !s.data || (has_offsets && !o.data))
      return invalid("need 2-D weights, or 3-D ones and a layer");
    const bool int8 = (int8_activations >> i) & 1;
    const ffi::DataType scale_type = scales->element_type();
    if (int8 && int8_scales == ffi::DataType::INVALID) int8_scales = scale_type;
    const auto yd = (*y)->dimensions();
    if (yd.size() != 2 || 2 * v.rows != k_size || yd[0] != rows || v.cols != yd[1] ||
        s.cols != yd[1] || yd[1] % kQTile != 0 || s.rows <= 0 || k_size % s.rows != 0 ||
        (k_size / s.rows) % kQBlock != 0 || (i > 0 && s.rows != parts[0].scales.rows) ||
        values->element_type() != ffi::DataType::U8 ||
        (int8 ? (scale_type != ffi::DataType::F32 && scale_type != ffi::DataType::F16) ||
                    scale_type != int8_scales
              : scale_type != ffi::DataType::F32) ||
        (has_offsets && (offsets->element_type() != scale_type || o.rows != s.rows ||
                         o.cols != s.cols)))
      return invalid("need int4 [K, N] weights (N of 64k) in the same groups of 32k, with "
                     "scales and offsets of one float dtype (float32 without 8-bit "
                     "activations)");
    parts.push_back({v, s, o, (*y)->typed_data(), int8});
  }
  const int64_t group = k_size / parts[0].scales.rows;
  // The float-activation weights' work items: their column tiles.
  struct Tile {
    const Parts* w;
    int64_t tile;
  };
  std::vector<Tile> tiles;
  for (const Parts& w : parts)
    for (int64_t t = 0; !w.int8 && t * kTile < w.values.cols; ++t) tiles.push_back({&w, t});
  const auto float_tile = [&](int64_t i) {
    const Parts& w = *tiles[i].w;
    KnTileAt<4>(x.typed_data(), rows, k_size, static_cast<const uint8_t*>(w.values.data),
                static_cast<const float*>(w.scales.data),
                has_offsets ? static_cast<const float*>(w.offsets.data) : nullptr, group,
                w.values.cols, tiles[i].tile, w.y);
  };
  if (int8_scales == ffi::DataType::INVALID) {  // no 8-bit-activation weight: x stays float
    ParallelFor(pool, static_cast<int64_t>(tiles.size()), float_tile);
    return ffi::Error::Success();
  }
  const Int8Rows xr(x.typed_data(), rows, k_size, group, /*nibble_order=*/true);
  const auto run = [&](const auto* tag) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    std::vector<Int4Product<S>> products;
    for (const Parts& w : parts)
      if (w.int8)
        products.push_back({static_cast<const uint8_t*>(w.values.data),
                            static_cast<const S*>(w.scales.data),
                            has_offsets ? static_cast<const S*>(w.offsets.data) : nullptr,
                            w.values.cols, w.y});
    Int4Int8Matmul(pool, xr, rows, products, static_cast<int64_t>(tiles.size()), float_tile);
  };
  if (int8_scales == ffi::DataType::F16) run(static_cast<const Half*>(nullptr));
  else run(static_cast<const float*>(nullptr));
  return ffi::Error::Success();
}

// ---- float32 matmul for few rows ------------------------------------------------------------

// y f32[T, N] = x f32[T, K] @ w f32[K, N] (or @ w^T for w f32[N, K], an embedding table as the
// output layer) for the few rows of a decode or verification step. XLA:CPU runs a one-row
// product as a matrix-vector loop but a 2-16-row one as a general matrix product that packs the
// whole weight first; this reads each weight once per kDenseRows rows, in place. Each output
// element is one fused multiply-add chain over k in a fixed order, the same for any T, so a row's
// result does not depend on which other rows share the call (a verification step's logits at
// its first position equal a plain step's bit for bit).
constexpr int64_t kDenseTile = 64;  // [K, N]: columns per work item's pass, 4 vectors
constexpr int kDenseRows = 4;       // [K, N]: rows of x per pass over a tile's weights
constexpr int64_t kDenseTableBlock = 256;  // [N, K]: table rows per work item

template <int R, int V>
void DenseTile(const float* x, int64_t k_size, const float* w, int64_t n_size, int64_t n0,
               float* y) {
  F16 acc[R][V] = {};
  for (int64_t k = 0; k < k_size; ++k) {
    const float* row = w + k * n_size + n0;
    // The tile's rows are a stride apart, which the hardware prefetcher follows poorly.
    for (int v = 0; v < V; ++v) __builtin_prefetch(row + kPrefetch * n_size + v * kLanes);
    F16 wk[V];
    for (int v = 0; v < V; ++v) wk[v] = Load(row + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float a = x[r * k_size + k];
      for (int v = 0; v < V; ++v) acc[r][v] += a * wk[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(y + r * n_size + n0 + v * kLanes, acc[r][v]);
}

template <int V>
void DenseColumns(const float* x, int64_t rows, int64_t k_size, const float* w, int64_t n_size,
                  int64_t n0, float* y) {
  for (int64_t r = 0; r < rows; r += kDenseRows) {
    const float* xr = x + r * k_size;
    float* yr = y + r * n_size;
    switch (std::min<int64_t>(kDenseRows, rows - r)) {
      case 4: DenseTile<4, V>(xr, k_size, w, n_size, n0, yr); break;
      case 3: DenseTile<3, V>(xr, k_size, w, n_size, n0, yr); break;
      case 2: DenseTile<2, V>(xr, k_size, w, n_size, n0, yr); break;
      default: DenseTile<1, V>(xr, k_size, w, n_size, n0, yr);
    }
  }
}

// One table row n against every row of x (R <= kDenseMaxRows accumulators).
template <int R>
void DenseTableRow(const float* x, int64_t k_size, const float* w, int64_t n_size, int64_t n,
                   float* y) {
  F16 acc[R] = {};
  const float* row = w + n * k_size;
  for (int64_t k = 0; k < k_size; k += kLanes) {
    const F16 wk = Load(row + k);
    for (int r = 0; r < R; ++r) acc[r] += Load(x + r * k_size + k) * wk;
  }
  for (int r = 0; r < R; ++r) y[r * n_size + n] = Sum(acc[r]);
}

constexpr int64_t kDenseMaxRows = 16;

template <int... Rs>
void DenseTableRows(int64_t rows, const float* x, int64_t k_size, const float* w, int64_t n_size,
                    int64_t n, float* y, std::integer_sequence<int, Rs...>) {
  using Fn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*);
  static constexpr Fn fns[] = {&DenseTableRow<Rs + 1>...};
  fns[rows - 1](x, k_size, w, n_size, n, y);
}

ffi::Error DenseMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> y, int64_t transposed) {
  const int64_t rows = x.dimensions()[0], k_size = x.dimensions()[1];
  const int64_t n_size = y->dimensions()[1];
  const auto wd = w.dimensions();
  const bool fits = transposed ? wd[0] == n_size && wd[1] == k_size && k_size % kLanes == 0
                               : wd[0] == k_size && wd[1] == n_size && n_size % kLanes == 0;
  if (!fits || rows < 1 || rows > kDenseMaxRows) {
    return ffi::Error::InvalidArgument("dense matmul: unsupported shape (see __init__.py)");
  }
  const float *xp = x.typed_data(), *wp = w.typed_data();
  float* yp = y->typed_data();
  if (transposed) {
    ParallelFor(pool, (n_size + kDenseTableBlock - 1) / kDenseTableBlock, [&](int64_t item) {
      const int64_t end = std::min(n_size, (item + 1) * kDenseTableBlock);
      for (int64_t n = item * kDenseTableBlock; n < end; ++n)
        DenseTableRows(rows, xp, k_size, wp, n_size, n, yp,
                       std::make_integer_sequence<int, kDenseMaxRows>{});
    });
    return ffi::Error::Success();
  }
  const int64_t tiles = n_size / kDenseTile, rest = (n_size % kDenseTile) / kLanes;
  ParallelFor(pool, tiles + rest, [&](int64_t item) {
    if (item < tiles) DenseColumns<kDenseTile / kLanes>(xp, rows, k_size, wp, n_size, item * kDenseTile, yp);
    else DenseColumns<1>(xp, rows, k_size, wp, n_size, tiles * kDenseTile + (item - tiles) * kLanes, yp);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveRaggedAttention, RaggedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::AnyBuffer>()         // kv_pages [P, ps, 2Hkv, D]
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
                                  .Arg<ffi::AnyBuffer>()         // scales f32|f16
                                  .Arg<ffi::AnyBuffer>()         // offsets (or a dummy)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, N]
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("transposed")
                                  .Attr<int64_t>("has_offsets")
                                  .Attr<int64_t>("int8_activations")
                                  .Attr<int64_t>("layer"));  // -1: 2-D weights

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveQuantizedMatmuls, QuantizedMatmulsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .RemainingArgs()  // values u8, scales, offsets per weight
                                  .RemainingRets()  // y [T, N_i] f32 per weight
                                  .Attr<int64_t>("has_offsets")
                                  .Attr<int64_t>("int8_activations")  // a bit per weight
                                  .Attr<int64_t>("layer"));  // -1: 2-D weights

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveDenseMatmul, DenseMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N]; transposed: [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, N]
                                  .Attr<int64_t>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveWriteKV, WriteKVImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // pages [P, ps, 2Hkv, Dp]
                                  .Arg<ffi::AnyBuffer>()          // rows [T, 2Hkv, Dp]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots [T]
                                  .Ret<ffi::AnyBuffer>());        // pages, aliased
