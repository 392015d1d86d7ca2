/*
 * SIMD helpers shared by mlxchat._kernels' sources (and the CPU checks, by mlxchat._quantized's 8-bit x): the
 * instruction set the CPU offers (chosen once, at load),
 * a vectorized exp (AVX-512, AVX2 and scalar forms of one function) and a scalar IEEE half to float.
 *
 * exp is a degree-7 polynomial of 2^f with an exact power-of-two scaling (about 1 ulp; MLX's within a few ulp
 * of it), 0 below -87.3 and saturating at 3.3e38 above 88.7 (the softmax and the gates never reach that far).
 */
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define MLXK_AVX512 __attribute__((target("avx512f,avx512dq,avx2,fma")))
#define MLXK_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace mlxchat_simd {

enum class Isa { scalar, avx2, avx512 };

inline Isa best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::scalar;
}

inline const Isa isa = best_isa();

/* Whether the CPU converts halves (F16C: every AVX2 processor, but a virtual machine may hide it). */
inline bool has_f16c() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

/* Whether the CPU multiplies int16 pairs into int32 sums in one instruction (AVX-512 BW and VNNI). */
inline bool has_avx512_vnni() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

/* An IEEE half's value (what F16C's vcvtph2ps computes; for the scalar loops). */
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float x = std::ldexp(float(mantissa), -24);
    return sign ? -x : x;
  }
  const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | mantissa << 13;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// -- exp ------------------------------------------------------------------------------------------------

inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLow = -87.3f, kHigh = 88.7f;  // float32 exp leaves the normal range beyond these
// 2^f = e^(f ln 2) on [-0.5, 0.5]: Taylor coefficients (ln 2)^i / i!, i = 0..7 (error below 1e-8)
inline constexpr float kC[8] = {1.0f, 0.693147180559945f, 0.240226506959101f, 0.0555041086648216f,
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

}  // namespace mlxchat_simd
