/*
 * Fused causal attention on the CPU (see attention.h): flash attention's online softmax over blocks of keys.
 *
 * The rows of a task are a block of queries of one KV head: the query heads that read it (grouped-query
 * attention without repeating keys or values) at consecutive positions. For each block of kKeys keys the
 * task computes the rows' scores, masks them (causal, sliding window) by position as it goes, folds them
 * into each row's running maximum and sum (rescaling what it has summed when the maximum grows) and adds
 * the block's values weighted by them. So keys and values are read once per block of rows, straight from
 * the cache's buffers (strided views: float32 and float16 in place; packed rows dequantized a block at a time into
 * the task's scratch, or, for one or two rows, converted in registers where they lie: attention_packed.h), and
 * the scratch is a block's, whatever the context. A decode step has one block of rows per KV head; when that
 * makes too few tasks for the cores, each block's keys are split among several tasks whose partial sums are
 * merged afterwards (flash decoding).
 */
#include "attention.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "pool.h"
#include "simd.h"

namespace mlxchat_attention {
namespace {

using mlxchat_simd::exp_scalar;
using mlxchat_simd::Isa;

constexpr int kLanes = 16;  // staged rows are padded to whole multiples of this many features
constexpr int kKeys = 64;   // keys per block (the values of a block of 64 stay in L1 while 64 rows sum them)
constexpr int kRows = 64;   // query rows per task (at most)
constexpr int kSplitKeys = 512;  // the fewest keys a task of a split block gets
/* Blocks of at most this many rows (a decode step of 1-2 query heads a KV head) read packed keys and values in
 * place, converting them in registers (attention_packed.h, where a chunk of its words fits in a group); more
 * rows share one staged float copy of each block (converting for each pair of rows cost more than the stores:
 * 3 and 4 rows ran 5-20% slower fused on an AVX2 EPYC, where 1 and 2 rows ran 21-42% faster;
 * benchmarks/results/quantized_kv_decode.md). */
constexpr int kFusedRows = 2;
constexpr int kQueryRoom = 64;  // floats past a row's features a table's `order` may write (attention_dot.h)
constexpr double kInline = 1 << 18;  // multiply-adds under which a problem runs on the calling thread

int padded(int n) {
  return (n + kLanes - 1) / kLanes * kLanes;
}

struct Ops {
  void (*scores)(const float* q, int rows, int qs, const float* k, int64_t ks, int n, int dims, float* s, int ss);
  void (*accumulate)(const float* p, int rows, int ps, const float* v, int64_t vs, int n, int dims, float* acc,
                     int as);
  void (*half_scores)(const float* q, int rows, int qs, const uint16_t* k, int64_t ks, int n, int dims, float* s,
                      int ss);
  void (*half_accumulate)(const float* p, int rows, int ps, const uint16_t* v, int64_t vs, int n, int dims,
                          float* acc, int as);
  void (*dequantize)(const Rows& rows, int b, int h, int64_t at, int n, float* out);
  float (*row_max)(const float* x, int n);
  float (*exp_sum)(float* x, int n, float shift);
  void (*scale)(float* x, int dims, float by);
  // packed rows read in place (attention_packed.h): chunks of `words` 32-bit words, rows put in their order
  int words;
  void (*order)(const float* x, int rows, int xs, int dims, int bits, float* out, int os);
  void (*add_ordered)(const float* x, int rows, int xs, int dims, int bits, float* out, int os);
  void (*packed_scores)(const float* q, int rows, int qs, const float* qsum, const Rows& keys, int b, int h,
                        int64_t at, int n, float* s, int ss);
  void (*packed_accumulate)(const float* p, int rows, int ps, const Rows& values, int b, int h, int64_t at, int n,
                            float* acc, int as);
  const Ops* wide = nullptr;  // packed loops over chunks of more words, for the formats whose groups hold their chunks
};

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using Vec = __m256;
struct V {
  static constexpr int W = 8, kAcc = 8, kMaxC = 4;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static float sum(Vec v) { return mlxchat_simd::hsum256(v); }
  static float top(Vec v) { return mlxchat_simd::hmax256(v); }
  static Vec exp(Vec v) { return mlxchat_simd::exp256(v); }
  static constexpr int input(int p) { return p / 4 + 2 * (p % 4); }
  static Vec sums(const Vec* a) {
    Vec x[4], y[2];
    for (int i = 0; i < 4; ++i)
      x[i] = add(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20), _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)
      y[i] = add(_mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    return add(_mm256_shuffle_ps(y[0], y[1], 0x88), _mm256_shuffle_ps(y[0], y[1], 0xDD));
  }
  template <int R>
  static void store_rows(Vec v, float* s, int ss) {
    const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    if constexpr (R == 1) {
      store(s, v);
    } else if constexpr (R == 2) {
      _mm_storeu_ps(s, lo);
      _mm_storeu_ps(s + ss, hi);
    } else {
      _mm_storel_pi(reinterpret_cast<__m64*>(s), lo);
      _mm_storeh_pi(reinterpret_cast<__m64*>(s + ss), lo);
      _mm_storel_pi(reinterpret_cast<__m64*>(s + 2 * ss), hi);
      _mm_storeh_pi(reinterpret_cast<__m64*>(s + 3 * ss), hi);
    }
  }
  static Vec bytes8(const uint8_t* w, int c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + c))));
  }
  static Vec bytes4(const uint8_t* w, int c) {
    int32_t word;
    std::memcpy(&word, w + c / 2, sizeof(word));
    const __m128i b = _mm_cvtsi32_si128(word), m = _mm_set1_epi8(15);
    const __m128i x = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x));
  }
  static constexpr int kWords = W;
  using Int = __m256i;
  static Int words(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  template <int F, int BITS, int SHIFT = F * BITS>
  static Vec field(Int x) {
    if constexpr (SHIFT > 0) x = _mm256_srli_epi32(x, SHIFT);
    if constexpr (SHIFT + BITS < 32) x = _mm256_and_si256(x, _mm256_set1_epi32((1 << BITS) - 1));
    return _mm256_cvtepi32_ps(x);
  }
  static void bytes4x2(const uint8_t* w, int c, Vec& lo, Vec& hi) {  // one load and unpack for 16 values
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + c / 2)), m = _mm_set1_epi8(15);
    const __m128i x = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(x, x)));
  }
};
#include "attention_ops.h"
#include "attention_packed.h"
constexpr Ops ops = {scores<float>, accumulate<float>, scores<uint16_t>, accumulate<uint16_t>, dequantize, row_max,
                     exp_sum, scale, V::kWords, order, add_ordered, packed_scores, packed_accumulate};
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx2,fma")
namespace avx512 {
using Vec = __m512;
struct V {
  static constexpr int W = 16, kAcc = 16, kMaxC = 8;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static float sum(Vec v) { return _mm512_reduce_add_ps(v); }
  static float top(Vec v) { return _mm512_reduce_max_ps(v); }
  static Vec exp(Vec v) { return mlxchat_simd::exp512(v); }
  static constexpr int input(int p) { return p / 4 + 4 * (p % 4); }
  /* A tree of shuffles and adds: 128-bit lanes, then 64-bit pairs, then single floats. */
  static Vec sums(const Vec* a) {
    Vec x[8], y[4], z[2];
    for (int i = 0; i < 8; ++i)
      x[i] = add(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)
      y[i] = add(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88), _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)
      z[i] = add(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44), _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
    return add(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  }
  template <int R>
  static void store_rows(Vec v, float* s, int ss) {
    constexpr int K = W / R;
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(s + i * (ss - K), __mmask16(((1u << K) - 1) << (i * K)), v);
  }
  static Vec bytes8(const uint8_t* w, int c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c))));
  }
  static Vec bytes4(const uint8_t* w, int c) {  // value 2i in the low nibble of byte i, 2i + 1 in the high one
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + c / 2)), m = _mm_set1_epi8(15);
    const __m128i x = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
  }
  static void bytes4x2(const uint8_t* w, int c, Vec& lo, Vec& hi) {
    lo = bytes4(w, c);
    hi = bytes4(w, c + W);
  }
  static constexpr int kWords = W;
  using Int = __m512i;
  static Int words(const uint8_t* p) { return _mm512_loadu_si512(p); }
  template <int F, int BITS, int SHIFT = F * BITS>
  static Vec field(Int x) {
    if constexpr (SHIFT > 0) x = _mm512_srli_epi32(x, SHIFT);
    if constexpr (SHIFT + BITS < 32) x = _mm512_and_si512(x, _mm512_set1_epi32((1 << BITS) - 1));
    return _mm512_cvtepi32_ps(x);
  }
};
#include "attention_ops.h"
namespace wide {
#include "attention_packed.h"
constexpr Ops ops = {scores<float>, accumulate<float>, scores<uint16_t>, accumulate<uint16_t>, dequantize, row_max,
                     exp_sum, scale, V::kWords, order, add_ordered, packed_scores, packed_accumulate};
}  // namespace wide
/* Packed rows read 8 words at a time (a chunk as AVX2's: 64 4-bit or 32 8-bit values, which groups of 64 and 32
 * hold), each word in two lanes: vector F of a chunk is fields 2F and 2F + 1, shifted by one srlv (4-bit KV at 16k
 * keys: 1.12x AVX2's 8-lane loops, Zen 4). */
namespace halves {
struct V : avx512::V {
  static constexpr int kWords = W / 2;
  static Int words(const uint8_t* p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  template <int F, int BITS>
  static Vec field(Int x) {
    constexpr int lo = 2 * F * BITS, hi = lo + BITS;
    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi32(lo), _mm256_set1_epi32(hi), 1);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(x, shift), _mm512_set1_epi32((1 << BITS) - 1)));
  }
};
#include "attention_packed.h"
}  // namespace halves
/* Packed rows are read 16 words at a time where a group holds a chunk of them (8-bit values in groups of 64 or
 * more), else 8 (halves: 4-bit values, 8-bit ones in groups of 32): wider words halve the instructions a packed
 * key or value costs, which bound these loops, not the memory. */
constexpr Ops ops = {scores<float>, accumulate<float>, scores<uint16_t>, accumulate<uint16_t>, dequantize, row_max,
                     exp_sum, scale, halves::V::kWords, halves::order, halves::add_ordered, halves::packed_scores,
                     halves::packed_accumulate, &wide::ops};
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vnni,avx2,fma")
/* The same tables with packed keys scored in integers (attention_dot.h) where they have at most kMaxBlocks blocks
 * (every head size in use), else by Float's loops: the query's layout is chosen by the same test. */
namespace dot {
using halves::Packed;
#include "attention_dot.h"

template <const Ops& Float>
void order(const float* x, int rows, int xs, int dims, int bits, float* out, int os) {
  if (!dot_reads(bits, dims)) return Float.order(x, rows, xs, dims, bits, out, os);
  return bits == 8 ? dot_order_rows<8>(x, rows, xs, dims, out, os) : dot_order_rows<4>(x, rows, xs, dims, out, os);
}

template <const Ops& Float>
void packed_scores(const float* q, int rows, int qs, const float* qsum, const Rows& keys, int b, int h, int64_t at,
                   int n, float* s, int ss) {
  if (!dot_reads(keys.bits, keys.dims)) return Float.packed_scores(q, rows, qs, qsum, keys, b, h, at, n, s, ss);
  by_format(keys, [&](auto bits, auto group) {
    constexpr int B = decltype(bits)::value, G = decltype(group)::value;
    if (rows == 2) return dot_scores_rows<2, B, G>(q, qs, qsum, keys, b, h, at, n, s, ss);
    dot_scores_rows<1, B, G>(q, qs, qsum, keys, b, h, at, n, s, ss);
  });
}

/* Constant (built at compile time): code run while the library loads must not be AVX-512's. */
template <const Ops& Float>
constexpr Ops with_integer_scores(const Ops* wide) {
  Ops o = Float;
  o.order = order<Float>, o.packed_scores = packed_scores<Float>, o.wide = wide;
  return o;
}

constexpr Ops wide_ops = with_integer_scores<wide::ops>(nullptr);
constexpr Ops ops = with_integer_scores<avx512::ops>(&wide_ops);
}  // namespace dot
#pragma GCC pop_options
}  // namespace avx512
#pragma GCC pop_options
#endif

namespace scalar {
using Vec = float;
struct V {
  static constexpr int W = 1, kAcc = 8, kMaxC = 8;
  static Vec zero() { return 0.0f; }
  static Vec set1(float x) { return x; }
  static Vec load(const float* p) { return *p; }
  static Vec load(const uint16_t* p) { return mlxchat_simd::half_to_float(*p); }
  static void store(float* p, Vec v) { *p = v; }
  static Vec fma(Vec a, Vec b, Vec c) { return a * b + c; }
  static Vec add(Vec a, Vec b) { return a + b; }
  static Vec sub(Vec a, Vec b) { return a - b; }
  static Vec mul(Vec a, Vec b) { return a * b; }
  static Vec max(Vec a, Vec b) { return std::fmax(a, b); }
  static float sum(Vec v) { return v; }
  static float top(Vec v) { return v; }
  static Vec exp(Vec v) { return exp_scalar(v); }
  static constexpr int input(int) { return 0; }
  static Vec sums(const Vec* a) { return a[0]; }
  template <int R>
  static void store_rows(Vec v, float* s, int) { *s = v; }
  static Vec bytes8(const uint8_t* w, int c) { return float(w[c]); }
  static Vec bytes4(const uint8_t* w, int c) { return float((w[c / 2] >> (4 * (c & 1))) & 15); }
  static void bytes4x2(const uint8_t* w, int c, Vec& lo, Vec& hi) {
    lo = bytes4(w, c);
    hi = bytes4(w, c + 1);
  }
  static constexpr int kWords = W;
  using Int = uint32_t;
  static Int words(const uint8_t* p) {
    Int x;
    std::memcpy(&x, p, sizeof(x));
    return x;
  }
  template <int F, int BITS>
  static Vec field(Int x) { return float((x >> (F * BITS)) & ((1u << BITS) - 1)); }
};
#include "attention_ops.h"
#include "attention_packed.h"
constexpr Ops ops = {scores<float>, accumulate<float>, scores<uint16_t>, accumulate<uint16_t>, dequantize, row_max,
                     exp_sum, scale, V::kWords, order, add_ordered, packed_scores, packed_accumulate};
}  // namespace scalar

std::atomic<Isa> active_isa{mlxchat_simd::isa};

#if defined(__x86_64__)
/* AVX2's loops where the CPU hides F16C: float16 rows converted by the scalar ones. */
const Ops avx2_without_f16c = [] {
  Ops o = avx2::ops;
  o.half_scores = scalar::ops.half_scores, o.half_accumulate = scalar::ops.half_accumulate;
  return o;
}();
#endif

std::atomic<bool> integer_keys{true};

const Ops& ops() {
#if defined(__x86_64__)
  static const bool vnni = mlxchat_simd::has_avx512_vnni();
  if (active_isa.load() == Isa::avx512) return vnni && integer_keys.load() ? avx512::dot::ops : avx512::ops;
  static const bool f16c = mlxchat_simd::has_f16c();
  if (active_isa.load() == Isa::avx2) return f16c ? avx2::ops : avx2_without_f16c;
#endif
  return scalar::ops;
}

/* Workers sleep as soon as a job is done: the next one is a layer away, and the products in between need the
 * cores (the BLAS's threads or mlxchat._quantized's). */
mlxchat_pool::Pool& pool() {
  static mlxchat_pool::Pool instance(mlxchat_pool::cores(), std::chrono::microseconds(0));
  return instance;
}

// -- the plan: tasks over (batch, KV head, block of rows, part of its keys) -----------------------------

struct Task {
  int b, h, r0, r1;  // rows [r0, r1): row r is query head h * group + r % group at position r / group
  int64_t k0, k1;    // the keys it reads
  int slot, part, parts;  // a block whose keys `parts` tasks share leaves partial sums in slot + part
};

struct Plan {
  const Problem* p;
  const Ops* ops;
  int group;          // query heads per KV head
  int64_t total;      // keys
  int q_dims, v_dims; // features of the staged queries and of the sums (padded to cover every segment's)
  int row_block;
  std::vector<Task> tasks;
  std::vector<float> partial;  // per slot: row_block maxima, row_block sums, row_block x v_dims weighted sums

  int64_t position(int row) const {
    return total - p->length + row / group;
  }
  int64_t first_key(int row) const {  // the first key row `row` sees
    return p->window > 0 ? std::max<int64_t>(0, position(row) - p->window + 1) : 0;
  }
  float* out_row(int b, int h, int row) const {  // where row `row` of the task's KV head h writes its output
    const int64_t at = (int64_t(b) * p->heads + h * group + row % group) * p->length + row / group;
    return p->out + at * (p->value_dims + (p->lse ? 1 : 0));
  }
  float* partial_at(int slot) {
    return partial.data() + size_t(slot) * row_block * (v_dims + 2);
  }
};

/* Floats on 64-byte boundaries (a vector a cache line: stores never straddle two). */
class Buffer {
 public:
  float* take(size_t n) {
    data_.resize(n + 16);
    const auto at = reinterpret_cast<uintptr_t>(data_.data());
    return data_.data() + (-at / sizeof(float)) % 16;
  }

 private:
  std::vector<float> data_;
};

struct Scratch {
  Buffer q, s, acc, k, v, qsum, ordered_q, ordered_acc;
  std::vector<float> top, sum;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

/* Rows as the loops read them: float32 or float16 ones (the other null) `stride` elements apart. */
struct Block {
  const float* floats = nullptr;
  const uint16_t* halves = nullptr;
  int64_t stride = 0;
};

/* `n` rows of `rows` from position `at`, as rows of `dims` (padded) features: float32 or float16 rows in place
 * when they hold whole multiples of kLanes features, else float32 ones staged (dequantized, converted, padded)
 * into `into`. */
Block rows_at(const Rows& rows, const Ops& ops, int b, int h, int64_t at, int n, int dims, Buffer& into) {
  if (rows.bits == 0 && rows.dims % kLanes == 0) {
    if (rows.half) return {nullptr, rows.data.at<uint16_t>(b, h, at), rows.data.row};
    return {rows.data.at<float>(b, h, at), nullptr, rows.data.row};
  }
  float* staged = into.take(size_t(n) * dims);
  if (rows.bits != 0) {  // packed rows hold whole groups: `dims` features
    ops.dequantize(rows, b, h, at, n, staged);
    return {staged, nullptr, dims};
  }
  for (int j = 0; j < n; ++j) {
    float* out = staged + size_t(j) * dims;
    if (rows.half) {
      const uint16_t* x = rows.data.at<uint16_t>(b, h, at + j);
      for (int d = 0; d < rows.dims; ++d) out[d] = mlxchat_simd::half_to_float(x[d]);
    } else {
      std::memcpy(out, rows.data.at<float>(b, h, at + j), sizeof(float) * rows.dims);
    }
    std::fill(out + rows.dims, out + dims, 0.0f);
  }
  return {staged, nullptr, dims};
}

/* Each of `rows` query rows' sums over each group of `dims` features (what packed keys' biases multiply). */
const float* group_sums(const float* q, int rows, int qs, int dims, int group, Buffer& into) {
  const int groups = dims / group;
  float* sums = into.take(size_t(rows) * groups);
  for (int i = 0; i < rows; ++i)
    for (int g = 0; g < groups; ++g) {
      const float* x = q + size_t(i) * qs + g * group;
      sums[i * groups + g] = std::accumulate(x, x + group, 0.0f);
    }
  return sums;
}

/* Whether `ops`' packed loops read these packed rows (a chunk of their words within a group). */
bool fits(const Ops& ops, const Rows& packed) {
  return packed.bits != 0 && ops.words * 32 / packed.bits <= packed.group;
}

/* The table whose packed loops read `packed`'s rows: the widest that fits them. */
const Ops& reading(const Ops& ops, const Rows& packed) {
  return ops.wide != nullptr && fits(*ops.wide, packed) ? *ops.wide : ops;
}

/* Whether a block of `rows` query rows reads these packed rows in place (attention_packed.h), rather than a float
 * copy of each block of them. */
bool fused(const Ops& ops, const Rows& packed, int rows) {
  return rows <= kFusedRows && fits(ops, packed);
}

int features(const Rows& rows) {
  return rows.bits == 0 ? padded(rows.dims) : rows.dims;
}

void run_task(const void* ctx, int index) {
  auto& plan = *static_cast<Plan*>(const_cast<void*>(ctx));
  const Task& t = plan.tasks[index];
  const Problem& p = *plan.p;
  const Ops& ops = *plan.ops;
  const int rows = t.r1 - t.r0, qd = plan.q_dims, vd = plan.v_dims;
  Scratch& s = scratch();
  float* q = s.q.take(size_t(rows) * qd);
  float* scores = s.s.take(size_t(rows) * kKeys);
  float* acc = s.acc.take(size_t(rows) * vd);
  std::fill(q, q + size_t(rows) * qd, 0.0f);
  std::fill(acc, acc + size_t(rows) * vd, 0.0f);
  s.top.assign(rows, -INFINITY);
  s.sum.assign(rows, 0.0f);
  for (int i = 0; i < rows; ++i) {
    const int r = t.r0 + i;
    const float* src = p.queries.at<float>(t.b, t.h * plan.group + r % plan.group, r / plan.group);
    for (int d = 0; d < p.dims; ++d) q[size_t(i) * qd + d] = src[d] * p.scale;
  }
  float* ordered = nullptr;
  const Ops* ordered_ops = nullptr;
  int ordered_bits = 0, ordered_dims = 0;
  int64_t start = 0;  // position of the segment's first key
  for (int si = 0; si < p.count; start += p.segments[si].count, ++si) {
    const Segment& seg = p.segments[si];
    const int kd = features(seg.keys), vdims = features(seg.values);
    const Ops &key_ops = reading(ops, seg.keys), &value_ops = reading(ops, seg.values);
    const bool packed_keys = fused(key_ops, seg.keys, rows);
    // Packed values sum into `ordered` in their chunks' order (the first such segment's format; another format
    // is staged), which goes into acc at the end.
    const bool packed_values = fused(value_ops, seg.values, rows) && (ordered == nullptr || (
        &value_ops == ordered_ops && seg.values.bits == ordered_bits && seg.values.dims == ordered_dims));
    if (packed_values && ordered == nullptr) {
      ordered = s.ordered_acc.take(size_t(rows) * vd);
      std::fill(ordered, ordered + size_t(rows) * vd, 0.0f);
      ordered_ops = &value_ops, ordered_bits = seg.values.bits, ordered_dims = seg.values.dims;
    }
    const float* qsum = packed_keys ? group_sums(q, rows, qd, seg.keys.dims, seg.keys.group, s.qsum) : nullptr;
    const int qks = qd + kQueryRoom;
    float* qk = packed_keys ? s.ordered_q.take(size_t(rows) * qks) : nullptr;
    if (packed_keys) key_ops.order(q, rows, qd, seg.keys.dims, seg.keys.bits, qk, qks);
    for (int64_t j0 = std::max(t.k0, start); j0 < std::min(t.k1, start + seg.count); j0 += kKeys) {
      const int n = int(std::min<int64_t>(kKeys, std::min(t.k1, start + seg.count) - j0));
      if (packed_keys) {
        key_ops.packed_scores(qk, rows, qks, qsum, seg.keys, t.b, t.h, j0 - start, n, scores, kKeys);
      } else if (const Block k = rows_at(seg.keys, ops, t.b, t.h, j0 - start, n, kd, s.k); k.halves != nullptr) {
        ops.half_scores(q, rows, qd, k.halves, k.stride, n, kd, scores, kKeys);
      } else {
        ops.scores(q, rows, qd, k.floats, k.stride, n, kd, scores, kKeys);
      }
      for (int i = 0; i < rows; ++i) {
        float* row = scores + size_t(i) * kKeys;
        const int a = int(std::clamp<int64_t>(plan.first_key(t.r0 + i) - j0, 0, n));
        const int e = int(std::clamp<int64_t>(plan.position(t.r0 + i) + 1 - j0, 0, n));
        if (a >= e) {
          std::fill(row, row + n, 0.0f);
          continue;
        }
        const float top = std::max(s.top[i], ops.row_max(row + a, e - a));
        const float rescale = s.top[i] == -INFINITY ? 0.0f : exp_scalar(s.top[i] - top);
        const float sum = ops.exp_sum(row + a, e - a, top);
        std::fill(row, row + a, 0.0f);
        std::fill(row + e, row + n, 0.0f);
        if (rescale != 1.0f) {
          ops.scale(acc + size_t(i) * vd, vd, rescale);
          if (ordered != nullptr) ops.scale(ordered + size_t(i) * vd, vd, rescale);
        }
        s.sum[i] = s.sum[i] * rescale + sum;
        s.top[i] = top;
      }
      if (packed_values) {
        value_ops.packed_accumulate(scores, rows, kKeys, seg.values, t.b, t.h, j0 - start, n, ordered, vd);
      } else if (const Block v = rows_at(seg.values, ops, t.b, t.h, j0 - start, n, vdims, s.v); v.halves != nullptr) {
        ops.half_accumulate(scores, rows, kKeys, v.halves, v.stride, n, vdims, acc, vd);
      } else {
        ops.accumulate(scores, rows, kKeys, v.floats, v.stride, n, vdims, acc, vd);
      }
    }
  }
  if (ordered != nullptr) ordered_ops->add_ordered(ordered, rows, vd, ordered_dims, ordered_bits, acc, vd);
  if (t.parts > 1) {
    float* out = plan.partial_at(t.slot + t.part);
    std::copy(s.top.begin(), s.top.end(), out);
    std::copy(s.sum.begin(), s.sum.end(), out + plan.row_block);
    std::copy(acc, acc + size_t(rows) * vd, out + 2 * plan.row_block);
    return;
  }
  for (int i = 0; i < rows; ++i) {
    float* out = plan.out_row(t.b, t.h, t.r0 + i);
    const float inv = 1.0f / s.sum[i];
    for (int d = 0; d < p.value_dims; ++d) out[d] = acc[size_t(i) * vd + d] * inv;
    if (p.lse) out[p.value_dims] = s.top[i] + std::log(s.sum[i]);
  }
}

/* The output of a block of rows whose keys several tasks shared, from their partial sums. */
void merge(Plan& plan, const Task& t) {
  const int splits = t.parts;
  const Problem& p = *plan.p;
  const int vd = plan.v_dims;
  for (int i = 0; i < t.r1 - t.r0; ++i) {
    float top = -INFINITY;
    for (int k = 0; k < splits; ++k) top = std::max(top, plan.partial_at(t.slot + k)[i]);
    float* out = plan.out_row(t.b, t.h, t.r0 + i);
    std::fill(out, out + p.value_dims, 0.0f);
    float sum = 0.0f;
    for (int k = 0; k < splits; ++k) {
      const float* part = plan.partial_at(t.slot + k);
      if (part[i] == -INFINITY) continue;  // this part saw none of the row's keys
      const float w = exp_scalar(part[i] - top);
      sum += w * part[plan.row_block + i];
      const float* acc = part + 2 * plan.row_block + size_t(i) * vd;
      for (int d = 0; d < p.value_dims; ++d) out[d] += w * acc[d];
    }
    for (int d = 0; d < p.value_dims; ++d) out[d] /= sum;
    if (p.lse) out[p.value_dims] = top + std::log(sum);
  }
}

}  // namespace

void attend(const Problem& p) {
  if (p.batch == 0 || p.heads == 0 || p.length == 0) return;
  Plan plan;
  plan.p = &p;
  plan.ops = &ops();
  plan.group = p.heads / p.kv_heads;
  plan.total = 0;
  plan.q_dims = padded(p.dims);
  plan.v_dims = padded(p.value_dims);
  for (int i = 0; i < p.count; ++i) {
    plan.total += p.segments[i].count;
    plan.q_dims = std::max(plan.q_dims, features(p.segments[i].keys));
    plan.v_dims = std::max(plan.v_dims, features(p.segments[i].values));
  }
  const int rows = plan.group * p.length;
  const int blocks = (rows + kRows - 1) / kRows;
  plan.row_block = (rows + blocks - 1) / blocks;
  const int threads = pool().threads();
  const int groups = p.batch * p.kv_heads * blocks;
  const int64_t widest = plan.total - plan.first_key((blocks - 1) * plan.row_block);  // the last block's keys
  int splits = 1;
  if (groups < 8 * threads) {  // enough tasks that a thread starting late still finds some
    splits = int(std::min<int64_t>((8 * threads + groups - 1) / groups, std::max<int64_t>(1, widest / kSplitKeys)));
  }
  double work = 0;
  int slots = 0;
  for (int blk = blocks - 1; blk >= 0; --blk) {  // the blocks that read the most keys first
    const int r0 = blk * plan.row_block, r1 = std::min(rows, r0 + plan.row_block);
    const int64_t k0 = plan.first_key(r0), k1 = plan.position(r1 - 1) + 1;
    const int64_t step = ((k1 - k0 + splits - 1) / splits + kKeys - 1) / kKeys * kKeys;
    const int parts = int((k1 - k0 + step - 1) / step);
    for (int b = 0; b < p.batch; ++b)
      for (int h = 0; h < p.kv_heads; ++h) {
        for (int k = 0; k < parts; ++k)
          plan.tasks.push_back({b, h, r0, r1, k0 + k * step, std::min(k1, k0 + (k + 1) * step), slots, k, parts});
        if (parts > 1) slots += parts;
      }
    work += double(p.batch) * p.kv_heads * (r1 - r0) * (k1 - k0) * (plan.q_dims + plan.v_dims);
  }
  plan.partial.resize(size_t(slots) * plan.row_block * (plan.v_dims + 2));
  if (work < kInline) {
    for (int i = 0; i < int(plan.tasks.size()); ++i) run_task(&plan, i);
  } else {
    pool().run(int(plan.tasks.size()), run_task, &plan);
  }
  for (const Task& t : plan.tasks)
    if (t.parts > 1 && t.part == 0) merge(plan, t);
}

int threads() {
  return pool().threads();
}

void parallel(int tasks, void (*task)(const void* ctx, int index), const void* ctx) {
  pool().run(tasks, task, ctx);
}

void use_isa(Isa isa, bool integer_scores) {
  active_isa.store(std::min(isa, mlxchat_simd::isa));
  integer_keys.store(integer_scores);
}

}  // namespace mlxchat_attention
