/* One-token attention over a KIVI cache (fusedkv/quant/kivi.py), reading its packed 2/4-bit codes, fp16
 * scales and zero points and its full-precision residual in place: nothing is dequantised into a tensor.
 *
 * KIVI (Liu et al. 2024, Sec. 3) stores keys per channel (one scale s and zero z per channel per group of
 * G tokens) and values per token (one s, z per group of G channels), x ~ c * s + z, plus the most recent
 * tokens in full precision. Both products of attention are linear in the codes, so the scales move off
 * the cache and onto the small side, as FusedKV's factored form moves the fusion weights (paper Sec. 2.5):
 *
 *     q . K_t         = sum_d (q_d s_gd) c_td + sum_d q_d z_gd                 (key group g holding t)
 *     sum_t p_t V_td  = sum_t (p_t s_t,g(d)) c_td + sum_g(d) (sum_t p_t z_t,g)   (value group g(d) of channel d)
 *
 * so a key group costs one product of the query with its [D] scales, and a value row one product of its
 * probability with its D/G scales. Codes are packed 8/bits per byte with the channels split into 8/bits
 * parts, byte i holding channel i of each part (`fusedkv.quant.kivi.pack_codes`), so one bit field of a row's
 * contiguous bytes meets one contiguous part of the query (keys) or of the accumulator (values). The loops
 * are written once over AVX-512 or AVX2 vectors (whichever the compiler targets, -march=native, as for the
 * other kernels), with portable loops for other processors and shapes (a part not a whole number of vectors).
 * AVX2 takes its own loops first where rows are whole 16-byte units (`cpu_kivi_avx2.h`: it has no float table
 * lookup, so it converts each bit field where it lies instead of widening bytes).
 *
 * Layout of one row of one KIVI storage layer (`KiviRow`, fusedkv.kernels.cpu_kivi.row_table), per kv head:
 *   key codes [k_cap, D/pb] u8, key scale / zero [k_cap/G, D] f16, key residual [R, D] f32,
 *   value codes [v_cap, D/pb] u8, value scale / zero [v_cap, D/G] f16, value residual [R + 1, D] f32.
 * A row holding n tokens (its own: padding is never stored) has (n/R)R keys and max(n - R, 0) values
 * quantised, the rest in its residual (KIVI Algorithm 1). A decode step appends one pending token to both
 * residuals (`kivi_append`), attends over n + 1 tokens, and quantises what left the residual windows only
 * after every layer has read it (`kivi_flush`), as the module path's `KIVILayer.update` returns its tokens
 * before flushing them. The flush computes the codes, scales and zeros as PyTorch's `_min_max_quantize`
 * does, operation for operation in f32 (round half to even), so both paths store the same bits.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#define KIVI_MAX_GROUP 64
#define KIVI_MAX_D 512

static inline float h2f(uint16_t h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }
static inline uint16_t f2h(float x) { _Float16 f = (_Float16)x; uint16_t h; memcpy(&h, &f, 2); return h; }

/* Elements between kv heads in each buffer of a row. */
typedef struct { long kc, ks, kr, vc, vs, vr; } HeadStrides;

static HeadStrides strides_of(const KiviShape* s, const KiviRow* r) {
    const int D = s->head_dim, pb = 8 / s->bits, G = s->group, R = s->residual;
    HeadStrides h = {r->k_cap * (D / pb), (r->k_cap / G) * D, (long)R * D, r->v_cap * (D / pb),
                     r->v_cap * (D / G), (long)(R + 1) * D};
    return h;
}

/* The vector primitives of the two loops below: AVX-512 (16 lanes) or AVX2 + FMA + F16C (8 lanes), whichever
 * the compiler targets (-march=native); neither: the portable loops only. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define KV_W 16
typedef __m512 vf;
typedef __m512i vi;
#define V_BYTES(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p)))  /* W bytes -> W int32 */
/* Bit field `sh` of each lane as f32 in one permute: vpermps reads the low 4 bits of each index lane, and the
 * table maps them to the field's value (4 bits: i; 2 bits: i & 3), so neither a mask nor a conversion. */
#define V_FIELD(x, sh, t) _mm512_permutexvar_ps((sh) != 0 ? _mm512_srlv_epi32((x), _mm512_set1_epi32(sh)) : (x), (t))
#define V_TABLE(bits) ((bits) == 4 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) \
                                   : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3))
typedef __m512 vtable;
#define V_HALF(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))  /* W fp16 -> W f32 */
#define V_LOAD _mm512_loadu_ps
#define V_STORE _mm512_storeu_ps
#define V_SET1 _mm512_set1_ps
#define V_ZERO _mm512_setzero_ps
#define V_MUL _mm512_mul_ps
#define V_ADD _mm512_add_ps
#define V_FMA _mm512_fmadd_ps
#define V_SUM _mm512_reduce_add_ps
static inline __m256 v_half_sum(__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_W 8
typedef __m256 vf;
typedef __m256i vi;
#define V_BYTES(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p)))
#define V_FIELD(x, sh, m) _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32((x), _mm256_set1_epi32(sh)), (m)))
#define V_TABLE(bits) _mm256_set1_epi32((1 << (bits)) - 1)  /* here a mask */
typedef __m256i vtable;
#define V_HALF(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#define V_LOAD _mm256_loadu_ps
#define V_STORE _mm256_storeu_ps
#define V_SET1 _mm256_set1_ps
#define V_ZERO _mm256_setzero_ps
#define V_MUL _mm256_mul_ps
#define V_ADD _mm256_add_ps
#define V_FMA _mm256_fmadd_ps
static inline __m256 v_half_sum(__m256 x) { return x; }
static inline float V_SUM(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#ifdef KV_W
/* The sums of four vectors at once (fewer shuffles than four reductions): out[k] = sum of x_k's lanes. */
static inline void v_sum4(vf x0, vf x1, vf x2, vf x3, float* out) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v_half_sum(x0), v_half_sum(x1)),
                                    _mm256_hadd_ps(v_half_sum(x2), v_half_sum(x3)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

/* Whether the vector loops take these shapes: whole vectors of bytes per part, and (values) of channels per
 * group, so that one vector of a part never straddles two value groups. */
static inline int vector_fits(int D, int G, int bits) {
#ifdef KV_W
    return (D * bits / 8) % KV_W == 0 && G % KV_W == 0;
#else
    (void)D; (void)G; (void)bits;
    return 0;
#endif
}

#ifdef KV_W
#define PREFETCH(p) _mm_prefetch((const char*)(p), _MM_HINT_T0)
#define KIVI_AHEAD 8192  /* bytes of each code stream prefetched ahead, as cpu_decode_attention.c's AHEAD (the
                          * hardware's streamer stops at each 4 KiB page) */
#if KV_W == 8
#define KIVI_AVX2 1
#include "cpu_kivi_avx2.h"  /* AVX2's own loops for whole 16-byte units (its header says why) */
#endif

/* Scores of 4 quantised keys r0[0..3] (rows of nb bytes) for query heads j0, j0 + JB - 1 (JB 1 or 2): each bit
 * field of the 4 rows is unpacked once for both heads. w [group, D]: each head's query times the key group's
 * scales; c0 [group]: its product with the zeros. */
static inline __attribute__((always_inline)) void key_block(const int JB, const int bits, int j0, const uint8_t* r0,
                                                            int nb, int D, const float* w, const float* c0,
                                                            float* scores, long T, long t, int add) {
    const int pb = 8 / bits;
    const vtable m = V_TABLE(bits);
    const float *w0 = w + (long)j0 * D, *w1 = w + (long)(j0 + JB - 1) * D;
    vf a[2][4];
    for (int j = 0; j < 2; j++)
        for (int k = 0; k < 4; k++) a[j][k] = V_ZERO();
    for (int i = 0; i < nb; i += KV_W) {
        const vi x0 = V_BYTES(r0 + i), x1 = V_BYTES(r0 + nb + i);
        const vi x2 = V_BYTES(r0 + 2 * nb + i), x3 = V_BYTES(r0 + 3 * nb + i);
        for (int p = 0; p < pb; p++) {
            const vf f0 = V_FIELD(x0, bits * p, m), f1 = V_FIELD(x1, bits * p, m);
            const vf f2 = V_FIELD(x2, bits * p, m), f3 = V_FIELD(x3, bits * p, m);
            const vf wa = V_LOAD(w0 + p * nb + i);
            a[0][0] = V_FMA(wa, f0, a[0][0]); a[0][1] = V_FMA(wa, f1, a[0][1]);
            a[0][2] = V_FMA(wa, f2, a[0][2]); a[0][3] = V_FMA(wa, f3, a[0][3]);
            if (JB == 2) {
                const vf wb = V_LOAD(w1 + p * nb + i);
                a[1][0] = V_FMA(wb, f0, a[1][0]); a[1][1] = V_FMA(wb, f1, a[1][1]);
                a[1][2] = V_FMA(wb, f2, a[1][2]); a[1][3] = V_FMA(wb, f3, a[1][3]);
            }
        }
    }
    for (int j = 0; j < JB; j++) {
        float dots[4], *s = scores + (long)(j0 + j) * T + t;
        v_sum4(a[j][0], a[j][1], a[j][2], a[j][3], dots);
        for (int k = 0; k < 4; k++) s[k] = (add ? s[k] : 0.f) + dots[k] + c0[j0 + j];
    }
}
#endif

/* Scores of the quantised keys t < nq (whole groups of G) against the query rows of every head of the group
 * (qs + j * q_js, weights and scale on them): scores[j * T + t] = or += q_j . K_t, the codes read once for all
 * the heads. `w` [group, D]: scratch for each head's query times one group's scales. Channel p * nb + i is bit
 * field p of byte i (`pack_codes`), so field p of a row's bytes meets the query's part p. */
static inline __attribute__((always_inline)) void key_scores_q(const float* qs, long q_js, int group,
                                                               const uint8_t* codes, const uint16_t* sc,
                                                               const uint16_t* zr, long nq, int D, int G,
                                                               float* scores, long T, int add, float* w,
                                                               const int bits) {
    const int pb = 8 / bits, nb = D / pb, mask = (1 << bits) - 1;
    const int vec = vector_fits(D, G, bits);
#ifdef KIVI_AVX2
    const int k2 = k2_fits(nb, G);
#endif
    float c0[KIVI_MAX_GROUP];
    for (long grp = 0; grp < nq / G; grp++) {
        const uint16_t *gs = sc + grp * D, *gz = zr + grp * D;
        const long t0 = grp * G;
        long t = t0;
        for (int j = 0; j < group; j++) {
            const float* qw = qs + j * q_js;
            float* wj = w + (long)j * D;
            int d = 0;
            c0[j] = 0.f;
#ifdef KV_W
            if (vec) {
                vf c = V_ZERO();
                for (; d < D; d += KV_W) {
                    const vf qv = V_LOAD(qw + d);
                    V_STORE(wj + d, V_MUL(qv, V_HALF(gs + d)));
                    c = V_FMA(qv, V_HALF(gz + d), c);
                }
                c0[j] = V_SUM(c);
            }
#endif
            for (; d < D; d++) {
                wj[d] = qw[d] * h2f(gs[d]);
                c0[j] += qw[d] * h2f(gz[d]);
            }
        }
#ifdef KIVI_AVX2
        if (k2) {
            k2_key_group(group, bits, codes, t0, G, nb, D, w, c0, w + (long)group * D, scores, T, add);
            continue;
        }
#endif
#ifdef KV_W
        if (vec) {
            const long ahead = KIVI_AHEAD / ((long)G * nb) > 1 ? KIVI_AHEAD / ((long)G * nb) : 1;  /* groups */
            for (int o = 0; o < 2 * D; o += 64) {  /* the scale and zero streams, a group's rows at a time */
                PREFETCH((const char*)(gs + ahead * D) + o);
                PREFETCH((const char*)(gz + ahead * D) + o);
            }
            for (; t + 4 <= t0 + G; t += 4) {  /* four keys at a time: independent sums (cpu_decode_attention.c) */
                const uint8_t* r0 = codes + t * nb;
                for (int o = 0; o < 4 * nb; o += 64) PREFETCH(r0 + KIVI_AHEAD + o);
                int j0 = 0;
                for (; j0 + 2 <= group; j0 += 2) key_block(2, bits, j0, r0, nb, D, w, c0, scores, T, t, add);
                if (j0 < group) key_block(1, bits, j0, r0, nb, D, w, c0, scores, T, t, add);
            }
        }
#endif
        for (; t < t0 + G; t++) {
            const uint8_t* r0 = codes + t * nb;
            for (int j = 0; j < group; j++) {
                const float* wj = w + (long)j * D;
                float a0 = 0.f, *s = scores + (long)j * T + t;
                for (int p = 0; p < pb; p++)
                    for (int i = 0; i < nb; i++) a0 += wj[p * nb + i] * (float)((r0[i] >> (bits * p)) & mask);
                *s = add ? *s + a0 + c0[j] : a0 + c0[j];
            }
        }
    }
}

/* For every head j of the group: acc_j [D] += sum_t p_j[t] (c_t * s_t) and zacc_j [D/G] += sum_t p_j[t] z_t over
 * the quantised values t < nq (p_j = scores + j * T, acc_j = acc + j * acc_js, zacc_j = zacc + j * D/G). Four rows
 * at a time in the vector loop, each bit field unpacked once for all the heads: one load and store of each
 * head's accumulator per four rows. `w` [group, 4, D/G]: scratch for the probabilities times the rows' scales. */
static inline __attribute__((always_inline)) void value_acc_q(const float* restrict scores, long T, int group,
                                                              const uint8_t* codes, const uint16_t* sc,
                                                              const uint16_t* zr, long nq, int D, int G,
                                                              float* restrict acc, long acc_js,
                                                              float* restrict zacc, float* restrict w,
                                                              const int bits) {
    const int pb = 8 / bits, nb = D / pb, mask = (1 << bits) - 1, ng = D / G;
    long t = 0;
#ifdef KIVI_AVX2
    if (k2_fits(nb, G)) t = k2_values(scores, T, group, codes, sc, zr, nq, D, G, acc, acc_js, zacc, w, bits);
    else
#endif
#ifdef KV_W
    if (vector_fits(D, G, bits)) {
        const vtable m = V_TABLE(bits);
        const long ahead = KIVI_AHEAD / nb;  /* rows */
        for (; t + 4 <= nq; t += 4) {
            const uint8_t* r0 = codes + t * nb;
            for (int o = 0; o < 4 * nb; o += 64) PREFETCH(r0 + KIVI_AHEAD + o);
            PREFETCH(sc + (t + ahead) * ng);
            PREFETCH(zr + (t + ahead) * ng);
            for (int k = 0; k < 4; k++)
                for (int g = 0; g < ng; g++) {
                    const float s = h2f(sc[(t + k) * ng + g]), z = h2f(zr[(t + k) * ng + g]);
                    for (int j = 0; j < group; j++) {
                        const float pj = scores[(long)j * T + t + k];
                        w[((long)j * 4 + k) * ng + g] = pj * s;
                        zacc[(long)j * ng + g] += pj * z;
                    }
                }
            for (int i = 0; i < nb; i += KV_W) {
                const vi x0 = V_BYTES(r0 + i), x1 = V_BYTES(r0 + nb + i);
                const vi x2 = V_BYTES(r0 + 2 * nb + i), x3 = V_BYTES(r0 + 3 * nb + i);
                for (int ph = 0; ph < pb; ph++) {
                    const int d0 = ph * nb + i, g = d0 / G;
                    const vf f0 = V_FIELD(x0, bits * ph, m), f1 = V_FIELD(x1, bits * ph, m);
                    const vf f2 = V_FIELD(x2, bits * ph, m), f3 = V_FIELD(x3, bits * ph, m);
                    for (int j = 0; j < group; j++) {
                        const float* wj = w + (long)j * 4 * ng + g;
                        float* o = acc + j * acc_js + d0;
                        /* a tree, so that the accumulator's chain from block to block is one add long */
                        const vf a01 = V_FMA(V_SET1(wj[ng]), f1, V_MUL(V_SET1(wj[0]), f0));
                        const vf a23 = V_FMA(V_SET1(wj[3 * ng]), f3, V_MUL(V_SET1(wj[2 * ng]), f2));
                        V_STORE(o, V_ADD(V_LOAD(o), V_ADD(a01, a23)));
                    }
                }
            }
        }
    }
#endif
    for (; t < nq; t++) {
        const uint8_t* r0 = codes + t * nb;
        for (int j = 0; j < group; j++) {
            const float pj = scores[(long)j * T + t];
            float* o = acc + j * acc_js;
            for (int ph = 0; ph < pb; ph++)
                for (int i = 0; i < nb; i++) {
                    const int d = ph * nb + i;
                    o[d] += pj * h2f(sc[t * ng + d / G]) * (float)((r0[i] >> (bits * ph)) & mask);
                }
            for (int g = 0; g < ng; g++) zacc[(long)j * ng + g] += pj * h2f(zr[t * ng + g]);
        }
    }
}

/* Full-precision residual: s[t] (+)= qw . K_t; acc [D] += sum_t p_t V_t. */
static void key_scores_f(const float* qw, const float* k, long n, int D, float* s, int add) {
#ifdef KIVI_AVX2
    if (D % 8 == 0) { k2_key_residual(qw, k, n, D, s, add); return; }
#endif
    for (long t = 0; t < n; t++) {
        float a = 0.f;
#pragma omp simd reduction(+:a)
        for (int d = 0; d < D; d++) a += qw[d] * k[t * D + d];
        s[t] = add ? s[t] + a : a;
    }
}

static void value_acc_f(const float* p, const float* v, long n, int D, float* acc) {
#ifdef KIVI_AVX2
    if (D % 8 == 0) { k2_value_residual(p, v, n, D, acc); return; }
#endif
    for (long t = 0; t < n; t++) {
        const float pt = p[t];
#pragma omp simd
        for (int d = 0; d < D; d++) acc[d] += pt * v[t * D + d];
    }
}

/* Token counts of a row holding n tokens plus `pending` new ones not yet flushed: quantised keys / values and
 * the total attended over. */
static inline void counts(long n, int R, long* kq, long* vq) {
    *kq = (n / R) * R;
    *vq = n > R ? n - R : 0;
}

/* F(group, bits) with the bit width and (MHA) group 1 as constants: the compiler unrolls on them (measured: the
 * runtime one-head loops made MHA 1.1-1.2x slower). */
#define BY_GROUP_AND_BITS(F)                                  \
    if (group == 1) { if (bits == 4) F(1, 4); else F(1, 2); } \
    else if (bits == 4) F(group, 4);                          \
    else F(group, 2);

int kivi_attention(const float* q, int B, int H_q, int H_kv, float scale, const KiviShape* shape,
                   int n_k, const KiviRow* k0, const KiviRow* k1, const float* ka0, const float* ka1, long ka_hs,
                   int n_v, const KiviRow* v0, const KiviRow* v1, const float* vb0, const float* vb1, long vb_hs,
                   const int64_t* n_tokens, int pending, float* out, int threads) {
    const KiviRow* k_rows[2] = {k0, k1};
    const KiviRow* v_rows[2] = {v0, v1};
    const float* k_w[2] = {ka0, ka1};
    const float* v_w[2] = {vb0, vb1};
    const int D = shape->head_dim, G = shape->group, R = shape->residual, bits = shape->bits;
    const int group = H_q / H_kv, pb = 8 / bits;
    if (group > KIVI_MAX_GROUP || n_k < 1 || n_k > 2 || n_v < 1 || n_v > 2 || D > KIVI_MAX_D || D % G
        || G % pb || R % G || (bits != 2 && bits != 4) || H_kv != shape->n_kv_heads)
        return 1;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (B * H_kv > 1 && threads > 1)
    for (int task = 0; task < B * H_kv; task++) {
        const int b = task / H_kv, g = task % H_kv;
        const long n = n_tokens[b], T = n + pending;
        long kq, vq;
        counts(n, R, &kq, &vq);
        float* scores = malloc(sizeof(float) * ((size_t)group * T + (size_t)group * (n_k + 2 * n_v + 4) * D
                                                + (size_t)16 * D));
        if (!scores) { failed = 1; continue; }
        float* qs = scores + (size_t)group * T;       /* [group, n_k, D]: query with key weights and scale */
        float* acc = qs + (size_t)group * n_k * D;     /* [group, n_v, D]: quantised values */
        float* accr = acc + (size_t)group * n_v * D;   /* [group, n_v, D]: residual values, natural order */
        float* zacc = accr + (size_t)group * n_v * D;  /* [group, D/G] */
        float* wsc = zacc + (size_t)group * D;         /* [3 group + 16, D]: keys' w, or values' w [group, 4, D/G],
                                                        * and the AVX2 loops' scratch (cpu_kivi_avx2.h) */
        for (int j = 0; j < group; j++)
            for (int k = 0; k < n_k; k++)
                for (int d = 0; d < D; d++) {
                    const float w = k_w[k] ? k_w[k][(long)g * ka_hs + d] : 1.f;
                    qs[((long)j * n_k + k) * D + d] = q[((long)b * H_q + g * group + j) * D + d] * w * scale;
                }
        for (int k = 0; k < n_k; k++) {
            const KiviRow* r = &k_rows[k][b];
            const HeadStrides hs = strides_of(shape, r);
            const uint8_t* codes = r->k_codes + g * hs.kc;
            const uint16_t *sc = r->k_scale + g * hs.ks, *zr = r->k_zero + g * hs.ks;
            const long q_js = (long)n_k * D;
#define KEYS(GR, BITS) key_scores_q(qs + k * D, q_js, GR, codes, sc, zr, kq, D, G, scores, T, k > 0, wsc, BITS)
            BY_GROUP_AND_BITS(KEYS)
#undef KEYS
            for (int j = 0; j < group; j++)
                key_scores_f(qs + j * q_js + k * D, r->k_res + g * hs.kr, T - kq, D, scores + (long)j * T + kq, k > 0);
        }
        float inv[KIVI_MAX_GROUP];  /* 1 / each head's sum of exps: applied to its output, not to every p */
        for (int j = 0; j < group; j++) {  /* softmax over the row's T tokens */
            float m;
            const float sum = softmax_exp(scores + (long)j * T, 0, (int)T, &m);
            inv[j] = sum > 0.f ? 1.f / sum : 0.f;
        }
        memset(acc, 0, sizeof(float) * (size_t)group * n_v * D * 2);  /* acc and accr */
        for (int j = 0; j < group; j++) memset(out + ((long)b * H_q + g * group + j) * D, 0, sizeof(float) * (size_t)D);
        for (int v = 0; v < n_v; v++) {
            const KiviRow* r = &v_rows[v][b];
            const HeadStrides hs = strides_of(shape, r);
            const uint8_t* codes = r->v_codes + g * hs.vc;
            const uint16_t *sc = r->v_scale + g * hs.vs, *zr = r->v_zero + g * hs.vs;
            const long a_js = (long)n_v * D;
            memset(zacc, 0, sizeof(float) * (size_t)group * (D / G));
#define VALUES(GR, BITS) value_acc_q(scores, T, GR, codes, sc, zr, vq, D, G, acc + v * D, a_js, zacc, wsc, BITS)
            BY_GROUP_AND_BITS(VALUES)
#undef VALUES
            const float* w = v_w[v] ? v_w[v] + (long)g * vb_hs : NULL;
            for (int j = 0; j < group; j++) {
                const float *a = acc + j * a_js + v * D, *z = zacc + (long)j * (D / G);
                float* ar = accr + j * a_js + v * D;
                float* o = out + ((long)b * H_q + g * group + j) * D;
                value_acc_f(scores + (long)j * T + vq, r->v_res + g * hs.vr, T - vq, D, ar);
                for (int d = 0; d < D; d++) {
                    const float y = a[d] + z[d / G] + ar[d];
                    o[d] += w ? w[d] * y : y;
                }
            }
        }
        for (int j = 0; j < group; j++)
            for (int d = 0; d < D; d++) out[((long)b * H_q + g * group + j) * D + d] *= inv[j];
        free(scores);
    }
    return failed ? 2 : 0;
}

/* Write the pending token's post-RoPE key and value ([D] each, f32) of kv head g into row r, which holds n
 * tokens: at the end of both residuals. */
void kivi_append(const KiviShape* shape, const KiviRow* r, int g, long n, const float* k, const float* v) {
    const int D = shape->head_dim, R = shape->residual;
    const HeadStrides hs = strides_of(shape, r);
    long kq, vq;
    counts(n, R, &kq, &vq);
    memcpy(r->k_res + g * hs.kr + (n - kq) * D, k, sizeof(float) * (size_t)D);
    memcpy(r->v_res + g * hs.vr + (n - vq) * D, v, sizeof(float) * (size_t)D);
}

/* KIVI's asymmetric min/max quantisation of `count` elements x[i * stride], as `_min_max_quantize`:
 * scale = fp16((hi - lo) / qmax), zero = fp16(lo), code = clamp(round_half_even((x - zero) / scale), 0, qmax)
 * (scale 0: divide by 1). Codes go to out[i] (one per element). Returns 1 when fp16 cannot hold them. */
static int quantize_run(const float* x, long stride, int count, int bits, uint16_t* scale, uint16_t* zero,
                        uint8_t* out) {
    const int qmax = (1 << bits) - 1;
    float lo = x[0], hi = x[0];
    for (int i = 1; i < count; i++) {
        const float e = x[i * stride];
        lo = e < lo ? e : lo;
        hi = e > hi ? e : hi;
    }
    *scale = f2h((hi - lo) / (float)qmax);
    *zero = f2h(lo);
    const float s = h2f(*scale), z = h2f(*zero);
    if (!isfinite(s) || !isfinite(z)) return 1;
    const float div = s > 0.f ? s : 1.f;
    for (int i = 0; i < count; i++) {
        float c = nearbyintf((x[i * stride] - z) / div);
        c = c < 0.f ? 0.f : (c > (float)qmax ? (float)qmax : c);
        out[i] = (uint8_t)c;
    }
    return 0;
}

/* Row r held n tokens and has just been given its (n+1)-th (`kivi_append`, then read by every layer): move
 * what leaves the residual windows into quantised storage, as `KIVILayer._flush`. Keys: once R have gathered,
 * all R, G tokens per channel group. Values: the oldest residual token once more than R are held, G channels
 * per group; the residual then moves down one row. Returns 0, or 1 when a group exceeds fp16's range. */
int kivi_flush(const KiviShape* shape, const KiviRow* r, long n) {
    const int D = shape->head_dim, R = shape->residual, G = shape->group, bits = shape->bits, pb = 8 / bits;
    const int nb = D / pb;
    const HeadStrides hs = strides_of(shape, r);
    long kq, vq;
    counts(n, R, &kq, &vq);
    uint8_t codes[KIVI_MAX_D > KIVI_MAX_GROUP ? KIVI_MAX_D : KIVI_MAX_GROUP];
    for (int g = 0; g < shape->n_kv_heads; g++) {
        if (n + 1 - kq == R) {  /* the key residual is full: R tokens become R/G groups */
            const float* kr = r->k_res + g * hs.kr;
            uint8_t* kc = r->k_codes + g * hs.kc + kq * nb;
            memset(kc, 0, (size_t)R * nb);
            for (int grp = 0; grp < R / G; grp++) {
                const long at = (kq / G + grp) * D;
                for (int d = 0; d < D; d++) {
                    if (quantize_run(kr + (long)grp * G * D + d, D, G, bits, r->k_scale + g * hs.ks + at + d,
                                     r->k_zero + g * hs.ks + at + d, codes))
                        return 1;
                    for (int t = 0; t < G; t++)
                        kc[((long)grp * G + t) * nb + d % nb] |= (uint8_t)(codes[t] << (bits * (d / nb)));
                }
            }
        }
        if (n + 1 > R) {  /* one value leaves the residual window */
            float* vr = r->v_res + g * hs.vr;
            uint8_t* vc = r->v_codes + g * hs.vc + vq * nb;
            memset(vc, 0, (size_t)nb);
            for (int grp = 0; grp < D / G; grp++) {
                const long at = g * hs.vs + vq * (D / G) + grp;
                if (quantize_run(vr + (long)grp * G, 1, G, bits, r->v_scale + at, r->v_zero + at, codes)) return 1;
                for (int c = 0; c < G; c++) {
                    const int d = grp * G + c;
                    vc[d % nb] |= (uint8_t)(codes[c] << (bits * (d / nb)));
                }
            }
            memmove(vr, vr + D, sizeof(float) * (size_t)R * D);
        }
    }
    return 0;
}
