/*
 * mlxchat._kernels: fused CPU kernels for the work MLX's CPU backend runs as many single-threaded scalar
 * passes (see mlxchat.kernels).
 *
 * On the CPU, MLX computes exp one value at a time (about 16 ns each here), so a SwiGLU gate and the softmax
 * of attention cost more than the matrix products around them in a prefill; mx.fast.rms_norm falls back to
 * seven separate operations (mx.fast.rope to about twenty), and attention to products whose scores grow with
 * the context. These primitives do each in one pass: attention over float32, float16 or packed keys and values
 * (attention.cpp: online softmax, keys and values read in place, split over the cores), silu(g) * u, RMS
 * normalization, rotate-half RoPE, and exp and silu alone (vectorized: simd.h). A decode step is mostly small
 * nodes, each a few microseconds to dispatch: attention's heads (Heads), a decode row's cache write and attention
 * (DecodeRows) and a Gated DeltaNet layer's step (GatedDeltaStep) are one node each.
 *
 * They are ordinary nodes of MLX's lazy graph, evaluated on the CPU stream, built and used like
 * mlxchat._quantized (Linux, the MLX version they were built against, float32 on the CPU device).
 */
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "mlx/version.h"

#include "attention.h"
#include "dispatch.h"
#include "simd.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace mlxchat_simd;

namespace {

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
 * Copies any array of T (float32, or float16 as uint16_t) into contiguous row-major order, a row of the last axis
 * at a time (a memcpy when that axis is contiguous, as after a transpose of the head and position axes): walking
 * the index per element made a 128-token prefill's RoPE on transposed queries and keys cost a fifth of the prefill.
 */
template <typename T = float>
void copy_contiguous(const mx::array& a, T* out) {
  const T* src = a.data<T>();
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
      std::memcpy(out, src + offset, size_t(width) * sizeof(T));
    else
      for (int64_t i = 0; i < width; ++i) out[i] = src[offset + i * step];
    for (int d = last - 1; d >= 0; --d) {
      if (++index[d] < a.shape(d)) break;
      index[d] = 0;
    }
  }
}

/* A float32 array's values in row-major order: where they lie, or copied into `copy` when laid out otherwise. */
const float* row_major(const mx::array& a, std::vector<float>& copy) {
  if (a.flags().row_contiguous) return a.data<float>();
  copy.resize(a.size());
  copy_contiguous(a, copy.data());
  return copy.data();
}

/* A [B, L, F] float32 view's rows (a view of a wider product's columns, say), read where they lie when its features
 * are contiguous, else copied; `strides` are then the batch's and the positions'. */
const float* rows_of(const mx::array& a, std::vector<float>& copy, int64_t (&strides)[2]) {
  if (a.strides()[2] == 1 || a.shape(2) == 1) {
    strides[0] = a.strides()[0], strides[1] = a.strides()[1];
    return a.data<float>();
  }
  strides[0] = int64_t(a.shape(1)) * a.shape(2), strides[1] = a.shape(2);
  return row_major(a, copy);
}

/*
 * Transforms of a primitive through `references`, the same function in MLX's own operations (one array per output),
 * over the inputs it differentiates (the others, such as packed integers, are held constant: their gradient is zero).
 */
template <typename Base>
class Referenced : public Base {
 public:
  explicit Referenced(mx::Stream stream) : Base(stream) {}

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<int> free;
    for (int i = 0; i < int(primals.size()); ++i)
      if (differentiable(i)) free.push_back(i);
    const auto grads = mx::vjp(over(primals, free), pick(primals, free), cotangents).second;
    std::vector<mx::array> out;
    for (int arg : argnums) {
      const auto at = std::find(free.begin(), free.end(), arg);
      out.push_back(at == free.end() ? mx::zeros_like(primals[arg], this->stream()) : grads[at - free.begin()]);
    }
    return out;
  }

  std::vector<mx::array> jvp(const std::vector<mx::array>& primals, const std::vector<mx::array>& tangents,
                             const std::vector<int>& argnums) override {
    std::vector<int> free;
    std::vector<mx::array> moving;
    for (size_t i = 0; i < argnums.size(); ++i)
      if (differentiable(argnums[i])) {
        free.push_back(argnums[i]);
        moving.push_back(tangents[i]);
      }
    if (free.empty()) {
      std::vector<mx::array> zeros;
      for (const auto& shape : this->output_shapes(primals)) zeros.push_back(mx::zeros(shape, mx::float32, this->stream()));
      return zeros;
    }
    return mx::jvp(over(primals, free), pick(primals, free), moving).second;
  }

  std::pair<std::vector<mx::array>, std::vector<int>> vmap(const std::vector<mx::array>& inputs,
                                                            const std::vector<int>& axes) override {
    std::vector<int> all(inputs.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = int(i);
    const std::vector<int> out_axes(this->output_shapes(inputs).size(), 0);
    return {mx::vmap(over(inputs, all), axes, out_axes)(inputs), out_axes};
  }

 protected:
  virtual std::vector<mx::array> references(const std::vector<mx::array>&) {
    throw std::logic_error(std::string(this->name()) + " has no reference to differentiate");
  }

  virtual bool differentiable(int) const {
    return true;
  }

  /* `references` as a function of the inputs `free` (the others as in `inputs`). */
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> over(const std::vector<mx::array>& inputs,
                                                                            const std::vector<int>& free) {
    return [this, inputs, free](const std::vector<mx::array>& x) {
      auto all = inputs;
      for (size_t i = 0; i < free.size(); ++i) all[free[i]] = x[i];
      return references(all);
    };
  }

  static std::vector<mx::array> pick(const std::vector<mx::array>& inputs, const std::vector<int>& which) {
    std::vector<mx::array> out;
    for (int i : which) out.push_back(inputs[i]);
    return out;
  }
};

/*
 * Shared plumbing: a float32 output shaped as input 0, computed by `run(inputs, data, out)` on the stream's
 * thread, `data` being each input's values in row-major order (copied there only when the input is laid out
 * otherwise, so that no copy is added to the graph). The gradient is that of `reference`, the same function in
 * MLX's own operations.
 */
class Kernel : public Referenced<mx::UnaryPrimitive> {
 public:
  explicit Kernel(mx::Stream stream) : Referenced(stream) {}

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat's fused kernels run on the CPU only");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 protected:
  virtual mx::array reference(const std::vector<mx::array>&) {
    throw std::logic_error(std::string(name()) + " has no reference to differentiate");
  }

  std::vector<mx::array> references(const std::vector<mx::array>& inputs) override {
    return {reference(inputs)};
  }

  template <typename Run>
  void dispatch_held(const std::vector<mx::array>& inputs, mx::array& out, Run run) {
    mlxchat_dispatch::dispatch_held(stream(), inputs, out, run);
  }

  /* As dispatch_held, with the inputs' float32 data contiguous (copied where they are not). */
  template <typename Run>
  void dispatch(const std::vector<mx::array>& inputs, mx::array& out, Run run) {
    dispatch_held(inputs, out, [run](const std::vector<mx::array>& held, mx::array& out) {
      std::vector<std::vector<float>> copies(held.size());
      std::vector<const float*> data;
      for (size_t i = 0; i < held.size(); ++i) data.push_back(row_major(held[i], copies[i]));
      run(held, data, out.data<float>());
    });
  }
};

/* silu(g) * u of two inputs, or (`halves`) of one, g and u its last axis's halves: a joined gate/up product's. */
class SiluMul : public Kernel {
 public:
  SiluMul(mx::Stream stream, bool halves) : Kernel(stream), halves_(halves) {}

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    if (halves_) shape.back() /= 2;
    return {shape};
  }

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [halves = halves_](const std::vector<mx::array>& in, const std::vector<const float*>& x,
                                             float* y) {
      if (!halves) return silu_mul_all(x[0], x[1], y, int64_t(in[0].size()));
      const int64_t width = in[0].shape(-1) / 2, rows = int64_t(in[0].size()) / std::max<int64_t>(2 * width, 1);
      for (int64_t r = 0; r < rows; ++r) silu_mul_all(x[0] + 2 * r * width, x[0] + (2 * r + 1) * width, y + r * width, width);
    });
  }

  const char* name() const override {
    return "MlxchatSiluMul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return halves_ == static_cast<const SiluMul&>(other).halves_;
  }

 protected:
  mx::array reference(const std::vector<mx::array>& in) override {
    const auto s = stream();
    if (!halves_) return mx::multiply(mx::multiply(in[0], mx::sigmoid(in[0], s), s), in[1], s);
    const auto parts = mx::split(in[0], 2, -1, s);
    return mx::multiply(mx::multiply(parts[0], mx::sigmoid(parts[0], s), s), parts[1], s);
  }

 private:
  bool halves_;
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
  /* offsets: the position of each row's first token, one for all rows or one per index of x's first axis. */
  Rope(mx::Stream stream, int dims, std::vector<int> offsets)
      : Kernel(stream), dims_(dims), offsets_(std::move(offsets)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [dims = dims_, offsets = offsets_](const std::vector<mx::array>& in,
                                                             const std::vector<const float*>& x, float* y) {
      const int d = in[0].shape(-1), length = in[0].shape(-2), half = dims / 2;
      const int64_t rows = int64_t(in[0].size() / std::max(d, 1));
      const int64_t per_offset = rows / int64_t(offsets.size());  // rows of x (of length each) one offset covers
      const float* inv_freq = x[1];
      // angles as transformers computes them: float32 position times float32 inverse frequency
      const size_t table = (size_t)length * half;
      std::vector<float> cos(offsets.size() * table), sin(offsets.size() * table);
      for (size_t o = 0; o < offsets.size(); ++o)
        for (int l = 0; l < length; ++l)
          for (int j = 0; j < half; ++j) {
            const float angle = float(offsets[o] + l) * inv_freq[j];
            cos[o * table + (size_t)l * half + j] = std::cos(angle);
            sin[o * table + (size_t)l * half + j] = std::sin(angle);
          }
      for (int64_t r = 0; r < rows; ++r) {
        const size_t at = size_t(r / std::max<int64_t>(per_offset, 1)) * table + (size_t)(r % length) * half;
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
      grads.push_back(mx::array(cotangents[0].shape(), mx::float32, std::make_shared<Rope>(stream(), dims_, offsets_),
                                {cotangents[0], mx::negative(primals[1], stream())}));
    }
    return grads;
  }

  const char* name() const override {
    return "MlxchatRope";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && offsets_ == o.offsets_;
  }

 private:
  int dims_;
  std::vector<int> offsets_;
};

/*
 * A CPU primitive of several outputs: `dispatch_all` runs `run(held, made)` on the stream's CPU encoder, `held` the
 * inputs and `made` the outputs (given their buffers by the caller first).
 */
class MultiKernel : public mx::Primitive {
 public:
  explicit MultiKernel(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxchat's fused kernels run on the CPU only");
  }

 protected:
  /* Every output holds the inputs (array::make_arrays), so no input would ever be donatable: the siblings of the
   * output being evaluated let go of theirs now rather than when it is detached, right after this. */
  static void release_inputs(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
    if (outputs[0].is_tracer()) return;
    for (auto& out : outputs)
      if (&out.inputs() != &inputs) out.inputs().clear();
  }

  template <typename Run>
  void dispatch_all(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, Run run) {
    mlxchat_dispatch::dispatch_all(stream(), inputs, outputs, run);
  }
};

/*
 * The heads of attention from its q, k and v projections' outputs [B, L, heads * D] (views of one product, read
 * where they lie; copied where the features are not contiguous): q and k normalized per head (RMS norm, when their
 * weights are given), their first `dims` features multiplied by `scale` (yarn's attention factor) and rotated at
 * each row's positions (rotate-half RoPE, as Rope, when `dims` > 0), and all three laid out [B, heads, L, D].
 * Inputs: q, k, v (or, `joined`, the one product [B, L, (heads + 2 * kv_heads) * D] they are parts of), then the q
 * and k norms' weights, then the inverse frequencies. One node for what is otherwise twelve a layer (the split,
 * three reshapes, two norms, three transposes, two rotations): a decode step of Qwen3-0.6B has 28 such layers. Its
 * gradient is the separate ops'; jvp and vmap with a rotation are not there (Rope has only its gradient).
 */
class Heads : public Referenced<MultiKernel> {
 public:
  Heads(mx::Stream stream, int heads, int kv_heads, bool joined, bool norm, float eps, int dims, float scale,
        std::vector<int> offsets, int span = 1)
      : Referenced(stream), heads_(heads), kv_heads_(kv_heads), joined_(joined), norm_(norm), eps_(eps), dims_(dims),
        scale_(scale), offsets_(std::move(offsets)), span_(span) {}

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    const int batch = in[0].shape(0), length = in[0].shape(1);
    const int d = joined_ ? in[0].shape(2) / (span_ * heads_ + 2 * kv_heads_) : in[0].shape(2) / (span_ * heads_);
    return {{batch, heads_, length, d}, {batch, kv_heads_, length, d},
            {batch, kv_heads_, length, joined_ ? d : in[2].shape(2) / kv_heads_}};
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch_all(inputs, outputs, [joined = joined_, norm = norm_, eps = eps_, dims = dims_, scale = scale_,
                                   offsets = offsets_, span = span_](std::vector<mx::array>& held,
                                                                     std::vector<mx::array>& made) {
      const int batch = held[0].shape(0), length = held[0].shape(1), half = dims / 2, first = joined ? 1 : 3;
      std::vector<float> copies[6];  // q, k, v; the norms' weights and the inverse frequencies (where laid out otherwise)
      const float* rows[3];
      int64_t strides[3][2];
      for (int i = 0; i < first; ++i) rows[i] = rows_of(held[i], copies[i], strides[i]);
      for (int i = 1; joined && i < 3; ++i) {  // k and v: the product's columns after q's, after k's
        rows[i] = rows[i - 1] + int64_t(made[i - 1].shape(1)) * made[i - 1].shape(3) * (i == 1 ? span : 1);
        strides[i][0] = strides[0][0], strides[i][1] = strides[0][1];
      }
      const float* weights[2] = {norm ? row_major(held[first], copies[3]) : nullptr,
                                 norm ? row_major(held[first + 1], copies[4]) : nullptr};
      // angles as Rope computes them: float32 position times float32 inverse frequency
      const size_t table = size_t(length) * half;
      std::vector<float> cos(offsets.size() * table), sin(offsets.size() * table);
      const float* inv_freq = dims > 0 ? row_major(held[first + (norm ? 2 : 0)], copies[5]) : nullptr;
      for (size_t o = 0; dims > 0 && o < offsets.size(); ++o)
        for (int l = 0; l < length; ++l)
          for (int j = 0; j < half; ++j) {
            const float angle = float(offsets[o] + l) * inv_freq[j];
            cos[o * table + size_t(l) * half + j] = std::cos(angle);
            sin[o * table + size_t(l) * half + j] = std::sin(angle);
          }
      std::vector<float> normed;
      for (int i = 0; i < 3; ++i) {
        const int count = made[i].shape(1), d = made[i].shape(3);
        const float* weight = i < 2 ? weights[i] : nullptr;
        const bool turn = dims > 0 && i < 2;
        normed.resize(d);
        float* out = made[i].data<float>();
        for (int b = 0; b < batch; ++b)
          for (int l = 0; l < length; ++l) {
            const float* row = rows[i] + b * strides[i][0] + l * strides[i][1];
            const size_t at = (offsets.size() == 1 ? 0 : size_t(b)) * table + size_t(l) * half;
            for (int h = 0; h < count; ++h) {
              const float* x = row + int64_t(h) * d * (i == 0 ? span : 1);
              float* y = out + ((int64_t(b) * count + h) * length + l) * d;
              if (!weight && !turn) {
                std::memcpy(y, x, size_t(d) * sizeof(float));
                continue;
              }
              if (weight) {
                rms_norm_row(x, weight, normed.data(), d, eps);
                x = normed.data();
              }
              if (!turn) {
                std::memcpy(y, x, size_t(d) * sizeof(float));
                continue;
              }
              if (scale != 1.0f) {
                if (x != normed.data()) std::memcpy(normed.data(), x, size_t(d) * sizeof(float));
                for (int j = 0; j < dims; ++j) normed[j] *= scale;
                x = normed.data();
              }
              rope_row(x, y, d, half, cos.data() + at, sin.data() + at);
            }
          }
      }
    });
  }

  const char* name() const override {
    return "MlxchatHeads";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Heads&>(other);
    return heads_ == o.heads_ && kv_heads_ == o.kv_heads_ && joined_ == o.joined_ && norm_ == o.norm_ &&
           eps_ == o.eps_ && dims_ == o.dims_ && scale_ == o.scale_ && offsets_ == o.offsets_ && span_ == o.span_;
  }

 protected:
  bool differentiable(int input) const override {
    return input < (joined_ ? 1 : 3) + (norm_ ? 2 : 0);  // not the inverse frequencies
  }

  std::vector<mx::array> references(const std::vector<mx::array>& given) override {
    const auto s = stream();
    std::vector<mx::array> in = given;
    if (joined_) {  // q, k, v: the product's parts
      const int d = given[0].shape(2) / (span_ * heads_ + 2 * kv_heads_);
      const auto parts = mx::split(given[0], mx::Shape{span_ * heads_ * d, (span_ * heads_ + kv_heads_) * d}, 2, s);
      in.erase(in.begin());
      in.insert(in.begin(), parts.begin(), parts.end());
    }
    const int batch = in[0].shape(0), length = in[0].shape(1);
    if (span_ > 1) {  // each query head's first of its `span` parts
      const int d = in[0].shape(2) / (span_ * heads_);
      const auto parted = mx::reshape(in[0], {batch, length, heads_, span_ * d}, s);
      in[0] = mx::reshape(mx::slice(parted, {0, 0, 0, 0}, {batch, length, heads_, d}, s), {batch, length, heads_ * d}, s);
    }
    auto heads_of = [&](const mx::array& x, int count, const mx::array* weight) {
      auto y = mx::reshape(x, {batch, length, count, x.shape(2) / count}, s);
      if (weight) y = mx::fast::rms_norm(y, *weight, eps_, s);
      y = mx::transpose(y, {0, 2, 1, 3}, s);
      if (dims_ == 0) return y;
      if (scale_ != 1.0f) {
        const int d = y.shape(3);
        const auto turned = mx::multiply(mx::slice(y, {0, 0, 0, 0}, {batch, count, length, dims_}, s),
                                         mx::array(scale_), s);
        y = dims_ == d ? turned
                       : mx::concatenate({turned, mx::slice(y, {0, 0, 0, dims_}, {batch, count, length, d}, s)}, 3, s);
      }
      return mx::array(y.shape(), mx::float32, std::make_shared<Rope>(s, dims_, offsets_), {y, in[norm_ ? 5 : 3]});
    };
    return {heads_of(in[0], heads_, norm_ ? &in[3] : nullptr), heads_of(in[1], kv_heads_, norm_ ? &in[4] : nullptr),
            mx::transpose(mx::reshape(in[2], {batch, length, kv_heads_, in[2].shape(2) / kv_heads_}, s), {0, 2, 1, 3}, s)};
  }

 private:
  int heads_, kv_heads_;
  bool joined_, norm_;
  float eps_;
  int dims_;  // the rotated features (0: none)
  float scale_;
  std::vector<int> offsets_;  // the first position of every row (one), or of each row of the batch
  int span_;  // a query head's features in q: its own, then (span 2: Qwen3.5's output gate) another head's worth
};

/* A 4-D array's place and strides, its features contiguous (copied into `copy` when they are not). */
mlxchat_attention::View view(const mx::array& a, std::vector<float>& copy) {
  if (a.strides()[3] == 1 || a.shape(3) == 1)
    return {a.data<void>(), int64_t(a.strides()[0]), int64_t(a.strides()[1]), int64_t(a.strides()[2])};
  copy.resize((a.nbytes() + sizeof(float) - 1) / sizeof(float));  // elements copied as they are
  if (a.itemsize() == 2)
    copy_contiguous(a, reinterpret_cast<uint16_t*>(copy.data()));
  else
    copy_contiguous(a, copy.data());  // 4-byte elements (float32, uint32)
  return {copy.data(), int64_t(a.shape(1)) * a.shape(2) * a.shape(3), int64_t(a.shape(2)) * a.shape(3), a.shape(3)};
}

/*
 * Causal attention of queries [B, heads, L, D] over keys and values read in place (mlxchat_attention::attend):
 * float32 or float16 keys and values [B, kv_heads, T, D|Dv], or (bits 4 or 8) mx.quantize's packed keys and values
 * with their scales and biases followed by float32 ones (a quantized cache's float tail). Inputs: q, k, v; q, a
 * prefix's keys and values (a shared prefix, read where it lies), k, v; or q, then for each packed segment (a
 * shared prefix's, then the cache's own) packed keys, scales, biases, packed values, scales, biases, then tail
 * keys, tail values. The output is [B, heads, L, Dv], or with `lse` [B, heads, L, Dv + 1]: each row's log-sum-exp
 * of its scaled scores last (to merge it with attention over other keys).
 */
class Attention : public Kernel {
 public:
  Attention(mx::Stream stream, float scale, int window, int bits, int group, bool lse = false, int packed = 1)
      : Kernel(stream), scale_(scale), window_(window), bits_(bits), group_(group), lse_(lse), packed_(packed) {}

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {{in[0].shape(0), in[0].shape(1), in[0].shape(2), in.back().shape(3) + (lse_ ? 1 : 0)}};
  }

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_held(inputs, out, [scale = scale_, window = window_, bits = bits_, group = group_, lse = lse_](
                                   const std::vector<mx::array>& held, mx::array& out) {
      namespace att = mlxchat_attention;
      std::vector<std::vector<float>> copies(held.size());
      std::vector<att::View> views;
      for (size_t i = 0; i < held.size(); ++i) views.push_back(view(held[i], copies[i]));
      att::Problem p;
      const auto& q = held[0];
      p.queries = views[0];
      p.batch = q.shape(0), p.heads = q.shape(1), p.length = q.shape(2), p.dims = q.shape(3);
      p.kv_heads = held.back().shape(1), p.value_dims = held.back().shape(3);
      p.scale = scale, p.window = window, p.out = out.data<float>(), p.lse = lse;
      auto floats = [&](size_t k, size_t v) {
        att::Segment seg;
        seg.count = held[k].shape(2);
        seg.keys.dims = held[k].shape(3), seg.keys.data = views[k], seg.keys.half = held[k].dtype() == mx::float16;
        seg.values.dims = held[v].shape(3), seg.values.data = views[v];
        seg.values.half = held[v].dtype() == mx::float16;
        return seg;
      };
      if (bits == 0) {
        p.segments[0] = floats(1, 2), p.count = 1;
        if (held.size() == 5) p.segments[1] = floats(3, 4), p.count = 2;  // a prefix, then the rest
      } else {
        const int packed = int(held.size() - 3) / 6;
        for (int i = 0; i < packed; ++i) {
          att::Segment& seg = p.segments[i];
          const size_t first = 1 + 6 * size_t(i);
          seg.count = held[first].shape(2);
          for (auto [rows, at] : {std::pair{&seg.keys, first}, std::pair{&seg.values, first + 3}}) {
            rows->bits = bits, rows->group = group, rows->dims = held[at].shape(3) * 32 / bits;
            rows->data = views[at], rows->scales = views[at + 1], rows->biases = views[at + 2];
          }
        }
        p.segments[packed] = floats(held.size() - 2, held.size() - 1), p.count = packed + 1;
      }
      att::attend(p);
    });
  }

  const char* name() const override {
    return "MlxchatAttention";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && window_ == o.window_ && bits_ == o.bits_ && group_ == o.group_ && lse_ == o.lse_ &&
           packed_ == o.packed_;
  }

 protected:
  bool differentiable(int input) const override {
    return bits_ == 0 || input == 0 || input > 6 * packed_;
  }

  mx::array reference(const std::vector<mx::array>& in) override {
    const auto s = stream();
    mx::array keys = in[1], values = in[2];
    if (bits_ == 0 && in.size() == 5)  // a prefix, then the rest
      keys = mx::concatenate({keys, in[3]}, 2, s), values = mx::concatenate({values, in[4]}, 2, s);
    if (bits_ != 0) {
      auto whole = [&](size_t at, const mx::array& tail) {
        std::vector<mx::array> parts;
        for (int i = 0; i < packed_; ++i, at += 6) {
          const auto held = mx::dequantize(in[at], in[at + 1], in[at + 2], group_, bits_, "affine", std::nullopt,
                                           std::nullopt, s);
          parts.push_back(mx::slice(held, {0, 0, 0, 0}, {held.shape(0), held.shape(1), held.shape(2), tail.shape(3)}, s));
        }
        parts.push_back(tail);
        return mx::concatenate(parts, 2, s);
      };
      keys = whole(1, in[in.size() - 2]), values = whole(4, in.back());
    }
    const auto& q = in[0];
    const int batch = q.shape(0), heads = q.shape(1), length = q.shape(2), kv_heads = keys.shape(1);
    const int total = keys.shape(2), group = heads / kv_heads;
    const auto grouped = mx::reshape(mx::multiply(q, mx::array(scale_), s), {batch, kv_heads, group, length, q.shape(3)}, s);
    auto scores = mx::matmul(grouped, mx::swapaxes(mx::expand_dims(keys, 2, s), -1, -2, s), s);
    const auto positions = mx::reshape(mx::arange(total - length, total, s), {length, 1}, s);
    const auto key_positions = mx::reshape(mx::arange(total, s), {1, total}, s);
    auto visible = mx::less_equal(key_positions, positions, s);
    if (window_ > 0)
      visible = mx::logical_and(visible, mx::less(mx::subtract(positions, key_positions, s), mx::array(window_), s), s);
    scores = mx::where(visible, scores, mx::array(-INFINITY), s);
    const auto probs = mx::softmax(scores, {-1}, true, s);
    const auto out = mx::reshape(mx::matmul(probs, mx::expand_dims(values, 2, s), s),
                                 {batch, heads, length, values.shape(3)}, s);
    if (!lse_) return out;
    const auto log_sum = mx::reshape(mx::logsumexp(scores, {-1}, true, s), {batch, heads, length, 1}, s);
    return mx::concatenate({out, log_sum}, 3, s);
  }

 private:
  float scale_;
  int window_, bits_, group_;
  bool lse_;
  int packed_;  // packed segments (bits > 0): the cache's own, after a shared prefix's when there is one
};

/*
 * One decode step of attention for several sequences, each with its own KV cache (batched decoding): row b's new
 * key and value (keys, values [B, kv_heads, 1, D|Dv]) are written at position starts[b] of its cache's buffers
 * ([1, kv_heads, capacity, D|Dv]: taken over in place where nothing else holds them, as MLX's slice update does,
 * else copied first), then its query heads (queries [B, heads, 1, D], float32) attend over positions
 * [from[b], to[b]) of its shared prefix's keys and values when it reads one ([1, kv_heads, length, D|Dv], read
 * where they lie), then the buffers' first starts[b] + 1. Inputs: queries, keys, values, then each row's key and
 * value buffers followed by its prefix's keys and values where from[b] < to[b]. Outputs: [B, heads, 1, Dv] (with
 * `lse`, Dv + 1: each row's log-sum-exp of its scaled scores last), then the buffers, in their order.
 *
 * Why: one node for what is otherwise seven per row and layer (the row's slices, two slice updates, the used
 * parts, its attention, a concatenation), each about 10 us on MLX's CPU stream: with 8 rows, a third of a
 * Qwen3-0.6B 4-bit step.
 */
class DecodeRows : public MultiKernel {
 public:
  DecodeRows(mx::Stream stream, float scale, std::vector<int64_t> starts, std::vector<int64_t> from,
             std::vector<int64_t> to, bool lse)
      : MultiKernel(stream), scale_(scale), starts_(std::move(starts)), from_(std::move(from)), to_(std::move(to)),
        lse_(lse) {}

  /* Where each row's key buffer is among the inputs (its value buffer next, then its prefix's when it has one). */
  static std::vector<size_t> layout(const std::vector<int64_t>& from, const std::vector<int64_t>& to) {
    std::vector<size_t> at;
    size_t next = 3;
    for (size_t b = 0; b < from.size(); ++b) {
      at.push_back(next);
      next += from[b] < to[b] ? 4 : 2;
    }
    return at;
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    release_inputs(inputs, outputs);
    const std::vector<size_t> at = layout(from_, to_);
    std::vector<char> copied(2 * at.size(), 0);
    for (size_t i = 0; i < copied.size(); ++i) {
      const auto& in = inputs[at[i / 2] + i % 2];
      auto& out = outputs[1 + i];
      if (in.is_donatable() && in.flags().row_contiguous) {
        out.copy_shared_buffer(in);
      } else {
        out.set_data(mx::allocator::malloc(out.nbytes()));
        copied[i] = 1;
      }
    }
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    dispatch_all(inputs, outputs, [copied = std::move(copied), at, scale = scale_, starts = starts_, from = from_,
                                   to = to_, lse = lse_](std::vector<mx::array>& held, std::vector<mx::array>& made) {
      namespace att = mlxchat_attention;
      for (size_t i = 0; i < copied.size(); ++i)
        if (copied[i]) {
          const auto& source = held[at[i / 2] + i % 2];
          if (source.itemsize() == 2)
            copy_contiguous(source, made[1 + i].data<uint16_t>());
          else
            copy_contiguous(source, made[1 + i].data<float>());
        }
      std::vector<float> copies[5];
      const att::View q = view(held[0], copies[0]), k = view(held[1], copies[1]), v = view(held[2], copies[2]);
      const int heads = held[0].shape(1), dims = held[0].shape(3), kv_heads = held[1].shape(1);
      const int value_dims = held[2].shape(3), width = value_dims + (lse ? 1 : 0);
      const size_t item = held[1].itemsize();
      const bool half = held[1].dtype() == mx::float16;
      auto rows = [&](att::Rows& r, int features, att::View data) { r.dims = features, r.half = half, r.data = data; };
      for (size_t b = 0; b < starts.size(); ++b) {
        mx::array &keys = made[1 + 2 * b], &values = made[2 + 2 * b];
        const int64_t capacity = keys.shape(2), written = starts[b];
        for (int h = 0; h < kv_heads; ++h) {
          std::memcpy(static_cast<char*>(keys.data<void>()) + ((h * capacity + written) * dims) * item,
                      static_cast<const char*>(k.data) + (b * k.batch + h * k.head) * item, dims * item);
          std::memcpy(static_cast<char*>(values.data<void>()) + ((h * capacity + written) * value_dims) * item,
                      static_cast<const char*>(v.data) + (b * v.batch + h * v.head) * item, value_dims * item);
        }
        att::Problem p;
        p.queries = {q.at<float>(int(b), 0, 0), q.batch, q.head, q.row};
        p.batch = 1, p.heads = heads, p.length = 1, p.dims = dims, p.kv_heads = kv_heads, p.value_dims = value_dims;
        p.scale = scale, p.lse = lse, p.out = made[0].data<float>() + b * heads * width;
        if (from[b] < to[b]) {  // the shared prefix's part this row reads, where it lies
          const att::View pk = view(held[at[b] + 2], copies[3]), pv = view(held[at[b] + 3], copies[4]);
          att::Segment& seg = p.segments[p.count++];
          seg.count = to[b] - from[b];
          rows(seg.keys, dims, {static_cast<const char*>(pk.data) + from[b] * pk.row * item, pk.batch, pk.head, pk.row});
          rows(seg.values, value_dims,
               {static_cast<const char*>(pv.data) + from[b] * pv.row * item, pv.batch, pv.head, pv.row});
        }
        att::Segment& seg = p.segments[p.count++];
        seg.count = written + 1;
        rows(seg.keys, dims, {keys.data<void>(), kv_heads * capacity * dims, capacity * dims, dims});
        rows(seg.values, value_dims,
             {values.data<void>(), kv_heads * capacity * value_dims, capacity * value_dims, value_dims});
        att::attend(p);
      }
    });
  }

  const char* name() const override {
    return "MlxchatDecodeRows";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeRows&>(other);
    return scale_ == o.scale_ && starts_ == o.starts_ && from_ == o.from_ && to_ == o.to_ && lse_ == o.lse_;
  }

 private:
  float scale_;
  std::vector<int64_t> starts_;  // where each row's new key and value go in its buffers
  std::vector<int64_t> from_, to_;  // the positions of its shared prefix each row reads (none where from >= to)
  bool lse_;
};

/*
 * One decode step of B rows of LFM2's gated short convolution in one node: from the input projection's output
 * [B, 1, 3H] (B | C | x, a view read where it lies), B * x joins the last K - 1 of them (conv_state [B, K - 1, H]),
 * the causal depthwise convolution (conv_weight [H, K, 1]) sums the window tap by tap, and C gates the sum. Outputs:
 * C * conv(B * x) [B, 1, H] for the output projection and the next conv_state. The same float steps, in the same
 * order, as core/layers/short_conv.py's ops for a chunk (each product rounded, then added), so a decode step gives
 * what a prompt chunk would. Why: those ops are some ten nodes a layer (LFM2-350M has ten such layers). Decode only:
 * it has no gradient.
 */
class ShortConvStep : public MultiKernel {
 public:
  explicit ShortConvStep(mx::Stream stream) : MultiKernel(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    release_inputs(inputs, outputs);
    for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch_all(inputs, outputs, [](std::vector<mx::array>& held, std::vector<mx::array>& made) {
      const int rows = held[0].shape(0), dims = held[0].shape(2) / 3, taps = held[2].shape(1);
      std::vector<float> copies[3];
      int64_t strides[2];
      const float* bcx = rows_of(held[0], copies[0], strides);
      const float *past = row_major(held[1], copies[1]), *weight = row_major(held[2], copies[2]);
      float *out = made[0].data<float>(), *next = made[1].data<float>();
      for (int b = 0; b < rows; ++b) {
        const float *gate_in = bcx + b * strides[0], *gate_out = gate_in + dims, *x = gate_in + 2 * dims;
        const float* window = past + int64_t(b) * (taps - 1) * dims;
        float* window_next = next + int64_t(b) * (taps - 1) * dims;
        for (int c = 0; c < dims; ++c) {
          const float newest = gate_in[c] * x[c];
          const float* w = weight + int64_t(c) * taps;
          float sum = window[c] * w[0];
          for (int t = 1; t < taps; ++t) {
            const float product = (t < taps - 1 ? window[int64_t(t) * dims + c] : newest) * w[t];
            sum = sum + product;
          }
          out[int64_t(b) * dims + c] = gate_out[c] * sum;
          window_next[int64_t(taps - 2) * dims + c] = newest;
        }
        if (taps > 2) std::memcpy(window_next, window + dims, size_t(taps - 2) * dims * sizeof(float));
      }
    });
  }

  const char* name() const override {
    return "MlxchatShortConvStep";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

/* One value head's delta rule for one token: the state S [Dk, Dv] decays and is corrected towards v along k,
 * S' = decay * S + k (beta (v - decay * S^T k))^T, and read by q, o = S'^T q; then o's gated RMS norm. */
struct DeltaHeads {
  int key_heads, value_heads, key_dims, value_dims;
  const float *q, *k, *v;  // [rows, key_heads, Dk] normalized (q scaled), [rows, value_heads, Dv]
  const float *decay, *beta;  // [rows, value_heads]
  const float* state;  // [rows, value_heads, Dk, Dv]
  float* next;  // the same shape (the state itself when it is taken over)
  const float* z;  // the gate, row b's at z + b * z_row
  int64_t z_row;
  const float* norm;  // [Dv]
  float eps;
  float* out;  // [rows, value_heads * Dv]
  unsigned fp_mode;  // the stream thread's MXCSR (its denormal flushing), which the pool's threads take on
};

__attribute__((target_clones("avx512f", "avx2", "default"))) void delta_sums(const float* S, const float* k, float* sum,
                                                                            int dk, int dv) {
  for (int j = 0; j < dv; ++j) sum[j] = 0.0f;
  for (int i = 0; i < dk; ++i) {
    const float ki = k[i];
    const float* row = S + int64_t(i) * dv;
    for (int j = 0; j < dv; ++j) sum[j] += ki * row[j];
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void delta_write(const float* S, float* next, const float* q,
                                                                             const float* k, const float* delta,
                                                                             float decay, float* o, int dk, int dv) {
  for (int j = 0; j < dv; ++j) o[j] = 0.0f;
  for (int i = 0; i < dk; ++i) {
    const float ki = k[i], qi = q[i];
    const float* row = S + int64_t(i) * dv;
    float* written = next + int64_t(i) * dv;
    for (int j = 0; j < dv; ++j) {
      const float x = row[j] * decay + ki * delta[j];
      written[j] = x;
      o[j] += qi * x;
    }
  }
}

void delta_head(const void* ctx, int task) {
  const auto& d = *static_cast<const DeltaHeads*>(ctx);
#if defined(__x86_64__)
  if (_mm_getcsr() != d.fp_mode) _mm_setcsr(d.fp_mode);  // a decaying state reaches denormals (FlushDenormals)
#endif
  const int b = task / d.value_heads, h = task % d.value_heads, kh = h / (d.value_heads / d.key_heads);
  const int dk = d.key_dims, dv = d.value_dims;
  const int64_t at = int64_t(b) * d.value_heads + h, key_at = (int64_t(b) * d.key_heads + kh) * dk;
  const float *S = d.state + at * dk * dv, *v = d.v + at * dv;
  thread_local std::vector<float> scratch;
  scratch.resize(3 * size_t(dv));
  float *delta = scratch.data(), *o = delta + dv, *normed = o + dv;
  delta_sums(S, d.k + key_at, delta, dk, dv);
  const float decay = d.decay[at], beta = d.beta[at];
  for (int j = 0; j < dv; ++j) delta[j] = (v[j] - decay * delta[j]) * beta;
  delta_write(S, d.next + at * dk * dv, d.q + key_at, d.k + key_at, delta, decay, o, dk, dv);
  rms_norm_row(o, d.norm, normed, dv, d.eps);
  silu_mul_all(d.z + b * d.z_row + int64_t(h) * dv, normed, d.out + at * dv, dv);
}

/*
 * One decode step of B rows of a Gated DeltaNet layer (Qwen3.5's linear attention) in one node: the causal
 * depthwise convolution of the last K - 1 inputs and this one, SiLU, q and k L2-normalized per key head (rms_norm
 * with a constant weight: q_weight, k_weight, `l2_eps`), beta = sigmoid(b), decay = exp(-exp(A_log) * softplus(a +
 * dt_bias)), each value head's delta rule (DeltaHeads; value head j reads key head j / (Hv / Hk)) and the output's
 * gated RMS norm (norm weight, `eps`, times silu(z)), as core/layers/gated_delta.py computes them one op at a time.
 * Inputs: qkv [B, 1, C], z [B, 1, Hv * Dv], b, a [B, 1, Hv] (views of one product), conv_state [B, K - 1, C],
 * conv_weight [C, K, 1], state [B, Hv, Dk, Dv], A_log, dt_bias [Hv], norm [Dv]. Outputs: [B, 1, Hv * Dv] for the
 * output projection, the next conv_state and the next state (the state's buffer taken over where nothing else holds
 * it, as MLX's elementwise ops would). Why: those ops are some 75 nodes a layer and read the state three times;
 * Qwen3.5-0.8B has 18 such layers. Decode only: it has no gradient (a prompt, and training, run the chunked form).
 */
class GatedDeltaStep : public MultiKernel {
 public:
  GatedDeltaStep(mx::Stream stream, int key_heads, float q_weight, float k_weight, float l2_eps, float eps)
      : MultiKernel(stream), key_heads_(key_heads), q_weight_(q_weight), k_weight_(k_weight), l2_eps_(l2_eps),
        eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    release_inputs(inputs, outputs);
    const auto& state = inputs[6];
    const bool taken = state.is_donatable() && state.flags().row_contiguous;
    if (taken)
      outputs[2].copy_shared_buffer(state);
    else
      outputs[2].set_data(mx::allocator::malloc(outputs[2].nbytes()));
    for (int i = 0; i < 2; ++i) outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
    dispatch_all(inputs, outputs, [key_heads = key_heads_, q_weight = q_weight_, k_weight = k_weight_,
                                   l2_eps = l2_eps_, eps = eps_](std::vector<mx::array>& held,
                                                                 std::vector<mx::array>& made) {
      const mx::array &qkv = held[0], &state = held[6];
      const int rows = qkv.shape(0), channels = qkv.shape(2), taps = held[5].shape(1);
      const int value_heads = state.shape(1), dk = state.shape(2), dv = state.shape(3);
      const int key_dim = key_heads * dk;
      std::vector<float> copies[10];
      int64_t strides[4][2];  // qkv, z, b and a: [B, 1, F] views, a row each
      const float* row[4];
      for (int i = 0; i < 4; ++i) row[i] = rows_of(held[i], copies[i], strides[i]);
      const float *conv_state = row_major(held[4], copies[4]), *weight = row_major(held[5], copies[5]);
      const float *a_log = row_major(held[7], copies[7]), *dt_bias = row_major(held[8], copies[8]);
      const float* norm = row_major(held[9], copies[9]);
      const float* old = row_major(held[6], copies[6]);  // (where it is taken over, the output's own buffer)
      float* next_conv = made[1].data<float>();
      std::vector<float> conv(channels), mixed(channels), q(size_t(rows) * key_dim), k(size_t(rows) * key_dim);
      std::vector<float> v(size_t(rows) * value_heads * dv), decay(size_t(rows) * value_heads),
          beta(size_t(rows) * value_heads);
      const std::vector<float> qw(dk, q_weight), kw(dk, k_weight);
      for (int b = 0; b < rows; ++b) {
        const float* x = row[0] + b * strides[0][0];
        const float* window = conv_state + int64_t(b) * (taps - 1) * channels;
        for (int c = 0; c < channels; ++c) {
          float sum = window[c] * weight[int64_t(c) * taps];
          for (int t = 1; t < taps; ++t)
            sum = sum + (t < taps - 1 ? window[int64_t(t) * channels + c] : x[c]) * weight[int64_t(c) * taps + t];
          conv[c] = sum;
        }
        unary_all<Unary::silu>(conv.data(), mixed.data(), channels);
        for (int h = 0; h < key_heads; ++h) {
          rms_norm_row(mixed.data() + h * dk, qw.data(), q.data() + (int64_t(b) * key_heads + h) * dk, dk, l2_eps);
          rms_norm_row(mixed.data() + key_dim + h * dk, kw.data(), k.data() + (int64_t(b) * key_heads + h) * dk, dk,
                       l2_eps);
        }
        std::memcpy(v.data() + int64_t(b) * value_heads * dv, mixed.data() + 2 * key_dim,
                    size_t(value_heads) * dv * sizeof(float));
        for (int h = 0; h < value_heads; ++h) {
          const float bh = row[2][b * strides[2][0] + h], ah = row[3][b * strides[3][0] + h] + dt_bias[h];
          const float high = std::max(ah, 0.0f), low = std::min(ah, 0.0f);
          const float softplus = high + std::log1p(std::exp(low - high));
          beta[int64_t(b) * value_heads + h] = 1.0f / (1.0f + std::exp(-bh));
          decay[int64_t(b) * value_heads + h] = std::exp(-std::exp(a_log[h]) * softplus);
        }
        float* window_next = next_conv + int64_t(b) * (taps - 1) * channels;
        if (taps > 2)
          std::memmove(window_next, window + channels, size_t(taps - 2) * channels * sizeof(float));
        std::memcpy(window_next + int64_t(taps - 2) * channels, x, size_t(channels) * sizeof(float));
      }
      unsigned fp_mode = 0;
#if defined(__x86_64__)
      fp_mode = _mm_getcsr();
#endif
      DeltaHeads d{key_heads, value_heads, dk, dv, q.data(), k.data(), v.data(), decay.data(), beta.data(), old,
                   made[2].data<float>(), row[1], strides[1][0], norm, eps, made[0].data<float>(), fp_mode};
      const int tasks = rows * value_heads;
      if (int64_t(tasks) * dk * dv < (1 << 16))
        for (int t = 0; t < tasks; ++t) delta_head(&d, t);
      else
        mlxchat_attention::parallel(tasks, delta_head, &d);
    });
  }

  const char* name() const override {
    return "MlxchatGatedDeltaStep";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GatedDeltaStep&>(other);
    return key_heads_ == o.key_heads_ && q_weight_ == o.q_weight_ && k_weight_ == o.k_weight_ &&
           l2_eps_ == o.l2_eps_ && eps_ == o.eps_;
  }

 private:
  int key_heads_;
  float q_weight_, k_weight_, l2_eps_, eps_;
};

/* Sets flush-to-zero and denormals-are-zero on the thread that evaluates it (the stream's): a denormal operand
 * costs about a hundred cycles on x86, and decays of linear attention reach them (a DeltaNet chunk's
 * exp(gamma) below 1e-38). Results change only where a value would be below 1.2e-38. */
class FlushDenormals : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;

  void eval_cpu(const std::vector<mx::array>&, mx::array& out) override {
    mlxchat_dispatch::dispatch_held(stream(), {}, out, [](const std::vector<mx::array>&, mx::array& out) {
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

/* Memory allocated and not written: a cache buffer's room, whose pages the kernel maps as tokens are written into
 * them. Zeros would touch every page at once: the float32 cache Qwen3-0.6B reserves for a 4k-token prompt is
 * 1.1 GB, one to three seconds of page faults on a 2-core VM in the step that first writes it, a stall for every
 * stream decoding beside it. Never merged with another (each is a buffer of its own). */
class Uninitialized : public mx::UnaryPrimitive {
 public:
  Uninitialized(mx::Stream stream, mx::Shape shape) : mx::UnaryPrimitive(stream), shape_(std::move(shape)) {}

  void eval_cpu(const std::vector<mx::array>&, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat's uninitialized buffers are for the CPU stream");
  }

  const char* name() const override {
    return "MlxchatUninitialized";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return false;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override {
    return {shape_};
  }

 private:
  mx::Shape shape_;
};

void check_float32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string(what) + " must be float32");
  if (a.ndim() < 1 || a.shape(-1) < 1) throw std::invalid_argument(std::string(what) + " must not be empty");
}

mx::array silu_mul(const mx::array& g, const std::optional<mx::array>& u) {
  check_float32(g, "gate");
  if (!u) {  // g is [..., 2 * I]: the gate, then x
    if (g.shape(-1) % 2) throw std::invalid_argument("a joined gate and x must have an even last axis");
    auto shape = g.shape();
    shape.back() /= 2;
    return mx::array(shape, mx::float32, std::make_shared<SiluMul>(cpu_stream(), true), {g});
  }
  check_float32(*u, "x");
  if (g.shape() != u->shape()) throw std::invalid_argument("gate and x must have the same shape");
  return mx::array(g.shape(), mx::float32, std::make_shared<SiluMul>(cpu_stream(), false), {g, *u});
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
 * pair j turning by position * inv_freq[j]; `offsets`: one offset, or one per index of x's first axis (the rows
 * of a batch, each at its own position). */
mx::array rope(const mx::array& x, const mx::array& inv_freq, int dims, const std::vector<int>& offsets) {
  check_float32(x, "x");
  check_float32(inv_freq, "inv_freq");
  if (x.ndim() < 2) throw std::invalid_argument("x must be [..., length, dims]");
  if (dims < 2 || dims % 2 || dims > x.shape(-1)) throw std::invalid_argument("dims must be even and fit x");
  if (inv_freq.ndim() != 1 || inv_freq.shape(0) != dims / 2) throw std::invalid_argument("inv_freq must be [dims / 2]");
  if (offsets.empty() || (offsets.size() != 1 && (x.ndim() < 3 || int64_t(offsets.size()) != x.shape(0))))
    throw std::invalid_argument("offsets must be one, or one per index of x's first axis");
  for (int offset : offsets)
    if (offset < 0) throw std::invalid_argument("offset must not be negative");
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(cpu_stream(), dims, offsets), {x, inv_freq});
}

/* See Heads: q, k, v [B, L, heads * D | kv_heads * D | kv_heads * Dv] float32, or (k and v none) q the product
 * [B, L, (heads + 2 * kv_heads) * D] they are parts of; `norms` none or the q and k norms' weights [D]; `inv_freq`
 * none (no rotation) or [dims / 2], with one offset or one per row. */
std::vector<mx::array> heads(const mx::array& q, const std::optional<mx::array>& k, const std::optional<mx::array>& v,
                             int heads, int kv_heads, const std::vector<mx::array>& norms, float eps,
                             const std::optional<mx::array>& inv_freq, int dims, float scale,
                             const std::vector<int>& offsets, int span) {
  if (k.has_value() != v.has_value()) throw std::invalid_argument("give k and v, or neither (q the joined product)");
  if (span != 1 && span != 2) throw std::invalid_argument("span must be 1, or 2 (each query head beside its gate)");
  std::vector<mx::array> inputs = {q};
  if (k) inputs.insert(inputs.end(), {*k, *v});
  for (const auto& a : inputs) {
    check_float32(a, "q, k and v");
    if (a.ndim() != 3 || a.shape(0) != q.shape(0) || a.shape(1) != q.shape(1))
      throw std::invalid_argument("q, k and v must be [batch, length, features] of one batch and length");
  }
  if (heads < 1 || kv_heads < 1 ||
      (k && (q.shape(2) % (span * heads) || k->shape(2) % kv_heads || v->shape(2) % kv_heads ||
             q.shape(2) / (span * heads) != k->shape(2) / kv_heads)) ||
      (!k && q.shape(2) % (span * heads + 2 * kv_heads)))
    throw std::invalid_argument("q must hold heads (span parts each), k and v kv_heads heads, q's and k's of one size");
  const int d = k ? q.shape(2) / (span * heads) : q.shape(2) / (span * heads + 2 * kv_heads);
  const int value_dims = k ? v->shape(2) / kv_heads : d;
  if (!norms.empty()) {
    if (norms.size() != 2) throw std::invalid_argument("norms must be none or the q and k norms' weights");
    for (const auto& w : norms) {
      check_float32(w, "a norm's weight");
      if (w.ndim() != 1 || w.shape(0) != d) throw std::invalid_argument("a norm's weight must be [head_dim]");
    }
    inputs.insert(inputs.end(), norms.begin(), norms.end());
  }
  std::vector<int> at = offsets;
  if (inv_freq) {
    check_float32(*inv_freq, "inv_freq");
    if (dims < 2 || dims % 2 || dims > d) throw std::invalid_argument("dims must be even and fit a head");
    if (inv_freq->ndim() != 1 || inv_freq->shape(0) != dims / 2) throw std::invalid_argument("inv_freq must be [dims / 2]");
    if (offsets.size() != 1 && int64_t(offsets.size()) != q.shape(0))
      throw std::invalid_argument("offsets must be one, or one per row");
    for (int offset : offsets)
      if (offset < 0) throw std::invalid_argument("offset must not be negative");
    inputs.push_back(*inv_freq);
  } else {
    dims = 0, at = {0};
  }
  const int batch = q.shape(0), length = q.shape(1);
  return mx::array::make_arrays({{batch, heads, length, d}, {batch, kv_heads, length, d},
                                 {batch, kv_heads, length, value_dims}},
                                {mx::float32, mx::float32, mx::float32},
                                std::make_shared<Heads>(cpu_stream(), heads, kv_heads, !k, !norms.empty(), eps, dims,
                                                        scale, at, span),
                                inputs);
}

/* See ShortConvStep: bcx [B, 1, 3H], conv_state [B, K - 1, H], conv_weight [H, K, 1] (K >= 2), float32. */
std::vector<mx::array> short_conv_step(const mx::array& bcx, const mx::array& conv_state, const mx::array& conv_weight) {
  for (const auto* x : {&bcx, &conv_state, &conv_weight}) check_float32(*x, "the step's arrays");
  if (bcx.ndim() != 3 || bcx.shape(1) != 1 || bcx.shape(2) % 3)
    throw std::invalid_argument("bcx must be [B, 1, 3 * dims]: B, C and x side by side");
  const int rows = bcx.shape(0), dims = bcx.shape(2) / 3;
  if (conv_weight.ndim() != 3 || conv_weight.shape(0) != dims || conv_weight.shape(1) < 2 || conv_weight.shape(2) != 1)
    throw std::invalid_argument("conv_weight must be [dims, taps >= 2, 1]");
  if (conv_state.shape() != mx::Shape{rows, conv_weight.shape(1) - 1, dims})
    throw std::invalid_argument("conv_state must be [B, taps - 1, dims]");
  return mx::array::make_arrays({{rows, 1, dims}, conv_state.shape()}, {mx::float32, mx::float32},
                                std::make_shared<ShortConvStep>(cpu_stream()), {bcx, conv_state, conv_weight});
}

/* See GatedDeltaStep. */
std::vector<mx::array> gated_delta_step(const mx::array& qkv, const mx::array& z, const mx::array& b, const mx::array& a,
                                        const mx::array& conv_state, const mx::array& conv_weight,
                                        const mx::array& state, const mx::array& a_log, const mx::array& dt_bias,
                                        const mx::array& norm, int key_heads, float q_weight, float k_weight,
                                        float l2_eps, float eps) {
  const std::vector<const mx::array*> all = {&qkv, &z, &b, &a, &conv_state, &conv_weight, &state, &a_log, &dt_bias, &norm};
  for (const auto* x : all) check_float32(*x, "the step's arrays");
  if (state.ndim() != 4) throw std::invalid_argument("state must be [B, value_heads, key_dims, value_dims]");
  const int rows = state.shape(0), value_heads = state.shape(1), dk = state.shape(2), dv = state.shape(3);
  if (key_heads < 1 || value_heads % key_heads) throw std::invalid_argument("value heads must be a multiple of key heads");
  const int channels = 2 * key_heads * dk + value_heads * dv;
  auto check = [&](const mx::array& x, mx::Shape shape, const char* what) {
    if (x.shape() != shape) throw std::invalid_argument(std::string(what) + " does not fit the state's heads");
  };
  check(qkv, {rows, 1, channels}, "qkv");
  check(z, {rows, 1, value_heads * dv}, "z");
  check(b, {rows, 1, value_heads}, "b");
  check(a, {rows, 1, value_heads}, "a");
  if (conv_weight.ndim() != 3 || conv_weight.shape(0) != channels || conv_weight.shape(1) < 2 || conv_weight.shape(2) != 1)
    throw std::invalid_argument("conv_weight must be [channels, taps >= 2, 1]");
  check(conv_state, {rows, conv_weight.shape(1) - 1, channels}, "conv_state");
  check(a_log, {value_heads}, "A_log");
  check(dt_bias, {value_heads}, "dt_bias");
  check(norm, {dv}, "the norm's weight");
  std::vector<mx::array> inputs;
  for (const auto* x : all) inputs.push_back(*x);
  return mx::array::make_arrays({{rows, 1, value_heads * dv}, conv_state.shape(), state.shape()},
                                {mx::float32, mx::float32, mx::float32},
                                std::make_shared<GatedDeltaStep>(cpu_stream(), key_heads, q_weight, k_weight, l2_eps, eps),
                                inputs);
}

void check_rows(const mx::array& a, mx::Dtype dtype, const char* what) {
  if (a.dtype() != dtype || a.ndim() != 4)
    throw std::invalid_argument(std::string(what) + " must be [batch, heads, positions, features] of " +
                                (dtype == mx::float32 ? "float32" : "uint32"));
}

void check_float_rows(const mx::array& a, const char* what) {
  if ((a.dtype() != mx::float32 && a.dtype() != mx::float16) || a.ndim() != 4)
    throw std::invalid_argument(std::string(what) + " must be [batch, heads, positions, features] of float32 or "
                                "float16");
}

/* Checks the queries against float keys and values [B, kv_heads, T, D|Dv]: T counts every key the queries see. */
void check_attention(const mx::array& q, const mx::array& k, const mx::array& v, int window) {
  check_rows(q, mx::float32, "queries");
  check_float_rows(k, "keys");
  check_float_rows(v, "values");
  if (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || v.shape(1) != k.shape(1) || v.shape(2) != k.shape(2))
    throw std::invalid_argument("keys and values must have the queries' batch and one head and position count");
  if (k.shape(1) < 1 || q.shape(1) % k.shape(1)) throw std::invalid_argument("query heads must be a multiple of KV heads");
  if (k.shape(3) != q.shape(3)) throw std::invalid_argument("keys must have the queries' features");
  if (window < 0) throw std::invalid_argument("window must be 0 (none) or more");
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale, int window, bool lse,
                    const std::optional<mx::array>& prefix_keys, const std::optional<mx::array>& prefix_values) {
  check_attention(q, k, v, window);
  if (q.shape(2) > k.shape(2)) throw std::invalid_argument("there must be a key for every query");
  std::vector<mx::array> inputs = {q, k, v};
  if (prefix_keys.has_value() != prefix_values.has_value())
    throw std::invalid_argument("a prefix needs both its keys and its values");
  if (prefix_keys) {
    const auto &pk = *prefix_keys, &pv = *prefix_values;
    check_attention(q, pk, pv, window);
    if (pk.shape(1) != k.shape(1) || pv.shape(3) != v.shape(3))
      throw std::invalid_argument("the prefix's keys and values must have the others' heads and features");
    inputs = {q, pk, pv, k, v};
  }
  return mx::array({q.shape(0), q.shape(1), q.shape(2), v.shape(3) + (lse ? 1 : 0)}, mx::float32,
                   std::make_shared<Attention>(cpu_stream(), scale, window, 0, 0, lse), inputs);
}

/* Packed keys or values with their scales and biases: the tail's batch, heads and features (up to padding). */
void check_packed(const mx::array& packed, const mx::array& scales, const mx::array& biases, const mx::array& tail,
                  int bits, int group, const char* what) {
  check_rows(packed, mx::uint32, what);
  check_rows(scales, mx::float32, "scales");
  check_rows(biases, mx::float32, "biases");
  const int features = packed.shape(3) * 32 / bits;
  for (const auto* a : {&scales, &biases})
    if (a->shape(0) != packed.shape(0) || a->shape(1) != packed.shape(1) || a->shape(2) != packed.shape(2) ||
        a->shape(3) * group != features)
      throw std::invalid_argument(std::string(what) + ": scales and biases must have a group of each row's features");
  if (packed.shape(0) != tail.shape(0) || packed.shape(1) != tail.shape(1) || features < tail.shape(3) ||
      features - tail.shape(3) >= group)
    throw std::invalid_argument(std::string(what) + " must have the float ones' batch, heads and features");
}

mx::array quantized_attention(const mx::array& q, const mx::array& kp, const mx::array& ks, const mx::array& kb,
                              const mx::array& vp, const mx::array& vs, const mx::array& vb, const mx::array& k,
                              const mx::array& v, float scale, int window, int bits, int group,
                              const std::vector<mx::array>& shared) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("bits must be 4 or 8");
  if (group != 32 && group != 64 && group != 128) throw std::invalid_argument("group_size must be 32, 64 or 128");
  if (!shared.empty() && shared.size() != 6)
    throw std::invalid_argument("a shared prefix is its packed keys, scales, biases, packed values, scales, biases");
  check_attention(q, k, v, window);
  const std::vector<mx::array> own = {kp, ks, kb, vp, vs, vb};
  std::vector<mx::array> inputs = {q};
  for (const auto* part : {&shared, &own}) {
    if (part->empty()) continue;
    const auto& a = *part;
    check_packed(a[0], a[1], a[2], k, bits, group, "packed keys");
    check_packed(a[3], a[4], a[5], v, bits, group, "packed values");
    if (a[3].shape(2) != a[0].shape(2)) throw std::invalid_argument("packed keys and values must hold as many positions");
    inputs.insert(inputs.end(), a.begin(), a.end());
  }
  inputs.insert(inputs.end(), {k, v});
  if (q.shape(2) > k.shape(2)) throw std::invalid_argument("the queries' own keys must be among the float ones");
  const int packed = int(inputs.size() - 3) / 6;
  return mx::array({q.shape(0), q.shape(1), q.shape(2), v.shape(3)}, mx::float32,
                   std::make_shared<Attention>(cpu_stream(), scale, window, bits, group, false, packed), inputs);
}

/* See DecodeRows: queries [B, heads, 1, D] float32, keys and values [B, kv_heads, 1, D|Dv] and each row's key and
 * value buffers [1, kv_heads, capacity, D|Dv] of one float dtype, starts[b] < capacity; spans (from, to) of each
 * row's shared prefix (empty: none reads one), whose keys and values (two arrays for each row with from < to, of
 * the keys' dtype) are `prefixes`. */
std::vector<mx::array> decode_rows(const mx::array& q, const mx::array& k, const mx::array& v,
                                   const std::vector<mx::array>& buffers, const std::vector<int64_t>& starts,
                                   float scale, const std::vector<mx::array>& prefixes,
                                   const std::vector<int64_t>& spans, bool lse) {
  check_attention(q, k, v, 0);
  const int rows = q.shape(0);
  if (q.shape(2) != 1 || k.shape(2) != 1) throw std::invalid_argument("decode rows have one query and one key each");
  if (k.dtype() != v.dtype()) throw std::invalid_argument("keys and values must have one dtype");
  if (int(starts.size()) != rows || int(buffers.size()) != 2 * rows)
    throw std::invalid_argument("each row needs its start and its key and value buffers");
  if (!spans.empty() && int(spans.size()) != 2 * rows)
    throw std::invalid_argument("spans must be none, or a (from, to) pair for each row");
  std::vector<int64_t> from(rows, 0), to(rows, 0);
  for (int b = 0; b < int(spans.size()) / 2; ++b) from[b] = spans[2 * b], to[b] = spans[2 * b + 1];
  auto check_kv = [&](const mx::array& a, int features, const char* what) {
    if (a.dtype() != k.dtype() || a.ndim() != 4 || a.shape(0) != 1 || a.shape(1) != k.shape(1) || a.shape(3) != features)
      throw std::invalid_argument(std::string(what) + " must be [1, kv_heads, positions, features] of the keys' dtype");
  };
  std::vector<mx::Shape> shapes = {{rows, q.shape(1), 1, v.shape(3) + (lse ? 1 : 0)}};
  std::vector<mx::Dtype> dtypes = {mx::float32};
  std::vector<mx::array> inputs = {q, k, v};
  size_t prefix = 0;
  for (int b = 0; b < rows; ++b) {
    const auto &kb = buffers[2 * b], &vb = buffers[2 * b + 1];
    check_kv(kb, k.shape(3), "a row's key buffer");
    check_kv(vb, v.shape(3), "a row's value buffer");
    if (vb.shape(2) != kb.shape(2)) throw std::invalid_argument("a row's buffers must hold as many positions each");
    if (starts[b] < 0 || starts[b] >= kb.shape(2)) throw std::invalid_argument("a row's start must be within its buffers");
    inputs.insert(inputs.end(), {kb, vb});
    for (const auto* buffer : {&kb, &vb}) {
      shapes.push_back(buffer->shape());
      dtypes.push_back(buffer->dtype());
    }
    if (from[b] >= to[b]) continue;
    if (prefix + 2 > prefixes.size()) throw std::invalid_argument("each row's span needs its prefix's keys and values");
    const auto &pk = prefixes[prefix], &pv = prefixes[prefix + 1];
    prefix += 2;
    check_kv(pk, k.shape(3), "a prefix's keys");
    check_kv(pv, v.shape(3), "a prefix's values");
    if (from[b] < 0 || to[b] > pk.shape(2) || pv.shape(2) != pk.shape(2))
      throw std::invalid_argument("a row's span must lie within its prefix");
    inputs.insert(inputs.end(), {pk, pv});
  }
  if (prefix != prefixes.size()) throw std::invalid_argument("more prefixes than spans that read them");
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<DecodeRows>(cpu_stream(), scale, starts, from, to, lse), inputs);
}

}  // namespace

NB_MODULE(_kernels, m) {
  m.doc() = "Fused float32 CPU kernels as MLX primitives (see mlxchat.kernels).";
  m.def("silu_mul", &silu_mul, nb::arg("gate"), nb::arg("x").none() = nb::none(),
        "silu(gate) * x; x None: gate is [..., 2 * I], the gate then x (a joined gate/up product's halves).");
  m.def("exp", [](const mx::array& x) { return unary(x, Unary::exp); }, nb::arg("x"), "exp(x), vectorized.");
  m.def("silu", [](const mx::array& x) { return unary(x, Unary::silu); }, nb::arg("x"), "x * sigmoid(x).");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"), "weight * x / rms(x).");
  m.def("rope", [](const mx::array& x, const mx::array& inv_freq, int dims, int offset) {
    return rope(x, inv_freq, dims, {offset});
  }, nb::arg("x"), nb::arg("inv_freq"), nb::arg("dims"), nb::arg("offset"),
        "Rotate-half RoPE of x [..., L, D] at positions offset.. over its first dims features.");
  m.def("rope_rows", &rope, nb::arg("x"), nb::arg("inv_freq"), nb::arg("dims"), nb::arg("offsets"),
        "rope with each index of x's first axis at its own offset (offsets[i]; one offset: all of them).");
  m.def("heads", &heads, nb::arg("q"), nb::arg("k").none(), nb::arg("v").none(), nb::arg("heads"), nb::arg("kv_heads"),
        nb::arg("norms") = std::vector<mx::array>{}, nb::arg("eps") = 0.0f, nb::arg("inv_freq") = nb::none(),
        nb::arg("dims") = 0, nb::arg("scale") = 1.0f, nb::arg("offsets") = std::vector<int>{0}, nb::arg("span") = 1,
        "Attention's heads [B, heads, L, D] from q, k, v [B, L, heads * D] (k and v None: q the product they are "
        "parts of): q and k RMS-normalized per head by norms "
        "(their weights), their first dims features scaled and rotated (RoPE at offsets: one, or one per row) when "
        "inv_freq is given; span 2: each query head's D features are followed in q by D others (a gate), skipped. "
        "Returns [q, k, v].");
  m.def("attention", &attention, nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"),
        nb::arg("window") = 0, nb::arg("lse") = false, nb::arg("prefix_keys") = nb::none(),
        nb::arg("prefix_values") = nb::none(),
        "Causal attention of [B, heads, L, D] queries (the last L positions) over [B, kv_heads, T, D] keys and "
        "values (float32 or float16) read in place, after a prefix's keys and values when they are given (read where "
        "they lie too); window > 0 limits each query to that many last keys; with lse each output row ends with the "
        "log-sum-exp of its scaled scores.");
  m.def("quantized_attention", &quantized_attention, nb::arg("queries"), nb::arg("packed_keys"),
        nb::arg("key_scales"), nb::arg("key_biases"), nb::arg("packed_values"), nb::arg("value_scales"),
        nb::arg("value_biases"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"), nb::arg("window"),
        nb::arg("bits"), nb::arg("group_size"), nb::arg("shared") = std::vector<mx::array>{},
        "attention over mx.quantize's packed keys and values (4 or 8 bits) followed by float ones, after a shared "
        "prefix's packed keys, scales, biases, packed values, scales, biases when they are given (read where they "
        "lie too).");
  m.def("decode_rows", &decode_rows, nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("buffers"),
        nb::arg("starts"), nb::arg("scale"), nb::arg("prefixes") = std::vector<mx::array>{},
        nb::arg("spans") = std::vector<int64_t>{}, nb::arg("lse") = false,
        "One decode step of B sequences' attention: row b's key and value written at starts[b] of its buffers "
        "(buffers[2b], buffers[2b + 1]: [1, kv_heads, capacity, D|Dv], taken over in place where nothing else holds "
        "them), its queries attending over positions spans[2b] to spans[2b + 1] of its shared prefix's keys and "
        "values (the next two of prefixes, for each row whose span is not empty), then their first starts[b] + 1 "
        "positions; with lse each output row ends with the log-sum-exp of its scaled scores. Returns [out, *buffers].");
  m.def("gated_delta_step", &gated_delta_step, nb::arg("qkv"), nb::arg("z"), nb::arg("b"), nb::arg("a"),
        nb::arg("conv_state"), nb::arg("conv_weight"), nb::arg("state"), nb::arg("a_log"), nb::arg("dt_bias"),
        nb::arg("norm"), nb::arg("key_heads"), nb::arg("q_weight"), nb::arg("k_weight"), nb::arg("l2_eps"),
        nb::arg("eps"),
        "One decode step of a Gated DeltaNet layer for B rows: its convolution, normalized q and k, the delta rule on "
        "each value head's state and the output's gated RMS norm. Returns [out [B, 1, Hv * Dv], conv_state, state].");
  m.def("short_conv_step", &short_conv_step, nb::arg("bcx"), nb::arg("conv_state"), nb::arg("conv_weight"),
        "One decode step of a gated short convolution (LFM2) for B rows: C * conv(B * x) over the last taps. Returns "
        "[out [B, 1, dims], conv_state].");
  m.def("flush_denormals", [] {
    return mx::array(mx::Shape{}, mx::bool_, std::make_shared<FlushDenormals>(cpu_stream()), {});
  }, "An array whose evaluation sets flush-to-zero / denormals-are-zero on the CPU stream's thread.");
  m.def("uninitialized", [](const std::vector<int>& sizes, mx::Dtype dtype) {
    for (int size : sizes)
      if (size < 0) throw std::invalid_argument("an array's sizes must not be negative");
    const mx::Shape shape(sizes.begin(), sizes.end());
    return mx::array(shape, dtype, std::make_shared<Uninitialized>(cpu_stream(), shape), {});
  }, nb::arg("shape"), nb::arg("dtype"), "An array of this shape and dtype whose memory is allocated, not written "
     "(what it holds is undefined: room for a buffer's writes).");
  m.def("mlx_version", [] {
    return std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
           std::to_string(MLX_VERSION_PATCH);
  });
  m.def("set_attention_isa", [](const std::string& name) {
    const bool avx512 = name.rfind("avx512", 0) == 0;
    mlxchat_attention::use_isa(avx512 ? Isa::avx512 : name == "avx2" ? Isa::avx2 : Isa::scalar, name != "avx512");
  }, nb::arg("isa"), "Run attention's inner loops on one of attention_isas() (at most the CPU's).");
  m.def("attention_isas", [] {
    std::vector<std::string> names = {"scalar"};
    if (isa >= Isa::avx2) names.push_back("avx2");
    if (isa >= Isa::avx512) names.push_back("avx512");
    if (isa >= Isa::avx512 && mlxchat_simd::has_avx512_vnni()) names.push_back("avx512 vnni");
    return names;
  }, "The instruction sets attention's inner loops run on here, the last the one they use (avx512 vnni: AVX-512 "
     "with packed keys scored in integers).");
  m.def("threads", &mlxchat_attention::threads, "The threads attention splits its work over.");
  m.def("isa", [] { return std::string(isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "scalar"); });
}
