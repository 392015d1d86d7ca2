/*
 * Kernels for x @ dequantize(w).T with MLX's affine quantization, on the CPU, for few rows of x.
 *
 * Layout (as mx.quantize writes it): w is [N, K * bits / 8] bytes; at 4 bits byte j of a row holds value 2j
 * in its low nibble and value 2j + 1 in its high nibble, at 8 bits byte j holds value j. Every group of
 * `gs` consecutive values of a row has one scale and one bias: w[n, k] = scale[n, g] * q[n, k] + bias[n, g].
 *
 * A product is computed as out[m, n] = sum_g scale[n, g] * (sum_k in g q[n, k] * x[m, k])
 *                                       + sum_g bias[n, g] * (sum_k in g x[m, k]),
 * so the inner loop is integer-to-float conversion and one FMA per weight, and the bias costs one FMA per
 * group. The packed bytes are read once for all rows of x: decode (one row) is bound by memory bandwidth.
 * On AVX2, three or more rows of x take the other form, x * (scale * q + bias): each weight vector is
 * dequantized once (one more FMA) and multiplied into up to 8 rows of x (tile_avx2_rows).
 * At 4 bits the x values are stored de-interleaved per SIMD block (even positions, then odd), so that the
 * low and high nibbles of a run of bytes multiply contiguous x vectors without any shuffles.
 *
 * Other widths (2, 3, 5 and 6 bits: mlx_lm.convert's --q-bits and its mixed recipes) are packed the same way,
 * as one little-endian bit stream per row (value k in bits [k * bits, (k + 1) * bits)): their rows are
 * repacked a few at a time, into L1, as 4 bits (2 and 3) or 8 bits (5 and 6), for those kernels.
 *
 * Results differ from MLX's own kernel (which sums x * (scale * q + bias) one value at a time) only in the
 * order of float32 additions.
 */
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define MLXQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")))
#define MLXQ_AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#endif

namespace mlxchat_q {

/* amx: AMX tiles for products of several rows of x (qmatmul_amx.h), the AVX-512 kernels for the rest. */
enum class Isa { scalar = 0, avx2 = 1, avx512 = 2, amx = 3 };

/*
 * Weight rows are streamed R at a time, R streams a row length apart, which the hardware prefetcher follows
 * poorly once the matrix is out of cache (a lm_head ran at a third of the bandwidth): each tile asks for the
 * bytes of the rows about 8 KiB ahead of it.
 */
inline size_t prefetch_rows(size_t row_bytes, int tile_rows) {
  return std::max<size_t>(tile_rows, 8192 / std::max<size_t>(row_bytes, 1));
}

/* The width whose kernels read a row: other widths are repacked, 2 and 3 bits as 4 (the table-lookup kernels),
 * 5 and 6 bits as 8 (see repack). */
inline int kernel_bits(int bits) {
  return bits <= 4 ? 4 : 8;
}

/* Floats per SIMD register of an ISA (0: the scalar kernel, which keeps x in its natural order). */
inline int simd_width(Isa isa) {
  return isa >= Isa::avx512 ? 16 : isa == Isa::avx2 ? 8 : 0;
}

/* Rows of x (prepared by prepare_x) against rows of one packed weight matrix. */
struct Panel {
  const float* x;        // [M, K], de-interleaved per block at 4 bits (see prepare_x)
  const float* xsum;     // [M, G]: sums of x over each group
  const long* out_at;    // [M]: where output row m starts in out
  int M, K, G, gs, bits;
  const uint8_t* w;      // [N, K * bits / 8]
  const float* scales;   // [N, G]
  const float* biases;   // [N, G]
  float* out;
};

/* Copies M rows of x (K values each) into `xp` in the order the ISA's kernel reads them, and their group sums. */
inline void prepare_x(const float* const* rows, int M, int K, int gs, int bits, Isa isa, float* xp, float* xsum) {
  const int width = simd_width(isa), G = K / gs;
  for (int m = 0; m < M; ++m) {
    const float* row = rows[m];
    float* dst = xp + (size_t)m * K;
    if (kernel_bits(bits) == 4 && width > 0) {
      for (int b = 0; b < K; b += 2 * width)
        for (int j = 0; j < width; ++j) {
          dst[b + j] = row[b + 2 * j];
          dst[b + width + j] = row[b + 2 * j + 1];
        }
    } else {
      std::copy(row, row + K, dst);
    }
    for (int g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int k = g * gs; k < (g + 1) * gs; ++k) s += row[k];
      xsum[(size_t)m * G + g] = s;
    }
  }
}

inline float bias_term(const Panel& p, int m, int n) {
  const float* b = p.biases + (size_t)n * p.G;
  const float* s = p.xsum + (size_t)m * p.G;
  float acc = 0.0f;
  for (int g = 0; g < p.G; ++g) acc += b[g] * s[g];
  return acc;
}

// -- scalar ------------------------------------------------------------------------------------------

template <int BITS>
void tile_scalar(const Panel& p, int m, int n) {
  const size_t row_bytes = (size_t)p.K * BITS / 8;
  const uint8_t* w = p.w + (size_t)n * row_bytes;
  const float* x = p.x + (size_t)m * p.K;
  float total = 0.0f;
  for (int g = 0; g < p.G; ++g) {
    float acc = 0.0f;
    for (int k = g * p.gs; k < (g + 1) * p.gs; k += 8 / BITS) {
      const uint8_t byte = w[k * BITS / 8];
      if (BITS == 4)
        acc += float(byte & 0xF) * x[k] + float(byte >> 4) * x[k + 1];
      else
        acc += float(byte) * x[k];
    }
    total += acc * p.scales[(size_t)n * p.G + g];
  }
  p.out[p.out_at[m] + n] = total + bias_term(p, m, n);
}

template <int BITS>
void rows_scalar(const Panel& p, int n0, int n1) {
  for (int n = n0; n < n1; ++n)
    for (int m = 0; m < p.M; ++m) tile_scalar<BITS>(p, m, n);
}

#if defined(__x86_64__)

/*
 * The SIMD kernels take the group size as a template parameter (MLX's affine modes use 32, 64 or 128): the
 * blocks of a group then unroll completely and every accumulator stays in a register.
 */

/* Prefetches the bytes of weight row `w` that this group covers, `ahead` bytes further on, a line at a time. */
template <int GROUP_BYTES>
inline void prefetch_group(const uint8_t* w, size_t ahead, int g) {
  if constexpr (GROUP_BYTES >= 64) {
    for (int off = 0; off < GROUP_BYTES; off += 64) _mm_prefetch(reinterpret_cast<const char*>(w + ahead + off), _MM_HINT_T0);
  } else {
    if ((g * GROUP_BYTES) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + ahead), _MM_HINT_T0);
  }
}

// -- AVX-512: 16 floats per register; a 16-byte block holds 32 values at 4 bits, 16 at 8 bits ----------

/*
 * At 4 bits a register holds the 16 possible dequantized values of a group, scale * [0..15] + bias, and
 * vpermps looks each nibble up in it (it reads only the low 4 bits of every lane, so the low nibbles need
 * no mask): no conversions, and no per-group sums. At 8 bits the bytes are converted and summed per group.
 */
template <int GS, int MT, int R>
MLXQ_AVX512 void tile_avx512_4bit(const Panel& p, int m0, int n0) {
  constexpr int BLOCKS = GS / 32, GROUP_BYTES = GS / 2;
  const int K = p.K, G = p.G;
  const size_t row_bytes = (size_t)K / 2;
  const uint8_t* w[R];
  for (int r = 0; r < R; ++r) w[r] = p.w + (size_t)(n0 + r) * row_bytes;
  const float* x = p.x + (size_t)m0 * K;
  const size_t ahead = prefetch_rows(row_bytes, R) * row_bytes;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 a0[MT][R], a1[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) a0[m][r] = a1[m][r] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m512 table[R];
    for (int r = 0; r < R; ++r) {
      prefetch_group<GROUP_BYTES>(w[r], ahead, g);
      const size_t at = (size_t)(n0 + r) * G + g;
      table[r] = _mm512_fmadd_ps(iota, _mm512_set1_ps(p.scales[at]), _mm512_set1_ps(p.biases[at]));
    }
    const float* xg = x + (size_t)g * GS;
    for (int b = 0; b < BLOCKS; ++b) {
      __m512 even[MT], odd[MT];
      for (int m = 0; m < MT; ++m) {
        even[m] = _mm512_loadu_ps(xg + (size_t)m * K + b * 32);
        odd[m] = _mm512_loadu_ps(xg + (size_t)m * K + b * 32 + 16);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + b * 16)));
        const __m512 lo = _mm512_permutexvar_ps(q, table[r]);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table[r]);
        for (int m = 0; m < MT; ++m) {
          a0[m][r] = _mm512_fmadd_ps(lo, even[m], a0[m][r]);
          a1[m][r] = _mm512_fmadd_ps(hi, odd[m], a1[m][r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) w[r] += GROUP_BYTES;
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r)
      p.out[p.out_at[m0 + m] + n0 + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m][r], a1[m][r]));
}

template <int GS, int MT, int R>
MLXQ_AVX512 void tile_avx512_8bit(const Panel& p, int m0, int n0) {
  constexpr int BLOCKS = GS / 16;
  const int K = p.K, G = p.G;
  const uint8_t* w[R];
  for (int r = 0; r < R; ++r) w[r] = p.w + (size_t)(n0 + r) * K;
  const float* x = p.x + (size_t)m0 * K;
  const size_t ahead = prefetch_rows(K, R) * K;
  __m512 total[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m512 a0[MT][R], a1[MT][R];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < R; ++r) a0[m][r] = a1[m][r] = _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) prefetch_group<GS>(w[r], ahead, g);
    const float* xg = x + (size_t)g * GS;
    for (int b = 0; b < BLOCKS; ++b) {
      __m512 xv[MT];
      for (int m = 0; m < MT; ++m) xv[m] = _mm512_loadu_ps(xg + (size_t)m * K + b * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 q = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + b * 16))));
        for (int m = 0; m < MT; ++m) {
          if (b % 2)
            a1[m][r] = _mm512_fmadd_ps(q, xv[m], a1[m][r]);
          else
            a0[m][r] = _mm512_fmadd_ps(q, xv[m], a0[m][r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      w[r] += GS;
      const __m512 scale = _mm512_set1_ps(p.scales[(size_t)(n0 + r) * G + g]);
      for (int m = 0; m < MT; ++m)
        total[m][r] = _mm512_fmadd_ps(_mm512_add_ps(a0[m][r], a1[m][r]), scale, total[m][r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r)
      p.out[p.out_at[m0 + m] + n0 + r] = _mm512_reduce_add_ps(total[m][r]) + bias_term(p, m0 + m, n0 + r);
}

template <int BITS, int GS, int MT, int R>
MLXQ_AVX512 void tile_avx512(const Panel& p, int m0, int n0) {
  if constexpr (BITS == 4)
    tile_avx512_4bit<GS, MT, R>(p, m0, n0);
  else
    tile_avx512_8bit<GS, MT, R>(p, m0, n0);
}

// -- AVX2: 8 floats per register; an 8-byte block holds 16 values at 4 bits, 8 at 8 bits ---------------

MLXQ_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int BITS, int GS, int MT, int R>
MLXQ_AVX2 void tile_avx2(const Panel& p, int m0, int n0) {
  constexpr int VALS = BITS == 4 ? 16 : 8, BLOCKS = GS / VALS, GROUP_BYTES = GS * BITS / 8;
  const int K = p.K, G = p.G;
  const size_t row_bytes = (size_t)K * BITS / 8;
  const uint8_t* w[R];
  for (int r = 0; r < R; ++r) w[r] = p.w + (size_t)(n0 + r) * row_bytes;
  const float* x = p.x + (size_t)m0 * K;
  const size_t ahead = prefetch_rows(row_bytes, R) * row_bytes;
  const __m256i low = _mm256_set1_epi32(0xF);
  __m256 total[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) total[m][r] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m256 a0[MT][R], a1[MT][R];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < R; ++r) a0[m][r] = a1[m][r] = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) prefetch_group<GROUP_BYTES>(w[r], ahead, g);
    const float* xg = x + (size_t)g * GS;
    for (int b = 0; b < BLOCKS; ++b) {
      if constexpr (BITS == 4) {
        __m256 even[MT], odd[MT];
        for (int m = 0; m < MT; ++m) {
          even[m] = _mm256_loadu_ps(xg + (size_t)m * K + b * 16);
          odd[m] = _mm256_loadu_ps(xg + (size_t)m * K + b * 16 + 8);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w[r] + b * 8)));
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(q, low));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
          for (int m = 0; m < MT; ++m) {
            a0[m][r] = _mm256_fmadd_ps(lo, even[m], a0[m][r]);
            a1[m][r] = _mm256_fmadd_ps(hi, odd[m], a1[m][r]);
          }
        }
      } else {
        __m256 xv[MT];
        for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(xg + (size_t)m * K + b * 8);
        for (int r = 0; r < R; ++r) {
          const __m256 q = _mm256_cvtepi32_ps(
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w[r] + b * 8))));
          for (int m = 0; m < MT; ++m) {
            if (b % 2)
              a1[m][r] = _mm256_fmadd_ps(q, xv[m], a1[m][r]);
            else
              a0[m][r] = _mm256_fmadd_ps(q, xv[m], a0[m][r]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      w[r] += GROUP_BYTES;
      const __m256 scale = _mm256_set1_ps(p.scales[(size_t)(n0 + r) * G + g]);
      for (int m = 0; m < MT; ++m)
        total[m][r] = _mm256_fmadd_ps(_mm256_add_ps(a0[m][r], a1[m][r]), scale, total[m][r]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r)
      p.out[p.out_at[m0 + m] + n0 + r] = hsum256(total[m][r]) + bias_term(p, m0 + m, n0 + r);
}

/*
 * Several rows of x on AVX2: each vector of R weight rows is dequantized once in registers (scale * q + bias,
 * one FMA) and multiplied into MT rows of x, one accumulator per output: MT * R = 8 independent FMA chains,
 * where the group-sum kernel above, with three accumulators per output, has room for four and waits on their
 * latency.
 */
template <int BITS, int GS, int MT, int R>
MLXQ_AVX2 void tile_avx2_rows(const Panel& p, int m0, int n0) {
  constexpr int VALS = BITS == 4 ? 16 : 8, BLOCKS = GS / VALS, GROUP_BYTES = GS * BITS / 8;
  const int K = p.K, G = p.G;
  const size_t row_bytes = (size_t)K * BITS / 8;
  const __m256i low = _mm256_set1_epi32(0xF);
  __m256 acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    const float* xg = p.x + (size_t)m0 * K + (size_t)g * GS;
    const uint8_t* w = p.w + (size_t)n0 * row_bytes + (size_t)g * GROUP_BYTES;
    const float* scales = p.scales + (size_t)n0 * G + g;
    const float* biases = p.biases + (size_t)n0 * G + g;
    __m256 scale[R], bias[R];
    for (int r = 0; r < R; ++r) {
      scale[r] = _mm256_set1_ps(scales[(size_t)r * G]);
      bias[r] = _mm256_set1_ps(biases[(size_t)r * G]);
    }
    for (int b = 0; b < BLOCKS; ++b)
      for (int r = 0; r < R; ++r) {  // all MT * R chains in flight in each block
        const __m256i q =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + r * row_bytes + b * 8)));
        if constexpr (BITS == 4) {
          const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low)), scale[r], bias[r]);
          const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), scale[r], bias[r]);
          for (int m = 0; m < MT; ++m) {
            acc[m][r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg + (size_t)m * K + b * 16), acc[m][r]);
            acc[m][r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xg + (size_t)m * K + b * 16 + 8), acc[m][r]);
          }
        } else {
          const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale[r], bias[r]);
          for (int m = 0; m < MT; ++m)
            acc[m][r] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xg + (size_t)m * K + b * 8), acc[m][r]);
        }
      }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) p.out[p.out_at[m0 + m] + n0 + r] = hsum256(acc[m][r]);
}

/* A tile of MT rows of x over weight rows [n0, n1): R weight rows at a time, then one. */
template <int BITS, int GS, int MT, int R>
void tiles_avx2_rows(const Panel& p, int m0, int n0, int n1) {
  int n = n0;
  for (; n + R <= n1; n += R) tile_avx2_rows<BITS, GS, MT, R>(p, m0, n);
  for (; n < n1; ++n) tile_avx2_rows<BITS, GS, MT, 1>(p, m0, n);
}

/* One tile of MT (3 to 8) rows of x: R weight rows a step, so that MT * R accumulators fill the registers. */
template <int BITS, int GS>
void tiles_avx2_rows(const Panel& p, int m0, int mt, int n0, int n1) {
  switch (mt) {
    case 3: return tiles_avx2_rows<BITS, GS, 3, 3>(p, m0, n0, n1);
    case 4: return tiles_avx2_rows<BITS, GS, 4, 2>(p, m0, n0, n1);
    case 5: return tiles_avx2_rows<BITS, GS, 5, 2>(p, m0, n0, n1);
    case 6: return tiles_avx2_rows<BITS, GS, 6, 1>(p, m0, n0, n1);
    case 7: return tiles_avx2_rows<BITS, GS, 7, 1>(p, m0, n0, n1);
    default: return tiles_avx2_rows<BITS, GS, 8, 1>(p, m0, n0, n1);
  }
}

/*
 * Rows [n0, n1) of the output for 3 or more rows of x on AVX2: 64 weight rows at a time (they stay in L2 while
 * every tile of x rows passes over them), the rows of x in as few tiles of at most 8 as there can be, of sizes
 * as equal as can be (9 rows: 5 and 4). Taking K whole measured faster than spans of it that fit L1 (which
 * cost a sum and a store per output each): 8 rows of Qwen3-0.6B's products at 55 GFLOP/s against 43.
 */
template <int BITS, int GS>
void rows_avx2_many(const Panel& p, int n0, int n1) {
  const int tiles = (p.M + 7) / 8;
  for (int nb = n0; nb < n1; nb += 64) {
    const int ne = std::min(nb + 64, n1);
    for (int t = 0, m0 = 0; t < tiles; ++t) {
      const int mt = (p.M - m0) / (tiles - t);
      tiles_avx2_rows<BITS, GS>(p, m0, mt, nb, ne);
      m0 += mt;
    }
  }
}

/*
 * Rows [n0, n1) of the output for every row of x: 64 weight rows at a time (they stay in L1/L2 while
 * every tile of x rows passes over them), each tile of MT x rows times R weight rows in registers.
 * AVX-512 has 32 registers: up to 4 x rows or 4 weight rows at once; AVX2 has 16: one or two rows of x here
 * (with two, dequantizing would cost half as much as the products; this form has no such FMA), three or more
 * in rows_avx2_many (8 rows of Qwen3-0.6B's products at 55 GFLOP/s against 35 here, on a 2-core Zen EPYC).
 */
template <int BITS, int GS, bool WIDE>
void rows_simd(const Panel& p, int n0, int n1) {
  constexpr int RMAX = WIDE ? 4 : 2;
  if constexpr (!WIDE) {
    if (p.M > 2) return rows_avx2_many<BITS, GS>(p, n0, n1);
  }
  for (int nb = n0; nb < n1; nb += 64) {
    const int ne = std::min(nb + 64, n1);
    for (int m0 = 0; m0 < p.M;) {
      const int mt = std::min(RMAX, p.M - m0);
      int n = nb;
      if constexpr (WIDE) {
        if (mt == 1)
          for (; n + 4 <= ne; n += 4) tile_avx512<BITS, GS, 1, 4>(p, m0, n);
        else if (mt == 2)  // 4 weight rows a tile: 2 rows of x cost about what one does (2 x 2: 1.4x as much)
          for (; n + 4 <= ne; n += 4) tile_avx512<BITS, GS, 2, 4>(p, m0, n);
        for (; n < ne; ++n) {
          if (mt == 1) tile_avx512<BITS, GS, 1, 1>(p, m0, n);
          else if (mt == 2) tile_avx512<BITS, GS, 2, 1>(p, m0, n);
          else if (mt == 3) tile_avx512<BITS, GS, 3, 1>(p, m0, n);
          else tile_avx512<BITS, GS, 4, 1>(p, m0, n);
        }
      } else {
        if (mt == 1)
          for (; n + 2 <= ne; n += 2) tile_avx2<BITS, GS, 1, 2>(p, m0, n);
        for (; n < ne; ++n) {
          if (mt == 1) tile_avx2<BITS, GS, 1, 1>(p, m0, n);
          else tile_avx2<BITS, GS, 2, 1>(p, m0, n);
        }
      }
      m0 += mt;
    }
  }
}

template <int BITS, bool WIDE>
void rows_simd(const Panel& p, int n0, int n1) {
  if (p.gs == 32) rows_simd<BITS, 32, WIDE>(p, n0, n1);
  else if (p.gs == 64) rows_simd<BITS, 64, WIDE>(p, n0, n1);
  else rows_simd<BITS, 128, WIDE>(p, n0, n1);
}

#endif  // __x86_64__

// -- other widths: repacked for the 4- and 8-bit kernels -------------------------------------------------

/* Whether rows of this width are repacked before the kernels read them (everything but 4 and 8 bits). */
inline bool repacked_width(int bits) {
  return bits != 4 && bits != 8;
}

/* `count` values (a multiple of 32) of `bits` bits from a little-endian bit stream into dst at `out_bits` (4 or
 * 8): one byte each, or two to a byte (value 2j in the low nibble of byte j, 2j + 1 in the high). */
inline void repack_scalar(const uint8_t* src, int count, int bits, int out_bits, uint8_t* dst) {
  const unsigned mask = (1u << bits) - 1;
  const auto value = [&](int k) {
    const int bit = k * bits, byte = bit >> 3;
    const unsigned word = src[byte] | (bit % 8 + bits > 8 ? unsigned(src[byte + 1]) << 8 : 0u);
    return uint8_t((word >> (bit % 8)) & mask);
  };
  if (out_bits == 8)
    for (int k = 0; k < count; ++k) dst[k] = value(k);
  else
    for (int k = 0; k < count; k += 2) dst[k / 2] = uint8_t(value(k) | value(k + 1) << 4);
}

#if defined(__x86_64__)

/*
 * 64 values at a time with AVX-512 VBMI: the 8 values of output qword q start at bit 8 q * bits, a whole
 * byte (q * bits), and span `bits` bytes: vpermb brings bytes [q * bits, q * bits + 8) into qword q, and
 * vpmultishiftqb takes value j from its bit j * bits; for 4 bits, pairs are then joined into nibbles
 * (vpmaddubsw: v0 + 16 v1, then vpmovwb). The loads and stores are masked to the stream's bytes.
 */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi"))) inline void repack_vbmi(const uint8_t* src, int count,
                                                                             int bits, int out_bits, uint8_t* dst) {
  alignas(64) uint8_t gather[64], shifts[64];
  for (int i = 0; i < 64; ++i) {
    gather[i] = uint8_t((i / 8) * bits + i % 8);
    shifts[i] = uint8_t((i % 8) * bits);
  }
  const __m512i from = _mm512_load_si512(gather), at = _mm512_load_si512(shifts);
  const __m512i mask = _mm512_set1_epi8(char((1u << bits) - 1)), pairs = _mm512_set1_epi16(0x1001);
  const bool nibbles = out_bits == 4;
  for (int k = 0; k < count; k += 64) {
    const int values = std::min(64, count - k), bytes = values * bits / 8;
    const __m512i packed = _mm512_maskz_loadu_epi8(bytes == 64 ? ~0ull : (1ull << bytes) - 1, src + (size_t)k * bits / 8);
    const __m512i v = _mm512_and_si512(_mm512_multishift_epi64_epi8(at, _mm512_permutexvar_epi8(from, packed)), mask);
    if (nibbles)
      _mm256_mask_storeu_epi8(dst + k / 2, values == 64 ? ~0u : (1u << (values / 2)) - 1,
                              _mm512_cvtepi16_epi8(_mm512_maddubs_epi16(v, pairs)));
    else
      _mm512_mask_storeu_epi8(dst + k, values == 64 ? ~0ull : (1ull << values) - 1, v);
  }
}

inline bool has_vbmi() {
  static const bool vbmi = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw");
  }();
  return vbmi;
}

#endif

inline void repack(const uint8_t* src, int count, int bits, int out_bits, Isa isa, uint8_t* dst) {
#if defined(__x86_64__)
  if (isa >= Isa::avx512 && has_vbmi()) return repack_vbmi(src, count, bits, out_bits, dst);
#endif
  repack_scalar(src, count, bits, out_bits, dst);
}

/* The panel from weight row n on: its row 0 is row n (weights, scales, biases and outputs shifted to match). */
inline Panel rows_from(const Panel& p, int n) {
  Panel q = p;
  q.w += (size_t)n * p.K * p.bits / 8;
  q.scales += (size_t)n * p.G;
  q.biases += (size_t)n * p.G;
  q.out += n;
  return q;
}

/* Asks for `bytes` bytes from `at` (the next weight rows: one contiguous run, which the hardware prefetcher does
 * not fetch soon enough when the rows are read a few at a time or a column of lines at a time). */
inline void prefetch_run(const uint8_t* at, size_t bytes) {
#if defined(__x86_64__)
  for (size_t offset = 0; offset < bytes; offset += 64)
    _mm_prefetch(reinterpret_cast<const char*>(at + offset), _MM_HINT_T0);
#endif
}

/* Weight rows [n, n + count) of a panel of another width repacked into `buffer`, as a panel of kernel_bits'
 * width whose row 0 is row n (its scales, biases and outputs shifted to match). */
inline Panel repacked_rows(const Panel& p, Isa isa, int n, int count, std::vector<uint8_t>& buffer) {
  const int bits = kernel_bits(p.bits);
  const size_t row_bytes = (size_t)p.K * p.bits / 8, kernel_row_bytes = (size_t)p.K * bits / 8;
  buffer.resize((size_t)count * kernel_row_bytes);
  prefetch_run(p.w + (size_t)(n + count) * row_bytes, count * row_bytes);
  for (int r = 0; r < count; ++r)
    repack(p.w + (size_t)(n + r) * row_bytes, p.K, p.bits, bits, isa, buffer.data() + r * kernel_row_bytes);
  Panel q = rows_from(p, n);
  q.w = buffer.data();
  q.bits = bits;
  return q;
}

inline void rows(const Panel& p, Isa isa, int n0, int n1);

/* Rows [n0, n1) of a panel of another width: 16 rows at a time repacked (into L1), then the kernels. */
inline void rows_repacked(const Panel& p, Isa isa, int n0, int n1) {
  constexpr int STEP = 16;
  thread_local std::vector<uint8_t> buffer;
  for (int n = n0; n < n1; n += STEP) {
    const int count = std::min(STEP, n1 - n);
    rows(repacked_rows(p, isa, n, count, buffer), isa, 0, count);
  }
}

/* out rows [n0, n1) of a panel with the ISA's kernel. */
inline void rows(const Panel& p, Isa isa, int n0, int n1) {
  if (repacked_width(p.bits)) return rows_repacked(p, isa, n0, n1);
#if defined(__x86_64__)
  if (isa >= Isa::avx512) {
    if (p.bits == 4) rows_simd<4, true>(p, n0, n1); else rows_simd<8, true>(p, n0, n1);
    return;
  }
  if (isa == Isa::avx2) {
    if (p.bits == 4) rows_simd<4, false>(p, n0, n1); else rows_simd<8, false>(p, n0, n1);
    return;
  }
#endif
  if (p.bits == 4) rows_scalar<4>(p, n0, n1); else rows_scalar<8>(p, n0, n1);
}

/*
 * Weight rows [n0, n1) as float32 into dst [n1 - n0, K] (for many rows of x: dequantize, then sgemm), in the
 * order the ISA's prepare_x puts x in: the product over k is the same, and no shuffles are needed.
 */
inline void dequantize_rows_scalar(const Panel& p, int n0, int n1, float* dst) {
  const size_t row_bytes = (size_t)p.K * p.bits / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + (size_t)n * row_bytes;
    float* out = dst + (size_t)(n - n0) * p.K;
    for (int g = 0; g < p.G; ++g) {
      const float s = p.scales[(size_t)n * p.G + g], b = p.biases[(size_t)n * p.G + g];
      for (int k = g * p.gs; k < (g + 1) * p.gs; ++k) {
        const int q = p.bits == 4 ? (row[k >> 1] >> ((k & 1) * 4)) & 0xF : row[k];
        out[k] = s * float(q) + b;
      }
    }
  }
}

#if defined(__x86_64__)

MLXQ_AVX512 void dequantize_rows_avx512(const Panel& p, int n0, int n1, float* dst) {
  const size_t row_bytes = (size_t)p.K * p.bits / 8;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + (size_t)n * row_bytes;
    float* out = dst + (size_t)(n - n0) * p.K;
    for (int g = 0; g < p.G; ++g) {
      const __m512 s = _mm512_set1_ps(p.scales[(size_t)n * p.G + g]), b = _mm512_set1_ps(p.biases[(size_t)n * p.G + g]);
      if (p.bits == 4) {
        const __m512 table = _mm512_fmadd_ps(iota, s, b);
        for (int k = 0; k < p.gs; k += 32, w += 16, out += 32) {
          const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
          _mm512_storeu_ps(out, _mm512_permutexvar_ps(q, table));
          _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
        }
      } else {
        for (int k = 0; k < p.gs; k += 16, w += 16, out += 16) {
          const __m512 q =
              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
          _mm512_storeu_ps(out, _mm512_fmadd_ps(q, s, b));
        }
      }
    }
  }
}

MLXQ_AVX2 void dequantize_rows_avx2(const Panel& p, int n0, int n1, float* dst) {
  const size_t row_bytes = (size_t)p.K * p.bits / 8;
  const __m256i low = _mm256_set1_epi32(0xF);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + (size_t)n * row_bytes;
    float* out = dst + (size_t)(n - n0) * p.K;
    for (int g = 0; g < p.G; ++g) {
      const __m256 s = _mm256_set1_ps(p.scales[(size_t)n * p.G + g]), b = _mm256_set1_ps(p.biases[(size_t)n * p.G + g]);
      if (p.bits == 4) {
        for (int k = 0; k < p.gs; k += 16, w += 8, out += 16) {
          const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
          _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low)), s, b));
          _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), s, b));
        }
      } else {
        for (int k = 0; k < p.gs; k += 8, w += 8, out += 8) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
          _mm256_storeu_ps(out, _mm256_fmadd_ps(q, s, b));
        }
      }
    }
  }
}

#endif  // __x86_64__

inline void dequantize_rows(const Panel& p, Isa isa, int n0, int n1, float* dst) {
  if (repacked_width(p.bits)) {  // one row at a time, repacked
    std::vector<uint8_t> buffer;
    for (int n = n0; n < n1; ++n) dequantize_rows(repacked_rows(p, isa, n, 1, buffer), isa, 0, 1, dst + (size_t)(n - n0) * p.K);
    return;
  }
#if defined(__x86_64__)
  if (isa >= Isa::avx512) return dequantize_rows_avx512(p, n0, n1, dst);
  if (isa == Isa::avx2) return dequantize_rows_avx2(p, n0, n1, dst);
#endif
  dequantize_rows_scalar(p, n0, n1, dst);
}

}  // namespace mlxchat_q
