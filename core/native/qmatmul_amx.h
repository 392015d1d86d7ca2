/*
 * x @ dequantize(w).T on Intel AMX tiles (Sapphire Rapids and later), exact to float32 rounding, for any
 * number of rows of x: a batched decode step, a prefill chunk, the rows of one expert.
 *
 * AVX-512 has two FMA ports, so for M rows of x every 16 weights cost at least M/2 cycles: with 8 rows the
 * FMAs alone, not the memory, bound a 4-bit product. An AMX tile product (TDPBF16PS) multiplies 16 x 32
 * bfloat16 values by 32 x 16 in about the time of 16 FMAs, and the packed weights become bfloat16 exactly
 * (integers 0..255 have at most 8 significant bits). x does not: each float32 is split into three
 * bfloat16 parts, hi + mid + lo == x exactly (each takes the next 8 bits of the significand), and the
 * parts are three columns of the x tile. Every product of a weight and a part is exact in float32, so
 * the result differs from MLX's only in the order of float32 additions, as the AVX-512 kernels' does.
 *
 * Per quantization group g the tile unit sums C[n][(m, part)] = sum_{k in g} q[n, k] * part(x[m, k]);
 * AVX-512 then adds scale[n, g] * C[n] + bias[n, g] * sum_{k in g} x[m, k] into a float32 accumulator
 * (the bias rides in the hi lane of each row of x), and at the end a row's three lanes are added.
 *
 * Layout: the A tile is 16 weight rows by 32 values of k (64 bytes each), the B tile holds 5 rows of x
 * times 3 parts in 15 of its 16 columns, as VNNI pairs: B[kp][col] = (part(x[e = 2 kp]), part(x[e = 2 kp + 1])).
 * Within a chunk of 32 values of k the order e is whatever makes the weights cheapest to unpack: at 4 bits
 * the 16 low nibbles of the chunk's 16 bytes, then the 16 high nibbles (k = 2e, then k = 2(e - 16) + 1);
 * at 8 bits the natural order. x is permuted to match when its tiles are prepared.
 */
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qmatmul_kernels.h"

#if defined(__x86_64__)
#define MLXQ_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")))
#endif

namespace mlxchat_q {

constexpr int AMX_ROWS = 5;        // rows of x per B tile (3 parts each: 15 of 16 columns)
constexpr int AMX_K = 32;          // values of k per tile
constexpr int AMX_TILE = 256;      // 32-bit words per tile (16 rows of 64 bytes)
constexpr int AMX_BLOCKS = 8;      // blocks of x rows one task takes: 40 rows share each unpacked weight tile

/* Whether this CPU has AMX-BF16 and the kernel lets this process use tile data (asked for once). */
inline bool amx_usable() {
#if defined(__x86_64__)
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22), avx512bw = b & (1u << 30);
    if (!tile || !bf16 || !avx512bw) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

/* Rows of x prepared as B tiles ([blocks][K / 32] tiles) and their group sums ([blocks][G][16]: row j's in lane 3j). */
struct AmxPanel {
  const uint32_t* xt;
  const float* xs;
  const long* out_at;  // [M]: where output row m starts in out
  int M, K, G, gs, bits;
  const uint8_t* w;
  const float* scales;
  const float* biases;
  float* out;
};

inline int amx_blocks(int rows) {
  return (rows + AMX_ROWS - 1) / AMX_ROWS;
}

#if defined(__x86_64__)

/* The order of k within a chunk (see unpack_group) as word indices into two float32 vectors: part of x[k(e)]
 * is the high half of float k(e), word 2 k(e) + 1. */
inline void chunk_order(int bits, uint16_t* index) {
  for (int e = 0; e < 32; ++e) {
    const int k = bits == 4 ? 4 * (e % 8) + e / 8 : e;
    index[e] = uint16_t(2 * k + 1);
  }
}

/*
 * Up to AMX_ROWS rows of x into one block's tiles (K / 32 of them, zeroed first: unused columns stay 0) and
 * their group sums (row j's in lane 3 j of xs[g]). A float32 x is split by truncation: hi keeps the top 16
 * bits, mid those of x - hi, lo those of x - hi - mid, and each difference is exact.
 */
MLXQ_AMX inline void prepare_x_block(const float* const* rows, int count, int K, int gs, int bits, uint32_t* tiles,
                                     float* xs) {
  const int chunks = K / AMX_K, per_group = gs / AMX_K;
  std::memset(tiles, 0, sizeof(uint32_t) * AMX_TILE * chunks);
  std::memset(xs, 0, sizeof(float) * 16 * (K / gs));
  alignas(64) uint16_t order[32];
  chunk_order(bits, order);
  const __m512i index = _mm512_load_si512(order);
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  const __m512i row_of_pair = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int m = 0; m < count; ++m) {
    const float* x = rows[m];
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < chunks; ++c) {
      const __m512 a = _mm512_loadu_ps(x + c * AMX_K), b = _mm512_loadu_ps(x + c * AMX_K + 16);
      const __m512 a_hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), top));
      const __m512 b_hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), top));
      const __m512 a_rest = _mm512_sub_ps(a, a_hi), b_rest = _mm512_sub_ps(b, b_hi);
      const __m512 a_mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a_rest), top));
      const __m512 b_mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b_rest), top));
      const __m512 a_lo = _mm512_sub_ps(a_rest, a_mid), b_lo = _mm512_sub_ps(b_rest, b_mid);
      const __m512i parts[3] = {
          _mm512_permutex2var_epi16(_mm512_castps_si512(a_hi), index, _mm512_castps_si512(b_hi)),
          _mm512_permutex2var_epi16(_mm512_castps_si512(a_mid), index, _mm512_castps_si512(b_mid)),
          _mm512_permutex2var_epi16(_mm512_castps_si512(a_lo), index, _mm512_castps_si512(b_lo)),
      };
      uint32_t* tile = tiles + (size_t)c * AMX_TILE;
      for (int p = 0; p < 3; ++p)
        _mm512_i32scatter_epi32(tile, _mm512_add_epi32(row_of_pair, _mm512_set1_epi32(3 * m + p)), parts[p], 4);
      sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
      if ((c + 1) % per_group == 0) {
        xs[(c / per_group) * 16 + 3 * m] = _mm512_reduce_add_ps(sum);
        sum = _mm512_setzero_ps();
      }
    }
  }
}

/*
 * The chunks of group g of weight rows [n, n + 32) (rows past `rows` are zero) as A tiles, two per chunk
 * (rows 0-15, 16-31): out[(i * 2 + half) * 512 + row * 32 + e] for the group's i-th chunk (bfloat16 bits).
 *
 * At 4 bits a chunk's 16 bytes are broadcast to the four 128-bit lanes; word j of lane L then holds nibbles
 * 4j .. 4j + 3, and shifting it right by 4L brings nibble e(j, L) = 4j + L to its low bits. A 32-entry table
 * (vpermw reads the low 5 bits) gives bfloat16(word & 15): one shift and one lookup per 32 weights, in the
 * order k(e) = 4 (e % 8) + e / 8 (chunk_order). At 8 bits bytes are converted to float32, whose high halves
 * are their bfloat16 values. Other widths (BITS 0: p.bits) are repacked to bytes first and go as 8 bits.
 */
template <int BITS>
MLXQ_AMX inline void unpack_group(const AmxPanel& p, int n, int rows, int g, uint16_t* out) {
  const int per_group = p.gs / AMX_K, bits = BITS ? BITS : p.bits;
  const size_t row_bytes = (size_t)p.K * bits / 8;
  alignas(64) uint16_t table[32], high[32], shifts[32];
  for (int i = 0; i < 32; ++i) {
    const float v = float(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    table[i] = uint16_t(bits >> 16);
    high[i] = uint16_t(2 * i + 1);
    shifts[i] = uint16_t(4 * (i / 8));
  }
  const __m512i lookup = _mm512_load_si512(table), high_words = _mm512_load_si512(high);
  const __m512i shift = _mm512_load_si512(shifts);
  const uint8_t* w = p.w + (size_t)n * row_bytes + (size_t)g * p.gs * bits / 8;
  size_t stride = row_bytes;
  alignas(64) uint8_t unpacked[32 * 128];  // a group of 32 rows, other widths
  if constexpr (BITS == 0) {
    for (int r = 0; r < rows; ++r) repack(w + (size_t)r * row_bytes, p.gs, bits, 8, Isa::avx512, unpacked + r * p.gs);
    w = unpacked;
    stride = p.gs;
  }
  for (int i = 0; i < per_group; ++i)
    for (int r = 0; r < 32; ++r, out += 32) {
      if (r >= rows) {
        _mm512_store_si512(out, _mm512_setzero_si512());
        continue;
      }
      const uint8_t* at = w + (size_t)r * stride + (size_t)i * AMX_K * (BITS == 4 ? 4 : 8) / 8;
      __m512i words;
      if constexpr (BITS == 4) {
        const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
        words = _mm512_permutexvar_epi16(_mm512_srlv_epi16(bytes, shift), lookup);
      } else {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16))));
        words = _mm512_permutex2var_epi16(_mm512_castps_si512(lo), high_words, _mm512_castps_si512(hi));
      }
      _mm512_store_si512(out, words);
    }
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

/* Tiles 0-1 and 2-3: two sets of sums (rows 0-15, 16-31), used by turns; 4-5: weights (rows 0-15, 16-31);
 * 6-7: x, by turns. A step's products start while the previous step's sums are stored and read. */
MLXQ_AMX inline void configure_tiles() {
  alignas(64) TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

/* acc[r] += scale[r] * sums[r] + bias[r] * x_sum for rows [0, rows) (sums: two stored tiles). */
MLXQ_AMX inline void add_scaled(float* acc, const float* sums, const float* scale, const float* bias, int G,
                                const float* x_sum, int rows) {
  const __m512 s = _mm512_loadu_ps(x_sum);
  for (int r = 0; r < rows; ++r, acc += 16, sums += 16) {
    const __m512 total = _mm512_fmadd_ps(s, _mm512_set1_ps(bias[(size_t)r * G]), _mm512_load_ps(acc));
    _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_load_ps(sums), _mm512_set1_ps(scale[(size_t)r * G]), total));
  }
}

/* The products of one step (a group of 32 weight rows times one block of x) into sum tiles S0 (rows 0-15) and
 * S1 (rows 16-31), stored to `stored` (the tile macros take tile numbers as literals). */
#define MLXQ_AMX_STEP(S0, S1, X, stored)                                      \
  do {                                                                        \
    _tile_zero(S0);                                                           \
    _tile_zero(S1);                                                           \
    for (int i = 0; i < per_group; ++i) {                                     \
      _tile_loadd(X, x + (size_t)(g * per_group + i) * AMX_TILE, 64);         \
      _tile_loadd(4, a + i * 1024, 64);                                       \
      _tile_dpbf16ps(S0, 4, X);                                               \
      if (lower) {                                                            \
        _tile_loadd(5, a + i * 1024 + 512, 64);                               \
        _tile_dpbf16ps(S1, 5, X);                                             \
      }                                                                       \
    }                                                                         \
    _tile_stored(S0, stored, 64);                                             \
    if (lower) _tile_stored(S1, (stored) + 256, 64);                          \
  } while (0)

/*
 * Output rows [n0, n1) for the x blocks [b0, b1) (at most AMX_BLOCKS) of a panel, 32 weight rows at a time,
 * a quantization group at a time: the group's weights are unpacked once (into L1) for all the blocks, whose
 * float32 sums stay in L1 too. The tile products of a group are issued first; the next group's weights are
 * unpacked and this group's sums scaled while they run. Tiles must be configured (configure_tiles).
 */
template <int BITS>
MLXQ_AMX void rows_amx(const AmxPanel& p, int n0, int n1, int b0, int b1) {
  const int chunks = p.K / AMX_K, per_group = p.gs / AMX_K, G = p.G, blocks = b1 - b0;
  alignas(64) uint16_t weights[2][4 * 2 * 512];  // a group's chunks (at most 4: group size 128), by turns
  alignas(64) float sums[AMX_BLOCKS][512];
  alignas(64) float acc[AMX_BLOCKS][32][16];
  // 32 weight rows are one contiguous run of bytes, read a group at a time across the rows: the hardware
  // prefetcher cannot follow 32 strides, so each group asks for its share of the next 32 rows' bytes
  const int bits = BITS ? BITS : p.bits;
  const size_t pass_bytes = (size_t)32 * p.K * bits / 8, share = (pass_bytes / G + 63) / 64 * 64;
  const char* end = reinterpret_cast<const char*>(p.w) + (size_t)n1 * p.K * bits / 8;
  const auto prefetch = [end](const char* from, size_t bytes) {
    for (const char* at = from; at < from + bytes && at < end; at += 64) _mm_prefetch(at, _MM_HINT_T0);
  };
  prefetch(reinterpret_cast<const char*>(p.w) + (size_t)n0 * p.K * bits / 8, pass_bytes);
  for (int n = n0; n < n1; n += 32) {
    const int rows = std::min(32, n1 - n);
    const bool lower = rows > 16;
    const char* next = reinterpret_cast<const char*>(p.w) + (size_t)(n + 32) * p.K * bits / 8;
    const float* scale = p.scales + (size_t)n * G;
    const float* bias = p.biases + (size_t)n * G;
    std::memset(acc, 0, sizeof(float) * 32 * 16 * blocks);
    unpack_group<BITS>(p, n, rows, 0, weights[0]);
    for (int g = 0; g < G; ++g) {
      const uint16_t* a = weights[g & 1];
      for (int b = b0; b < b1; ++b) {
        const uint32_t* x = p.xt + (size_t)b * chunks * AMX_TILE;
        if ((b - b0) & 1)
          MLXQ_AMX_STEP(2, 3, 7, sums[b - b0]);
        else
          MLXQ_AMX_STEP(0, 1, 6, sums[b - b0]);
      }
      prefetch(next + g * share, share);
      if (g + 1 < G) unpack_group<BITS>(p, n, rows, g + 1, weights[(g + 1) & 1]);
      for (int b = b0; b < b1; ++b)
        add_scaled(acc[b - b0][0], sums[b - b0], scale + g, bias + g, G, p.xs + ((size_t)b * G + g) * 16, rows);
    }
    for (int b = b0; b < b1; ++b) {
      const int m0 = b * AMX_ROWS, count = std::min(AMX_ROWS, p.M - m0);
      for (int i = 0; i < count; ++i) {
        float* out = p.out + p.out_at[m0 + i] + n;
        const float(*total)[16] = acc[b - b0];
        for (int r = 0; r < rows; ++r) out[r] = total[r][3 * i] + (total[r][3 * i + 1] + total[r][3 * i + 2]);
      }
    }
  }
}

#undef MLXQ_AMX_STEP

/* rows_amx with tiles configured for the call and released after it. */
MLXQ_AMX inline void run_amx(const AmxPanel& p, int n0, int n1, int b0, int b1) {
  configure_tiles();
  if (p.bits == 4)
    rows_amx<4>(p, n0, n1, b0, b1);
  else if (p.bits == 8)
    rows_amx<8>(p, n0, n1, b0, b1);
  else
    rows_amx<0>(p, n0, n1, b0, b1);
  _tile_release();
}

#endif  // __x86_64__

}  // namespace mlxchat_q
