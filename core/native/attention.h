/*
 * Fused causal attention on the CPU (mlxchat._kernels' attention primitive; see attention.cpp).
 *
 * Plain data: what to attend and where it lies, with every array read in place through its strides (a KV
 * cache's used prefix is a strided view of its buffer), float32, float16 or mx.quantize's packed rows.
 */
#pragma once

#include <cstdint>

#include "simd.h"

namespace mlxchat_attention {

/* A 4-D array [batch, heads, rows, features] whose features are contiguous: its start and the strides, in
 * elements, of the first three axes. */
struct View {
  const void* data = nullptr;
  int64_t batch = 0, head = 0, row = 0;

  template <typename T>
  const T* at(int b, int h, int64_t r) const {
    return static_cast<const T*>(data) + b * batch + h * head + r * row;
  }
};

/* Keys (or values) of consecutive positions: float32 rows of `dims` features (float16 ones with `half`), or
 * (bits 4 or 8) mx.quantize's affine layout: `dims` features packed into uint32 words, a float32 scale and bias
 * per `group` of them. */
struct Rows {
  int bits = 0;
  int group = 0;
  int dims = 0;
  bool half = false;
  View data, scales, biases;
};

/* Keys and values of a run of positions. */
struct Segment {
  int64_t count = 0;
  Rows keys, values;
};

/*
 * out [batch, heads, length, value_dims (+ 1 with lse)] (contiguous) = softmax(scale * q k^T) v for queries
 * [batch, heads, length, dims], grouped-query: query head h reads KV head h / (heads / kv_heads). The keys are the
 * segments' in order; the queries are the last `length` positions, each seeing the keys up to its own and,
 * with a window, only the `window` last of them (itself included).
 */
struct Problem {
  View queries;
  int batch = 0, heads = 0, kv_heads = 0, length = 0, dims = 0, value_dims = 0;
  float scale = 1.0f;
  int64_t window = 0;
  Segment segments[3];  // at most: a shared prefix's packed rows, a quantized cache's own, its float tail
  int count = 0;
  float* out = nullptr;
  /* With `lse`, each output row holds value_dims + 1 floats, the last the log-sum-exp of the row's scaled
   * scores (its softmax's log denominator): what merging with attention over other keys needs. */
  bool lse = false;
};

void attend(const Problem& problem);

/* The threads attend splits its work over. */
int threads();

/* task(ctx, 0 .. tasks - 1) split over those threads (the other kernels of mlxchat._kernels share them). */
void parallel(int tasks, void (*task)(const void* ctx, int index), const void* ctx);

/* The instruction set attend's inner loops use from now on (at most the CPU's; for tests), and whether AVX-512
 * scores packed keys in integers where the CPU can (mlxchat_simd::has_avx512_vnni). */
void use_isa(mlxchat_simd::Isa isa, bool integer_scores = true);

}  // namespace mlxchat_attention
