/*
 * Scores against packed keys in integers, for one or two query rows a KV head (attention.cpp's AVX-512 tables
 * where the CPU has AVX-512 BW and VNNI; keys that attention_packed.h's loops read): the query is rounded to int16
 * against its largest magnitude, once a task (`order`; an error below 1 / 65534 of that magnitude, where the
 * keys' own is up to 1 / 30 (4-bit) or 1 / 510 (8-bit) of their range), and multiplied by the keys' values 32
 * pairs an instruction (vpdpwssd), where converting every value to float cost a conversion and a product each.
 * Values are still summed in float (attention_packed.h): summing them in integers too (weights rounded to int16
 * per group, two keys' values side by side in 16-bit pairs) ran 1.09x faster at 4 bits and no faster at 8, the
 * sums then bound by memory, for twice the rounding error.
 *
 * A key's words are read 64 bytes (a block) at a time. Its 16-bit lane l holds the values F * l .. F * l + F - 1
 * (F = 16 / BITS), field f of every lane is one vector, and the query is laid out to match: block b, field f, lane
 * l holds query value b * N + F * l + f (N the block's values). vpdpwssd sums pairs of lanes, so int32 lane L holds
 * the products of values [2F L, 2F L + 2F): all in one group, whose scale multiplies it in float (the groups'
 * scales spread over the lanes by a permute), as the bias multiplies the query's sum over the group, spread over the
 * same lanes. A last block of fewer bytes is read through a mask.
 */

constexpr int kBlockBytes = 64;
constexpr int kMaxBlocks = 8;  // keys of more features are scored in float (attention_packed.h)

template <int BITS>
constexpr int kLaneValues = 16 / BITS;  // F

template <int BITS>
constexpr int kBlockValues = 32 * kLaneValues<BITS>;  // N

template <int BITS>
constexpr int blocks(int dims) {
  return (dims + kBlockValues<BITS> - 1) / kBlockValues<BITS>;
}

/* Whether these loops score keys of this many features. */
inline bool dot_reads(int bits, int dims) {
  return bits == 8 ? blocks<8>(dims) <= kMaxBlocks : blocks<4>(dims) <= kMaxBlocks;
}

/* A row's int16 query (blocks of N values in the order above, zeros past dims) and, after it, its scale. */
template <int BITS, typename T>
inline T* dot_scale(T* row, int dims) {
  return row + blocks<BITS>(dims) * kBlockValues<BITS> / 2;
}

template <int BITS>
inline void dot_order_rows(const float* x, int rows, int xs, int dims, float* out, int os) {
  constexpr int F = kLaneValues<BITS>, N = kBlockValues<BITS>;
  for (int i = 0; i < rows; ++i) {
    const float* row = x + size_t(i) * xs;
    float top = 0.0f;
    bool finite = true;
    for (int d = 0; d < dims; ++d) {
      finite = finite && std::isfinite(row[d]);
      top = std::max(top, std::fabs(row[d]));
    }
    // A query of infinities or NaNs scores NaN, as in float.
    const float scale = !finite ? NAN : top > 0.0f ? std::max(top / 32767.0f, FLT_MIN) : 1.0f;
    auto* q = reinterpret_cast<int16_t*>(out + size_t(i) * os);
    for (int v = 0; v < blocks<BITS>(dims) * N; ++v) {
      const int d = v / N * N + F * (v % 32) + v % N / 32;
      q[v] = finite && d < dims ? int16_t(std::lrint(std::clamp(row[d] / scale, -32767.0f, 32767.0f))) : 0;
    }
    *dot_scale<BITS>(out + size_t(i) * os, dims) = scale;
  }
}

/* Field f of every 16-bit lane of a block. */
template <int f, int BITS>
inline __m512i lane_field(__m512i x) {
  constexpr int shift = f * BITS;
  if constexpr (shift > 0) x = _mm512_srli_epi16(x, shift);
  if constexpr (shift + BITS < 16) x = _mm512_and_si512(x, _mm512_set1_epi16((1 << BITS) - 1));
  return x;
}

/* The M floats from p on (a block's groups' scales or biases), each in its group's lanes: a plain load of exactly
 * them (masked loads, here and of the blocks, made the loop 1.8x slower on a Zen 4 EPYC). */
template <int M>
inline Vec spread(const float* p, __m512i lane_group) {
  if constexpr (M == 1) {
    return _mm512_set1_ps(*p);
  } else if constexpr (M == 2) {
    return _mm512_permutexvar_ps(lane_group, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadu_si64(p))));
  } else {
    return _mm512_permutexvar_ps(lane_group, _mm512_castps128_ps512(_mm_loadu_ps(p)));
  }
}

/* a[i] += field f.. of every lane of x times row i's query from value `at` on, for R rows (unrolled: a lambda
 * would not inline here, its target options being more than attention_packed.h's `each`). */
template <int R, int BITS, int f = 0>
inline void dot_fields(__m512i x, const int16_t* const* query, int at, __m512i* a) {
  const __m512i values = lane_field<f, BITS>(x);
  for (int i = 0; i < R; ++i) a[i] = _mm512_dpwssd_epi32(a[i], values, _mm512_loadu_si512(query[i] + at + f * 32));
  if constexpr (f + 1 < kLaneValues<BITS>) dot_fields<R, BITS, f + 1>(x, query, at, a);
}

/* s[i * ss + j] = q_i . k_j for R rows and n packed keys (from position `at`). */
template <int R, int BITS, int GROUP>
inline void dot_scores_rows(const float* q, int qs, const float* qsum, const Rows& keys, int b, int h, int64_t at,
                            int n, float* s, int ss) {
  constexpr int F = kLaneValues<BITS>, N = kBlockValues<BITS>;
  constexpr int lanes = GROUP / (2 * F);  // int32 lanes a group's products fill
  constexpr int M = N > GROUP ? N / GROUP : 1;  // groups a whole block holds
  const int dims = keys.dims, groups = dims / GROUP, count = blocks<BITS>(dims);
  // int32 lane L's group, counted from its block's first; per block: that first group, a mask of its groups (of
  // lanes of `lane_group`'s input) and one of the bytes it holds (all but in a last, partial block).
  alignas(64) int32_t group_of[16];
  for (int lane = 0; lane < 16; ++lane) group_of[lane] = lane * 2 * F / GROUP;
  const __m512i lane_group = _mm512_load_si512(group_of);
  int first[kMaxBlocks];
  __mmask16 in[kMaxBlocks];
  __mmask64 bytes[kMaxBlocks];
  for (int k = 0; k < count; ++k) {
    first[k] = k * N / GROUP;
    in[k] = __mmask16((1u << std::min(std::max(N / GROUP, 1), groups - first[k])) - 1);
    const int left = (dims - k * N) * BITS / 8;
    bytes[k] = left >= kBlockBytes ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
  }
  const int full = dims / N;  // blocks read whole
  const int16_t* query[R];
  float scale[R];
  Vec sums[R][kMaxBlocks];  // per lane: the query's sum over the lane's group, over its lanes and the scale
  for (int i = 0; i < R; ++i) {
    const float* row = q + size_t(i) * qs;
    query[i] = reinterpret_cast<const int16_t*>(row);
    scale[i] = *dot_scale<BITS>(row, dims);
    const Vec by = V::set1(1.0f / (lanes * scale[i]));
    for (int k = 0; k < count; ++k)
      sums[i][k] = V::mul(_mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps(in[k], qsum + i * groups + first[k])),
                          by);
  }
  const Packed key(keys, b, h, at);
  for (int j = 0; j < n; ++j) {
    const uint8_t* w = key.w + j * key.w_row;
    const float *times = key.scale + j * key.s_row, *plus = key.bias + j * key.s_row;
    Vec t[R];
    for (int i = 0; i < R; ++i) t[i] = V::zero();
    for (int k = 0; k < count; ++k) {
      const __m512i x = k < full ? _mm512_loadu_si512(w + k * kBlockBytes)
                                 : _mm512_maskz_loadu_epi8(bytes[k], w + k * kBlockBytes);
      __m512i a[R];
      for (int i = 0; i < R; ++i) a[i] = _mm512_setzero_si512();
      dot_fields<R, BITS>(x, query, k * N, a);
      Vec by, shift;
      if (k < full) {
        by = spread<M>(times + first[k], lane_group), shift = spread<M>(plus + first[k], lane_group);
      } else {
        by = _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps(in[k], times + first[k]));
        shift = _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps(in[k], plus + first[k]));
      }
      for (int i = 0; i < R; ++i) t[i] = V::fma(_mm512_cvtepi32_ps(a[i]), by, V::fma(shift, sums[i][k], t[i]));
    }
    for (int i = 0; i < R; ++i) s[i * ss + j] = scale[i] * V::sum(t[i]);
  }
}
