/*
 * MLX's cblas_sgemm, routed: single-row products to sgemv, a few rows to our own kernel, everything else to
 * the BLAS mlxchat chose.
 *
 * MLX's CPU backend calls cblas_sgemm for every float32 matmul, including the one-row products that make
 * up all of decode. OpenBLAS's sgemm with M == 1 reads weights at a third of the speed of its sgemv, and
 * with 2 <= M <= 8 (a speculative round's verify pass, a short turn's prefill) at a third of it too: it
 * packs the whole weight matrix for a handful of rows. This library exports cblas_sgemm; loaded with
 * RTLD_GLOBAL before MLX, it takes MLX's calls, sends products with one row (or one column) of output to
 * sgemv, products of a few rows of x against a weight matrix stored [out, in] (x @ W.T) to the few-rows
 * kernel below, which reads the weights once for all rows on every core, and hands everything else to
 * the real sgemm of the BLAS named in mlxchat_blas_route_init.
 *
 * That BLAS is either a plain CBLAS (cblas_sgemm with 32-bit integers: Debian's libopenblas) or the
 * OpenBLAS inside numpy's wheel (scipy-openblas: 64-bit integers, symbols scipy_cblas_sgemm64_), which
 * exports no cblas_sgemm of its own and so is reachable only through this route. It is built on Linux
 * only (macOS uses Accelerate through Metal).
 *
 * The first cblas_sgemm in the process's global scope is the one MLX calls: a library that exports one and
 * was loaded before mlxchat (a distribution's numpy linked to libopenblas) takes MLX's calls instead. Then
 * the remedy is to load this library first with LD_PRELOAD: until mlxchat_blas_route_init binds it, it
 * passes every call on to the next cblas_sgemm (RTLD_NEXT), so whatever calls it early is served.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm32_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                           float *, int);
typedef void (*sgemv32_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
typedef void (*sgemm64_fn)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *,
                           int64_t, float, float *, int64_t);
typedef void (*sgemv64_fn)(int, int, int64_t, int64_t, float, const float *, int64_t, const float *, int64_t, float,
                           float *, int64_t);

static sgemm32_fn sgemm32;
static sgemv32_fn sgemv32;
static sgemm64_fn sgemm64;
static sgemv64_fn sgemv64;
static int gemv_route = 1;
static int small_rows = 8; /* products of 2..small_rows rows of x go to the few-rows kernel (0: none; the CPU's
                               default once mlxchat_blas_route_set_rows(-1) runs) */
static int pass_rows = 0;   /* and, when set, products of more rows too, in passes of at most this many rows */

/*
 * Bind to the BLAS at `path`. Returns 32 or 64 (the integer width of the interface found), 0 if the library
 * cannot be opened, -1 if it has neither interface.
 */
int mlxchat_blas_route_init(const char *path) {
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) return 0;
    sgemm32 = (sgemm32_fn)dlsym(handle, "cblas_sgemm");
    sgemv32 = (sgemv32_fn)dlsym(handle, "cblas_sgemv");
    if (sgemm32 && sgemv32) return 32;
    sgemm32 = 0;
    sgemv32 = 0;
    sgemm64 = (sgemm64_fn)dlsym(handle, "scipy_cblas_sgemm64_");
    sgemv64 = (sgemv64_fn)dlsym(handle, "scipy_cblas_sgemv64_");
    if (sgemm64 && sgemv64) return 64;
    sgemm64 = 0;
    sgemv64 = 0;
    return -1;
}

/* 0 sends every product to sgemm (MLXCHAT_GEMV=0). */
void mlxchat_blas_route_set_gemv(int on) {
    gemv_route = on;
}

/* The most rows of x the few-rows kernel takes (0 sends them to sgemm; at most ROWS_MAX). Below 0: this CPU's
 * default (see the kernel's comment): where its AVX-512 kernel runs, every product, in passes of at most 128
 * rows; with AVX2, up to 64 rows; with neither (the scalar kernel), up to 8. */
#define ROWS_MAX 256
static int kernel_level(void);
void mlxchat_blas_route_set_rows(int rows) {
    const int level = kernel_level(), all = rows < 0 && level == 2;
    pass_rows = all ? 128 : 0;
    small_rows = all ? 128 : rows >= 0 ? (rows > ROWS_MAX ? ROWS_MAX : rows) : level == 1 ? 64 : 8;
}

/* How many products went each way since load: [read once (sgemv, few rows), gemm]. For tests and
 * runtime_info. */
static long routed_counts[2];
void mlxchat_blas_route_counts(long *out) {
    out[0] = __atomic_load_n(&routed_counts[0], __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&routed_counts[1], __ATOMIC_RELAXED);
}

/* Called before mlxchat_blas_route_init (preloaded): bind to the next library's CBLAS. */
static void bind_next(void) {
    sgemm32 = (sgemm32_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    sgemv32 = (sgemv32_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
    if (!sgemm32 || !sgemv32) abort(); /* no CBLAS after this one: nothing can compute the product */
}
static pthread_once_t next_once = PTHREAD_ONCE_INIT;

static void sgemv(int order, int trans, int m, int n, float alpha, const float *a, int lda, const float *x,
                  int inc_x, float beta, float *y, int inc_y) {
    if (sgemv32)
        sgemv32(order, trans, m, n, alpha, a, lda, x, inc_x, beta, y, inc_y);
    else
        sgemv64(order, trans, m, n, alpha, a, lda, x, inc_x, beta, y, inc_y);
}

/* -- the few-rows kernel ------------------------------------------------------------------------------ */

/*
 * c[m, n] = alpha * sum_k a[m, k] * b[n, k] (+ beta * c[m, n]) for a few rows of a: weight rows are
 * streamed two (or four) at a time, each loaded once and multiplied into every row of a (which stays in cache),
 * and each row's sum is reduced at its end. Summation order differs from the BLAS's only as float32 order does.
 *
 * Up to a few dozen rows this beats OpenBLAS's sgemm, which packs the weights for them and runs at half its
 * speed or less where M is not a multiple of its blocking: 12, 24 and 40 rows against Qwen3-0.6B's MLP
 * products ran at 44, 100 and 137 GFLOP/s there against 141, 181 and 189 here with two weight rows a tile,
 * and 20 rows of a scaled Qwen3-30B-A3B expert (384 x 1024, a 512-token prompt's share of one expert) at 78
 * against 176 (2 cores of an AVX-512 EPYC, Zen 4, 2026-12). AVX-512's tiles of four weight rows for more than
 * FEW_MAX rows then ran 260-320 GFLOP/s from 32 to 256 rows, and 290-330 for 512 and 1,024 rows in passes of
 * 128, where OpenBLAS 0.3.21 (AVX2 kernels on that CPU) ran 200-260, so there the kernel takes every product by
 * default; AVX2's kernel (forced on the same CPU, 165-190 GFLOP/s) takes up to 64 rows, about where OpenBLAS
 * reaches it at multiples of 16 rows.
 */
#define FEW_MAX 8 /* rows the unrolled path takes (in at most two groups); more go in groups of QR */
#define QR 6       /* rows of x a tile of the path for more takes: with NW weight rows, 4 x 6 + 5 of AVX-512's 32
                      registers (2 x 6 + 3 of AVX2's 16); 4 weight rows ran 40 and 64 rows 12% and 20% faster
                      than 2 on AVX-512 */
typedef struct {
    int m, n, k, lda, ldb, ldc;
    const float *a, *b;
    float *c;
    float alpha, beta;
} few_job;

static void store(const few_job *j, int m, int n, float sum) {
    float *out = j->c + (long)m * j->ldc + n;
    *out = j->alpha * sum + (j->beta != 0.0f ? j->beta * *out : 0.0f);
}

/* A block of the sum: the first stores it (with beta), the others add to what is there. */
static inline void add(const few_job *j, int m, int n, float sum, int first) {
    if (first)
        store(j, m, n, sum);
    else
        j->c[(long)m * j->ldc + n] += j->alpha * sum;
}

static void few_scalar(const few_job *j, int n0, int n1) {
    for (int n = n0; n < n1; ++n)
        for (int m = 0; m < j->m; ++m) {
            const float *x = j->a + (long)m * j->lda, *w = j->b + (long)n * j->ldb;
            float sum = 0.0f;
            for (int k = 0; k < j->k; ++k) sum += x[k] * w[k];
            store(j, m, n, sum);
        }
}

#if defined(__x86_64__)
/*
 * M given as a constant by the callers below, so that the accumulators stay in registers: two for each row
 * of x, the two weight vectors and one of x. More than MR rows (what the registers hold: 6 of AVX2's 16,
 * 8 of AVX-512's 32) go in two groups, each pair of weight rows read from memory by the first group and
 * from the cache by the second (8 rows in one group spilled on AVX2 and took about 1.5x the time of two
 * groups of 4 over Qwen3-0.6B's products, 2026-12). K is taken in blocks whose rows of x fit in the L1
 * cache together (FEW_BLOCK bytes; 32 KiB measured fastest, on AVX2 too against 16: 8 rows of Qwen3-0.6B's
 * 196 products, 2.4 GB, then take 101 ms where one row takes 86, against 133 before), so that x is read
 * from there for every pair of weight rows: the first block stores alpha * sum + beta * c, the others add
 * alpha * sum.
 */
#define FEW_BLOCK 32768
#define MANY_BLOCK 2048 /* K's block for more rows: x's rows stay in a core's L2 (48 rows of it: 384 KiB), as
                           blocks that kept them in L1 were a fifth slower */
#define FEW_KERNEL(NAME, TARGET, VEC, WIDTH, MR, NW, ZERO, LOAD, FMA, REDUCE)                                  \
    _Static_assert(FEW_MAX <= 2 * (MR), #NAME ": the rows of x come in two groups at most");                \
    /* Rows m0..m0+R-1 of x against weight rows n and n + 1 (w1 = w0 when n is the last), k0..k1. */        \
    __attribute__((target(TARGET), always_inline)) static inline void NAME##_tile(                            \
        const few_job *j, const int m0, const int R, int n, int pair, int k0, int k1, int tail) {             \
        const float *xs[MR];                                                                                 \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) xs[m] = j->a + (long)(m0 + m) * j->lda;          \
        const float *w0 = j->b + (long)n * j->ldb, *w1 = pair ? w0 + j->ldb : w0;                            \
        VEC acc0[MR], acc1[MR];                                                                              \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) acc0[m] = acc1[m] = ZERO;                        \
        for (int k = k0; k < k1; k += WIDTH) {                                                               \
            if (m0 == 0) {                                                                                   \
                _mm_prefetch((const char *)(w0 + 2 * (long)j->ldb + k), _MM_HINT_T0);                        \
                _mm_prefetch((const char *)(w1 + 2 * (long)j->ldb + k), _MM_HINT_T0);                        \
            }                                                                                                \
            const VEC v0 = LOAD(w0 + k), v1 = LOAD(w1 + k);                                                  \
            _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {                                            \
                VEC x = LOAD(xs[m] + k);                                                                     \
                __asm__("" : "+v"(x)); /* one load of x for both products, not one in each */                \
                acc0[m] = FMA(x, v0, acc0[m]);                                                               \
                acc1[m] = FMA(x, v1, acc1[m]);                                                               \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {                                                \
            const float *x = xs[m];                                                                          \
            float s0 = REDUCE(acc0[m]), s1 = REDUCE(acc1[m]);                                                \
            for (int k = tail; k < j->k; ++k) {                                                              \
                s0 += x[k] * w0[k];                                                                          \
                s1 += x[k] * w1[k];                                                                          \
            }                                                                                                \
            add(j, m0 + m, n, s0, k0 == 0);                                                                  \
            if (pair) add(j, m0 + m, n + 1, s1, k0 == 0);                                                    \
        }                                                                                                    \
    }                                                                                                        \
    __attribute__((target(TARGET), always_inline)) static inline void NAME##_m(const few_job *j, int n0, int n1, \
                                                                              const int M) {                 \
        const int K = j->k, whole = K - K % WIDTH, first = M <= MR ? M : (M + 1) / 2;                        \
        const int block = FEW_BLOCK / (int)sizeof(float) / M / WIDTH * WIDTH;                                \
        for (int k0 = 0; k0 < K; k0 += block) {                                                              \
            const int k1 = k0 + block < whole ? k0 + block : whole, tail = k0 + block >= K ? whole : K;      \
            for (int n = n0; n < n1; n += 2) {                                                               \
                const int pair = n + 1 < n1;                                                                 \
                NAME##_tile(j, 0, first, n, pair, k0, k1, tail);                                             \
                if (first < M) NAME##_tile(j, first, M - first, n, pair, k0, k1, tail);                      \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    /* Rows m0..m0+R-1 of x (R <= QR, a constant) against NW weight rows from n, of which nw are the matrix's   \
     * (the others repeat row n: computed, not stored), k0..k1. */                                           \
    __attribute__((target(TARGET), always_inline)) static inline void NAME##_wide(                            \
        const few_job *j, int m0, const int R, int n, int nw, int k0, int k1, int tail) {                    \
        const float *xs[QR], *w[NW];                                                                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) xs[m] = j->a + (long)(m0 + m) * j->lda;          \
        _Pragma("GCC unroll 4") for (int i = 0; i < NW; ++i) w[i] = j->b + (long)(n + (i < nw ? i : 0)) * j->ldb; \
        VEC acc[NW][QR];                                                                                     \
        _Pragma("GCC unroll 4") for (int i = 0; i < NW; ++i)                                                 \
            _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) acc[i][m] = ZERO;                            \
        for (int k = k0; k < k1; k += WIDTH) {                                                               \
            VEC v[NW];                                                                                       \
            _Pragma("GCC unroll 4") for (int i = 0; i < NW; ++i) {                                           \
                if (m0 == 0) _mm_prefetch((const char *)(w[i] + (NW) * (long)j->ldb + k), _MM_HINT_T0);      \
                v[i] = LOAD(w[i] + k);                                                                       \
            }                                                                                                \
            _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {                                            \
                VEC x = LOAD(xs[m] + k);                                                                     \
                __asm__("" : "+v"(x)); /* one load of x for all products */                                  \
                _Pragma("GCC unroll 4") for (int i = 0; i < NW; ++i) acc[i][m] = FMA(x, v[i], acc[i][m]);    \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {                                                \
            const float *x = xs[m];                                                                          \
            for (int i = 0; i < nw; ++i) {                                                                   \
                float sum = REDUCE(acc[i][m]);                                                               \
                for (int k = tail; k < j->k; ++k) sum += x[k] * w[i][k];                                     \
                add(j, m0 + m, n + i, sum, k0 == 0);                                                         \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    /* More than FEW_MAX rows: groups of at most QR rows (as even as they divide) against NW weight rows at a  \
     * time, the weight rows read from memory by the first group and from the cache by the others. */        \
    __attribute__((target(TARGET))) static void NAME##_many(const few_job *j, int n0, int n1) {               \
        const int M = j->m, K = j->k, whole = K - K % WIDTH, groups = (M + (QR) - 1) / (QR);                \
        for (int k0 = 0; k0 < K; k0 += MANY_BLOCK) {                                                         \
            const int k1 = k0 + MANY_BLOCK < whole ? k0 + MANY_BLOCK : whole;                                \
            const int tail = k0 + MANY_BLOCK >= K ? whole : K;                                               \
            for (int n = n0; n < n1; n += (NW)) {                                                            \
                const int nw = n1 - n < (NW) ? n1 - n : (NW);                                                \
                for (int g = 0; g < groups; ++g) {                                                           \
                    const int m0 = g * M / groups, R = (g + 1) * M / groups - m0;                            \
                    switch (R) {                                                                             \
                    case 1: NAME##_wide(j, m0, 1, n, nw, k0, k1, tail); break;                               \
                    case 2: NAME##_wide(j, m0, 2, n, nw, k0, k1, tail); break;                               \
                    case 3: NAME##_wide(j, m0, 3, n, nw, k0, k1, tail); break;                               \
                    case 4: NAME##_wide(j, m0, 4, n, nw, k0, k1, tail); break;                               \
                    case 5: NAME##_wide(j, m0, 5, n, nw, k0, k1, tail); break;                               \
                    default: NAME##_wide(j, m0, 6, n, nw, k0, k1, tail); break;                              \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    __attribute__((target(TARGET))) static void NAME(const few_job *j, int n0, int n1) {                     \
        if (j->m > FEW_MAX) return NAME##_many(j, n0, n1);                                                   \
        switch (j->m) {                                                                                      \
        case 1: NAME##_m(j, n0, n1, 1); break;                                                               \
        case 2: NAME##_m(j, n0, n1, 2); break;                                                               \
        case 3: NAME##_m(j, n0, n1, 3); break;                                                               \
        case 4: NAME##_m(j, n0, n1, 4); break;                                                               \
        case 5: NAME##_m(j, n0, n1, 5); break;                                                               \
        case 6: NAME##_m(j, n0, n1, 6); break;                                                               \
        case 7: NAME##_m(j, n0, n1, 7); break;                                                               \
        default: NAME##_m(j, n0, n1, 8); break;                                                              \
        }                                                                                                    \
    }

__attribute__((target("avx2,fma"))) static inline float reduce256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

FEW_KERNEL(few_avx512, "avx512f,avx2,fma", __m512, 16, 8, 4, _mm512_setzero_ps(), _mm512_loadu_ps, _mm512_fmadd_ps,
           _mm512_reduce_add_ps)
FEW_KERNEL(few_avx2, "avx2,fma", __m256, 8, 6, 2, _mm256_setzero_ps(), _mm256_loadu_ps, _mm256_fmadd_ps, reduce256)
#endif

typedef void (*few_fn)(const few_job *, int, int);

static few_fn few_kernel(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return few_avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return few_avx2;
#endif
    return few_scalar;
}

/* 2: AVX-512's kernel runs here, 1: AVX2's, 0: the scalar one. */
static int kernel_level(void) {
#if defined(__x86_64__)
    const few_fn kernel = few_kernel();
    return kernel == few_avx512 ? 2 : kernel == few_avx2 ? 1 : 0;
#else
    return 0;
#endif
}

/*
 * A small pool: the caller and (cores - 1) workers claim parts of a job (ranges of weight rows) through one
 * word holding (job number, next part), so a worker that wakes late never runs a part of a job it did not
 * read: it reads the job (a copy the pool owns) only after claiming a part, which keeps the job running.
 * Workers spin about 50 us after a job (a decode step issues the next within microseconds), then sleep
 * on a futex. A process that forks runs on the calling thread alone in the child.
 */
static struct {
    pthread_once_t once;
    int threads, parts;
    few_fn kernel;
    _Atomic uint64_t claim;
    _Atomic unsigned posted, sleepers;
    _Atomic int done;
    few_job job;
    pthread_mutex_t busy;
} pool = {.once = PTHREAD_ONCE_INIT, .busy = PTHREAD_MUTEX_INITIALIZER};

static void pause_cpu(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void run_part(const few_job *j, int part) {
    const int per = (j->n + pool.parts - 1) / pool.parts, step = (per + 3) / 4 * 4; /* rows go in 2s or 4s */
    const int n0 = part * step, n1 = n0 + step < j->n ? n0 + step : j->n;
    if (n0 < n1) pool.kernel(j, n0, n1);
}

/* Claims and runs parts of job `id` until none is left. */
static void help(uint32_t id) {
    uint64_t word = atomic_load_explicit(&pool.claim, memory_order_acquire);
    while ((uint32_t)(word >> 32) == id) {
        const int part = (int)(word & 0xffffffffu);
        if (part >= pool.parts) return;
        if (atomic_compare_exchange_weak_explicit(&pool.claim, &word, word + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            run_part(&pool.job, part);
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
            word = atomic_load_explicit(&pool.claim, memory_order_acquire);
        }
    }
}

static void *work(void *unused) {
    (void)unused;
    unsigned seen = atomic_load_explicit(&pool.posted, memory_order_acquire);
    for (;;) {
        const double until = seconds() + 50e-6;
        unsigned now;
        for (int i = 1; (now = atomic_load_explicit(&pool.posted, memory_order_acquire)) == seen; ++i) {
            pause_cpu();
            if (i % 64 == 0 && seconds() > until) {
                atomic_fetch_add(&pool.sleepers, 1);
                syscall(SYS_futex, &pool.posted, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&pool.sleepers, 1);
            }
        }
        seen = now;
        help((uint32_t)(atomic_load_explicit(&pool.claim, memory_order_acquire) >> 32));
    }
    return NULL;
}

static void forked_child(void) {
    pool.threads = 1; /* the workers did not come along: run on the calling thread */
    pthread_mutex_init(&pool.busy, NULL);
}

static void start_pool(void) {
    cpu_set_t set;
    pool.threads = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    pool.kernel = few_kernel();
    pool.parts = 4 * pool.threads;
    for (int i = 1; i < pool.threads; ++i) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&thread, &attr, work, NULL) != 0) pool.threads = i;
        pthread_attr_destroy(&attr);
    }
    pthread_atfork(NULL, NULL, forked_child);
}

static void few_rows(int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb, float beta,
                     float *c, int ldc) {
    pthread_once(&pool.once, start_pool);
    const few_job j = {m, n, k, lda, ldb, ldc, a, b, c, alpha, beta};
    if (pool.threads <= 1 || pthread_mutex_trylock(&pool.busy) != 0) { /* a second stream finds it busy */
        pool.kernel(&j, 0, n);
        return;
    }
    static uint32_t id;
    ++id;
    pool.job = j;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.claim, (uint64_t)id << 32, memory_order_release);
    atomic_fetch_add_explicit(&pool.posted, 1, memory_order_release);
    if (atomic_load(&pool.sleepers)) syscall(SYS_futex, &pool.posted, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    help(id);
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < pool.parts) pause_cpu();
    pthread_mutex_unlock(&pool.busy);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    if (!sgemm32 && !sgemm64) pthread_once(&next_once, bind_next);
    if (gemv_route && order == ROW_MAJOR && m == 1) {
        /* c[1, n] = a[1, k] . op(b)[k, n]: a's elements are contiguous unless a is stored transposed */
        int inc_a = trans_a == NO_TRANS ? 1 : lda;
        if (trans_b == NO_TRANS)
            sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_a, beta, c, 1);
        else
            sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_a, beta, c, 1);
        __atomic_fetch_add(&routed_counts[0], 1, __ATOMIC_RELAXED);
        return;
    }
    if (gemv_route && order == ROW_MAJOR && n == 1) {
        /* c[m, 1] = op(a)[m, k] . b[k, 1]: c's elements are ldc apart */
        int inc_b = trans_b == NO_TRANS ? ldb : 1;
        if (trans_a == NO_TRANS)
            sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, inc_b, beta, c, ldc);
        else
            sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, inc_b, beta, c, ldc);
        __atomic_fetch_add(&routed_counts[0], 1, __ATOMIC_RELAXED);
        return;
    }
    if (gemv_route && order == ROW_MAJOR && trans_a == NO_TRANS && trans_b == TRANS && m >= 2 &&
        (m <= small_rows || pass_rows > 0) && (long)n * k >= 65536) {
        /* x[m, k] @ W[n, k].T, W large enough for the weights' reading to be what it costs; more rows than
           small_rows in passes as even as they divide */
        const int passes = m <= small_rows ? 1 : (m + pass_rows - 1) / pass_rows;
        for (int p = 0; p < passes; ++p) {
            const int m0 = (int)((long)p * m / passes), m1 = (int)((long)(p + 1) * m / passes);
            few_rows(m1 - m0, n, k, alpha, a + (long)m0 * lda, lda, b, ldb, beta, c + (long)m0 * ldc, ldc);
        }
        __atomic_fetch_add(&routed_counts[0], 1, __ATOMIC_RELAXED);
        return;
    }
    __atomic_fetch_add(&routed_counts[1], 1, __ATOMIC_RELAXED);
    if (sgemm32)
        sgemm32(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    else
        sgemm64(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
