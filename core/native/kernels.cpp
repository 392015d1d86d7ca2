/*
 * mlxchat._kernels: fused CPU kernels for the work MLX's CPU backend runs as many single-threaded scalar
 * passes (see mlxchat.kernels).
 *
 * On the CPU, MLX computes exp one value at a time (about 16 ns each here), so a SwiGLU gate and the softmax
 * of attention cost more than the matrix products around them in a prefill; and mx.fast.rms_norm falls
 * back to seven separate operations (mx.fast.rope to about twenty). These primitives do each in one
 * vectorized pass: the softmax of attention scores with the causal mask applied as it goes, silu(g) * u,
 * RMS normalization, rotate-half RoPE, and exp and silu alone. exp is a
 * degree-7 polynomial of 2^f with an exact power-of-two scaling (about 1 ulp; MLX's within a few ulp of it), 0
 * below -87.3 and saturating at 3.3e38 above 88.7 (the softmax and the gates never reach that far).
 *
 * They are ordinary nodes of MLX's lazy graph, evaluated on the CPU stream, built and used like
 * mlxchat._quantized (Linux, the MLX version they were built against, float32 on the CPU device).
 */
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "mlx/version.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define MLXK_AVX512 __attribute__((target("avx512f,avx512dq,avx2,fma")))
#define MLXK_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

enum class Isa { scalar, avx2, avx512 };

Isa best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::scalar;
}

const Isa isa = best_isa();

// -- exp ------------------------------------------------------------------------------------------------

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLow = -87.3f, kHigh = 88.7f;  // float32 exp leaves the normal range beyond these
// 2^f = e^(f ln 2) on [-0.5, 0.5]: Taylor coefficients (ln 2)^i / i!, i = 0..7 (error below 1e-8)
constexpr float kC[8] = {1.0f, 0.693147180559945f, 0.240226506959101f, 0.0555041086648216f,
                         0.00961812910762848f, 0.00133335581464284f, 0.000154035303933816f, 1.52527338040598e-05f};

/* exp(x): 0 below kLow (where float32 exp underflows; -inf included), clamped above kHigh. */
inline float exp_scalar(float x) {
  if (!(x >= kLow)) return x != x ? x : 0.0f;
  x = std::fmin(x, kHigh);
  const float t = x * kLog2e, n = std::nearbyint(t), f = t - n;
  float p = kC[7];
  for (int i = 6; i >= 0; --i) p = p * f + kC[i];
  return std::ldexp(p, int(n));
}

#if defined(__x86_64__)
MLXK_AVX512 inline __m512 exp512(__m512 in) {
  const __mmask16 live = _mm512_cmp_ps_mask(in, _mm512_set1_ps(kLow), _CMP_GE_OQ);
  const __m512 x = _mm512_min_ps(_mm512_max_ps(in, _mm512_set1_ps(kLow)), _mm512_set1_ps(kHigh));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kC[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC[i]));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

MLXK_AVX2 inline __m256 exp256(__m256 in) {
  const __m256 live = _mm256_cmp_ps(in, _mm256_set1_ps(kLow), _CMP_GE_OQ);
  const __m256 x = _mm256_min_ps(_mm256_max_ps(in, _mm256_set1_ps(kLow)), _mm256_set1_ps(kHigh));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kC[7]);
  for (int i = 6; i >= 0; --i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

MLXK_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

MLXK_AVX2 inline float hmax256(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// -- softmax ---------------------------------------------------------------------------------------------

/* One row: out[j] = exp(x[j] - max) / sum over j < visible, 0 from visible on. */
void softmax_row_scalar(const float* x, float* out, int n, int visible) {
  float top = -INFINITY;
  for (int j = 0; j < visible; ++j) top = std::fmax(top, x[j]);
  float sum = 0.0f;
  for (int j = 0; j < visible; ++j) sum += out[j] = exp_scalar(x[j] - top);
  const float scale = visible > 0 ? 1.0f / sum : 0.0f;
  for (int j = 0; j < visible; ++j) out[j] *= scale;
  for (int j = visible; j < n; ++j) out[j] = 0.0f;
}

#if defined(__x86_64__)
MLXK_AVX512 void softmax_row_avx512(const float* x, float* out, int n, int visible) {
  const int whole = visible - visible % 16;
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int j = 0; j < whole; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(x + j));
  float m = _mm512_reduce_max_ps(top);
  for (int j = whole; j < visible; ++j) m = std::fmax(m, x[j]);
  const __m512 shift = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < whole; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + j), shift));
    _mm512_storeu_ps(out + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (int j = whole; j < visible; ++j) sum += out[j] = exp_scalar(x[j] - m);
  const float inv = visible > 0 ? 1.0f / sum : 0.0f;
  const __m512 scale = _mm512_set1_ps(inv);
  for (int j = 0; j < whole; j += 16) _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_loadu_ps(out + j), scale));
  for (int j = whole; j < visible; ++j) out[j] *= inv;
  for (int j = visible; j < n; ++j) out[j] = 0.0f;
}

MLXK_AVX2 void softmax_row_avx2(const float* x, float* out, int n, int visible) {
  const int whole = visible - visible % 8;
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (int j = 0; j < whole; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(x + j));
  float m = hmax256(top);
  for (int j = whole; j < visible; ++j) m = std::fmax(m, x[j]);
  const __m256 shift = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (int j = 0; j < whole; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift));
    _mm256_storeu_ps(out + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum256(acc);
  for (int j = whole; j < visible; ++j) sum += out[j] = exp_scalar(x[j] - m);
  const float inv = visible > 0 ? 1.0f / sum : 0.0f;
  const __m256 scale = _mm256_set1_ps(inv);
  for (int j = 0; j < whole; j += 8) _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(out + j), scale));
  for (int j = whole; j < visible; ++j) out[j] *= inv;
  for (int j = visible; j < n; ++j) out[j] = 0.0f;
}
#endif

void softmax_row(const float* x, float* out, int n, int visible) {
#if defined(__x86_64__)
  if (isa == Isa::avx512) return softmax_row_avx512(x, out, n, visible);
  if (isa == Isa::avx2) return softmax_row_avx2(x, out, n, visible);
#endif
  softmax_row_scalar(x, out, n, visible);
}

// -- silu(g) * u -----------------------------------------------------------------------------------------

void silu_mul_scalar(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] * u[i] / (1.0f + exp_scalar(-g[i]));
}

#if defined(__x86_64__)
MLXK_AVX512 void silu_mul_avx512(const float* g, const float* u, float* out, int64_t n) {
  const int64_t whole = n - n % 16;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 d = _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)));
    _mm512_storeu_ps(out + i, _mm512_div_ps(_mm512_mul_ps(x, _mm512_loadu_ps(u + i)), d));
  }
  silu_mul_scalar(g + whole, u + whole, out + whole, n - whole);
}

MLXK_AVX2 void silu_mul_avx2(const float* g, const float* u, float* out, int64_t n) {
  const int64_t whole = n - n % 8;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 d = _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x)));
    _mm256_storeu_ps(out + i, _mm256_div_ps(_mm256_mul_ps(x, _mm256_loadu_ps(u + i)), d));
  }
  silu_mul_scalar(g + whole, u + whole, out + whole, n - whole);
}
#endif

void silu_mul_all(const float* g, const float* u, float* out, int64_t n) {
#if defined(__x86_64__)
  if (isa == Isa::avx512) return silu_mul_avx512(g, u, out, n);
  if (isa == Isa::avx2) return silu_mul_avx2(g, u, out, n);
#endif
  silu_mul_scalar(g, u, out, n);
}

// -- exp, silu ------------------------------------------------------------------------------------------

enum class Unary { exp, silu };

template <Unary OP>
void unary_scalar(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = OP == Unary::exp ? exp_scalar(x[i]) : x[i] / (1.0f + exp_scalar(-x[i]));
}

#if defined(__x86_64__)
template <Unary OP>
MLXK_AVX512 void unary_avx512(const float* x, float* out, int64_t n) {
  const int64_t whole = n - n % 16;
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    _mm512_storeu_ps(out + i, OP == Unary::exp ? exp512(v)
                                               : _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                                exp512(_mm512_sub_ps(_mm512_setzero_ps(), v)))));
  }
  unary_scalar<OP>(x + whole, out + whole, n - whole);
}

template <Unary OP>
MLXK_AVX2 void unary_avx2(const float* x, float* out, int64_t n) {
  const int64_t whole = n - n % 8;
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(out + i, OP == Unary::exp ? exp256(v)
                                               : _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                                                exp256(_mm256_sub_ps(_mm256_setzero_ps(), v)))));
  }
  unary_scalar<OP>(x + whole, out + whole, n - whole);
}
#endif

template <Unary OP>
void unary_all(const float* x, float* out, int64_t n) {
#if defined(__x86_64__)
  if (isa == Isa::avx512) return unary_avx512<OP>(x, out, n);
  if (isa == Isa::avx2) return unary_avx2<OP>(x, out, n);
#endif
  unary_scalar<OP>(x, out, n);
}

// -- RMS norm --------------------------------------------------------------------------------------------

void rms_norm_scalar(const float* x, const float* w, float* out, int d, float eps) {
  float sum = 0.0f;
  for (int j = 0; j < d; ++j) sum += x[j] * x[j];
  const float r = 1.0f / std::sqrt(sum / float(d) + eps);
  for (int j = 0; j < d; ++j) out[j] = w[j] * (x[j] * r);
}

#if defined(__x86_64__)
MLXK_AVX512 void rms_norm_avx512(const float* x, const float* w, float* out, int d, float eps) {
  const int whole = d - d % 16;
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < whole; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (int j = whole; j < d; ++j) sum += x[j] * x[j];
  const float r = 1.0f / std::sqrt(sum / float(d) + eps);
  const __m512 scale = _mm512_set1_ps(r);
  for (int j = 0; j < whole; j += 16)
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_loadu_ps(w + j), _mm512_mul_ps(_mm512_loadu_ps(x + j), scale)));
  for (int j = whole; j < d; ++j) out[j] = w[j] * (x[j] * r);
}
#endif

void rms_norm_row(const float* x, const float* w, float* out, int d, float eps) {
#if defined(__x86_64__)
  if (isa == Isa::avx512) return rms_norm_avx512(x, w, out, d, eps);
#endif
  rms_norm_scalar(x, w, out, d, eps);
}

// -- rotary embedding ------------------------------------------------------------------------------------

/* Rotate-half RoPE of one row: pairs (j, j + half) for j < half turn by the row's angles; the features from
 * 2 * half on pass unchanged. */
__attribute__((target_clones("avx512f", "avx2", "default"))) void rope_row(const float* x, float* out, int d, int half,
                                                                           const float* cos, const float* sin) {
  for (int j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    out[j] = a * cos[j] - b * sin[j];
    out[j + half] = b * cos[j] + a * sin[j];
  }
  for (int j = 2 * half; j < d; ++j) out[j] = x[j];
}

// -- primitives ------------------------------------------------------------------------------------------

mx::Stream cpu_stream() {
  return mx::default_stream(mx::Device::cpu);
}

/*
 * Copies any float32 array into contiguous row-major order, a row of the last axis at a time (a memcpy when
 * that axis is contiguous, as after a transpose of the head and position axes): walking the index per element
 * made a 128-token prefill's RoPE on transposed queries and keys cost a fifth of the prefill.
 */
void copy_contiguous(const mx::array& a, float* out) {
  const float* src = a.data<float>();
  const int last = int(a.ndim()) - 1;
  if (last < 0) {
    *out = *src;
    return;
  }
  const int64_t width = a.shape(last), step = a.strides()[last];
  std::vector<int> index(last, 0);
  for (size_t row = 0; row < a.size() / std::max<int64_t>(width, 1); ++row, out += width) {
    int64_t offset = 0;
    for (int d = 0; d < last; ++d) offset += int64_t(index[d]) * a.strides()[d];
    if (step == 1)
      std::memcpy(out, src + offset, size_t(width) * sizeof(float));
    else
      for (int64_t i = 0; i < width; ++i) out[i] = src[offset + i * step];
    for (int d = last - 1; d >= 0; --d) {
      if (++index[d] < a.shape(d)) break;
      index[d] = 0;
    }
  }
}

/*
 * Shared plumbing: a float32 output shaped as input 0, computed by `run(inputs, data, out)` on the stream's
 * thread, `data` being each input's values in row-major order (copied there only when the input is laid out
 * otherwise, so that no copy is added to the graph). The gradient is that of `reference`, the same function in
 * MLX's own operations.
 */
class Kernel : public mx::UnaryPrimitive {
 public:
  explicit Kernel(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat's fused kernels run on the CPU only");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    const auto grads = mx::vjp([this](const std::vector<mx::array>& in) { return std::vector<mx::array>{reference(in)}; },
                               primals, cotangents).second;
    std::vector<mx::array> out;
    for (int arg : argnums) out.push_back(grads[arg]);
    return out;
  }

 protected:
  virtual mx::array reference(const std::vector<mx::array>&) {
    throw std::logic_error(std::string(name()) + " has no reference to differentiate");
  }

  template <typename Run>
  void dispatch(const std::vector<mx::array>& inputs, mx::array& out, Run run) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    std::vector<mx::array> held;
    for (const auto& a : inputs) held.push_back(mx::array::unsafe_weak_copy(a));
    encoder.dispatch([held = std::move(held), out = mx::array::unsafe_weak_copy(out), run]() mutable {
      std::vector<std::vector<float>> copies(held.size());
      std::vector<const float*> data;
      for (size_t i = 0; i < held.size(); ++i) {
        if (held[i].flags().row_contiguous) {
          data.push_back(held[i].data<float>());
        } else {
          copies[i].resize(held[i].size());
          copy_contiguous(held[i], copies[i].data());
          data.push_back(copies[i].data());
        }
      }
      run(held, data, out.data<float>());
    });
  }
};

class Softmax : public Kernel {
 public:
  Softmax(mx::Stream stream, int queries) : Kernel(stream), queries_(queries) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [queries = queries_](const std::vector<mx::array>& in, const std::vector<const float*>& x,
                                               float* y) {
      const int n = in[0].shape(-1);
      const int64_t rows = int64_t(in[0].size() / std::max(n, 1));
      for (int64_t r = 0; r < rows; ++r) {
        const int visible = queries > 0 ? std::min(n, n - queries + 1 + int(r % queries)) : n;
        softmax_row(x[0] + r * n, y + r * n, n, std::max(visible, 0));
      }
    });
  }

  const char* name() const override {
    return "MlxchatSoftmax";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return queries_ == static_cast<const Softmax&>(other).queries_;
  }

 protected:
  mx::array reference(const std::vector<mx::array>& in) override {
    const auto s = stream();
    if (queries_ == 0) return mx::softmax(in[0], {-1}, false, s);
    const int n = in[0].shape(-1);
    const auto visible = mx::less_equal(mx::reshape(mx::arange(n, s), {1, n}, s),
                                        mx::reshape(mx::arange(n - queries_, n, s), {queries_, 1}, s), s);
    const auto rows = mx::reshape(in[0], {-1, queries_, n}, s);
    const auto masked = mx::where(visible, rows, mx::array(-INFINITY), s);
    return mx::reshape(mx::softmax(masked, {-1}, false, s), in[0].shape(), s);
  }

 private:
  int queries_;
};

class SiluMul : public Kernel {
 public:
  using Kernel::Kernel;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [](const std::vector<mx::array>& in, const std::vector<const float*>& x, float* y) {
      silu_mul_all(x[0], x[1], y, int64_t(in[0].size()));
    });
  }

  const char* name() const override {
    return "MlxchatSiluMul";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }

 protected:
  mx::array reference(const std::vector<mx::array>& in) override {
    const auto s = stream();
    return mx::multiply(mx::multiply(in[0], mx::sigmoid(in[0], s), s), in[1], s);
  }
};

class UnaryKernel : public Kernel {
 public:
  UnaryKernel(mx::Stream stream, Unary op) : Kernel(stream), op_(op) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [op = op_](const std::vector<mx::array>& in, const std::vector<const float*>& x, float* y) {
      if (op == Unary::exp)
        unary_all<Unary::exp>(x[0], y, int64_t(in[0].size()));
      else
        unary_all<Unary::silu>(x[0], y, int64_t(in[0].size()));
    });
  }

  const char* name() const override {
    return op_ == Unary::exp ? "MlxchatExp" : "MlxchatSilu";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return op_ == static_cast<const UnaryKernel&>(other).op_;
  }

 protected:
  mx::array reference(const std::vector<mx::array>& in) override {
    const auto s = stream();
    return op_ == Unary::exp ? mx::exp(in[0], s) : mx::multiply(in[0], mx::sigmoid(in[0], s), s);
  }

 private:
  Unary op_;
};

class RmsNorm : public Kernel {
 public:
  RmsNorm(mx::Stream stream, float eps) : Kernel(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [eps = eps_](const std::vector<mx::array>& in, const std::vector<const float*>& x, float* y) {
      const int d = in[0].shape(-1);
      const int64_t rows = int64_t(in[0].size() / std::max(d, 1));
      for (int64_t r = 0; r < rows; ++r) rms_norm_row(x[0] + r * d, x[1], y + r * d, d, eps);
    });
  }

  const char* name() const override {
    return "MlxchatRmsNorm";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 protected:
  mx::array reference(const std::vector<mx::array>& in) override {
    return mx::fast::rms_norm(in[0], in[1], eps_, stream());
  }

 private:
  float eps_;
};

class Rope : public Kernel {
 public:
  Rope(mx::Stream stream, int dims, int offset) : Kernel(stream), dims_(dims), offset_(offset) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [dims = dims_, offset = offset_](const std::vector<mx::array>& in,
                                                           const std::vector<const float*>& x, float* y) {
      const int d = in[0].shape(-1), length = in[0].shape(-2), half = dims / 2;
      const int64_t rows = int64_t(in[0].size() / std::max(d, 1));
      const float* inv_freq = x[1];
      // angles as transformers computes them: float32 position times float32 inverse frequency
      std::vector<float> cos((size_t)length * half), sin((size_t)length * half);
      for (int l = 0; l < length; ++l)
        for (int j = 0; j < half; ++j) {
          const float angle = float(offset + l) * inv_freq[j];
          cos[(size_t)l * half + j] = std::cos(angle);
          sin[(size_t)l * half + j] = std::sin(angle);
        }
      for (int64_t r = 0; r < rows; ++r) {
        const size_t at = (size_t)(r % length) * half;
        rope_row(x[0] + r * d, y + r * d, d, half, cos.data() + at, sin.data() + at);
      }
    });
  }

  /* A rotation: its gradient turns the cotangent back by the opposite angles. */
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<mx::array> grads;
    for (int arg : argnums) {
      if (arg != 0) throw std::invalid_argument("mlxchat rope: only x has a gradient");
      grads.push_back(mx::array(cotangents[0].shape(), mx::float32, std::make_shared<Rope>(stream(), dims_, offset_),
                                {cotangents[0], mx::negative(primals[1], stream())}));
    }
    return grads;
  }

  const char* name() const override {
    return "MlxchatRope";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && offset_ == o.offset_;
  }

 private:
  int dims_, offset_;
};

/* Sets flush-to-zero and denormals-are-zero on the thread that evaluates it (the stream's): a denormal operand
 * costs about a hundred cycles on x86, and decays of linear attention reach them (a DeltaNet chunk's
 * exp(gamma) below 1e-38). Results change only where a value would be below 1.2e-38. */
class FlushDenormals : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;

  void eval_cpu(const std::vector<mx::array>&, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_output_array(out);
    encoder.dispatch([out = mx::array::unsafe_weak_copy(out)]() mutable {
#if defined(__x86_64__)
      _mm_setcsr(_mm_getcsr() | 0x8040);
      out.data<bool>()[0] = true;
#else
      out.data<bool>()[0] = false;
#endif
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat's denormal flushing is for the CPU stream");
  }

  const char* name() const override {
    return "MlxchatFlushDenormals";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return false;  // never merged away: each evaluation sets the mode on its stream's thread
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override {
    return {{}};
  }
};

void check_float32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string(what) + " must be float32");
  if (a.ndim() < 1 || a.shape(-1) < 1) throw std::invalid_argument(std::string(what) + " must not be empty");
}

/* Softmax over the last axis; `queries` > 0 applies the causal mask of that many queries ending at the last
 * key (row r is query r % queries and sees the keys up to n - queries + r % queries). */
mx::array softmax(const mx::array& x, int queries) {
  check_float32(x, "scores");
  if (queries < 0) throw std::invalid_argument("queries must be 0 or more");
  return mx::array(x.shape(), mx::float32, std::make_shared<Softmax>(cpu_stream(), queries), {x});
}

mx::array silu_mul(const mx::array& g, const mx::array& u) {
  check_float32(g, "gate");
  check_float32(u, "x");
  if (g.shape() != u.shape()) throw std::invalid_argument("gate and x must have the same shape");
  return mx::array(g.shape(), mx::float32, std::make_shared<SiluMul>(cpu_stream()), {g, u});
}

mx::array unary(const mx::array& x, Unary op) {
  check_float32(x, "x");
  return mx::array(x.shape(), mx::float32, std::make_shared<UnaryKernel>(cpu_stream(), op), {x});
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  check_float32(x, "x");
  check_float32(w, "weight");
  if (w.ndim() != 1 || w.shape(0) != x.shape(-1)) throw std::invalid_argument("weight must be [x.shape[-1]]");
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(cpu_stream(), eps), {x, w});
}

/* Rotate-half RoPE of x [..., L, D] at positions offset .. offset + L - 1 over its first `dims` features,
 * pair j turning by position * inv_freq[j]. */
mx::array rope(const mx::array& x, const mx::array& inv_freq, int dims, int offset) {
  check_float32(x, "x");
  check_float32(inv_freq, "inv_freq");
  if (x.ndim() < 2) throw std::invalid_argument("x must be [..., length, dims]");
  if (dims < 2 || dims % 2 || dims > x.shape(-1)) throw std::invalid_argument("dims must be even and fit x");
  if (inv_freq.ndim() != 1 || inv_freq.shape(0) != dims / 2) throw std::invalid_argument("inv_freq must be [dims / 2]");
  if (offset < 0) throw std::invalid_argument("offset must not be negative");
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(cpu_stream(), dims, offset),
                   {x, inv_freq});
}

}  // namespace

NB_MODULE(_kernels, m) {
  m.doc() = "Fused float32 CPU kernels as MLX primitives (see mlxchat.kernels).";
  m.def("softmax", &softmax, nb::arg("scores"), nb::arg("queries") = 0,
        "Softmax over the last axis; with queries > 0, under the causal mask of that many trailing queries.");
  m.def("silu_mul", &silu_mul, nb::arg("gate"), nb::arg("x"), "silu(gate) * x.");
  m.def("exp", [](const mx::array& x) { return unary(x, Unary::exp); }, nb::arg("x"), "exp(x), vectorized.");
  m.def("silu", [](const mx::array& x) { return unary(x, Unary::silu); }, nb::arg("x"), "x * sigmoid(x).");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"), "weight * x / rms(x).");
  m.def("rope", &rope, nb::arg("x"), nb::arg("inv_freq"), nb::arg("dims"), nb::arg("offset"),
        "Rotate-half RoPE of x [..., L, D] at positions offset.. over its first dims features.");
  m.def("flush_denormals", [] {
    return mx::array(mx::Shape{}, mx::bool_, std::make_shared<FlushDenormals>(cpu_stream()), {});
  }, "An array whose evaluation sets flush-to-zero / denormals-are-zero on the CPU stream's thread.");
  m.def("mlx_version", [] {
    return std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
           std::to_string(MLX_VERSION_PATCH);
  });
  m.def("isa", [] { return std::string(isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "scalar"); });
}
