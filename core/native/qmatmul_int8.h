/*
 * x @ dequantize(w).T with x rounded to 8-bit integers, for products of many rows of x (a prefill chunk, a batched
 * or speculative step of 4 rows or more), on AVX-512 VNNI or AVX2. Opt-in (mlxchat.quantized.set_int8_activations):
 * llama.cpp's arithmetic, not MLX's.
 *
 * Why: a float32 product does at most 16 multiply-adds a cycle a core (one 512-bit FMA); vpdpbusd does 64
 * (four unsigned bytes times four signed bytes into each of 16 int32 lanes). With a prompt's rows of x the
 * dequantize-then-sgemm path runs at ~90% of the float32 GEMM bound, so integers are the only way past it,
 * and llama.cpp's Q4_0 and Q8_0 products round activations to 8 bits the same way. Without VNNI, AVX2's
 * vpmaddubsw and vpmaddwd compute the same integer sums (tile_int8_avx2), in more instructions.
 *
 * Per row m of x and quantization group g: sx = max|x| / 127, xq = round(x / sx), and
 *   out[m, n] = sum_g sx[m, g] * (scale[n, g] * sum_{k in g} q[n, k] * xq[m, k] + bias[n, g] * sum_{k in g} xq[m, k]),
 * the product of the rounded x with the dequantized weights. (With the exact sum of x in the bias term instead,
 * the rounding errors meet q's mean, 7.5 at 4 bits, without the bias's cancelling them: 2.7x the error.)
 * The inner sums are exact integers and a row's float steps do not depend on the other rows, so on this path a
 * row's result is the same whatever rows it is computed with (whether a product takes the path depends on its
 * rows' count); it differs from the float product by x's rounding (up to half of sx per value: outputs move by
 * ~1e-3 relative). A group holding an infinity or a NaN gives NaN.
 *
 * Layout: a task copies 16 weight rows at a time into a buffer a 32-bit word at a time (word i of the 16 rows
 * side by side: one register), with their scales and biases as [G][16]. At 4 bits word i's low nibbles are
 * k = 8i, 8i+2, 8i+4, 8i+6 and its high nibbles the odd k, so each 8 values of a row of xq are stored as the
 * even four, then the odd four; at 8 bits word i is k = 4i..4i+3 and xq keeps its order. Other widths are
 * repacked to 4 or 8 bits first (repacked_rows). Rows of x go through in tiles of 12, then 8 or 4 (the last padded
 * with zero rows), each tile's int32 and float accumulators in registers.
 */
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "qmatmul_kernels.h"
#include "simd.h"

namespace mlxchat_q {

constexpr int INT8_ROWS = 12;  // most rows of x a tile keeps in registers: 12 int32 and 12 float accumulators
constexpr int INT8_MIN_ROWS = 4;  // the smallest tile (8 and 4 take the rows past the 12s: at most 3 padded)

/* The integer kernels an ISA's tables can use: vpdpbusd (AVX-512 VNNI), or vpmaddubsw and vpmaddwd (AVX2). */
enum class Int8Kernel { none, avx2, vnni };

/* The kernel for the active ISA (`isa` is never more than the CPU has; avx512 means F, BW, VL and DQ). */
inline Int8Kernel int8_kernel(Isa isa) {
  if (isa >= Isa::avx512 && mlxchat_simd::has_avx512_vnni()) return Int8Kernel::vnni;
  return isa >= Isa::avx2 ? Int8Kernel::avx2 : Int8Kernel::none;
}

/* Rows of x rounded for the kernel: [M][K] int8 (in the kernel's order), [M][G] scales sx and sums of xq (NaN for a
 * group holding an infinity or a NaN); M a multiple of INT8_MIN_ROWS. */
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
  int M = 0;
};

#if defined(__x86_64__)
#define MLXQ_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))

/* Row `row` (K values) rounded into slot m of `x` (kernel_bits: 4 or 8, the order the kernel reads). */
MLXQ_VNNI inline void round_row(const float* row, int K, int gs, int bits, Int8Rows& x, int m) {
  const int G = K / gs;
  const __m512i order = bits == 4 ? _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
                                  : _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int8_t* q = x.q.data() + (size_t)m * K;
  for (int g = 0; g < G; ++g) {
    const float* v = row + (size_t)g * gs;
    __m512 peak = _mm512_setzero_ps();
    __mmask16 special = 0;  // lanes that held an infinity or a NaN (max_ps may drop a NaN)
    for (int k = 0; k < gs; k += 16) {
      const __m512 a = _mm512_loadu_ps(v + k);
      peak = _mm512_max_ps(peak, _mm512_abs_ps(a));
      special |= _mm512_fpclass_ps_mask(a, 0x99);  // quiet NaN, +inf, -inf, signalling NaN
    }
    const float amax = _mm512_reduce_max_ps(peak), scale = amax / 127.0f;
    // groups below 1e-30 (where 127 / max could overflow) round to zeros: they add less than 1e-28
    const __m512 inv = _mm512_set1_ps(amax > 1e-30f ? 127.0f / amax : 0.0f);
    __m512i rounded_total = _mm512_setzero_si512();
    for (int k = 0; k < gs; k += 16) {
      const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + k), inv));
      rounded_total = _mm512_add_epi32(rounded_total, rounded);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + (size_t)g * gs + k),
                       _mm512_cvtsepi32_epi8(_mm512_permutexvar_epi32(order, rounded)));
    }
    x.scale[(size_t)m * G + g] = scale;
    x.sum[(size_t)m * G + g] =
        special ? std::numeric_limits<float>::quiet_NaN() : float(_mm512_reduce_add_epi32(rounded_total));
  }
}

/* dst[i * 16 + r] = 32-bit value i of row r, for `values` values of rows [0, count) (count <= 16) `stride` bytes
 * apart; rows past count are zero. 16 values at a time: 16 rows loaded, transposed in registers. */
MLXQ_VNNI inline void transpose_rows(const uint8_t* rows, size_t stride, int count, int values, uint32_t* dst) {
  for (int i0 = 0; i0 < values; i0 += 16) {
    const __mmask16 live = __mmask16(values - i0 >= 16 ? 0xFFFF : (1u << (values - i0)) - 1);
    __m512i r[16], t[16], u[16];
    for (int j = 0; j < 16; ++j)
      r[j] = j < count ? _mm512_maskz_loadu_epi32(live, rows + j * stride + 4 * (size_t)i0) : _mm512_setzero_si512();
    for (int j = 0; j < 16; j += 2) {  // t[j] lane L: r[j][4L], r[j+1][4L], r[j][4L+1], r[j+1][4L+1]; t[j+1]: +2
      t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
      t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
    }
    for (int b = 0; b < 16; b += 4) {  // u[b + c] lane L: rows b..b+3 at 4L + c
      u[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
      u[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
      u[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
      u[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    for (int c = 0; c < 4; ++c) {  // value 4L + c of all rows: lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
      const __m512i even_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), odd_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
      const __m512i even_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
      const __m512i odd_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
      const __m512i out[4] = {_mm512_shuffle_i32x4(even_lo, even_hi, 0x88), _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88),
                              _mm512_shuffle_i32x4(even_lo, even_hi, 0xDD), _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xDD)};
      for (int L = 0; L < 4; ++L)
        if (i0 + 4 * L + c < values) _mm512_storeu_si512(dst + (size_t)(i0 + 4 * L + c) * 16, out[L]);
    }
  }
}

/* The next 16 weight rows, their scales and biases (as the panel lays them out), fetched into L1 a part per group
 * while a tile computes: the transposes otherwise wait on memory (with 8 rows of x, a 3072x1024 4-bit product
 * took 0.13 ms from DRAM, 0.063 from L2; fetching the next rows in one run when a panel starts, at any distance
 * or cache level, measured no better; spread over the tile's groups, with the scales and biases: 0.077). */
struct Upcoming {
  const uint8_t* words = nullptr;  // null: nothing to fetch
  size_t per_group = 0;            // bytes of `words` a group fetches
  const uint8_t *scales = nullptr, *biases = nullptr;  // 16 rows x G floats: a 64-byte line a group

  void fetch(int g) const {
    if (words == nullptr) return;
    for (size_t offset = 0; offset < per_group; offset += 64)
      _mm_prefetch(reinterpret_cast<const char*>(words + g * per_group + offset), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(scales + 64 * (size_t)g), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(biases + 64 * (size_t)g), _MM_HINT_T0);
  }
};

/* One tile: R rows of x (from m0) against 16 gathered weight rows; out[r] (null: a padding row). */
template <int BITS, int GS, int R>
MLXQ_VNNI void tile_int8(const uint32_t* words, const float* scales, const float* biases, const Int8Rows& x, int m0,
                         int K, float* const* out, __mmask16 columns, const Upcoming& next) {
  constexpr int WORDS = GS * BITS / 32;
  const int G = K / GS;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* xq = x.q.data() + (size_t)m0 * K;
  const float* sx = x.scale.data() + (size_t)m0 * G;
  const float* xs = x.sum.data() + (size_t)m0 * G;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    next.fetch(g);
    __m512i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm512_setzero_si512();
    for (int i = 0; i < WORDS; ++i) {
      const __m512i w = _mm512_loadu_si512(words + (size_t)(g * WORDS + i) * 16);
      const int8_t* xi = xq + (size_t)g * GS + i * (32 / BITS);
      if constexpr (BITS == 4) {
        const __m512i even = _mm512_and_si512(w, low), odd = _mm512_and_si512(_mm512_srli_epi32(w, 4), low);
        for (int r = 0; r < R; ++r) {
          int32_t e, o;
          std::memcpy(&e, xi + (size_t)r * K, 4);
          std::memcpy(&o, xi + (size_t)r * K + 4, 4);
          dots[r] = _mm512_dpbusd_epi32(dots[r], even, _mm512_set1_epi32(e));
          dots[r] = _mm512_dpbusd_epi32(dots[r], odd, _mm512_set1_epi32(o));
        }
      } else {
        for (int r = 0; r < R; ++r) {
          int32_t v;
          std::memcpy(&v, xi + (size_t)r * K, 4);
          dots[r] = _mm512_dpbusd_epi32(dots[r], w, _mm512_set1_epi32(v));
        }
      }
    }
    const __m512 scale = _mm512_loadu_ps(scales + (size_t)g * 16), bias = _mm512_loadu_ps(biases + (size_t)g * 16);
    for (int r = 0; r < R; ++r) {  // (scale * dot + bias * sum of xq) * sx: no overflow where x is huge
      const __m512 dot = _mm512_fmadd_ps(bias, _mm512_set1_ps(xs[(size_t)r * G + g]),
                                         _mm512_mul_ps(_mm512_cvtepi32_ps(dots[r]), scale));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(sx[(size_t)r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    if (out[r] != nullptr) _mm512_mask_storeu_ps(out[r], columns, acc[r]);
}

template <int BITS, int R>
MLXQ_VNNI void tile_int8(int gs, const uint32_t* words, const float* scales, const float* biases, const Int8Rows& x,
                         int m0, int K, float* const* out, __mmask16 columns, const Upcoming& next) {
  if (gs == 32) return tile_int8<BITS, 32, R>(words, scales, biases, x, m0, K, out, columns, next);
  if (gs == 64) return tile_int8<BITS, 64, R>(words, scales, biases, x, m0, K, out, columns, next);
  tile_int8<BITS, 128, R>(words, scales, biases, x, m0, K, out, columns, next);
}

/* The tile for the rows from m0 (of x.M, a multiple of INT8_MIN_ROWS); returns how many it took. */
template <int BITS>
MLXQ_VNNI int tile_int8(int gs, const uint32_t* words, const float* scales, const float* biases, const Int8Rows& x,
                        int m0, int K, float* const* out, __mmask16 columns, const Upcoming& next) {
  const int left = x.M - m0;
  if (left >= 12) return tile_int8<BITS, 12>(gs, words, scales, biases, x, m0, K, out, columns, next), 12;
  if (left >= 8) return tile_int8<BITS, 8>(gs, words, scales, biases, x, m0, K, out, columns, next), 8;
  return tile_int8<BITS, 4>(gs, words, scales, biases, x, m0, K, out, columns, next), 4;
}

// -- AVX2: vpmaddubsw (pairs of unsigned weight bytes times signed x bytes into int16) and vpmaddwd ------------

/* round_row's AVX2 twin: the same rounding, order and sums. */
MLXQ_AVX2 inline void round_row_avx2(const float* row, int K, int gs, int bits, Int8Rows& x, int m) {
  const int G = K / gs;
  const __m256i order = bits == 4 ? _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7) : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 sign = _mm256_set1_ps(-0.0f), infinity = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  int8_t* q = x.q.data() + (size_t)m * K;
  for (int g = 0; g < G; ++g) {
    const float* v = row + (size_t)g * gs;
    __m256 peak = _mm256_setzero_ps(), special = _mm256_setzero_ps();
    for (int k = 0; k < gs; k += 8) {
      const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + k));
      peak = _mm256_max_ps(peak, a);
      special = _mm256_or_ps(special, _mm256_cmp_ps(a, infinity, _CMP_NLT_UQ));  // infinite or NaN
    }
    __m128 p4 = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
    p4 = _mm_max_ps(p4, _mm_movehl_ps(p4, p4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(p4, _mm_movehdup_ps(p4))), scale = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 1e-30f ? 127.0f / amax : 0.0f);
    __m256i total = _mm256_setzero_si256();
    for (int k = 0; k < gs; k += 8) {
      const __m256i rounded = _mm256_permutevar8x32_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + k), inv)),
                                                          order);
      total = _mm256_add_epi32(total, rounded);
      const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + (size_t)g * gs + k), _mm_packs_epi16(halves, halves));
    }
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    x.scale[(size_t)m * G + g] = scale;
    x.sum[(size_t)m * G + g] = _mm256_movemask_ps(special) ? std::numeric_limits<float>::quiet_NaN()
                                                           : float(_mm_cvtsi128_si32(t4));
  }
}

/* transpose_rows' AVX2 twin: 8 rows by 8 values at a time. */
MLXQ_AVX2 inline void transpose_rows_avx2(const uint8_t* rows, size_t stride, int count, int values, uint32_t* dst) {
  for (int i0 = 0; i0 < values; i0 += 8) {
    const int live = std::min(8, values - i0);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7
      __m256i r[8], t[8], u[8];
      for (int j = 0; j < 8; ++j) {
        const int row = 8 * h + j;
        r[j] = row < count ? _mm256_maskload_epi32(reinterpret_cast<const int*>(rows + row * stride + 4 * (size_t)i0), mask)
                           : _mm256_setzero_si256();
      }
      for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
      }
      for (int b = 0; b < 8; b += 4) {  // u[b + c] half L: rows b..b+3 at 4L + c
        u[b] = _mm256_unpacklo_epi64(t[b], t[b + 2]);
        u[b + 1] = _mm256_unpackhi_epi64(t[b], t[b + 2]);
        u[b + 2] = _mm256_unpacklo_epi64(t[b + 1], t[b + 3]);
        u[b + 3] = _mm256_unpackhi_epi64(t[b + 1], t[b + 3]);
      }
      for (int c = 0; c < 4; ++c) {
        if (c < live)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (size_t)(i0 + c) * 16 + 8 * h),
                              _mm256_permute2x128_si256(u[c], u[4 + c], 0x20));
        if (4 + c < live)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (size_t)(i0 + 4 + c) * 16 + 8 * h),
                              _mm256_permute2x128_si256(u[c], u[4 + c], 0x31));
      }
    }
  }
}

/*
 * One AVX2 tile: 4 rows of x against 8 of the 16 gathered weight rows (half h). vpmaddubsw multiplies adjacent
 * byte pairs into int16 (4-bit weights: at most 2 * 15 * 128, no saturation), vpmaddwd adds those pairs into
 * int32. 8-bit weights (up to 255) would saturate int16: they go in centred, q - 128 (at most 2 * 128 * 127 a
 * pair, vpsignb carrying its sign over to x), and 128 * sum xq is added back in float, exactly.
 */
template <int BITS, int GS>
MLXQ_AVX2 void tile_int8_avx2(const uint32_t* words, const float* scales, const float* biases, const Int8Rows& x,
                              int m0, int K, float* const* out, int h, int columns, const Upcoming& next) {
  constexpr int R = INT8_MIN_ROWS, WORDS = GS * BITS / 32;
  const int G = K / GS;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
  const int8_t* xq = x.q.data() + (size_t)m0 * K;
  const float* sx = x.scale.data() + (size_t)m0 * G;
  const float* xs = x.sum.data() + (size_t)m0 * G;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    next.fetch(g);
    __m256i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = _mm256_setzero_si256();
    for (int i = 0; i < WORDS; ++i) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + (size_t)(g * WORDS + i) * 16 + 8 * h));
      const int8_t* xi = xq + (size_t)g * GS + i * (32 / BITS);
      if constexpr (BITS == 4) {  // lo: k = 8i + 2j, hi: 8i + 2j + 1 (the even quad, then the odd one)
        const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        for (int r = 0; r < R; ++r) {
          int32_t e, o;
          std::memcpy(&e, xi + (size_t)r * K, 4);
          std::memcpy(&o, xi + (size_t)r * K + 4, 4);
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(e)),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(o)));
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(pairs, ones));
        }
      } else {  // (q - 128) * x as |q - 128| * (x signed like q - 128)
        const __m256i centred = _mm256_xor_si256(w, flip), magnitude = _mm256_abs_epi8(centred);
        for (int r = 0; r < R; ++r) {
          int32_t v;
          std::memcpy(&v, xi + (size_t)r * K, 4);
          const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(_mm256_set1_epi32(v), centred));
          dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    const __m256 scale = _mm256_loadu_ps(scales + (size_t)g * 16 + 8 * h);
    const __m256 bias = _mm256_loadu_ps(biases + (size_t)g * 16 + 8 * h);
    for (int r = 0; r < R; ++r) {
      const __m256 sum = _mm256_set1_ps(xs[(size_t)r * G + g]);
      __m256 integers = _mm256_cvtepi32_ps(dots[r]);
      if constexpr (BITS == 8) integers = _mm256_fmadd_ps(_mm256_set1_ps(128.0f), sum, integers);  // exact: < 2^24
      const __m256 dot = _mm256_fmadd_ps(bias, sum, _mm256_mul_ps(integers, scale));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(sx[(size_t)r * G + g]), acc[r]);
    }
  }
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(columns), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int r = 0; r < R; ++r)
    if (out[r] != nullptr) _mm256_maskstore_ps(out[r] + 8 * h, mask, acc[r]);
}

template <int BITS>
MLXQ_AVX2 void tile_int8_avx2(int gs, const uint32_t* words, const float* scales, const float* biases,
                              const Int8Rows& x, int m0, int K, float* const* out, int h, int columns,
                              const Upcoming& next) {
  if (gs == 32) return tile_int8_avx2<BITS, 32>(words, scales, biases, x, m0, K, out, h, columns, next);
  if (gs == 64) return tile_int8_avx2<BITS, 64>(words, scales, biases, x, m0, K, out, h, columns, next);
  tile_int8_avx2<BITS, 128>(words, scales, biases, x, m0, K, out, h, columns, next);
}
/* Weight rows [0, count) of a kernel-width panel (count <= 16) into the task's buffers (rows past count: zero). */
inline void gather_words(const Panel& p, Int8Kernel kernel, int count, std::vector<uint32_t>& words,
                         std::vector<float>& scales, std::vector<float>& biases) {
  const int row_words = p.K * p.bits / 32;
  words.resize((size_t)row_words * 16);
  scales.resize((size_t)p.G * 16);
  biases.resize((size_t)p.G * 16);
  const auto transpose = kernel == Int8Kernel::vnni ? transpose_rows : transpose_rows_avx2;
  transpose(p.w, (size_t)row_words * 4, count, row_words, words.data());
  transpose(reinterpret_cast<const uint8_t*>(p.scales), (size_t)p.G * 4, count, p.G,
            reinterpret_cast<uint32_t*>(scales.data()));
  transpose(reinterpret_cast<const uint8_t*>(p.biases), (size_t)p.G * 4, count, p.G,
            reinterpret_cast<uint32_t*>(biases.data()));
}
#endif

/* Room for M rows of x rounded, padded to a multiple of INT8_MIN_ROWS (slots past M stay zero). */
inline void size_rows(int M, int K, int gs, Int8Rows& x) {
  x.M = (M + INT8_MIN_ROWS - 1) / INT8_MIN_ROWS * INT8_MIN_ROWS;
  x.q.assign((size_t)x.M * K, 0);
  x.scale.assign((size_t)x.M * (K / gs), 0.0f);
  x.sum.assign((size_t)x.M * (K / gs), 0.0f);
}

/* Rows [first, first + count) of x rounded into their slots, for weights of `bits`. */
inline void round_rows(const float* const* rows, int first, int count, int K, int gs, int bits, Int8Kernel kernel,
                       Int8Rows& x) {
#if defined(__x86_64__)
  for (int m = first; m < first + count; ++m)
    if (kernel == Int8Kernel::vnni)
      round_row(rows[m], K, gs, kernel_bits(bits), x, m);
    else
      round_row_avx2(rows[m], K, gs, kernel_bits(bits), x, m);
#endif
}

/* Output columns [n0, n1) of the product for every row of a panel (p.M rows; x rounded from them). */
inline void rows_int8(const Panel& p, Isa isa, Int8Kernel kernel, const Int8Rows& x, int n0, int n1) {
#if defined(__x86_64__)
  thread_local std::vector<uint8_t> repacked;
  thread_local std::vector<uint32_t> words;
  thread_local std::vector<float> scales, biases;
  for (int n = n0; n < n1; n += 16) {
    const int count = std::min(16, n1 - n);
    const Panel q = repacked_width(p.bits) ? repacked_rows(p, isa, n, count, repacked) : rows_from(p, n);
    Upcoming next;  // the first tile fetches the next 16 rows (repacked widths fetch their own, repacked_rows)
    if (!repacked_width(p.bits) && n + 16 < n1) {
      const size_t block = (size_t)16 * p.K * p.bits / 8;
      next = {q.w + block, (block / p.G + 63) / 64 * 64, reinterpret_cast<const uint8_t*>(q.scales + 16 * p.G),
              reinterpret_cast<const uint8_t*>(q.biases + 16 * p.G)};
    }
    gather_words(q, kernel, count, words, scales, biases);
    for (int m0 = 0; m0 < x.M; next = {}) {
      float* out[INT8_ROWS];
      for (int r = 0; r < INT8_ROWS; ++r) out[r] = m0 + r < p.M ? p.out + p.out_at[m0 + r] + n : nullptr;
      if (kernel == Int8Kernel::vnni) {
        const __mmask16 columns = __mmask16((1u << count) - 1);
        m0 += q.bits == 4
                  ? tile_int8<4>(p.gs, words.data(), scales.data(), biases.data(), x, m0, p.K, out, columns, next)
                  : tile_int8<8>(p.gs, words.data(), scales.data(), biases.data(), x, m0, p.K, out, columns, next);
        continue;
      }
      for (int h = 0; h * 8 < count; ++h, next = {})
        if (q.bits == 4)
          tile_int8_avx2<4>(p.gs, words.data(), scales.data(), biases.data(), x, m0, p.K, out, h, count - 8 * h, next);
        else
          tile_int8_avx2<8>(p.gs, words.data(), scales.data(), biases.data(), x, m0, p.K, out, h, count - 8 * h, next);
      m0 += INT8_MIN_ROWS;
    }
  }
#endif
}

}  // namespace mlxchat_q
