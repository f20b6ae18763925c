/* Fixed-order fp32 GEMM: every output element is one fused multiply-add chain over K, in order.

   C[i, j] = fma(A[i, K-1], B[K-1, j], ... fma(A[i, 1], B[1, j], fma(A[i, 0], B[0, j], 0)) ...)

   Vectorised across j (the columns of B) and blocked over i and j only, never over K, so the
   rounding of C[i, j] depends on row i of A and column j of B alone: not on M, N, the position of
   the row in the batch, the tile it falls in, the vector width or the thread that computes it.
   Exact zero terms anywhere in the chain leave it unchanged (fma(0, b, c) == c for finite b and
   c != 0; fma(a, b, +-0) == round(a b)), so zero-padding K (masked keys in attention, a KV-cache
   step against a full forward) gives the same bits.

   Built by kernels/fixed_order.py with `-O3 -march=native -ffp-contract=fast`; it refuses to
   compile without hardware FMA, where `acc += a * b` could round twice. B arrives packed in
   panels of NR columns ([P][K][NR], zero-padded), C with any row stride. No OpenMP: the caller
   splits panels across threads (ctypes releases the GIL). */

#include <stddef.h>
#include <string.h>

#if !defined(__FMA__) && !defined(__ARM_FEATURE_FMA)
#error "fixed_order_gemm needs hardware FMA (x86-64-v3 or ARMv8)"
#endif

#if defined(__AVX512F__)
#define VW 16 /* floats per vector */
#define NV 4  /* vectors per panel row: NR = 64 */
#define MR 6  /* rows per micro-tile: 24 accumulators + 4 B vectors of 32 zmm registers */
#elif defined(__AVX__)
#define VW 8
#define NV 2
#define MR 6 /* 12 accumulators of 16 ymm registers */
#else
#define VW 4
#define NV 2
#define MR 6
#endif
#define NR (VW * NV)

typedef float vf __attribute__((vector_size(VW * sizeof(float)), aligned(4)));

int fo_nr(void) { return NR; }

static inline __attribute__((always_inline)) void micro(int mr, const float *a, ptrdiff_t lda,
                                                        const float *bp, ptrdiff_t k_len, float *c,
                                                        ptrdiff_t ldc, int ncols) {
    vf acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = (vf){0};
    for (ptrdiff_t k = 0; k < k_len; k++) {
        vf b[NV];
        for (int v = 0; v < NV; v++) b[v] = *(const vf *)(bp + k * NR + v * VW);
        for (int r = 0; r < mr; r++) {
            vf av = (vf){0} + a[r * lda + k];
            for (int v = 0; v < NV; v++) acc[r][v] += av * b[v]; /* one FMA (-ffp-contract=fast) */
        }
    }
    for (int r = 0; r < mr; r++) {
        if (ncols == NR) {
            for (int v = 0; v < NV; v++) *(vf *)(c + r * ldc + v * VW) = acc[r][v];
        } else {
            float tmp[NR];
            for (int v = 0; v < NV; v++) *(vf *)(tmp + v * VW) = acc[r][v];
            memcpy(c + r * ldc, tmp, (size_t)ncols * sizeof(float));
        }
    }
}

/* C[bi] rows 0..m, panels p0..p1 (columns p*NR .. min(n, (p+1)*NR)) for every batch bi.
   A[bi] is m x k with row stride lda (unit column stride); Bp[bi] is [P][k][NR]. */
void fo_gemm(const float *a, ptrdiff_t a_bstride, ptrdiff_t lda, const float *bp,
             ptrdiff_t bp_bstride, float *c, ptrdiff_t c_bstride, ptrdiff_t ldc, ptrdiff_t batch,
             ptrdiff_t m, ptrdiff_t n, ptrdiff_t k, ptrdiff_t p0, ptrdiff_t p1) {
    const ptrdiff_t IB = 96; /* rows of A per block: MR-multiple, stays in L2 while panels pass */
    for (ptrdiff_t bi = 0; bi < batch; bi++) {
        const float *ab = a + bi * a_bstride;
        const float *bb = bp + bi * bp_bstride;
        float *cb = c + bi * c_bstride;
        for (ptrdiff_t i0 = 0; i0 < m; i0 += IB) {
            ptrdiff_t i1 = i0 + IB < m ? i0 + IB : m;
            for (ptrdiff_t p = p0; p < p1; p++) {
                const float *panel = bb + p * k * NR;
                int ncols = (int)(n - p * NR < NR ? n - p * NR : NR);
                ptrdiff_t i = i0;
                for (; i + MR <= i1; i += MR)
                    micro(MR, ab + i * lda, lda, panel, k, cb + i * ldc + p * NR, ldc, ncols);
                switch (i1 - i) { /* constant row counts: each call site unrolls */
                case 5: micro(5, ab + i * lda, lda, panel, k, cb + i * ldc + p * NR, ldc, ncols); break;
                case 4: micro(4, ab + i * lda, lda, panel, k, cb + i * ldc + p * NR, ldc, ncols); break;
                case 3: micro(3, ab + i * lda, lda, panel, k, cb + i * ldc + p * NR, ldc, ncols); break;
                case 2: micro(2, ab + i * lda, lda, panel, k, cb + i * ldc + p * NR, ldc, ncols); break;
                case 1: micro(1, ab + i * lda, lda, panel, k, cb + i * ldc + p * NR, ldc, ncols); break;
                default: break;
                }
            }
        }
    }
}
