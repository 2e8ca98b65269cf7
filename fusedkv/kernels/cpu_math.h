/* Small vectorisable math shared by the native CPU decode kernels. */
#ifndef FUSEDKV_CPU_MATH_H
#define FUSEDKV_CPU_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Cephes expf for |x| <= 87 (clamped below: scores minus their max, and -x in SiLU, never need more);
 * relative error ~1e-7. A polynomial, so the loops that call it vectorise. */
static inline float exp_poly(float x) {
    x = x < -87.f ? -87.f : (x > 87.f ? 87.f : x);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

#endif
