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
 * (GQA), then its values once; tasks are split across threads. exp is a polynomial (Cephes expf,
 * relative error ~1e-7), on vectors in the vector path below (AVX-512 / AVX2), which is what runs in practice.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_GROUP 64

/* How a row of D cache elements is read, per kind. f32 is read in place. bf16 is the top half of an f32, so
 * each element is widened as it is read (a shift: cheaper than a pass over a buffer, measured). An f16 row
 * is first widened into `buf` by F16C in a loop of its own (element by element it does not vectorise,
 * measured 2x slower). ROWT: the row pointer's type; PREP: the row as read; EL: element d as f32. */
static inline const float* widen_f16(const void* row, int D, float* buf) {
    int d = 0;
#if defined(__F16C__)
    const uint16_t* s = (const uint16_t*)row;
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

/* The vector path (AVX-512, or AVX2 + FMA + F16C; D a multiple of CH): both passes stream the cache in
 * blocks of 4 rows, each row read once for two query heads under GQA, one chunk of CH elements (two f32
 * vectors) at a time, widened in registers, with a prefetch ahead. A bf16 chunk is loaded whole and split into
 * its even elements (shifted up) and its odd ones (masked): two operations per 2 VL elements, no per-element
 * widening, which is what made the portable loops compute-bound over a long cache (~4.7 GB/s). Its lanes then
 * hold the elements deinterleaved, so the query and the value accumulator are kept in that order (`reorder`).
 * The portable loops above remain for other head widths and processors. */
#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, x) _mm512_storeu_ps((p), (x))
#define V_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define V_SET1(x) _mm512_set1_ps(x)
#define V_MAX(a, b) _mm512_max_ps((a), (b))
#define V_ADD(a, b) _mm512_add_ps((a), (b))
#define V_SUB(a, b) _mm512_sub_ps((a), (b))
#define V_MUL(a, b) _mm512_mul_ps((a), (b))
#define V_MIN(a, b) _mm512_min_ps((a), (b))
#define V_FLOOR(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define V_POW2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), \
                                                                         _mm512_set1_epi32(127)), 23))
static inline void chunk(int kind, const void* p, vf* a, vf* b) {
    if (kind == KV_F32) { *a = _mm512_loadu_ps((const float*)p); *b = _mm512_loadu_ps((const float*)p + 16); }
    else if (kind == KV_BF16) {
        const __m512i x = _mm512_loadu_si512(p);
        *a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        *b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
    } else {
        *a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
        *b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p + 1));
    }
}
static inline __m256 half_sum(vf x) {  /* 16 lanes -> 8 */
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}
#define PREFETCH(p) _mm_prefetch((const char*)(p), _MM_HINT_T0)
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VL 8
typedef __m256 vf;
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, x) _mm256_storeu_ps((p), (x))
#define V_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define V_SET1(x) _mm256_set1_ps(x)
#define V_MAX(a, b) _mm256_max_ps((a), (b))
#define V_ADD(a, b) _mm256_add_ps((a), (b))
#define V_SUB(a, b) _mm256_sub_ps((a), (b))
#define V_MUL(a, b) _mm256_mul_ps((a), (b))
#define V_MIN(a, b) _mm256_min_ps((a), (b))
#define V_FLOOR(x) _mm256_floor_ps(x)
#define V_POW2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), \
                                                                         _mm256_set1_epi32(127)), 23))
static inline void chunk(int kind, const void* p, vf* a, vf* b) {
    if (kind == KV_F32) { *a = _mm256_loadu_ps((const float*)p); *b = _mm256_loadu_ps((const float*)p + 8); }
    else if (kind == KV_BF16) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)p);
        *a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        *b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
    } else {
        *a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
        *b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p + 1));
    }
}
static inline __m256 half_sum(vf x) { return x; }
#define PREFETCH(p) _mm_prefetch((const char*)(p), _MM_HINT_T0)
#endif

#ifdef VL
#define CH (2 * VL)  /* cache elements per chunk */
#define AHEAD 8192   /* bytes of rows prefetched ahead (measured: 1.3x at 32k; the hardware's streamer stops at each
                      * 4 KiB page, and a VM's page walks are slow), at least 4 rows */

/* [4] sums of 4 vectors, as one __m128 (s0, s1, s2, s3). */
static inline __m128 sum4(vf x0, vf x1, vf x2, vf x3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(half_sum(x0), half_sum(x1)),
                                    _mm256_hadd_ps(half_sum(x2), half_sum(x3)));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* exp_poly (cpu_kernels.h) on a vector: the compiler leaves the scalar loop over the scores unvectorised. */
static inline vf v_exp(vf x) {
    x = V_MIN(V_MAX(x, V_SET1(-87.f)), V_SET1(87.f));
    const vf n = V_FLOOR(V_FMA(x, V_SET1(1.44269504088896341f), V_SET1(0.5f)));
    const vf r = V_FMA(n, V_SET1(2.12194440e-4f), V_FMA(n, V_SET1(-0.693359375f), x));
    vf p = V_SET1(1.9875691500e-4f);
    p = V_FMA(p, r, V_SET1(1.3981999507e-3f));
    p = V_FMA(p, r, V_SET1(8.3334519073e-3f));
    p = V_FMA(p, r, V_SET1(4.1665795894e-2f));
    p = V_FMA(p, r, V_SET1(1.6666665459e-1f));
    p = V_FMA(p, r, V_SET1(5.0000001201e-1f));
    p = V_FMA(V_MUL(p, r), r, V_ADD(r, V_SET1(1.f)));
    return V_MUL(p, V_POW2(n));
}

/* Where element e of a row lands in a chunk's lanes: bf16 chunks deinterleave (even elements, then odd). */
static inline int lane_of(int kind, int e) {
    const int c = e / CH * CH, i = e % CH;
    return kind == KV_BF16 ? c + (i % 2) * VL + i / 2 : e;
}

/* x [n, D] from row order into chunk lane order (or back, `back`), through tmp [D]. */
static void reorder(int kind, float* x, int n, int D, float* tmp, int back) {
    if (kind != KV_BF16) return;
    for (int r = 0; r < n; r++, x += D) {
        for (int e = 0; e < D; e++) {
            if (back) tmp[e] = x[lane_of(kind, e)];
            else tmp[lane_of(kind, e)] = x[e];
        }
        memcpy(x, tmp, sizeof(float) * (size_t)D);
    }
}

/* s[j][t] (+)= q_j . K[t] over t in [start, T), heads j of [0, group) in steps of JB (1 or 2): each block of 4
 * rows is widened once per JB heads. `first`: store, else add (a second key source). */
static inline __attribute__((always_inline)) void vec_scores(
        const int kind, const int JB, const float* qs, int n_k, int k, int group, int D, const char* base,
        long st_bytes, long esz, int start, int T, float* scores, int first) {
    const long pf = (AHEAD / (D * esz) > 4 ? AHEAD / (D * esz) : 4) * st_bytes;
    for (int j0 = 0; j0 < group; j0 += JB) {
        const float* q0 = qs + ((long)j0 * n_k + k) * D;
        const float* q1 = qs + ((long)(j0 + JB - 1) * n_k + k) * D;
        float* s0 = scores + (long)j0 * T;
        float* s1 = scores + (long)(j0 + JB - 1) * T;
        int t = start;
        for (; t + 4 <= T; t += 4) {
            const char* r = base + t * st_bytes;
            vf a[2][4];
            for (int j = 0; j < 2; j++)
                for (int i = 0; i < 4; i++) a[j][i] = V_ZERO();
            for (int c = 0; c < D; c += CH) {
                vf x[4], y[4];
                for (int i = 0; i < 4; i++) {
                    PREFETCH(r + pf + i * st_bytes + c * esz);
                    chunk(kind, r + i * st_bytes + c * esz, &x[i], &y[i]);
                }
                const vf qa = V_LOAD(q0 + c), qb = V_LOAD(q0 + c + VL);
                for (int i = 0; i < 4; i++) a[0][i] = V_FMA(qb, y[i], V_FMA(qa, x[i], a[0][i]));
                if (JB == 2) {
                    const vf pa = V_LOAD(q1 + c), pb = V_LOAD(q1 + c + VL);
                    for (int i = 0; i < 4; i++) a[1][i] = V_FMA(pb, y[i], V_FMA(pa, x[i], a[1][i]));
                }
            }
            for (int j = 0; j < JB; j++) {
                float* s = j ? s1 : s0;
                __m128 v = sum4(a[j][0], a[j][1], a[j][2], a[j][3]);
                if (!first) v = _mm_add_ps(v, _mm_loadu_ps(s + t));
                _mm_storeu_ps(s + t, v);
            }
        }
        for (; t < T; t++) {  /* the last 1-3 rows */
            vf a0 = V_ZERO(), a1 = V_ZERO();
            for (int c = 0; c < D; c += CH) {
                vf x, y;
                chunk(kind, base + t * st_bytes + c * esz, &x, &y);
                a0 = V_FMA(V_LOAD(q0 + c + VL), y, V_FMA(V_LOAD(q0 + c), x, a0));
                if (JB == 2) a1 = V_FMA(V_LOAD(q1 + c + VL), y, V_FMA(V_LOAD(q1 + c), x, a1));
            }
            const __m128 v = sum4(a0, a1, a0, a1);
            s0[t] = (first ? 0.f : s0[t]) + _mm_cvtss_f32(v);
            if (JB == 2) s1[t] = (first ? 0.f : s1[t]) + _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1));
        }
    }
}

/* o_j += sum_t p_j[t] V[t] over t in [start, T) for every head j of the group (o_j in chunk lane order): each
 * block of 4 rows is widened once for all the heads. */
static inline __attribute__((always_inline)) void vec_values(
        const int kind, int group, int D, const char* base, long st_bytes, long esz, int start, int T,
        const float* scores, float* acc, long acc_js) {
    const long pf = (AHEAD / (D * esz) > 4 ? AHEAD / (D * esz) : 4) * st_bytes;
    int t = start;
    for (; t + 4 <= T; t += 4) {
        const char* r = base + t * st_bytes;
        for (int c = 0; c < D; c += CH) {
            vf x[4], y[4];
            for (int i = 0; i < 4; i++) {
                PREFETCH(r + pf + i * st_bytes + c * esz);
                chunk(kind, r + i * st_bytes + c * esz, &x[i], &y[i]);
            }
            for (int j = 0; j < group; j++) {
                const float* p = scores + (long)j * T + t;
                float* o = acc + j * acc_js + c;
                vf oa = V_LOAD(o), ob = V_LOAD(o + VL);
                for (int i = 0; i < 4; i++) {
                    const vf pi = V_SET1(p[i]);
                    oa = V_FMA(pi, x[i], oa);
                    ob = V_FMA(pi, y[i], ob);
                }
                V_STORE(o, oa);
                V_STORE(o + VL, ob);
            }
        }
    }
    for (; t < T; t++)
        for (int c = 0; c < D; c += CH) {
            vf x, y;
            chunk(kind, base + t * st_bytes + c * esz, &x, &y);
            for (int j = 0; j < group; j++) {
                float* o = acc + j * acc_js + c;
                const vf pi = V_SET1(scores[(long)j * T + t]);
                V_STORE(o, V_FMA(pi, x, V_LOAD(o)));
                V_STORE(o + VL, V_FMA(pi, y, V_LOAD(o + VL)));
            }
        }
}

#define VEC_SCORES(KIND)                                                                                \
    for (int k = 0; k < n_k; k++) {                                                                     \
        const char* base = (const char*)k_ptr[k] + (b * k_sb[k] + g * k_sh[k]) * esz;                   \
        if (group % 2 == 0)                                                                             \
            vec_scores(KIND, 2, qs, n_k, k, group, D, base, k_st[k] * esz, esz, start, T_len, scores, !k); \
        else                                                                                            \
            vec_scores(KIND, 1, qs, n_k, k, group, D, base, k_st[k] * esz, esz, start, T_len, scores, !k); \
    }
#define VEC_VALUES(KIND)                                                                                \
    for (int v = 0; v < n_v; v++)                                                                       \
        vec_values(KIND, group, D, (const char*)v_ptr[v] + (b * v_sb[v] + g * v_sh[v]) * esz,           \
                   v_st[v] * esz, esz, start, T_len, scores, acc + (long)v * D, (long)n_v * D);
#endif

/* The softmax's max and sum of exp(s - max) over s[start, T), the exps written back; sum 0 with no key
 * (also the KIVI kernel's, cpu_kivi_attention.c). */
float softmax_exp(float* s, int start, int T, float* m_out) {
#ifdef VL
    float lanes[VL], m = -INFINITY, sum = 0.f;
    int t = start;
    vf mv = V_SET1(-INFINITY);
    for (; t + VL <= T; t += VL) mv = V_MAX(mv, V_LOAD(s + t));
    V_STORE(lanes, mv);
    for (int i = 0; i < VL; i++) m = lanes[i] > m ? lanes[i] : m;
    for (; t < T; t++) m = s[t] > m ? s[t] : m;
    const vf mm = V_SET1(m);
    vf sv = V_ZERO();
    for (t = start; t + VL <= T; t += VL) {
        const vf e = v_exp(V_SUB(V_LOAD(s + t), mm));
        V_STORE(s + t, e);
        sv = V_ADD(sv, e);
    }
    V_STORE(lanes, sv);
    for (int i = 0; i < VL; i++) sum += lanes[i];
    for (; t < T; t++) { s[t] = exp_poly(s[t] - m); sum += s[t]; }
#else
    float m = -INFINITY, sum = 0.f;
    for (int t = start; t < T; t++) m = s[t] > m ? s[t] : m;
    for (int t = start; t < T; t++) { s[t] = exp_poly(s[t] - m); sum += s[t]; }
#endif
    *m_out = m;
    return sum;
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
#ifdef VL
        const long esz = kind == KV_F32 ? 4 : 2;
        const int vec = D % CH == 0;
        if (vec) {
            reorder(kind, qs, group * n_k, D, wbuf, 0);
            if (kind == KV_F32) { VEC_SCORES(KV_F32) }
            else if (kind == KV_BF16) { VEC_SCORES(KV_BF16) }
            else { VEC_SCORES(KV_F16) }
        } else
#endif
        if (kind == KV_F32) { DOT_ROW(KV_F32, float) }
        else if (kind == KV_BF16) { DOT_ROW(KV_BF16, uint16_t) }
        else { DOT_ROW(KV_F16, _Float16) }
        float inv[MAX_GROUP];  /* 1 / each head's sum of exps: applied to its output, not to every p */
        for (int j = 0; j < group; j++) {  /* softmax over [start, T) */
            float* s = scores + (long)j * T_len;
            float m = -INFINITY, sum = 0.f;
            if (softcap > 0.f)
                for (int t = start; t < T_len; t++) s[t] = softcap * tanhf(s[t] / softcap);
            sum = softmax_exp(s, start, T_len, &m);
            inv[j] = sum > 0.f ? 1.f / sum : 0.f;  /* no key at all: zeros, as the reference */
            if (lse) lse[(long)b * H_q + g * group + j] = sum > 0.f ? m + logf(sum) : -INFINITY;
        }
        memset(acc, 0, sizeof(float) * (size_t)group * n_v * D);
#ifdef VL
        if (vec) {
            if (kind == KV_F32) { VEC_VALUES(KV_F32) }
            else if (kind == KV_BF16) { VEC_VALUES(KV_BF16) }
            else { VEC_VALUES(KV_F16) }
            reorder(kind, acc, group * n_v, D, wbuf, 1);
        } else
#endif
        if (kind == KV_F32) { ACC_ROW(KV_F32, float) }
        else if (kind == KV_BF16) { ACC_ROW(KV_BF16, uint16_t) }
        else { ACC_ROW(KV_F16, _Float16) }
        for (int j = 0; j < group; j++) {
            float* o = out + ((long)b * H_q + g * group + j) * D;
            for (int d = 0; d < D; d++) {
                float y = 0.f;
                for (int v = 0; v < n_v; v++)
                    y += (v_w[v] ? v_w[v][(long)g * vb_hs + d] : 1.f) * acc[((long)j * n_v + v) * D + d];
                o[d] = y * inv[j];
            }
        }
        free(scores);
    }
    return failed ? 2 : 0;
}
