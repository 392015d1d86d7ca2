/*
 * The inner loops of mlxchat's fused attention (attention.cpp), written once over a vector type V and
 * included once per instruction set, inside that set's `#pragma GCC target` region and namespace, where V is
 * defined: W lanes of float32 (Vec); zero, set1, load (of W floats, or of W IEEE halves as floats), store, fma,
 * add, sub, mul, max; sum and top of one vector's lanes; sums(acc), the W sums of W vectors in one vector (lane p
 * holds the sum of acc[input(p)]),
 * and store_rows<R>, which writes that vector's R rows of W / R lanes; exp; bytes8/bytes4, the W 8- or 4-bit
 * values from feature c on, and bytes4x2 the 2W 4-bit ones, in two vectors; kAcc and kMaxC, the accumulators
 * and value chunks the registers hold.
 *
 * Feature counts (`dims`) are whole multiples of 16 (attention.cpp pads what it stages), so of W. Keys and values
 * read as they lie are T: float (float32) or uint16_t (float16, converted as they are loaded).
 */

/* s[i * ss + j] = q_i . k_j for R rows of q and n keys, one key at a time. */
template <int R, typename T>
inline void score_each(const float* q, int qs, const T* k, int64_t ks, int n, int dims, float* s, int ss) {
  for (int j = 0; j < n; ++j) {
    const T* kj = k + j * ks;
    Vec acc[R];
    for (int i = 0; i < R; ++i) acc[i] = V::zero();
    for (int c = 0; c < dims; c += V::W) {
      const Vec kv = V::load(kj + c);
      for (int i = 0; i < R; ++i) acc[i] = V::fma(V::load(q + i * qs + c), kv, acc[i]);
    }
    for (int i = 0; i < R; ++i) s[i * ss + j] = V::sum(acc[i]);
  }
}

/* The same for R rows and W / R keys at a time: W accumulators, whose lanes are summed together at the end
 * (V::sums), so a score costs a fraction of a horizontal sum. */
template <int R, typename T>
inline void score_rows(const float* q, int qs, const T* k, int64_t ks, int n, int dims, float* s, int ss) {
  constexpr int K = V::W / R;
  int j = 0;
  for (; j + K <= n; j += K) {
    Vec acc[V::W];
    for (auto& a : acc) a = V::zero();
    for (int c = 0; c < dims; c += V::W) {
      Vec qv[R];
      for (int i = 0; i < R; ++i) qv[i] = V::load(q + i * qs + c);
      for (int m = 0; m < K; ++m) {
        const Vec kv = V::load(k + (j + m) * ks + c);
        for (int i = 0; i < R; ++i) acc[V::input(K * i + m)] = V::fma(qv[i], kv, acc[V::input(K * i + m)]);
      }
    }
    V::template store_rows<R>(V::sums(acc), s + j, ss);
  }
  score_each<R>(q, qs, k + j * ks, ks, n - j, dims, s + j, ss);
}

template <typename T>
inline void scores(const float* q, int rows, int qs, const T* k, int64_t ks, int n, int dims, float* s, int ss) {
  int r = 0;
  if constexpr (V::W >= 4)
    for (; r + 4 <= rows; r += 4) score_rows<4>(q + r * qs, qs, k, ks, n, dims, s + r * ss, ss);
  if constexpr (V::W >= 2)
    for (; r + 2 <= rows; r += 2) score_rows<2>(q + r * qs, qs, k, ks, n, dims, s + r * ss, ss);
  for (; r < rows; ++r) score_rows<1>(q + r * qs, qs, k, ks, n, dims, s + r * ss, ss);
}

/* acc[i * as + f] += sum over j of p[i * ps + j] * v[j * vs + f], for R rows and C * W features. */
template <int R, int C, typename T>
inline void accumulate_tile(const float* p, int ps, const T* v, int64_t vs, int n, float* acc, int as) {
  Vec a[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) a[i][c] = V::load(acc + i * as + c * V::W);
  for (int j = 0; j < n; ++j) {
    Vec x[C];
    for (int c = 0; c < C; ++c) x[c] = V::load(v + j * vs + c * V::W);
    for (int i = 0; i < R; ++i) {
      const Vec w = V::set1(p[i * ps + j]);
      for (int c = 0; c < C; ++c) a[i][c] = V::fma(w, x[c], a[i][c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) V::store(acc + i * as + c * V::W, a[i][c]);
}

template <int R, typename T>
inline void accumulate_rows(const float* p, int ps, const T* v, int64_t vs, int n, int dims, float* acc, int as) {
  constexpr int C = V::kAcc / R < V::kMaxC ? V::kAcc / R : V::kMaxC;
  const int chunks = dims / V::W;
  int c = 0;
  for (; c + C <= chunks; c += C) accumulate_tile<R, C>(p, ps, v + c * V::W, vs, n, acc + c * V::W, as);
  for (; c < chunks; ++c) accumulate_tile<R, 1>(p, ps, v + c * V::W, vs, n, acc + c * V::W, as);
}

template <typename T>
inline void accumulate(const float* p, int rows, int ps, const T* v, int64_t vs, int n, int dims, float* acc,
                       int as) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) accumulate_rows<4>(p + r * ps, ps, v, vs, n, dims, acc + r * as, as);
  switch (rows - r) {
    case 3: return accumulate_rows<3>(p + r * ps, ps, v, vs, n, dims, acc + r * as, as);
    case 2: return accumulate_rows<2>(p + r * ps, ps, v, vs, n, dims, acc + r * as, as);
    case 1: return accumulate_rows<1>(p + r * ps, ps, v, vs, n, dims, acc + r * as, as);
    default: return;
  }
}

/* The W values from feature c on of a packed row, as floats. */
template <int BITS>
inline Vec unpack(const uint8_t* w, int c) {
  return BITS == 8 ? V::bytes8(w, c) : V::bytes4(w, c);
}

/* The 2W values from feature c on (4-bit ones unpacked together). */
template <int BITS>
inline void unpack2(const uint8_t* w, int c, Vec& lo, Vec& hi) {
  if constexpr (BITS == 8) {
    lo = V::bytes8(w, c);
    hi = V::bytes8(w, c + V::W);
  } else {
    V::bytes4x2(w, c, lo, hi);
  }
}

/* n packed rows (mx.quantize's affine layout) from position `at` in float32: w * scale + bias, a group at a time
 * (GROUP features, unrolled). */
template <int BITS, int GROUP>
inline void dequantize_rows(const Rows& rows, int b, int h, int64_t at, int n, float* out) {
  const int dims = rows.dims;
  const View data = rows.data, scales = rows.scales, biases = rows.biases;
  for (int j = 0; j < n; ++j, out += dims) {
    const auto* w = reinterpret_cast<const uint8_t*>(data.at<uint32_t>(b, h, at + j));
    const float* scale = scales.at<float>(b, h, at + j);
    const float* bias = biases.at<float>(b, h, at + j);
    for (int c = 0; c < dims; c += GROUP) {
      const Vec times = V::set1(scale[c / GROUP]), plus = V::set1(bias[c / GROUP]);
      for (int f = 0; f < GROUP; f += 2 * V::W) {
        Vec lo, hi;
        unpack2<BITS>(w, c + f, lo, hi);
        V::store(out + c + f, V::fma(lo, times, plus));
        V::store(out + c + f + V::W, V::fma(hi, times, plus));
      }
    }
  }
}

/* f(bits, group) for a packed layout, both as compile-time constants (std::integral_constant). */
template <class F>
inline void by_format(const Rows& rows, F&& f) {
  const auto with = [&](auto bits) {
    switch (rows.group) {
      case 32: return f(bits, std::integral_constant<int, 32>{});
      case 64: return f(bits, std::integral_constant<int, 64>{});
      default: return f(bits, std::integral_constant<int, 128>{});
    }
  };
  return rows.bits == 8 ? with(std::integral_constant<int, 8>{}) : with(std::integral_constant<int, 4>{});
}

inline void dequantize(const Rows& rows, int b, int h, int64_t at, int n, float* out) {
  by_format(rows, [&](auto bits, auto group) {
    dequantize_rows<decltype(bits)::value, decltype(group)::value>(rows, b, h, at, n, out);
  });
}

inline float row_max(const float* x, int n) {
  Vec top = V::set1(-INFINITY);
  int j = 0;
  for (; j + V::W <= n; j += V::W) top = V::max(top, V::load(x + j));
  float m = V::top(top);
  for (; j < n; ++j) m = std::fmax(m, x[j]);
  return m;
}

/* x[j] = exp(x[j] - shift); returns their sum. */
inline float exp_sum(float* x, int n, float shift) {
  const Vec by = V::set1(shift);
  Vec sum = V::zero();
  int j = 0;
  for (; j + V::W <= n; j += V::W) {
    const Vec e = V::exp(V::sub(V::load(x + j), by));
    V::store(x + j, e);
    sum = V::add(sum, e);
  }
  float total = V::sum(sum);
  for (; j < n; ++j) total += x[j] = exp_scalar(x[j] - shift);
  return total;
}

/* x *= by over dims features. */
inline void scale(float* x, int dims, float by) {
  const Vec f = V::set1(by);
  for (int c = 0; c < dims; c += V::W) V::store(x + c, V::mul(V::load(x + c), f));
}

