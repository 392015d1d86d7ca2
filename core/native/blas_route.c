/*
 * MLX's cblas_sgemm, routed: single-row products to sgemv, everything to the BLAS mlxchat chose.
 *
 * MLX's CPU backend calls cblas_sgemm for every float32 matmul, including the one-row products that make
 * up all of decode. OpenBLAS's sgemm with M == 1 reads weights at a third of the speed of its sgemv. This
 * library exports cblas_sgemm; loaded with RTLD_GLOBAL before MLX, it takes MLX's calls, sends products
 * with one row (or one column) of output to sgemv, and hands everything else to the real sgemm of the
 * BLAS named in mlxchat_blas_route_init.
 *
 * That BLAS is either a plain CBLAS (cblas_sgemm with 32-bit integers: Debian's libopenblas) or the
 * OpenBLAS inside numpy's wheel (scipy-openblas: 64-bit integers, symbols scipy_cblas_sgemm64_), which
 * exports no cblas_sgemm of its own and so is reachable only through this route. It is built on Linux
 * only (macOS uses Accelerate through Metal).
 */
#include <dlfcn.h>
#include <stdint.h>

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

/* How many products went each way since load: [gemv, gemm]. For tests and runtime_info. */
static long routed_counts[2];
void mlxchat_blas_route_counts(long *out) {
    out[0] = __atomic_load_n(&routed_counts[0], __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&routed_counts[1], __ATOMIC_RELAXED);
}

static void sgemv(int order, int trans, int m, int n, float alpha, const float *a, int lda, const float *x,
                  int inc_x, float beta, float *y, int inc_y) {
    if (sgemv32)
        sgemv32(order, trans, m, n, alpha, a, lda, x, inc_x, beta, y, inc_y);
    else
        sgemv64(order, trans, m, n, alpha, a, lda, x, inc_x, beta, y, inc_y);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
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
    __atomic_fetch_add(&routed_counts[1], 1, __ATOMIC_RELAXED);
    if (sgemm32)
        sgemm32(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    else
        sgemm64(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
