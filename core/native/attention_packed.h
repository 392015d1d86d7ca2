/*
 * The fused attention's inner loops over packed keys and values (mx.quantize's affine layout) for one or two
 * query rows a KV head (a decode step; attention.cpp, kFusedRows), converting the packed values in registers.
 * Included per instruction set like attention_ops.h (after it), where V also has kWords (the 32-bit words a
 * chunk reads: W, or W / 2 with each word in two lanes), Int (those words), words(p) (the kWords words from byte p
 * on) and field<F, BITS>(x) (vector F of the chunk's BITS-bit values, as floats).
 *
 * A chunk of a packed row is kWords words, S = 32 / BITS values each; field k of its words (each word's value at
 * bit k * BITS) holds its values S * m + k (m = 0..kWords-1), and its vector F is the fields F * P .. F * P + P - 1
 * (P = W / kWords), one a kWords lanes. So a chunk is converted with shifts and masks only, no shuffles (4-bit
 * values were unpacked with several a vector: 1.5x slower on a Zen 3 EPYC; 8-bit ones ran as fast either way,
 * bound by their conversions and products). The rows these loops multiply follow the chunks' order: a query is
 * put in it once a task (`order`), and the sums of values are kept in it and put back in feature order at the
 * end (`add_ordered`). A chunk never spans two groups (the caller checks kChunk against the group size), so a
 * group's scale and bias apply to whole chunks.
 */

template <int BITS>
constexpr int kPerWord = 32 / BITS;

template <int BITS>
constexpr int kChunk = V::kWords * kPerWord<BITS>;

template <int BITS>
constexpr int kVectors = kChunk<BITS> / V::W;  // a chunk's vectors of values

/* f(std::integral_constant<int, k>) for k = 0..N-1, unrolled. */
template <int N, class F>
inline void each(F&& f) {
  [&]<int... K>(std::integer_sequence<int, K...>) {
    (f(std::integral_constant<int, K>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}

/* out[i * os + ...] = the dims features of row i of x in chunk order, for `rows` rows. */
template <int BITS>
inline void order_rows(const float* x, int rows, int xs, int dims, float* out, int os) {
  constexpr int S = kPerWord<BITS>, C = kChunk<BITS>, M = V::kWords;
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < dims; c += C)
      for (int k = 0; k < S; ++k)
        for (int m = 0; m < M; ++m) out[i * os + c + k * M + m] = x[i * xs + c + S * m + k];
}

/* out (feature order) += x (chunk order) over dims features of `rows` rows. */
template <int BITS>
inline void add_ordered_rows(const float* x, int rows, int xs, int dims, float* out, int os) {
  constexpr int S = kPerWord<BITS>, C = kChunk<BITS>, M = V::kWords;
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < dims; c += C)
      for (int k = 0; k < S; ++k)
        for (int m = 0; m < M; ++m) out[i * os + c + S * m + k] += x[i * xs + c + k * M + m];
}

inline void order(const float* x, int rows, int xs, int dims, int bits, float* out, int os) {
  return bits == 8 ? order_rows<8>(x, rows, xs, dims, out, os) : order_rows<4>(x, rows, xs, dims, out, os);
}

inline void add_ordered(const float* x, int rows, int xs, int dims, int bits, float* out, int os) {
  return bits == 8 ? add_ordered_rows<8>(x, rows, xs, dims, out, os)
                   : add_ordered_rows<4>(x, rows, xs, dims, out, os);
}

/* Where packed rows lie from position `at` of (b, h) on. */
struct Packed {
  const uint8_t* w;
  const float *scale, *bias;
  int64_t w_row, s_row;  // from one row to the next: bytes, floats (scales and biases share a layout)

  Packed(const Rows& rows, int b, int h, int64_t at)
      : w(reinterpret_cast<const uint8_t*>(rows.data.at<uint32_t>(b, h, at))),
        scale(rows.scales.at<float>(b, h, at)),
        bias(rows.biases.at<float>(b, h, at)),
        w_row(rows.data.row * int64_t(sizeof(uint32_t))),
        s_row(rows.scales.row) {}
};

/* s[i * ss + j] = q_i . k_j for R rows of q (in chunk order) and n packed keys: over each group,
 * scale * (q_i . w) + bias * (the group's sum of q_i, in qsum[i * groups + g]). */
template <int R, int BITS, int GROUP>
inline void packed_scores_rows(const float* q, int qs, const float* qsum, const Rows& keys, int b, int h, int64_t at,
                               int n, float* s, int ss) {
  constexpr int C = kChunk<BITS>;
  const int groups = keys.dims / GROUP;
  const Packed k(keys, b, h, at);
  for (int j = 0; j < n; ++j) {
    const uint8_t* w = k.w + j * k.w_row;
    const float *scale = k.scale + j * k.s_row, *bias = k.bias + j * k.s_row;
    Vec acc[R];
    float shift[R];
    for (int i = 0; i < R; ++i) acc[i] = V::zero(), shift[i] = 0.0f;
    for (int g = 0; g < groups; ++g) {
      Vec t[R][2];
      for (int i = 0; i < R; ++i) t[i][0] = t[i][1] = V::zero();
      for (int c = g * GROUP; c < (g + 1) * GROUP; c += C) {
        const typename V::Int x = V::words(w + c * BITS / 8);
        each<kVectors<BITS>>([&](auto f) {
          constexpr int F = decltype(f)::value;
          const Vec values = V::template field<F, BITS>(x);
          for (int i = 0; i < R; ++i) t[i][F % 2] = V::fma(V::load(q + i * qs + c + F * V::W), values, t[i][F % 2]);
        });
      }
      const Vec times = V::set1(scale[g]);
      for (int i = 0; i < R; ++i) {
        acc[i] = V::fma(V::add(t[i][0], t[i][1]), times, acc[i]);
        shift[i] += bias[g] * qsum[i * groups + g];
      }
    }
    for (int i = 0; i < R; ++i) s[i * ss + j] = V::sum(acc[i]) + shift[i];
  }
}

inline void packed_scores(const float* q, int rows, int qs, const float* qsum, const Rows& keys, int b, int h,
                          int64_t at, int n, float* s, int ss) {
  by_format(keys, [&](auto bits, auto group) {
    constexpr int B = decltype(bits)::value, G = decltype(group)::value;
    if constexpr (kChunk<B> <= G) {
      if (rows == 2) return packed_scores_rows<2, B, G>(q, qs, qsum, keys, b, h, at, n, s, ss);
      packed_scores_rows<1, B, G>(q, qs, qsum, keys, b, h, at, n, s, ss);
    }
  });
}

/* acc[i * as + ...] += sum over j of weight[i * kKeys + j] * (vector F0 + f of v_j's chunk, f < N) for the chunk
 * from feature c, for R rows and n packed values. */
template <int R, int BITS, int F0, int N>
inline void packed_accumulate_tile(const float* weight, const Packed& v, int n, int c, float* acc, int as) {
  Vec a[R][N];
  for (int i = 0; i < R; ++i)
    for (int f = 0; f < N; ++f) a[i][f] = V::load(acc + i * as + c + (F0 + f) * V::W);
  const uint8_t* w = v.w + c * BITS / 8;
  for (int j = 0; j < n; ++j, w += v.w_row) {
    const typename V::Int x = V::words(w);
    Vec times[R];
    for (int i = 0; i < R; ++i) times[i] = V::set1(weight[i * kKeys + j]);
    each<N>([&](auto f) {
      const Vec values = V::template field<F0 + decltype(f)::value, BITS>(x);
      for (int i = 0; i < R; ++i) a[i][f] = V::fma(times[i], values, a[i][f]);
    });
  }
  for (int i = 0; i < R; ++i)
    for (int f = 0; f < N; ++f) V::store(acc + i * as + c + (F0 + f) * V::W, a[i][f]);
}

/* acc[i] (chunk order) += sum over j of p_ij * (scale * v_j + bias): per group, the weights times the values'
 * scales, then the chunks, then the weights' sum against the biases. */
template <int R, int BITS, int GROUP>
inline void packed_accumulate_rows(const float* p, int ps, const Rows& values, int b, int h, int64_t at, int n,
                                   float* acc, int as) {
  constexpr int C = kChunk<BITS>, K = kVectors<BITS>;
  constexpr int N = K < V::kAcc / R ? K : V::kAcc / R;  // vectors a tile sums (the registers)
  const Packed v(values, b, h, at);
  float weight[R * kKeys];
  for (int g = 0; g < values.dims / GROUP; ++g) {
    float shift[R] = {};
    for (int j = 0; j < n; ++j) {
      const float scale = v.scale[j * v.s_row + g], bias = v.bias[j * v.s_row + g];
      for (int i = 0; i < R; ++i) {
        weight[i * kKeys + j] = p[i * ps + j] * scale;
        shift[i] += p[i * ps + j] * bias;
      }
    }
    for (int c = g * GROUP; c < (g + 1) * GROUP; c += C)
      each<K / N>([&](auto tile) {
        packed_accumulate_tile<R, BITS, decltype(tile)::value * N, N>(weight, v, n, c, acc, as);
      });
    for (int i = 0; i < R; ++i) {
      const Vec by = V::set1(shift[i]);
      float* out = acc + i * as + g * GROUP;
      for (int f = 0; f < GROUP; f += V::W) V::store(out + f, V::add(V::load(out + f), by));
    }
  }
}

inline void packed_accumulate(const float* p, int rows, int ps, const Rows& values, int b, int h, int64_t at, int n,
                              float* acc, int as) {
  by_format(values, [&](auto bits, auto group) {
    constexpr int B = decltype(bits)::value, G = decltype(group)::value;
    if constexpr (kChunk<B> <= G) {
      if (rows == 2) return packed_accumulate_rows<2, B, G>(p, ps, values, b, h, at, n, acc, as);
      packed_accumulate_rows<1, B, G>(p, ps, values, b, h, at, n, acc, as);
    }
  });
}
