/* One-row-at-a-time weight products for CPU decoding: y[r, :] = x[r, :] W^T (+ bias), for a few rows.
 *
 * The weight is read in the decode layout of fusedkv.model.packing: W^T stored [in, out] row-major
 * (a column-major [out, in] weight), row stride `ldw` so that a column slice of a packed Q|K|V buffer
 * is read in place. Each thread owns a contiguous range of output columns and streams, for 8 input
 * channels at a time, 8 rows of W^T over that range: y_range += sum_k x[i + k] * W^T[i + k, range].
 * Every weight byte is read once per step, in long sequential runs, and the accumulators stay in L1,
 * so the loop runs at the memory's streaming rate; the threads split the bytes, not the reduction.
 *
 * f32 weights only: widening bf16 / f16 / int8 weights in this loop was measured slower than PyTorch's
 * own reduced-precision kernels (compute-bound), which therefore keep those formats. Compiled on the
 * machine that runs it (-march=native, by fusedkv/kernels/cpu_gemv.py), so the compiler picks AVX-512 or
 * AVX2 itself. The macro keeps the weight type a parameter for that comparison.
 */
#include <stdint.h>
#include <string.h>

static inline float from_f32(float w) { return w; }

#define DEFINE_GEMV(NAME, T, CONVERT)                                                                      \
static void NAME##_range(const float* restrict x, int rows, int in, const T* restrict wt, long ldw,        \
                         float* restrict y, long out, int j0, int j1) {                                   \
    for (int r = 0; r < rows; r++) memset(y + r * out + j0, 0, sizeof(float) * (size_t)(j1 - j0));        \
    int i = 0;                                                                                             \
    for (; i + 8 <= in; i += 8) {                                                                          \
        const T* w0 = wt + (long)i * ldw; const T* w1 = w0 + ldw; const T* w2 = w1 + ldw;                 \
        const T* w3 = w2 + ldw; const T* w4 = w3 + ldw; const T* w5 = w4 + ldw;                           \
        const T* w6 = w5 + ldw; const T* w7 = w6 + ldw;                                                   \
        for (int r = 0; r < rows; r++) {                                                                   \
            const float* xr = x + (long)r * in + i;                                                        \
            const float a0 = xr[0], a1 = xr[1], a2 = xr[2], a3 = xr[3];                                    \
            const float a4 = xr[4], a5 = xr[5], a6 = xr[6], a7 = xr[7];                                    \
            float* restrict yr = y + r * out;                                                              \
            _Pragma("omp simd")                                                                            \
            for (int j = j0; j < j1; j++)                                                                  \
                yr[j] += (a0 * CONVERT(w0[j]) + a1 * CONVERT(w1[j]) + a2 * CONVERT(w2[j]) + a3 * CONVERT(w3[j])) \
                       + (a4 * CONVERT(w4[j]) + a5 * CONVERT(w5[j]) + a6 * CONVERT(w6[j]) + a7 * CONVERT(w7[j])); \
        }                                                                                                  \
    }                                                                                                      \
    for (; i < in; i++) {                                                                                  \
        const T* w0 = wt + (long)i * ldw;                                                                  \
        for (int r = 0; r < rows; r++) {                                                                   \
            const float a0 = x[(long)r * in + i];                                                          \
            float* restrict yr = y + r * out;                                                              \
            _Pragma("omp simd")                                                                            \
            for (int j = j0; j < j1; j++) yr[j] += a0 * CONVERT(w0[j]);                                    \
        }                                                                                                  \
    }                                                                                                      \
}                                                                                                          \
void NAME(const float* x, int rows, int in, const T* wt, long ldw, const float* bias,                      \
          float* y, int out, int threads) {                                                                \
    int per = (out + threads - 1) / threads;                                                               \
    per = (per + 15) / 16 * 16; /* whole vectors per thread */                                             \
    int parts = (out + per - 1) / per;                                                                     \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(parts > 1)")                        \
    for (int p = 0; p < parts; p++) {                                                                      \
        int j0 = p * per, j1 = j0 + per < out ? j0 + per : out;                                            \
        NAME##_range(x, rows, in, wt, ldw, y, out, j0, j1);                                                \
        for (int r = 0; r < rows; r++) {                                                                   \
            float* yr = y + (long)r * out;                                                                 \
            if (bias) for (int j = j0; j < j1; j++) yr[j] += bias[j];                                      \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_GEMV(gemv_f32, float, from_f32)
