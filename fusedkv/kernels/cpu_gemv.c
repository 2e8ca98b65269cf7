/* One-row-at-a-time weight products for CPU decoding: y[r, :] = x[r, :] W^T (+ bias), for a few rows.
 *
 * The weight is read in the decode layout of fusedkv.engine.packing: W^T stored [in, out] row-major
 * (a column-major [out, in] weight), row stride `ldw` so that a column slice of a packed Q|K|V buffer
 * is read in place. Each thread owns a contiguous range of output columns and streams, for 8 input
 * channels at a time, 8 rows of W^T over that range: y_range += sum_k x[i + k] * W^T[i + k, range].
 * Every weight byte is read once per step, in long sequential runs, and the accumulators stay in L1,
 * so the loop runs at the memory's streaming rate; the threads split the bytes, not the reduction.
 *
 * f32 weights here; widening f16 / int8 weights in this loop was measured slower than PyTorch's own
 * reduced-precision kernels (compute-bound). bf16 and int8 weights instead get the block kernels below,
 * which multiply pairs of bf16 in one instruction where the processor has AVX-512 BF16 and widen a block's
 * weights in registers for f32 FMAs on AVX2. Compiled on the
 * machine that runs it (-march=native, by fusedkv/kernels/native.py), so the compiler picks AVX-512 or
 * AVX2 itself. The macro keeps the weight type a parameter for that comparison.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

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

/* bf16 weights with native bf16 dot products (AVX-512 BF16): acc[j] += x[i] W[j, i] + x[i+1] W[j, i+1] for 16
 * outputs j in one instruction. The weight is stored in blocks of 16 outputs, each block holding all its
 * input channels in pairs: wb[blk, p, j, 0..1] = (W[16 blk + j, 2p], W[16 blk + j, 2p + 1]) as bf16, so one
 * block is one contiguous run of memory that its accumulators consume in order (the layout these
 * instructions read; llama.cpp repacks its weights for the same reason). `block_stride`: elements
 * between blocks. x is given in bf16 (rounded once by the caller, as PyTorch's bf16 GEMV rounds it), with
 * `in` even (the caller pads with a zero channel). Accumulation in f32. `gemv_blocks_isa` says which
 * build this is: 2 AVX-512 BF16, 1 AVX2 (the loops after this one), 0 neither (the caller keeps PyTorch's kernel).
 *
 * int8 weights (symmetric, one f32 scale per output) use the same blocks with int8 elements: every int8 is
 * exactly a bf16, so a block pair-row of 32 weights is widened to bf16 in registers (int8 -> int32 -> f32
 * -> bf16, exact) and multiplied the same way; y = scale (.) acc. Weight-only: x is rounded to bf16 as for
 * bf16 weights, never quantised. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define MAX_BLOCK_ROWS 4

int gemv_blocks_isa(void) { return 2; }

static inline __m512bh load_bf16_pairs(const uint16_t* w) { return (__m512bh)_mm512_loadu_si512(w); }

static inline __m512bh load_int8_pairs(const int8_t* w) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);  /* elements 0-15 from lo, 16-31 from hi: the stored order */
}

/* Rows are taken 4 at a time (the accumulators of 4 rows fit the registers); a block (16 outputs x `in`
 * channels: 16-48 KB here) stays in L1/L2 between those passes, so more rows add arithmetic, not reads
 * from memory. */
#define DEFINE_BLOCKS(NAME, T, LOAD)                                                                       \
int NAME(const uint16_t* x, int rows, int in, const T* wb, long block_stride, const float* scale,         \
         const float* bias, float* y, int out, int threads) {                                             \
    if (out % 16 || in % 2) return 1;                                                                      \
    const int pairs = in / 2, blocks = out / 16;                                                           \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (blocks > 1 && threads > 1)")       \
    for (int blk = 0; blk < blocks; blk++) {                                                               \
        const T* w = wb + (long)blk * block_stride;                                                        \
        for (int r0 = 0; r0 < rows; r0 += MAX_BLOCK_ROWS) {                                                \
            const int nr = rows - r0 < MAX_BLOCK_ROWS ? rows - r0 : MAX_BLOCK_ROWS;                        \
            const uint16_t* xr0 = x + (long)r0 * in;                                                       \
            __m512 acc[MAX_BLOCK_ROWS][2];                                                                 \
            for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                      \
            int p = 0;                                                                                     \
            for (; p + 2 <= pairs; p += 2) {                                                               \
                const __m512bh w0 = LOAD(w + 32 * (long)p), w1 = LOAD(w + 32 * (long)(p + 1));             \
                for (int r = 0; r < nr; r++) {                                                             \
                    int32_t x0, x1;                                                                        \
                    memcpy(&x0, xr0 + (long)r * in + 2 * p, 4);                                            \
                    memcpy(&x1, xr0 + (long)r * in + 2 * p + 2, 4);                                        \
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32(x0), w0);          \
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_set1_epi32(x1), w1);          \
                }                                                                                          \
            }                                                                                              \
            if (p < pairs) {                                                                               \
                const __m512bh w0 = LOAD(w + 32 * (long)p);                                                \
                for (int r = 0; r < nr; r++) {                                                             \
                    int32_t x0;                                                                            \
                    memcpy(&x0, xr0 + (long)r * in + 2 * p, 4);                                           \
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32(x0), w0);          \
                }                                                                                          \
            }                                                                                              \
            for (int r = 0; r < nr; r++) {                                                                 \
                __m512 sum = _mm512_add_ps(acc[r][0], acc[r][1]);                                          \
                if (scale) sum = _mm512_mul_ps(sum, _mm512_loadu_ps(scale + 16 * blk));                    \
                if (bias) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias + 16 * blk));                      \
                _mm512_storeu_ps(y + (long)(r0 + r) * out + 16 * blk, sum);                                \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    return 0;                                                                                              \
}

DEFINE_BLOCKS(gemv_bf16_blocks, uint16_t, load_bf16_pairs)
DEFINE_BLOCKS(gemv_int8_blocks, int8_t, load_int8_pairs)
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 (no bf16 dot products): the same block layout and results, with the weights widened to f32 in registers and
 * multiplied by f32 FMAs. A pair-row's 16 elements for 8 outputs (channel-interleaved) split into the 8 weights of
 * each channel: bf16 by a shift and a mask (exact), int8 by sign-extending shifts and a conversion (exact). Two
 * rows per pass, four accumulator chains per row (outputs 0-7 and 8-15, each channel of the pair apart), so one
 * row keeps the FMA units busy; a block stays in L1/L2 between passes. */
#include <immintrin.h>
#define AVX2_BLOCK_ROWS 2

int gemv_blocks_isa(void) { return 1; }

static inline void widen_bf16_pairs(const uint16_t* w, __m256* c0, __m256* c1) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)w);
    *c0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *c1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline void widen_int8_lanes(__m128i q, __m256* c0, __m256* c1) {
    const __m256i v = _mm256_cvtepi8_epi16(q);
    *c0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16));
    *c1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16));
}

static inline void widen_int8_pairs(const int8_t* w, __m256* c0, __m256* c1) {
    widen_int8_lanes(_mm_loadu_si128((const __m128i*)w), c0, c1);
}

/* The inputs widened to f32 once per product (exact), so each use is one broadcast load; NULL if out of memory. */
static float* widen_inputs(const uint16_t* x, long n) {
    float* xf = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (xf) for (long i = 0; i < n; i++) xf[i] = bf16_to_f32(x[i]);
    return xf;
}

/* `nr` (1 or 2) rows of one block; inlined with a constant `nr` so the accumulators stay in registers. */
#define DEFINE_BLOCK_ROWS_AVX2(NAME, T, WIDEN)                                                             \
static inline __attribute__((always_inline)) void NAME##_rows(const float* x, const int nr, int in,       \
        const T* w, const float* scale, const float* bias, float* y, long ldy) {                          \
    __m256 acc[AVX2_BLOCK_ROWS][4];                                                                        \
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();      \
    for (int p = 0; p < in / 2; p++) {                                                                     \
        __m256 a0, a1, b0, b1;                                                                             \
        WIDEN(w + 32 * (long)p, &a0, &a1);                                                                 \
        WIDEN(w + 32 * (long)p + 16, &b0, &b1);                                                            \
        for (int r = 0; r < nr; r++) {                                                                     \
            const __m256 x0 = _mm256_broadcast_ss(x + (long)r * in + 2 * p);                               \
            const __m256 x1 = _mm256_broadcast_ss(x + (long)r * in + 2 * p + 1);                           \
            acc[r][0] = _mm256_fmadd_ps(x0, a0, acc[r][0]);                                                \
            acc[r][1] = _mm256_fmadd_ps(x1, a1, acc[r][1]);                                                \
            acc[r][2] = _mm256_fmadd_ps(x0, b0, acc[r][2]);                                                \
            acc[r][3] = _mm256_fmadd_ps(x1, b1, acc[r][3]);                                                \
        }                                                                                                  \
    }                                                                                                      \
    for (int r = 0; r < nr; r++) {                                                                         \
        __m256 lo = _mm256_add_ps(acc[r][0], acc[r][1]), hi = _mm256_add_ps(acc[r][2], acc[r][3]);         \
        if (scale) {                                                                                       \
            lo = _mm256_mul_ps(lo, _mm256_loadu_ps(scale));                                                \
            hi = _mm256_mul_ps(hi, _mm256_loadu_ps(scale + 8));                                            \
        }                                                                                                  \
        if (bias) {                                                                                        \
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));                                                 \
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));                                             \
        }                                                                                                  \
        _mm256_storeu_ps(y + (long)r * ldy, lo);                                                           \
        _mm256_storeu_ps(y + (long)r * ldy + 8, hi);                                                       \
    }                                                                                                      \
}                                                                                                          \
int NAME(const uint16_t* x, int rows, int in, const T* wb, long block_stride, const float* scale,         \
         const float* bias, float* y, int out, int threads) {                                             \
    if (out % 16 || in % 2) return 1;                                                                      \
    const int blocks = out / 16;                                                                           \
    float* xf = widen_inputs(x, (long)rows * in);                                                          \
    if (!xf) return 2;                                                                                     \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (blocks > 1 && threads > 1)")       \
    for (int blk = 0; blk < blocks; blk++) {                                                               \
        const T* w = wb + (long)blk * block_stride;                                                        \
        const float* s = scale ? scale + 16 * blk : NULL;                                                  \
        const float* b = bias ? bias + 16 * blk : NULL;                                                    \
        int r0 = 0;                                                                                        \
        for (; r0 + 2 <= rows; r0 += 2)                                                                    \
            NAME##_rows(xf + (long)r0 * in, 2, in, w, s, b, y + (long)r0 * out + 16 * blk, out);           \
        if (r0 < rows) NAME##_rows(xf + (long)r0 * in, 1, in, w, s, b, y + (long)r0 * out + 16 * blk, out);\
    }                                                                                                      \
    free(xf);                                                                                              \
    return 0;                                                                                              \
}

DEFINE_BLOCK_ROWS_AVX2(gemv_bf16_blocks, uint16_t, widen_bf16_pairs)
DEFINE_BLOCK_ROWS_AVX2(gemv_int8_blocks, int8_t, widen_int8_pairs)
#else
int gemv_blocks_isa(void) { return 0; }
int gemv_bf16_blocks(const uint16_t* x, int rows, int in, const uint16_t* wb, long block_stride, const float* scale,
                     const float* bias, float* y, int out, int threads) {
    (void)x; (void)rows; (void)in; (void)wb; (void)block_stride; (void)scale; (void)bias; (void)y; (void)out;
    (void)threads;
    return 1;
}
int gemv_int8_blocks(const uint16_t* x, int rows, int in, const int8_t* wb, long block_stride, const float* scale,
                     const float* bias, float* y, int out, int threads) {
    (void)x; (void)rows; (void)in; (void)wb; (void)block_stride; (void)scale; (void)bias; (void)y; (void)out;
    (void)threads;
    return 1;
}
#endif

/* f16 weights in the same blocks, on any processor with AVX2, FMA and F16C (AVX-512 ones included): each 8 f16
 * of a pair-row (4 outputs x 2 channels, interleaved) become f32 in one conversion and multiply the pair's two
 * inputs, broadcast as (x0, x1, x0, x1, ...), in f32 FMAs; neighbouring lanes (the two channels of an output)
 * are added at the end. x is read in f32 as given, not rounded (`in` its true width, rows `in` apart; an odd
 * last channel pairs with a zero input, as the blocks pair it with a zero weight). The format llama.cpp's F16
 * files keep, so a 16-bit row loses what theirs does. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

int has_f16_blocks(void) { return 1; }

static inline __attribute__((always_inline)) void f16_rows(const float* x, const int nr, int in, const uint16_t* w,
                                                           const float* bias, float* y, long ldy) {
    __m256 acc[2][4];  /* outputs 0-3, 4-7, 8-11, 12-15, each lane pair one output's two channels */
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
    const int pairs = (in + 1) / 2;
    for (int p = 0; p < pairs; p++) {
        __m256 wk[4];
        for (int k = 0; k < 4; k++) wk[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 32 * (long)p + 8 * k)));
        for (int r = 0; r < nr; r++) {
            const float* xr = x + (long)r * in + 2 * p;
            double pair;
            float two[2] = {xr[0], 2 * p + 1 < in ? xr[1] : 0.0f};
            memcpy(&pair, two, 8);
            const __m256 xp = _mm256_castpd_ps(_mm256_set1_pd(pair));
            for (int k = 0; k < 4; k++) acc[r][k] = _mm256_fmadd_ps(xp, wk[k], acc[r][k]);
        }
    }
    for (int r = 0; r < nr; r++) {
        for (int half = 0; half < 2; half++) {
            /* hadd: [o0 o1 o4 o5 | o2 o3 o6 o7] of this half's 8 outputs; the 64-bit swap puts them in order */
            const __m256 sums = _mm256_hadd_ps(acc[r][2 * half], acc[r][2 * half + 1]);
            __m256 out8 = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(sums), 0xD8));
            if (bias) out8 = _mm256_add_ps(out8, _mm256_loadu_ps(bias + 8 * half));
            _mm256_storeu_ps(y + (long)r * ldy + 8 * half, out8);
        }
    }
}

int gemv_f16_blocks(const float* x, int rows, int in, const uint16_t* wb, long block_stride, const float* bias,
                    float* y, int out, int threads) {
    if (out % 16 || rows < 1) return 1;
    const int blocks = out / 16;
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (blocks > 1 && threads > 1)")
    for (int blk = 0; blk < blocks; blk++) {
        const uint16_t* w = wb + (long)blk * block_stride;
        const float* b = bias ? bias + 16 * blk : NULL;
        int r0 = 0;
        for (; r0 + 2 <= rows; r0 += 2) f16_rows(x + (long)r0 * in, 2, in, w, b, y + (long)r0 * out + 16 * blk, out);
        if (r0 < rows) f16_rows(x + (long)r0 * in, 1, in, w, b, y + (long)r0 * out + 16 * blk, out);
    }
    return 0;
}
#else
int has_f16_blocks(void) { return 0; }
int gemv_f16_blocks(const float* x, int rows, int in, const uint16_t* wb, long block_stride, const float* bias,
                    float* y, int out, int threads) {
    (void)x; (void)rows; (void)in; (void)wb; (void)block_stride; (void)bias; (void)y; (void)out; (void)threads;
    return 1;
}
#endif

/* int4 weights, group-wise (llama.cpp's Q4_0 unit: 32 input channels per group, one f16 scale per output and
 * group, signed levels -8..7, no zero point): W[j, i] = scale[j, i / 32] * q[j, i]. The block layout of the
 * bf16 / int8 kernels, with each block's pair-rows grouped and stored as unsigned nibbles q + 8, two pair-rows
 * per 32 bytes: wb[blk, g, c, k] (bytes) = element k of pair 2c (low nibble) | element k of pair 2c + 1 (high
 * nibble), where element k = 2 j + ch of a pair-row is output j of the block at channel 32 g + 2 p + ch, as
 * in the bf16 layout. 256 bytes per group; scales sg[blk, g, j] (f16), the groups of a block contiguous. `in`
 * is a multiple of 32 (the caller pads channels with zero weights and zero inputs); x given in bf16 as for
 * the others.
 *
 * y[j] = sum_g scale[j, g] * sum_{i in g} x_bf16[i] q[j, i], accumulated in f32: each group's sum is exact up
 * to f32 rounding (products of a bf16 and a small integer), then scaled and added. With AVX-512 BF16, 32 bytes
 * (two pair-rows) are widened to 16-bit lanes once; the low nibbles, and the lanes shifted right by 4, index a
 * 32-entry table of the levels in bf16 (vpermw reads 5 index bits: the table repeats every 16, so the bit
 * above the nibble does not matter), and the bf16 pairs are multiplied as in the bf16 kernel. With AVX2, the
 * levels come from byte look-ups and are multiplied in f32 (int4_rows_avx2); elsewhere the portable loop below,
 * which the compiler vectorises over the 32 bytes, computes the same sums with f32 multiply-adds. */
__attribute__((unused)) static void int4_block_portable(const uint16_t* x, int rows, int in, const uint8_t* w,
                                                        const uint16_t* sg, float* y, long ldy) {
    const int groups = in / 32;
    for (int r = 0; r < rows; r++) {
        const uint16_t* xr = x + (long)r * in;
        float total[32] = {0};
        for (int g = 0; g < groups; g++) {
            float acc[32] = {0};
            for (int c = 0; c < 8; c++) {
                const uint8_t* b = w + ((long)g * 8 + c) * 32;
                const uint16_t* xc = xr + 32 * g + 4 * c;
                const float xa[2] = {bf16_to_f32(xc[0]), bf16_to_f32(xc[1])};
                const float xb[2] = {bf16_to_f32(xc[2]), bf16_to_f32(xc[3])};
#pragma omp simd
                for (int k = 0; k < 32; k++)
                    acc[k] += xa[k & 1] * (float)((b[k] & 15) - 8) + xb[k & 1] * (float)((b[k] >> 4) - 8);
            }
            const _Float16* s = (const _Float16*)sg + (long)g * 16;
#pragma omp simd
            for (int k = 0; k < 32; k++) total[k] += acc[k] * (float)s[k >> 1];
        }
        for (int j = 0; j < 16; j++) y[(long)r * ldy + j] = total[2 * j] + total[2 * j + 1];
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
static void int4_block_avx512(const uint16_t* x, int rows, int in, const uint8_t* w, const uint16_t* sg,
                              float* y, long ldy, __m512i levels) {
    const int groups = in / 32;
    for (int r0 = 0; r0 < rows; r0 += MAX_BLOCK_ROWS) {
        const int nr = rows - r0 < MAX_BLOCK_ROWS ? rows - r0 : MAX_BLOCK_ROWS;
        const uint16_t* xr0 = x + (long)r0 * in;
        __m512 total[MAX_BLOCK_ROWS];
        for (int r = 0; r < nr; r++) total[r] = _mm512_setzero_ps();
        for (int g = 0; g < groups; g++) {
            __m512 acc[MAX_BLOCK_ROWS][2];
            for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            const uint8_t* wg = w + (long)g * 256;
            for (int c = 0; c < 8; c++) {
                const __m512i lanes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(wg + 32 * c)));
                const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(lanes, levels);
                const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(lanes, 4), levels);
                for (int r = 0; r < nr; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, xr0 + (long)r * in + 32 * g + 4 * c, 4);
                    memcpy(&x1, xr0 + (long)r * in + 32 * g + 4 * c + 2, 4);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32(x0), w0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_set1_epi32(x1), w1);
                }
            }
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sg + (long)g * 16)));
            for (int r = 0; r < nr; r++) total[r] = _mm512_fmadd_ps(_mm512_add_ps(acc[r][0], acc[r][1]), s, total[r]);
        }
        for (int r = 0; r < nr; r++) _mm512_storeu_ps(y + (long)(r0 + r) * ldy, total[r]);
    }
}
#endif

#ifdef AVX2_BLOCK_ROWS
/* AVX2: 32 bytes of a group at a time. Their low and high nibbles (pairs 2c and 2c + 1) become bf16 levels by two
 * byte look-ups (each level's high and low byte; exact) interleaved into 16-bit lanes; those split into each
 * channel's weights in f32 as the bf16 blocks do; f32 FMAs; each group's sums scaled once. The interleave works
 * within 128-bit lanes, so one accumulator holds outputs 0-3 and 8-11 (A) and the other 4-7 and 12-15 (B),
 * put back in order at the end. `nr` (1 or 2) rows, inlined with a constant as the bf16 / int8 blocks. */
static inline __attribute__((always_inline)) void int4_rows_avx2(const float* x, const int nr, int in,
                                                                 const uint8_t* w, const uint16_t* sg, float* y,
                                                                 long ldy, __m256i level_lo, __m256i level_hi) {
    const __m256i low4 = _mm256_set1_epi8(15), high16 = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 total[AVX2_BLOCK_ROWS][2];
    for (int r = 0; r < nr; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < in / 32; g++) {
        __m256 acc[AVX2_BLOCK_ROWS][4];  /* A channel 0, A channel 1, B channel 0, B channel 1 */
        for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(w + (long)g * 256 + 32 * c));
            const __m256i nibbles[2] = {_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)};
            for (int h = 0; h < 2; h++) {
                const __m256i lo = _mm256_shuffle_epi8(level_lo, nibbles[h]);
                const __m256i hi = _mm256_shuffle_epi8(level_hi, nibbles[h]);
                const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
                const __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
                const __m256 a1 = _mm256_castsi256_ps(_mm256_and_si256(a, high16));
                const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
                const __m256 b1 = _mm256_castsi256_ps(_mm256_and_si256(b, high16));
                for (int r = 0; r < nr; r++) {
                    const float* xr = x + (long)r * in + 32 * g + 4 * c + 2 * h;
                    const __m256 x0 = _mm256_broadcast_ss(xr), x1 = _mm256_broadcast_ss(xr + 1);
                    acc[r][0] = _mm256_fmadd_ps(x0, a0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(x1, a1, acc[r][1]);
                    acc[r][2] = _mm256_fmadd_ps(x0, b0, acc[r][2]);
                    acc[r][3] = _mm256_fmadd_ps(x1, b1, acc[r][3]);
                }
            }
        }
        const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sg + (long)g * 16)));
        const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sg + (long)g * 16 + 8)));
        const __m256 sa = _mm256_permute2f128_ps(s0, s1, 0x20), sb = _mm256_permute2f128_ps(s0, s1, 0x31);
        for (int r = 0; r < nr; r++) {
            total[r][0] = _mm256_fmadd_ps(_mm256_add_ps(acc[r][0], acc[r][1]), sa, total[r][0]);
            total[r][1] = _mm256_fmadd_ps(_mm256_add_ps(acc[r][2], acc[r][3]), sb, total[r][1]);
        }
    }
    for (int r = 0; r < nr; r++) {
        _mm256_storeu_ps(y + (long)r * ldy, _mm256_permute2f128_ps(total[r][0], total[r][1], 0x20));
        _mm256_storeu_ps(y + (long)r * ldy + 8, _mm256_permute2f128_ps(total[r][0], total[r][1], 0x31));
    }
}
#endif

int gemv_int4_blocks(const uint16_t* x, int rows, int in, const uint8_t* wb, long block_stride, const uint16_t* scale,
                     const float* bias, float* y, int out, int threads) {
    if (out % 16 || in % 32 || rows < 1) return 1;
    const int blocks = out / 16;
    const long scale_stride = (long)(in / 32) * 16;  /* f16 scales per block */
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
    uint16_t table[32];
    for (int i = 0; i < 32; i++) {
        const float level = (float)(i % 16 - 8);
        uint32_t u;
        memcpy(&u, &level, 4);
        table[i] = (uint16_t)(u >> 16);  /* exact: small integers have 8-bit mantissas */
    }
    const __m512i levels = _mm512_loadu_si512(table);
#elif defined(AVX2_BLOCK_ROWS)
    uint8_t bytes[2][32];  /* the high and low byte of each level's bf16, for both 128-bit lanes */
    for (int i = 0; i < 32; i++) {
        const float level = (float)(i % 16 - 8);
        uint32_t u;
        memcpy(&u, &level, 4);
        bytes[0][i] = (uint8_t)(u >> 16);
        bytes[1][i] = (uint8_t)(u >> 24);
    }
    const __m256i level_lo = _mm256_loadu_si256((const __m256i*)bytes[0]);
    const __m256i level_hi = _mm256_loadu_si256((const __m256i*)bytes[1]);
    float* xf = widen_inputs(x, (long)rows * in);
    if (!xf) return 2;
#endif
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (blocks > 1 && threads > 1)")
    for (int blk = 0; blk < blocks; blk++) {
        const uint8_t* w = wb + (long)blk * block_stride;
        const uint16_t* sg = scale + (long)blk * scale_stride;
        float* yb = y + 16 * (long)blk;
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
        int4_block_avx512(x, rows, in, w, sg, yb, out, levels);
#elif defined(AVX2_BLOCK_ROWS)
        int r0 = 0;
        for (; r0 + 2 <= rows; r0 += 2)
            int4_rows_avx2(xf + (long)r0 * in, 2, in, w, sg, yb + (long)r0 * out, out, level_lo, level_hi);
        if (r0 < rows) int4_rows_avx2(xf + (long)r0 * in, 1, in, w, sg, yb + (long)r0 * out, out, level_lo, level_hi);
#else
        int4_block_portable(x, rows, in, w, sg, yb, out);
#endif
        if (bias)
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < 16; j++) yb[(long)r * out + j] += bias[16 * blk + j];
    }
#if defined(AVX2_BLOCK_ROWS) && !(defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__))
    free(xf);
#endif
    return 0;
}
