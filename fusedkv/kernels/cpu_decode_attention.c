/* One-token attention over a KV cache for CPU decoding: the factored form of paper Sec. 2.5, the CPU
 * counterpart of the Triton decode kernel (fusedkv/kernels/triton_decode.py).
 *
 * For each batch row b and query head h (kv head g = h / group):
 *     s_t   = sum_k (a_k[g] (.) q_h) . K_k[b, g, t] * scale          (1 or 2 key sources)
 *     p     = softmax(s) over t in [start_b, T)
 *     out_h = sum_v b_v[g] (.) (sum_t p_t V_v[b, g, t])              (1 or 2 value sources)
 * with a_k, b_v per-channel fusion weights [H_kv, D] (NULL: weight 1, plain reuse). Nothing fused is
 * ever written: key weights go onto the query, value weights onto the output.
 *
 * Sources are read in place with their own strides (a static cache's filled prefix is a strided view)
 * and in the cache's element type: f32, bf16 or f16, widened to f32 as read (f16 a row at a time),
 * f32 arithmetic throughout.
 * One task per (b, kv head) streams that head's keys once for all the query heads that share it
 * (GQA), then its values once; tasks are split across threads. exp is a vectorisable polynomial
 * (Cephes expf, relative error ~1e-7) so the softmax loop vectorises with the rest.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define MAX_GROUP 64

/* How a row of D cache elements is read, per kind. f32 is read in place. bf16 is the top half of an f32, so
 * each element is widened as it is read (a shift: cheaper than a pass over a buffer, measured). An f16 row
 * is first widened into `buf` by F16C in a loop of its own (element by element it does not vectorise,
 * measured 2x slower). ROWT: the row pointer's type; PREP: the row as read; EL: element d as f32. */
static inline const float* widen_f16(const void* row, int D, float* buf) {
    const uint16_t* s = (const uint16_t*)row;
    int d = 0;
#if defined(__F16C__)
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + d))));
#endif
    for (; d < D; d++) buf[d] = (float)((const _Float16*)row)[d];
    return buf;
}

#define ROWT_KV_F32 const float*
#define ROWT_KV_BF16 const uint16_t*
#define ROWT_KV_F16 const float*
#define PREP_KV_F32(row, buf) ((const float*)(row))
#define PREP_KV_BF16(row, buf) ((const uint16_t*)(row))
#define PREP_KV_F16(row, buf) widen_f16((row), D, (buf))
#define EL_KV_F32(r, d) ((r)[d])
#define EL_KV_BF16(r, d) bf16_to_f32((r)[d])
#define EL_KV_F16(r, d) ((r)[d])

/* Scores of 4 keys at a time: four independent dot products keep the FMA units busy while each one's
 * horizontal sum completes (one key at a time is bound by that sum's latency). */
#define DOT_ROW(KIND, T)                                                                                 \
    for (int j = 0; j < group; j++)                                                                     \
        for (int k = 0; k < n_k; k++) {                                                                 \
            const float* qk = qs + ((long)j * n_k + k) * D;                                             \
            const T* base = (const T*)k_ptr[k] + b * k_sb[k] + g * k_sh[k];                             \
            const long st = k_st[k];                                                                    \
            float* s = scores + (long)j * T_len;                                                        \
            int t = start;                                                                              \
            for (; t + 4 <= T_len; t += 4) {                                                            \
                ROWT_##KIND r0 = PREP_##KIND(base + t * st, wbuf);                                      \
                ROWT_##KIND r1 = PREP_##KIND(base + (t + 1) * st, wbuf + D);                            \
                ROWT_##KIND r2 = PREP_##KIND(base + (t + 2) * st, wbuf + 2 * D);                        \
                ROWT_##KIND r3 = PREP_##KIND(base + (t + 3) * st, wbuf + 3 * D);                        \
                float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;                                           \
                _Pragma("omp simd reduction(+:a0,a1,a2,a3)")                                            \
                for (int d = 0; d < D; d++) {                                                           \
                    a0 += qk[d] * EL_##KIND(r0, d); a1 += qk[d] * EL_##KIND(r1, d);                     \
                    a2 += qk[d] * EL_##KIND(r2, d); a3 += qk[d] * EL_##KIND(r3, d);                     \
                }                                                                                       \
                if (k == 0) { s[t] = a0; s[t + 1] = a1; s[t + 2] = a2; s[t + 3] = a3; }                 \
                else { s[t] += a0; s[t + 1] += a1; s[t + 2] += a2; s[t + 3] += a3; }                    \
            }                                                                                           \
            for (; t < T_len; t++) {                                                                    \
                ROWT_##KIND r0 = PREP_##KIND(base + t * st, wbuf);                                      \
                float a0 = 0.f;                                                                         \
                _Pragma("omp simd reduction(+:a0)")                                                     \
                for (int d = 0; d < D; d++) a0 += qk[d] * EL_##KIND(r0, d);                             \
                s[t] = k == 0 ? a0 : s[t] + a0;                                                         \
            }                                                                                           \
        }

/* Values 4 rows at a time: one load and store of the accumulator per 4 value rows. */
#define ACC_ROW(KIND, T)                                                                                 \
    for (int v = 0; v < n_v; v++) {                                                                     \
        const T* base = (const T*)v_ptr[v] + b * v_sb[v] + g * v_sh[v];                                 \
        const long st = v_st[v];                                                                        \
        for (int j = 0; j < group; j++) {                                                               \
            const float* p = scores + (long)j * T_len;                                                  \
            float* o = acc + ((long)j * n_v + v) * D;                                                   \
            int t = start;                                                                              \
            for (; t + 4 <= T_len; t += 4) {                                                            \
                ROWT_##KIND r0 = PREP_##KIND(base + t * st, wbuf);                                      \
                ROWT_##KIND r1 = PREP_##KIND(base + (t + 1) * st, wbuf + D);                            \
                ROWT_##KIND r2 = PREP_##KIND(base + (t + 2) * st, wbuf + 2 * D);                        \
                ROWT_##KIND r3 = PREP_##KIND(base + (t + 3) * st, wbuf + 3 * D);                        \
                const float p0 = p[t], p1 = p[t + 1], p2 = p[t + 2], p3 = p[t + 3];                     \
                _Pragma("omp simd")                                                                     \
                for (int d = 0; d < D; d++)                                                             \
                    o[d] += p0 * EL_##KIND(r0, d) + p1 * EL_##KIND(r1, d) + p2 * EL_##KIND(r2, d)       \
                          + p3 * EL_##KIND(r3, d);                                                      \
            }                                                                                           \
            for (; t < T_len; t++) {                                                                    \
                ROWT_##KIND r0 = PREP_##KIND(base + t * st, wbuf);                                      \
                const float p0 = p[t];                                                                  \
                _Pragma("omp simd")                                                                     \
                for (int d = 0; d < D; d++) o[d] += p0 * EL_##KIND(r0, d);                              \
            }                                                                                           \
        }                                                                                               \
    }

/* q [B, H_q, D] contiguous; out [B, H_q, D] contiguous; the sources of K (and those of V) share their
 * strides (elements); fusion weights are f32 with `*_hs` elements between kv heads (0: one [D] weight
 * shared by the heads) or NULL; kv_start [B] or NULL. Returns 0, or non-zero on a bad argument. */
int decode_attention(const float* q, int B, int H_q, int H_kv, int D, int T_len, float scale, int kind,
                     int n_k, const void* k0, const void* k1, long ksb, long ksh, long kst,
                     const float* ka0, const float* ka1, long ka_hs,
                     int n_v, const void* v0, const void* v1, long vsb, long vsh, long vst,
                     const float* vb0, const float* vb1, long vb_hs,
                     const int64_t* kv_start, float* out, int threads) {
    return decode_attention_capped(q, B, H_q, H_kv, D, T_len, scale, 0.f, kind, n_k, k0, k1, ksb, ksh, kst, ka0, ka1,
                                   ka_hs, n_v, v0, v1, vsb, vsh, vst, vb0, vb1, vb_hs, kv_start, out, NULL, threads);
}

/* The same, with Gemma 2's soft-capping of the scores (softcap > 0: s -> softcap tanh(s / softcap), after the
 * scale) and, where `lse` [B, H_q] is given, each row's log-sum-exp of its scores (-inf with no key), so that
 * the native step can merge attention over two sets of keys (a window's ring and this step's token). */
int decode_attention_capped(const float* q, int B, int H_q, int H_kv, int D, int T_len, float scale, float softcap,
                            int kind, int n_k, const void* k0, const void* k1, long ksb, long ksh, long kst,
                            const float* ka0, const float* ka1, long ka_hs,
                            int n_v, const void* v0, const void* v1, long vsb, long vsh, long vst,
                            const float* vb0, const float* vb1, long vb_hs,
                            const int64_t* kv_start, float* out, float* lse, int threads) {
    const void* k_ptr[2] = {k0, k1};
    const void* v_ptr[2] = {v0, v1};
    const long k_sb[2] = {ksb, ksb}, k_sh[2] = {ksh, ksh}, k_st[2] = {kst, kst};
    const long v_sb[2] = {vsb, vsb}, v_sh[2] = {vsh, vsh}, v_st[2] = {vst, vst};
    const float* k_w[2] = {ka0, ka1};
    const float* v_w[2] = {vb0, vb1};
    const int group = H_q / H_kv;
    if (group > MAX_GROUP || n_k < 1 || n_k > 2 || n_v < 1 || n_v > 2) return 1;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (B * H_kv > 1 && threads > 1)
    for (int task = 0; task < B * H_kv; task++) {
        const int b = task / H_kv, g = task % H_kv;
        const int start = kv_start ? (int)kv_start[b] : 0;
        float* scores = malloc(sizeof(float) * ((size_t)group * T_len + (size_t)(group * (n_k + n_v) + 4) * D));
        if (!scores) { failed = 1; continue; }
        float* qs = scores + (size_t)group * T_len;  /* [group, n_k, D]: query with key weights and scale */
        float* acc = qs + (size_t)group * n_k * D;    /* [group, n_v, D] */
        float* wbuf = acc + (size_t)group * n_v * D;  /* [4, D]: f16 cache rows widened to f32 */
        for (int j = 0; j < group; j++)
            for (int k = 0; k < n_k; k++)
                for (int d = 0; d < D; d++) {
                    const float w = k_w[k] ? k_w[k][(long)g * ka_hs + d] : 1.f;
                    qs[((long)j * n_k + k) * D + d] = q[((long)b * H_q + g * group + j) * D + d] * w * scale;
                }
        if (kind == KV_F32) { DOT_ROW(KV_F32, float) }
        else if (kind == KV_BF16) { DOT_ROW(KV_BF16, uint16_t) }
        else { DOT_ROW(KV_F16, _Float16) }
        for (int j = 0; j < group; j++) {  /* softmax over [start, T) */
            float* s = scores + (long)j * T_len;
            float m = -INFINITY, sum = 0.f;
            if (softcap > 0.f)
                for (int t = start; t < T_len; t++) s[t] = softcap * tanhf(s[t] / softcap);
            for (int t = start; t < T_len; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+:sum)
            for (int t = start; t < T_len; t++) { s[t] = exp_poly(s[t] - m); sum += s[t]; }
            const float inv = sum > 0.f ? 1.f / sum : 0.f;  /* no key at all: zeros, as the reference */
            if (lse) lse[(long)b * H_q + g * group + j] = sum > 0.f ? m + logf(sum) : -INFINITY;
#pragma omp simd
            for (int t = start; t < T_len; t++) s[t] *= inv;
        }
        memset(acc, 0, sizeof(float) * (size_t)group * n_v * D);
        if (kind == KV_F32) { ACC_ROW(KV_F32, float) }
        else if (kind == KV_BF16) { ACC_ROW(KV_BF16, uint16_t) }
        else { ACC_ROW(KV_F16, _Float16) }
        for (int j = 0; j < group; j++) {
            float* o = out + ((long)b * H_q + g * group + j) * D;
            for (int d = 0; d < D; d++) {
                float y = 0.f;
                for (int v = 0; v < n_v; v++)
                    y += (v_w[v] ? v_w[v][(long)g * vb_hs + d] : 1.f) * acc[((long)j * n_v + v) * D + d];
                o[d] = y;
            }
        }
        free(scores);
    }
    return failed ? 2 : 0;
}
