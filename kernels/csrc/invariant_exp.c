/* kernels.invariant.exp, element by element in C: the same float32 operations in the same order,
   each rounded once (built with -ffp-contract=off, so no multiply-add is fused), hence the same
   bits as the torch version, which issues each of them as a separate aten op over the tensor.
   Cody-Waite reduction x = n ln2 + r, Horner polynomial (Taylor to r^7), 2^n from exponent bits;
   x > 88.72 -> inf, x < -87 (and -inf) -> 0, NaN -> NaN. Built by kernels/fixed_order.py;
   tests/unit/kernels/test_fixed_order.py checks it bit for bit against the torch version. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>


void fo_exp(const float *x, float *y, ptrdiff_t n) {
    const float log2e = (float)1.4426950408889634;
    const float ln2_hi = (float)0.693145751953125;
    const float ln2_lo = (float)1.4286067653301870e-06;
    const float c[8] = {(float)1.0,          (float)1.0,           (float)(1.0 / 2),
                        (float)(1.0 / 6),    (float)(1.0 / 24),    (float)(1.0 / 120),
                        (float)(1.0 / 720),  (float)(1.0 / 5040)};
    for (ptrdiff_t i = 0; i < n; i++) {
        float xi = x[i];
        float xc = xi < -87.0f ? -87.0f : (xi > 88.0f ? 88.0f : xi);
        float t = xc * log2e;
        float nn = floorf(t + 0.5f);
        float r = (xc - nn * ln2_hi) - nn * ln2_lo;
        float p = c[7];
        p = p * r + c[6];
        p = p * r + c[5];
        p = p * r + c[4];
        p = p * r + c[3];
        p = p * r + c[2];
        p = p * r + c[1];
        p = p * r + c[0];
        int32_t bits = ((int32_t)(xc == xc ? nn : 0.0f) + 127) << 23;
        float scale;
        memcpy(&scale, &bits, sizeof scale);
        float out = p * scale;
        out = xi > 88.72f ? INFINITY : out;
        out = xi < -87.0f ? 0.0f : out;
        y[i] = xi != xi ? xi : out;
    }
}
