/*
 * mlxchat._quantized: MLX primitives for affine-quantized matmuls on the CPU (see mlxchat.quantized).
 *
 * MLX's own CPU kernel for quantized_matmul runs on one thread and reads packed weights at 1-2 GB/s, so a
 * quantized checkpoint decodes slower than float32 there. These primitives compute the same product with
 * SIMD kernels (qmatmul_kernels.h) split over all cores: for a few rows of x (decode, small batches) the
 * packed weights are read once, at close to memory bandwidth; for many rows (prefill) each block of weight
 * rows is dequantized to float32 and handed to the process's cblas_sgemm (OpenBLAS when mlxchat loaded it).
 *
 * They are ordinary nodes of MLX's lazy graph (evaluated on the CPU stream, usable under mx.compile, with a
 * gradient for x), built only on Linux and used by mlxchat only on the CPU device; everything else stays
 * on MLX's own ops.
 */
#include <dlfcn.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/version.h"
#include "dispatch.h"
#include "pool.h"
#include "qmatmul_amx.h"
#include "qmatmul_int8.h"
#include "qmatmul_kernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using mlxchat_dispatch::dispatch_held;
using mlxchat_q::Isa;
using mlxchat_q::Panel;

namespace {

// -- settings -----------------------------------------------------------------------------------------

Isa best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return mlxchat_q::amx_usable() ? Isa::amx : Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::scalar;
}

const Isa detected_isa = best_isa();
std::atomic<Isa> active_isa{detected_isa};

/* Up to this many rows of x share one pass over the packed weights; more go through sgemm (measured
 * crossover on a 2-core AVX-512 machine: between 48 and 64 rows at 4 bits; on a 2-core AVX2 EPYC, between
 * 48 and 128 rows by product, at 4 and 8 bits). */
std::atomic<int> small_rows{48};

/* Products asked to (int8=True) round x to 8-bit integers (qmatmul_int8.h) where they have at least this many rows
 * of x and the CPU has an integer kernel for them (AVX-512 VNNI or AVX2); fewer rows keep float32 x (measured:
 * batched decoding of 4-bit Qwen3-0.6B shapes gains from 8-bit x from 4 streams, loses at 2). */
std::atomic<int> int8_rows{4};

const char* isa_name(Isa isa) {
  return isa == Isa::amx ? "amx" : isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "scalar";
}

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::atoi(value) : fallback;
}

/* With AMX, products of at least this many rows of x go through tiles (qmatmul_amx.h); fewer stay on AVX-512,
 * which reads two rows' weights once as fast as tiles read them for three (measured on Qwen3-0.6B's products). */
std::atomic<int> amx_rows{env_int("MLXCHAT_QUANT_AMX_ROWS", 3)};

// -- the thread pool (pool.h) ----------------------------------------------------------------------------

int default_threads() {
  cpu_set_t set;
  const int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  return std::max(1, env_int("MLXCHAT_QUANT_THREADS", cores));
}

mlxchat_pool::Pool& pool() {
  static mlxchat_pool::Pool instance(default_threads(),
                                     std::chrono::microseconds(env_int("MLXCHAT_QUANT_SPIN_US", 50)));
  return instance;
}

// -- the BLAS for many rows -----------------------------------------------------------------------------

using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                          int);

int tile_floats() {
  static const int floats = env_int("MLXCHAT_QUANT_TILE", 1 << 20);
  return floats;
}

/* The cblas_sgemm MLX itself resolves to (mlxchat's route or OpenBLAS when loaded globally); may be null. */
sgemm_fn process_sgemm() {
  static const sgemm_fn fn = reinterpret_cast<sgemm_fn>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return fn;
}

// -- computing one product ------------------------------------------------------------------------------

/* How a segment is computed: the few-rows kernels, dequantized tiles and sgemm, AMX tiles, or 8-bit x. */
enum class Route { rows, gemm, amx, int8 };

/* Rows of x that go through one weight matrix (one expert of a gathered product, or the whole of a plain one). */
struct Segment {
  int row0, rows;  // rows [row0, row0 + rows) of the ordered x
  const uint8_t* w;
  const float* scales;
  const float* biases;
  Route route = Route::rows;  // set by route_segments
};

struct Product {
  int K, N, G, gs, bits;
  Isa isa;
  bool int8;  // x rounded to 8 bits where the rows are many (see route_segments)
  float* out;
  std::vector<Segment> segments;
  std::vector<long> out_at;    // where each ordered row's output starts in out
  std::vector<float> x, xsum;  // the ordered rows of x, prepared for the ISA's kernels (see prepare_x)
};

/* Each segment's route, the thresholds read once (a setter on another thread cannot leave a segment on none). */
void route_segments(Product& p) {
  const int small = small_rows.load(), amx = amx_rows.load(), int8 = int8_rows.load();
  const bool sgemm = process_sgemm() != nullptr;
  const bool integers = p.int8 && mlxchat_q::int8_kernel(p.isa) != mlxchat_q::Int8Kernel::none;
  for (Segment& s : p.segments)
    s.route = integers && s.rows >= int8           ? Route::int8
              : p.isa == Isa::amx && s.rows >= amx ? Route::amx
              : sgemm && s.rows > small            ? Route::gemm
                                                   : Route::rows;
}

struct Chunk {
  int segment, n0, n1;
};

struct SmallJob {
  const Product* product;
  std::vector<Chunk> chunks;
};

Panel panel_of(const Product& p, const Segment& s);

void run_chunk(const void* ctx, int index) {
  const auto& job = *static_cast<const SmallJob*>(ctx);
  const Product& p = *job.product;
  const Chunk& c = job.chunks[index];
  mlxchat_q::rows(panel_of(p, p.segments[c.segment]), p.isa, c.n0, c.n1);
}

/* (x and xsum stay empty when every segment rounds x to 8 bits: no prepared rows then.) */
Panel panel_of(const Product& p, const Segment& s) {
  const bool prepared = !p.x.empty();
  return Panel{prepared ? p.x.data() + (size_t)s.row0 * p.K : nullptr,
               prepared ? p.xsum.data() + (size_t)s.row0 * p.G : nullptr, p.out_at.data() + s.row0, s.rows, p.K, p.G,
               p.gs, p.bits, s.w, s.scales, s.biases, p.out};
}

struct DequantizeJob {
  Panel panel;
  Isa isa;
  int n0, n1, step;
  float* tile;
};

void run_dequantize(const void* ctx, int index) {
  const auto& job = *static_cast<const DequantizeJob*>(ctx);
  const int n0 = job.n0 + index * job.step, n1 = std::min(n0 + job.step, job.n1);
  mlxchat_q::dequantize_rows(job.panel, job.isa, n0, n1, job.tile + (size_t)(n0 - job.n0) * job.panel.K);
}

/*
 * Many rows of x: dequantize a tile of weight rows (4 MiB of float32 by default: large enough for sgemm to
 * run near its peak, small enough to stay in cache; all threads), then sgemm it against the rows of x (the
 * BLAS's threads). x and the tile share the ISA's order.
 */
void gemm_segment(const Product& p, const Segment& s) {
  const int tile_rows = std::min(p.N, std::max(32, tile_floats() / p.K));
  std::vector<float> tile((size_t)tile_rows * p.K);
  bool direct = true;  // the segment's output rows are consecutive (always so for a plain product)
  for (int r = 1; r < s.rows && direct; ++r) direct = p.out_at[s.row0 + r] == p.out_at[s.row0] + long(r) * p.N;
  std::vector<float> staged(direct ? 0 : (size_t)s.rows * p.N);
  float* out = direct ? p.out + p.out_at[s.row0] : staged.data();
  const Panel panel = panel_of(p, s);
  const int pieces = 2 * pool().threads();
  for (int n0 = 0; n0 < p.N; n0 += tile_rows) {
    const int n1 = std::min(n0 + tile_rows, p.N), step = (n1 - n0 + pieces - 1) / pieces;
    const DequantizeJob job{panel, p.isa, n0, n1, step, tile.data()};
    pool().run((n1 - n0 + step - 1) / step, run_dequantize, &job, false);
    process_sgemm()(101, 111, 112, s.rows, n1 - n0, p.K, 1.0f, panel.x, p.K, tile.data(), p.K, 0.0f, out + n0, p.N);
  }
  if (!direct)
    for (int r = 0; r < s.rows; ++r)
      std::memcpy(p.out + p.out_at[s.row0 + r], staged.data() + (size_t)r * p.N, sizeof(float) * p.N);
}

// -- AMX: segments of several rows through tiles ------------------------------------------------------

/* A 64-byte line: buffers of them are aligned for AVX-512 stores (allocated without zeroing: all is written). */
struct alignas(64) Line {
  uint8_t bytes[64];
};

struct AmxJob {
  struct Task {
    int panel, n0, n1, b0, b1;
  };
  const float* const* rows;                  // each ordered row of x
  std::vector<mlxchat_q::AmxPanel> panels;  // one per segment on AMX
  std::vector<int> first_block, first_row;   // where each panel's blocks of x and rows start
  uint32_t* tiles;                            // [blocks][K / 32] tiles of x
  float* group_sums;                          // [blocks][G][16]
  std::vector<Task> tasks;
};

void run_amx_prepare(const void* ctx, int block) {
  const auto& job = *static_cast<const AmxJob*>(ctx);
  const int i = int(std::upper_bound(job.first_block.begin(), job.first_block.end(), block) - job.first_block.begin()) - 1;
  const auto& p = job.panels[i];
  const int m0 = (block - job.first_block[i]) * mlxchat_q::AMX_ROWS;
  mlxchat_q::prepare_x_block(job.rows + job.first_row[i] + m0, std::min(mlxchat_q::AMX_ROWS, p.M - m0), p.K, p.gs,
                             p.bits, job.tiles + (size_t)block * (p.K / mlxchat_q::AMX_K) * mlxchat_q::AMX_TILE,
                             job.group_sums + (size_t)block * p.G * 16);
}

void run_amx_task(const void* ctx, int index) {
  const auto& job = *static_cast<const AmxJob*>(ctx);
  const AmxJob::Task& t = job.tasks[index];
  mlxchat_q::run_amx(job.panels[t.panel], t.n0, t.n1, t.b0, t.b1);
}

/*
 * The segments on AMX: their rows of x, each segment's in whole blocks of AMX_ROWS, are prepared as tiles
 * (in parallel when there are many), then tasks of (segment, up to AMX_BLOCKS blocks, a range of weight rows
 * in multiples of 32) run on the pool.
 */
void compute_amx(const Product& p, const float* const* rows) {
  const int chunks = p.K / mlxchat_q::AMX_K;
  AmxJob job;
  job.rows = rows;
  int blocks = 0;
  for (const Segment& s : p.segments)
    if (s.route == Route::amx) {
      job.first_block.push_back(blocks);
      job.first_row.push_back(s.row0);
      blocks += mlxchat_q::amx_blocks(s.rows);
    }
  if (blocks == 0) return;
  const std::unique_ptr<Line[]> tiles(new Line[(size_t)blocks * chunks * mlxchat_q::AMX_TILE * 4 / 64]);
  std::vector<float> group_sums((size_t)blocks * p.G * 16);
  job.tiles = reinterpret_cast<uint32_t*>(tiles.get());
  job.group_sums = group_sums.data();
  for (const Segment& s : p.segments)
    if (s.route == Route::amx) {
      const int b = job.first_block[job.panels.size()];
      job.panels.push_back({job.tiles + (size_t)b * chunks * mlxchat_q::AMX_TILE, job.group_sums + (size_t)b * p.G * 16,
                            p.out_at.data() + s.row0, s.rows, p.K, p.G, p.gs, p.bits, s.w, s.scales, s.biases, p.out});
    }
  if (blocks > 4)
    pool().run(blocks, run_amx_prepare, &job);
  else
    for (int b = 0; b < blocks; ++b) run_amx_prepare(&job, b);

  const bool small_weight = (size_t)p.N * p.K * p.bits / 8 < (1u << 16);  // not worth waking other threads
  const int passes = (p.N + 31) / 32, pieces = small_weight ? 1 : std::min(4 * pool().threads(), passes);
  const int step = (passes + pieces - 1) / pieces * 32;
  for (int i = 0; i < int(job.panels.size()); ++i) {
    const int panel_blocks = mlxchat_q::amx_blocks(job.panels[i].M);
    for (int b0 = 0; b0 < panel_blocks; b0 += mlxchat_q::AMX_BLOCKS)
      for (int n0 = 0; n0 < p.N; n0 += step)
        job.tasks.push_back({i, n0, std::min(n0 + step, p.N), b0, std::min(b0 + mlxchat_q::AMX_BLOCKS, panel_blocks)});
  }
  pool().run(int(job.tasks.size()), run_amx_task, &job);
}

// -- 8-bit x: segments of many rows with x rounded to integers ---------------------------------------

struct Int8Job {
  struct Task {
    int segment, first, count;  // rounding: rows [first, first + count) of segment; product: columns
  };
  const Product* product;
  const float* const* rows;
  std::vector<int> segments;                 // indices into product->segments
  mutable std::vector<mlxchat_q::Int8Rows> x;  // each segment's rows of x, rounded (by the rounding tasks)
  std::vector<Task> rounding, tasks;
};

void run_int8_round(const void* ctx, int index) {
  const auto& job = *static_cast<const Int8Job*>(ctx);
  const Product& p = *job.product;
  const Int8Job::Task& t = job.rounding[index];
  const Segment& s = p.segments[job.segments[t.segment]];
  mlxchat_q::round_rows(job.rows + s.row0, t.first, t.count, p.K, p.gs, p.bits, mlxchat_q::int8_kernel(p.isa),
                        job.x[t.segment]);
}

void run_int8_task(const void* ctx, int index) {
  const auto& job = *static_cast<const Int8Job*>(ctx);
  const Product& p = *job.product;
  const Int8Job::Task& t = job.tasks[index];
  mlxchat_q::rows_int8(panel_of(p, p.segments[job.segments[t.segment]]), p.isa, mlxchat_q::int8_kernel(p.isa),
                       job.x[t.segment], t.first, t.first + t.count);
}

/* The segments with 8-bit x: their rows rounded (16 rows a task), then tasks of (segment, weight rows in
 * multiples of 16) on the pool. */
void compute_int8(const Product& p, const float* const* rows) {
  Int8Job job;
  job.product = &p;
  job.rows = rows;
  for (int i = 0; i < int(p.segments.size()); ++i)
    if (p.segments[i].route == Route::int8) job.segments.push_back(i);
  if (job.segments.empty() || p.N == 0) return;
  job.x.resize(job.segments.size());
  const int pieces = std::min(4 * pool().threads(), (p.N + 15) / 16);
  const int step = ((p.N + pieces - 1) / pieces + 15) / 16 * 16;
  for (int i = 0; i < int(job.segments.size()); ++i) {
    const Segment& s = p.segments[job.segments[i]];
    mlxchat_q::size_rows(s.rows, p.K, p.gs, job.x[i]);
    for (int m = 0; m < s.rows; m += 16) job.rounding.push_back({i, m, std::min(16, s.rows - m)});
    for (int n0 = 0; n0 < p.N; n0 += step) job.tasks.push_back({i, n0, std::min(step, p.N - n0)});
  }
  pool().run(int(job.rounding.size()), run_int8_round, &job);
  pool().run(int(job.tasks.size()), run_int8_task, &job);
}

/* Copies any float32 array into contiguous row-major order. */
void copy_contiguous(const mx::array& a, float* out) {
  const float* src = a.data<float>();
  std::vector<int> index(a.ndim(), 0);
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t offset = 0;
    for (size_t d = 0; d < a.ndim(); ++d) offset += int64_t(index[d]) * a.strides()[d];
    out[i] = src[offset];
    for (int d = int(a.ndim()) - 1; d >= 0; --d) {
      if (++index[d] < a.shape(d)) break;
      index[d] = 0;
    }
  }
}

/*
 * Computes the product over the ordered rows: ordered row i is row source[i] of x (x's last dimension being
 * K) and its output goes to row target[i] of out; the segments say which weights each run of ordered rows uses.
 */
void compute(Product& p, const mx::array& x, const std::vector<int>& source, const std::vector<int>& target) {
  const int count = int(source.size());
  std::vector<float> copy;
  const float* data = x.data<float>();
  if (!x.flags().row_contiguous) {
    copy.resize(x.size());
    copy_contiguous(x, copy.data());
    data = copy.data();
  }
  std::vector<const float*> rows(count);
  p.out_at.resize(count);
  for (int i = 0; i < count; ++i) {
    rows[i] = data + (size_t)source[i] * p.K;
    p.out_at[i] = long(target[i]) * p.N;
  }
  route_segments(p);
  SmallJob job{&p, {}};
  const int threads = pool().threads();
  const bool small_weight = (size_t)p.N * p.K * p.bits / 8 < (1u << 16);  // not worth waking other threads
  for (int i = 0; i < int(p.segments.size()); ++i) {
    if (p.segments[i].route != Route::rows) continue;
    const int pieces = small_weight ? 1 : std::min(4 * threads, std::max(1, p.N / 16));
    const int step = ((p.N + pieces - 1) / pieces + 3) / 4 * 4;  // whole tiles of 4 weight rows
    for (int n0 = 0; n0 < p.N; n0 += step) job.chunks.push_back({i, n0, std::min(n0 + step, p.N)});
  }
  const bool others = !job.chunks.empty() || std::any_of(p.segments.begin(), p.segments.end(), [&](const Segment& s) {
    return s.route == Route::gemm;
  });
  if (others) {  // x in the order the ISA's AVX kernels read it (all rows: few when decoding)
    p.x.resize((size_t)count * p.K);
    p.xsum.resize((size_t)count * p.G);
    mlxchat_q::prepare_x(rows.data(), count, p.K, p.gs, p.bits, p.isa, p.x.data(), p.xsum.data());
  }
  if (!job.chunks.empty()) pool().run(int(job.chunks.size()), run_chunk, &job);
  compute_int8(p, rows.data());
  compute_amx(p, rows.data());
  for (const Segment& s : p.segments)
    if (s.route == Route::gemm) gemm_segment(p, s);
}

Product product_for(const mx::array& x, int n, int gs, int bits, bool int8, mx::array& out) {
  Product p;
  p.K = x.shape(-1);
  p.N = n;
  p.gs = gs;
  p.bits = bits;
  p.G = p.K / gs;
  p.isa = active_isa.load();
  p.int8 = int8;
  p.out = out.data<float>();
  return p;
}

class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, bool int8)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_held(stream(), inputs, out, [gs = group_size_, bits = bits_, int8 = int8_](
                                             const std::vector<mx::array>& in, mx::array& out) {
      const mx::array &x = in[0], &w = in[1], &scales = in[2], &biases = in[3];
      Product p = product_for(x, w.shape(0), gs, bits, int8, out);
      const int rows = int(x.size() / p.K);
      std::vector<int> order(rows);
      for (int i = 0; i < rows; ++i) order[i] = i;
      p.segments.push_back({0, rows, w.data<uint8_t>(), scales.data<float>(), biases.data<float>()});
      compute(p, x, order, order);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat's quantized matmul runs on the CPU only; use mx.quantized_matmul on a GPU");
  }

  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<mx::array> grads;
    for (int arg : argnums) {
      if (arg != 0) throw std::invalid_argument("mlxchat quantized matmul: only x has a gradient");
      // The cotangent times the weight dequantized (a layer at a time, freed after) on BLAS: MLX's CPU
      // product with a quantized weight untransposed runs on one thread (QLoRA's backward spent minutes a
      // step there).
      const auto weight = mx::dequantize(primals[1], primals[2], primals[3], group_size_, bits_, "affine",
                                         std::nullopt, cotangents[0].dtype(), stream());
      grads.push_back(mx::matmul(cotangents[0], weight, stream()));
    }
    return grads;
  }

  const char* name() const override {
    return "MlxchatQuantizedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && int8_ == o.int8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_size_, bits_;
  bool int8_;
};

/* Offset of the i-th element (row-major order) of a possibly strided array. */
int64_t element_offset(const mx::array& a, int64_t i) {
  if (a.flags().row_contiguous) return i;
  int64_t offset = 0;
  for (int d = int(a.ndim()) - 1; d >= 0; --d) {
    offset += (i % a.shape(d)) * a.strides()[d];
    i /= a.shape(d);
  }
  return offset;
}

/* The element of an array of shape `from` (broadcast against `to`, right-aligned) that element t of `to` reads. */
int64_t broadcast_index(int64_t t, const mx::Shape& to, const mx::Shape& from) {
  int64_t index = 0, stride = 1;
  for (int d = int(to.size()) - 1, f = int(from.size()) - 1; d >= 0; --d, --f) {
    const int64_t coordinate = t % to[d];
    t /= to[d];
    if (f >= 0) {
      if (from[f] != 1) index += coordinate * stride;
      stride *= from[f];
    }
  }
  return index;
}

int64_t index_at(const mx::array& indices, int64_t i) {
  const int64_t at = element_offset(indices, i);
  return indices.dtype() == mx::uint32 ? int64_t(indices.data<uint32_t>()[at]) : int64_t(indices.data<int32_t>()[at]);
}

/*
 * Rows of a quantized matrix as float32: out[i] = dequantize(w[indices[i]]) (a quantized embedding's lookup). MLX
 * runs it as three gathers and a dequantize that its CPU backend spells as some fifty operations (shifts, masks,
 * broadcasts) for one token; here it is one node. An index out of range gives a row of NaNs (token ids are checked
 * before they reach a model: this only keeps a bad one from reading outside the matrix).
 */
class DequantizeRows : public mx::UnaryPrimitive {
 public:
  DequantizeRows(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_held(stream(), inputs, out, [gs = group_size_, bits = bits_](const std::vector<mx::array>& in,
                                                                           mx::array& out) {
      const mx::array &w = in[0], &scales = in[1], &biases = in[2], &indices = in[3];
      const int64_t rows = w.shape(0), G = scales.shape(1), K = G * gs, row_bytes = K * bits / 8;
      const unsigned mask = (1u << bits) - 1;
      const uint8_t* packed = w.data<uint8_t>();
      float* y = out.data<float>();
      for (int64_t i = 0; i < int64_t(indices.size()); ++i, y += K) {
        const int64_t row = index_at(indices, i);
        if (row < 0 || row >= rows) {
          std::fill(y, y + K, std::numeric_limits<float>::quiet_NaN());
          continue;
        }
        const uint8_t* src = packed + row * row_bytes;
        const float* s = scales.data<float>() + row * G;
        const float* b = biases.data<float>() + row * G;
        for (int64_t k = 0; k < K; ++k) {  // value k in bits [k * bits, (k + 1) * bits) of the row, little-endian
          const int64_t bit = k * bits, byte = bit >> 3;
          const unsigned word = src[byte] | (bit % 8 + bits > 8 ? unsigned(src[byte + 1]) << 8 : 0u);
          const float scaled = s[k / gs] * float((word >> (bit % 8)) & mask);
          y[k] = scaled + b[k / gs];
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat's quantized rows run on the CPU only; use mx.dequantize on a GPU");
  }

  /* The scales' and biases' gradients, of the same lookup written with MLX's ops. */
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    const mx::array w = primals[0], indices = primals[3];
    const auto lookup = [w, indices, gs = group_size_, bits = bits_, s = stream()](const std::vector<mx::array>& sb) {
      return std::vector<mx::array>{mx::dequantize(mx::take(w, indices, 0, s), mx::take(sb[0], indices, 0, s),
                                                   mx::take(sb[1], indices, 0, s), gs, bits, "affine", std::nullopt,
                                                   mx::float32, s)};
    };
    const auto grads = mx::vjp(lookup, {primals[1], primals[2]}, cotangents).second;
    std::vector<mx::array> out;
    for (int arg : argnums) {
      if (arg != 1 && arg != 2) throw std::invalid_argument("mlxchat quantized rows: only scales and biases have a gradient");
      out.push_back(grads[arg - 1]);
    }
    return out;
  }

  const char* name() const override {
    return "MlxchatDequantizeRows";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DequantizeRows&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[3].shape();
    shape.push_back(inputs[1].shape(1) * group_size_);
    return {shape};
  }

 private:
  int group_size_, bits_;
};

/* x [..., M, K] against indices [...] and w [E, N, K']: [broadcast(x's batch, indices), M, N]. */
mx::Shape gathered_shape(const mx::array& x, const mx::array& w, const mx::array& indices) {
  auto shape = mx::broadcast_shapes(mx::Shape(x.shape().begin(), x.shape().end() - 2), indices.shape());
  shape.push_back(x.shape(-2));
  shape.push_back(w.shape(1));
  return shape;
}

/* The rows of a gathered product ordered by expert: ordered row i is row source[i] of x (as [rows, K]) and goes
 * to row target[i] of out; expert e's rows are [start[e], start[e + 1]), rows with an index out of range last. */
struct ExpertOrder {
  std::vector<int> source, target, start;
};

/* x [..., M, K] against indices [...] (out's batch shape is both broadcast, see gathered_shape): a counting sort of
 * the rows by expert, so that each expert's weights are read once. */
ExpertOrder order_by_expert(const mx::array& x, const mx::array& indices, const mx::array& out, int experts) {
  const int per_index = x.shape(-2);
  const mx::Shape batch(out.shape().begin(), out.shape().end() - 2);
  const mx::Shape x_batch(x.shape().begin(), x.shape().end() - 2);
  const int64_t count = int64_t(out.size() / ((size_t)per_index * out.shape(-1)));
  std::vector<int> expert(count), x_row(count);
  for (int64_t t = 0; t < count; ++t) {
    const int64_t e = index_at(indices, broadcast_index(t, batch, indices.shape()));
    expert[t] = e >= 0 && e < experts ? int(e) : experts;
    x_row[t] = int(broadcast_index(t, batch, x_batch));
  }
  ExpertOrder order;
  order.start.assign(experts + 2, 0);
  for (int e : expert) order.start[e + 1] += per_index;
  for (int e = 0; e <= experts; ++e) order.start[e + 1] += order.start[e];
  order.source.resize(order.start[experts + 1]);
  order.target.resize(order.source.size());
  std::vector<int> fill(order.start.begin(), order.start.end() - 1);
  for (int64_t t = 0; t < count; ++t)
    for (int m = 0; m < per_index; ++m) {
      const int at = fill[expert[t]]++;
      order.source[at] = x_row[t] * per_index + m;
      order.target[at] = int(t) * per_index + m;
    }
  return order;
}

/* Whether rows[i] == rows[0] + i for the n rows from `at`. */
bool consecutive(const std::vector<int>& rows, int at, int n) {
  for (int i = 1; i < n; ++i)
    if (rows[at + i] != rows[at] + i) return false;
  return true;
}

/*
 * x @ w[indices].T for float32 experts w [E, N, K] (mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices)):
 * MLX's CPU gather_mm multiplies each row alone (one matrix-vector product per row and expert, reading the
 * expert's weights each time); here the rows are grouped by expert and each expert's rows are one sgemm.
 */
class GatherMatmul : public mx::UnaryPrimitive {
 public:
  explicit GatherMatmul(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_held(stream(), inputs, out, [](const std::vector<mx::array>& in, mx::array& out) {
      const mx::array &x = in[0], &w = in[1], &indices = in[2];
      const int K = x.shape(-1), N = w.shape(1), experts = w.shape(0);
      const ExpertOrder order = order_by_expert(x, indices, out, experts);
      std::vector<float> copy;
      const float* data = x.data<float>();
      if (!x.flags().row_contiguous) {
        copy.resize(x.size());
        copy_contiguous(x, copy.data());
        data = copy.data();
      }
      float* y = out.data<float>();
      std::vector<float> rows, staged;
      for (int e = 0; e < experts; ++e) {
        const int at = order.start[e], n = order.start[e + 1] - at;
        if (n == 0) continue;
        const float* a = data + (size_t)order.source[at] * K;
        if (!consecutive(order.source, at, n)) {
          rows.resize((size_t)n * K);
          for (int i = 0; i < n; ++i)
            std::memcpy(rows.data() + (size_t)i * K, data + (size_t)order.source[at + i] * K, sizeof(float) * K);
          a = rows.data();
        }
        const bool direct = consecutive(order.target, at, n);
        if (!direct) staged.resize((size_t)n * N);
        float* c = direct ? y + (size_t)order.target[at] * N : staged.data();
        process_sgemm()(101, 111, 112, n, N, K, 1.0f, a, K, w.data<float>() + (size_t)e * N * K, K, 0.0f, c, N);
        if (!direct)
          for (int i = 0; i < n; ++i)
            std::memcpy(y + (size_t)order.target[at + i] * N, staged.data() + (size_t)i * N, sizeof(float) * N);
      }
      for (int i = order.start[experts]; i < order.start[experts + 1]; ++i)
        std::fill(y + (size_t)order.target[i] * N, y + (size_t)(order.target[i] + 1) * N, 0.0f);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat's gathered matmul runs on the CPU only; use mx.gather_mm on a GPU");
  }

  /* MLX's gather_mm's gradients (for x and w), of the same product written with it. */
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    const mx::array indices = primals[2];
    const auto product = [indices, s = stream()](const std::vector<mx::array>& xw) {
      return std::vector<mx::array>{
          mx::gather_mm(xw[0], mx::swapaxes(xw[1], -1, -2, s), std::nullopt, indices, false, s)};
    };
    const auto grads = mx::vjp(product, {primals[0], primals[1]}, cotangents).second;
    std::vector<mx::array> out;
    for (int arg : argnums) {
      if (arg > 1) throw std::invalid_argument("mlxchat gathered matmul: indices have no gradient");
      out.push_back(grads[arg]);
    }
    return out;
  }

  const char* name() const override {
    return "MlxchatGatherMatmul";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {gathered_shape(inputs[0], inputs[1], inputs[2])};
  }
};

class GatherQuantizedMatmul : public mx::UnaryPrimitive {
 public:
  GatherQuantizedMatmul(mx::Stream stream, int group_size, int bits, bool int8)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch_held(stream(), inputs, out, [gs = group_size_, bits = bits_, int8 = int8_](
                                             const std::vector<mx::array>& in, mx::array& out) {
      const mx::array &x = in[0], &w = in[1], &scales = in[2], &biases = in[3], &indices = in[4];
      Product p = product_for(x, w.shape(1), gs, bits, int8, out);
      const int experts = w.shape(0);
      const ExpertOrder order = order_by_expert(x, indices, out, experts);
      const std::vector<int>& start = order.start;
      const size_t w_stride = (size_t)p.N * p.K * bits / 8, s_stride = (size_t)p.N * p.G;
      for (int e = 0; e < experts; ++e)
        if (start[e + 1] > start[e])
          p.segments.push_back({start[e], start[e + 1] - start[e], w.data<uint8_t>() + e * w_stride,
                                scales.data<float>() + e * s_stride, biases.data<float>() + e * s_stride});
      compute(p, x, order.source, order.target);
      for (int i = start[experts]; i < start[experts + 1]; ++i)
        std::fill(p.out + p.out_at[i], p.out + p.out_at[i] + p.N, 0.0f);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("mlxchat's gathered quantized matmul runs on the CPU only; use mx.gather_qmm on a GPU");
  }

  // x's gradient (adapters on a quantized mixture of experts train through the experts): the cotangent times each
  // row's expert weight, untransposed, summed back over the experts x was broadcast to.
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<mx::array> grads;
    for (int arg : argnums) {
      if (arg != 0) throw std::invalid_argument("mlxchat gathered quantized matmul: only x has a gradient");
      const auto& x = primals[0];
      auto grad = mx::gather_qmm(cotangents[0], primals[1], primals[2], primals[3], std::nullopt, primals[4], false,
                                 group_size_, bits_, "affine", std::nullopt, false, stream());
      const int extra = int(grad.ndim()) - int(x.ndim());
      std::vector<int> axes;
      for (int i = 0; i < int(grad.ndim()); ++i)
        if (i < extra || (x.shape(i - extra) == 1 && grad.shape(i) != 1)) axes.push_back(i);
      if (!axes.empty()) grad = mx::sum(grad, axes, true, stream());
      grads.push_back(mx::reshape(grad, x.shape(), stream()));
    }
    return grads;
  }

  const char* name() const override {
    return "MlxchatGatherQuantizedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GatherQuantizedMatmul&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && int8_ == o.int8_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {gathered_shape(inputs[0], inputs[1], inputs[4])};
  }

 private:
  int group_size_, bits_;
  bool int8_;
};

// -- the operations -------------------------------------------------------------------------------------

/* A packed matrix (w [..., N, K*bits/32] uint32, its scales and biases [..., N, K/group_size] float32) of depth K. */
void check_packed(const mx::array& w, const mx::array& scales, const mx::array& biases, int64_t K, int group_size,
                  int bits) {
  if (bits < 2 || bits > 8 || bits == 7) throw std::invalid_argument("bits must be 2, 3, 4, 5, 6 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("group_size must be 32, 64 or 128");
  if (scales.dtype() != mx::float32 || biases.dtype() != mx::float32)
    throw std::invalid_argument("scales and biases must be float32");
  if (w.dtype() != mx::uint32) throw std::invalid_argument("w must be uint32 (packed)");
  if (w.ndim() < 1 || K % group_size != 0 || int64_t(w.shape(-1)) * 32 != K * bits)
    throw std::invalid_argument("the depth does not match the packed weight");
  if (scales.shape() != biases.shape() || scales.ndim() != w.ndim() || scales.shape(-1) != K / group_size ||
      scales.shape(-2) != w.shape(-2))
    throw std::invalid_argument("scales and biases do not match the packed weight");
}

void check_common(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                  int group_size, int bits) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("x, scales and biases must be float32");
  if (x.ndim() < 1) throw std::invalid_argument("x must have at least one dimension");
  check_packed(w, scales, biases, x.shape(-1), group_size, bits);
}

mx::Stream cpu_stream() {
  return mx::default_stream(mx::Device::cpu);
}

/* The kernels read weights, scales and biases in place: an evaluated contiguous array (a model's parameter)
 * as it is, anything else through MLX's contiguous (a no-op at evaluation when it already is). */
mx::array row_contiguous(const mx::array& a) {
  return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, cpu_stream());
}

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, bool int8) {
  if (w.ndim() != 2) throw std::invalid_argument("w must be 2-dimensional");
  check_common(x, w, scales, biases, group_size, bits);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<QuantizedMatmul>(cpu_stream(), group_size, bits, int8),
                   {x, row_contiguous(w), row_contiguous(scales), row_contiguous(biases)});
}

/* x [..., M, K] times expert indices[...] of float32 w [E, N, K]: out [..., M, N] (batch shapes broadcast). */
mx::array gather_matmul(const mx::array& x, const mx::array& w, const mx::array& indices) {
  if (w.ndim() != 3) throw std::invalid_argument("w must be 3-dimensional [experts, out, in]");
  if (x.ndim() < 2) throw std::invalid_argument("x must have at least two dimensions");
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) throw std::invalid_argument("x and w must be float32");
  if (indices.dtype() != mx::uint32 && indices.dtype() != mx::int32)
    throw std::invalid_argument("indices must be int32 or uint32");
  if (x.shape(-1) != w.shape(-1)) throw std::invalid_argument("x's last dimension does not match w's inputs");
  if (process_sgemm() == nullptr) throw std::runtime_error("no cblas_sgemm in this process");
  return mx::array(gathered_shape(x, w, indices), mx::float32, std::make_shared<GatherMatmul>(cpu_stream()),
                   {x, row_contiguous(w), indices});
}

/* x [..., M, K] times expert indices[...] of w [E, N, K*bits/32]: out [..., M, N] (batch shapes broadcast). */
mx::array gather_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                  const mx::array& biases, const mx::array& indices, int group_size, int bits,
                                  bool int8) {
  if (w.ndim() != 3) throw std::invalid_argument("w must be 3-dimensional [experts, out, in]");
  if (x.ndim() < 2) throw std::invalid_argument("x must have at least two dimensions");
  if (indices.dtype() != mx::uint32 && indices.dtype() != mx::int32)
    throw std::invalid_argument("indices must be int32 or uint32");
  check_common(x, w, scales, biases, group_size, bits);
  return mx::array(gathered_shape(x, w, indices), mx::float32,
                   std::make_shared<GatherQuantizedMatmul>(cpu_stream(), group_size, bits, int8),
                   {x, row_contiguous(w), row_contiguous(scales), row_contiguous(biases), indices});
}

/* Rows indices[...] of w [rows, K*bits/32] dequantized: [..., K] float32. */
mx::array dequantize_rows(const mx::array& w, const mx::array& scales, const mx::array& biases,
                          const mx::array& indices, int group_size, int bits) {
  if (w.ndim() != 2) throw std::invalid_argument("w must be 2-dimensional");
  if (indices.dtype() != mx::uint32 && indices.dtype() != mx::int32)
    throw std::invalid_argument("indices must be int32 or uint32");
  if (bits < 2 || int64_t(w.shape(1)) * 32 % bits != 0) throw std::invalid_argument("w does not hold whole values");
  const int K = int(int64_t(w.shape(1)) * 32 / bits);
  check_packed(w, scales, biases, K, group_size, bits);
  auto shape = indices.shape();
  shape.push_back(K);
  return mx::array(shape, mx::float32, std::make_shared<DequantizeRows>(cpu_stream(), group_size, bits),
                   {row_contiguous(w), row_contiguous(scales), row_contiguous(biases), indices});
}

}  // namespace

NB_MODULE(_quantized, m) {
  m.doc() = "Affine-quantized matmuls on the CPU as MLX primitives (see mlxchat.quantized).";
  m.def("quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("int8") = false,
        "x @ dequantize(w, scales, biases).T for float32 x on the CPU stream (int8: x rounded to 8 bits where rows "
        "are many and the CPU has AVX-512 VNNI or AVX2).");
  m.def("gather_quantized_matmul", &gather_quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("indices"), nb::arg("group_size"), nb::arg("bits"), nb::arg("int8") = false,
        "x @ dequantize(w[indices]).T, one expert per index (mx.gather_qmm with rhs_indices, transpose=True).");
  m.def("gather_matmul", &gather_matmul, nb::arg("x"), nb::arg("w"), nb::arg("indices"),
        "x @ w[indices].T for float32 experts w [E, out, in], rows grouped by expert (mx.gather_mm with "
        "rhs_indices and w transposed).");
  m.def("dequantize_rows", &dequantize_rows, nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("indices"), nb::arg("group_size"), nb::arg("bits"),
        "dequantize(w[indices], scales[indices], biases[indices]) in one node (a quantized embedding's lookup).");
  m.def("mlx_version", [] {
    return std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
           std::to_string(MLX_VERSION_PATCH);
  });
  m.def("isa", [] { return std::string(isa_name(active_isa.load())); });
  m.def("detected_isa", [] { return std::string(isa_name(detected_isa)); });
  m.def("set_isa", [](const std::string& name) {
    const Isa wanted = name == "amx"      ? Isa::amx
                       : name == "avx512" ? Isa::avx512
                       : name == "avx2"   ? Isa::avx2
                       : name == "scalar" ? Isa::scalar
                                          : Isa(-1);
    if (int(wanted) < 0 || int(wanted) > int(detected_isa))
      throw std::invalid_argument("ISA not available here: " + name + " (best: " + isa_name(detected_isa) + ")");
    active_isa.store(wanted);
  });
  m.def("threads", [] { return pool().threads(); });
  m.def("has_sgemm", [] { return process_sgemm() != nullptr; });
  m.def("small_rows", [] { return small_rows.load(); });
  m.def("set_small_rows", [](int rows) { small_rows.store(std::max(1, rows)); });
  m.def("int8_kernel", [] {
    const auto kernel = mlxchat_q::int8_kernel(active_isa.load());
    return std::string(kernel == mlxchat_q::Int8Kernel::vnni ? "avx512 vnni"
                       : kernel == mlxchat_q::Int8Kernel::avx2 ? "avx2"
                                                                : "");
  });
  m.def("int8_rows", [] { return int8_rows.load(); });
  m.def("set_int8_rows", [](int rows) { int8_rows.store(std::max(1, rows)); });
  m.def("amx_rows", [] { return amx_rows.load(); });
  m.def("set_amx_rows", [](int rows) { amx_rows.store(std::max(1, rows)); });
}
