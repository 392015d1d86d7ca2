/*
 * Route single-row matrix products to cblas_sgemv.
 *
 * MLX's CPU backend calls cblas_sgemm for every float32 matmul, including the one-row products that make
 * up all of decode. OpenBLAS's sgemm with M == 1 reads weights at a third of the speed of its sgemv. This
 * library exports cblas_sgemm; loaded with RTLD_GLOBAL before MLX, it takes MLX's calls, sends products
 * with one row (or one column) of output to sgemv, and hands everything else to the real sgemm of the
 * BLAS named in mlxchat_blas_route_init. It is built on Linux only (macOS uses Accelerate through Metal).
 */
#include <dlfcn.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;

/* Bind to the BLAS at `path`. Returns 0 on success, 1 if it cannot be opened, 2 if a symbol is missing. */
int mlxchat_blas_route_init(const char *path) {
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) return 1;
    real_sgemm = (sgemm_fn)dlsym(handle, "cblas_sgemm");
    real_sgemv = (sgemv_fn)dlsym(handle, "cblas_sgemv");
    return (real_sgemm && real_sgemv) ? 0 : 2;
}

/* How many products went each way since load: [gemv, gemm]. For tests and runtime_info. */
static long routed_counts[2];
void mlxchat_blas_route_counts(long *out) {
    out[0] = __atomic_load_n(&routed_counts[0], __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&routed_counts[1], __ATOMIC_RELAXED);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    if (order == ROW_MAJOR && m == 1) {
        /* c[1, n] = a[1, k] . op(b)[k, n]: a's elements are contiguous unless a is stored transposed */
        int inc_a = trans_a == NO_TRANS ? 1 : lda;
        if (trans_b == NO_TRANS)
            real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_a, beta, c, 1);
        else
            real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_a, beta, c, 1);
        __atomic_fetch_add(&routed_counts[0], 1, __ATOMIC_RELAXED);
        return;
    }
    if (order == ROW_MAJOR && n == 1) {
        /* c[m, 1] = op(a)[m, k] . b[k, 1]: c's elements are ldc apart */
        int inc_b = trans_b == NO_TRANS ? ldb : 1;
        if (trans_a == NO_TRANS)
            real_sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, inc_b, beta, c, ldc);
        else
            real_sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, inc_b, beta, c, ldc);
        __atomic_fetch_add(&routed_counts[0], 1, __ATOMIC_RELAXED);
        return;
    }
    __atomic_fetch_add(&routed_counts[1], 1, __ATOMIC_RELAXED);
    real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
