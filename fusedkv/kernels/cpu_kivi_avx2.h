/* The AVX2 loops of cpu_kivi_attention.c (included there when the compiler targets AVX2 + FMA + F16C but not
 * AVX-512): the codes are turned into floats in place, without moving a byte across lanes.
 *
 * AVX2 has no one-instruction table lookup of floats (AVX-512's vpermps over 16 entries), and widening each
 * byte to a 32-bit lane before shifting costs a shuffle per 8 codes. Instead a row's bytes are read as 32-bit
 * lanes and field j of every lane (bits [bits * j, bits * (j + 1))) is masked where it lies: the lane is then
 * the integer c * 2^(bits j), which converts to float exactly (4 significant bits at most). The 2^(-bits j) is
 * folded into the other operand, exactly (a power of two): into the keys' weights once per key group, onto the
 * value accumulators once at the end. The top field is shifted down instead (a signed conversion would read
 * its high bit as a sign). So one mask, one conversion and one FMA per 8 codes.
 *
 * Which channel a lane holds: 16 bytes of a row (a "unit" u) are 4 lanes; lane l holds bytes 4l..4l+3, and
 * byte m of it holds, in bit field p, channel p * nb + 16u + 4l + m (`pack_codes`: channel i of part p in
 * field p of byte i). Field j = m * pb + p. So the 16 channels of a unit's part form a 4x4 block whose
 * transpose gives each field's lanes: the keys' weights are transposed once per group, the value
 * accumulators once at the end. Two rows share a 256-bit vector (row a in the low 128 bits, b in the high),
 * so rows of 16 bytes (2-bit codes of 64 channels) fill whole vectors. Taken when a row is whole units and a
 * value group whole units of channels (nb % 16 == 0 and G % 16 == 0: 64-channel heads at 2 bits, 32 at 4, and
 * KIVI's G = 32); other shapes take the generic vector loops. Products are the same products as the generic
 * loops'; only the order of the sums differs.
 */
#include <immintrin.h>

#define K2_PAIRS 16  /* value row pairs per pass: their weights stay in L1 while each field is accumulated */

static inline int k2_fits(int nb, int G) { return nb % 16 == 0 && G % 16 == 0; }

/* Field j of each 32-bit lane as float: c * 2^(bits j), or c for the top field. */
static inline __attribute__((always_inline)) __m256 k2_field(__m256i x, int j, int bits) {
    if (j == 32 / bits - 1) return _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 32 - bits));
    return _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(((1 << bits) - 1) << (bits * j))));
}

/* What field j's lanes are multiplied by to give the codes (exact). */
static inline float k2_unit(int j, int bits) { return j == 32 / bits - 1 ? 1.f : 1.f / (float)(1u << (bits * j)); }

/* 16 bytes of row a (low half) and of row b (high half). */
static inline __m256i k2_pair(const uint8_t* a, const uint8_t* b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                                   _mm_loadu_si128((const __m128i*)b), 1);
}

/* One head's key weights w [D] (its query times a key group's scales) in field order, both halves alike:
 * out [U, F, 8], out[u][j][l] = w[p * nb + 16u + 4l + m] * k2_unit(j) (j = m * pb + p). */
static inline void k2_key_weights(const float* w, int nb, int bits, float* out) {
    const int pb = 8 / bits, F = 32 / bits;
    for (int u = 0; u < nb / 16; u++)
        for (int p = 0; p < pb; p++) {
            const float* c = w + p * nb + 16 * u;
            __m128 r[4] = {_mm_loadu_ps(c), _mm_loadu_ps(c + 4), _mm_loadu_ps(c + 8), _mm_loadu_ps(c + 12)};
            _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
            for (int m = 0; m < 4; m++) {
                const int j = m * pb + p;
                const __m128 v = _mm_mul_ps(r[m], _mm_set1_ps(k2_unit(j, bits)));
                _mm256_storeu_ps(out + ((long)u * F + j) * 8, _mm256_set_m128(v, v));
            }
        }
}

/* Scores of 8 key rows r0[0..7] (nb bytes each) for heads h0, h0 + JB - 1: s_h[k] (+)= W_h . c_k + c0_h. Each
 * field of a pair of rows is converted once for both heads; with one head, two sums per pair (odd and even
 * fields) keep the FMA chains short. */
static inline __attribute__((always_inline)) void k2_key_block(const int JB, const int bits, const uint8_t* r0,
                                                               int nb, const float* W0, const float* W1,
                                                               float* s0, float* s1, float c0, float c1, int add) {
    const int F = 32 / bits;
    __m256 a[2][4];
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 4; p++) a[h][p] = _mm256_setzero_ps();
    for (int u = 0; u < nb / 16; u++) {
        __m256i x[4];
        for (int p = 0; p < 4; p++) x[p] = k2_pair(r0 + 2 * p * nb + 16 * u, r0 + (2 * p + 1) * nb + 16 * u);
        const float *w0 = W0 + (long)u * F * 8, *w1 = W1 + (long)u * F * 8;
#pragma GCC unroll 16
        for (int j = 0; j < F; j++) {
            const __m256 wa = _mm256_loadu_ps(w0 + j * 8);
            const __m256 wb = JB == 2 ? _mm256_loadu_ps(w1 + j * 8) : wa;
            for (int p = 0; p < 4; p++) {
                const __m256 f = k2_field(x[p], j, bits);
                if (JB == 2) {
                    a[0][p] = _mm256_fmadd_ps(f, wa, a[0][p]);
                    a[1][p] = _mm256_fmadd_ps(f, wb, a[1][p]);
                } else {
                    a[j & 1][p] = _mm256_fmadd_ps(f, wa, a[j & 1][p]);
                }
            }
        }
    }
    if (JB == 1)
        for (int p = 0; p < 4; p++) a[0][p] = _mm256_add_ps(a[0][p], a[1][p]);
    for (int h = 0; h < JB; h++) {
        /* lane k of the low half: row 2k; of the high half: row 2k + 1 */
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
        const __m128 lo = _mm256_castps256_ps128(s), hi = _mm256_extractf128_ps(s, 1);
        float dots[8], *o = h ? s1 : s0;
        const float c = h ? c1 : c0;
        _mm_storeu_ps(dots, _mm_unpacklo_ps(lo, hi));
        _mm_storeu_ps(dots + 4, _mm_unpackhi_ps(lo, hi));
        for (int k = 0; k < 8; k++) o[k] = (add ? o[k] : 0.f) + dots[k] + c;
    }
}

/* Scores of the 8-row blocks of one key group (rows t0..t0 + G) for every head: `w` [group, D] the heads'
 * weights for the group, c0 their products with the zeros, `wt` [group, 2D] scratch. */
static inline __attribute__((always_inline)) void k2_key_group(const int group, const int bits, const uint8_t* codes,
                                                               long t0, int G, int nb, int D, const float* w,
                                                               const float* c0, float* wt, float* scores, long T,
                                                               int add) {
    for (int j = 0; j < group; j++) k2_key_weights(w + (long)j * D, nb, bits, wt + (long)j * 2 * D);
    for (long t = t0; t < t0 + G; t += 8) {
        const uint8_t* r0 = codes + t * nb;
        for (int o = 0; o < 8 * nb; o += 64) _mm_prefetch((const char*)(r0 + KIVI_AHEAD + o), _MM_HINT_T0);
        int j = 0;
        for (; j + 2 <= group; j += 2)
            k2_key_block(2, bits, r0, nb, wt + (long)j * 2 * D, wt + (long)(j + 1) * 2 * D, scores + (long)j * T + t,
                         scores + (long)(j + 1) * T + t, c0[j], c0[j + 1], add);
        if (j < group)
            k2_key_block(1, bits, r0, nb, wt + (long)j * 2 * D, NULL, scores + (long)j * T + t, NULL, c0[j], 0.f, add);
    }
}

/* Fields j0..j0 + FB - 1 of unit u of `npairs` row pairs (codes rc), for heads h0..h0 + JB - 1: acc_T[h][u][j] +=
 * the pair's weights for j's value group (pw [JB, K2_PAIRS, ng, 8]: [p_a s_a ... | p_b s_b ...]) times the field.
 * The JB * FB sums stay in registers over the pairs. */
static inline __attribute__((always_inline)) void k2_value_fields(const int JB, const int FB, const int bits,
                                                                  const uint8_t* rc, int npairs, int nb, int G,
                                                                  int ng, int u, int j0, const float* pw,
                                                                  float* accT, long accT_js) {
    const int pb = 8 / bits, F = 32 / bits;
    __m256 a[2][8];
    int gof[8];
    for (int f = 0; f < FB; f++) gof[f] = (((j0 + f) % pb) * nb + 16 * u) / G;
    for (int h = 0; h < JB; h++)
        for (int f = 0; f < FB; f++) a[h][f] = _mm256_loadu_ps(accT + h * accT_js + ((long)u * F + j0 + f) * 8);
    for (int q = 0; q < npairs; q++) {
        const __m256i x = k2_pair(rc + 2L * q * nb + 16 * u, rc + (2L * q + 1) * nb + 16 * u);
        const float* wq = pw + (long)q * ng * 8;
#pragma GCC unroll 8
        for (int f = 0; f < FB; f++) {
            const __m256 v = k2_field(x, j0 + f, bits);
            for (int h = 0; h < JB; h++)
                a[h][f] = _mm256_fmadd_ps(v, _mm256_loadu_ps(wq + (long)h * K2_PAIRS * ng * 8 + gof[f] * 8), a[h][f]);
        }
    }
    for (int h = 0; h < JB; h++)
        for (int f = 0; f < FB; f++) _mm256_storeu_ps(accT + h * accT_js + ((long)u * F + j0 + f) * 8, a[h][f]);
}

/* The two rows of each of `npairs` pairs, as one vector: 2 ng fp16 scales (or zeros) from s, zeros above. */
static inline __m256 k2_pair_halves(const uint16_t* s, int ng) {
    __m128i x;
    if (ng == 4) x = _mm_loadu_si128((const __m128i*)s);
    else if (ng == 2) x = _mm_loadl_epi64((const __m128i*)s);
    else { int32_t v; memcpy(&v, s, 4); x = _mm_cvtsi32_si128(v); }
    return _mm256_cvtph_ps(x);
}

/* Each pair q's value weights pw[q][g] = [p_a s_a,g x4 | p_b s_b,g x4] (p = one head's probabilities from the
 * first pair on; sc, zr: the pairs' scales and zeros, [2 npairs, ng]), and z[g] += sum p_t z_t,g. Lane
 * i < 2 ng of a pair's vectors is row i / ng's group i % ng (ng <= 4); larger ng: one scale at a time. */
static inline void k2_pair_weights(const float* p, const uint16_t* sc, const uint16_t* zr, int npairs, int ng,
                                   float* pw, float* z) {
    if (ng > 4) {
        for (int q = 0; q < npairs; q++)
            for (int g = 0; g < ng; g++) {
                const uint16_t *sa = sc + 2L * q * ng, *za = zr + 2L * q * ng;
                const __m128 wa = _mm_set1_ps(p[2 * q] * h2f(sa[g])), wb = _mm_set1_ps(p[2 * q + 1] * h2f(sa[ng + g]));
                _mm256_storeu_ps(pw + ((long)q * ng + g) * 8, _mm256_set_m128(wb, wa));
                z[g] += p[2 * q] * h2f(za[g]) + p[2 * q + 1] * h2f(za[ng + g]);
            }
        return;
    }
    __m256i spread = _mm256_setzero_si256(), pick[4];  /* p_a, p_b over the lanes; lanes of group g */
    int ix[8];
    for (int i = 0; i < 8; i++) ix[i] = i < 2 * ng ? i / ng : 0;
    spread = _mm256_loadu_si256((const __m256i*)ix);
    for (int g = 0; g < ng; g++) pick[g] = _mm256_setr_epi32(g, g, g, g, ng + g, ng + g, ng + g, ng + g);
    __m256 zs = _mm256_setzero_ps();
    for (int q = 0; q < npairs; q++) {
        const __m256 pp = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double*)(p + 2 * q)))), spread);
        const __m256 w = _mm256_mul_ps(pp, k2_pair_halves(sc + 2L * q * ng, ng));
        zs = _mm256_fmadd_ps(pp, k2_pair_halves(zr + 2L * q * ng, ng), zs);
        for (int g = 0; g < ng; g++) _mm256_storeu_ps(pw + ((long)q * ng + g) * 8, _mm256_permutevar8x32_ps(w, pick[g]));
    }
    float zl[8];
    _mm256_storeu_ps(zl, zs);
    for (int g = 0; g < ng; g++) z[g] += zl[g] + zl[ng + g];
}

/* The quantised values' rows [0, 2 * (nq / 2)) for every head, as value_acc_q (acc_j [D] += sum_t p_j[t] s_t c_t,
 * zacc_j [D/G] += sum_t p_j[t] z_t); returns the rows done (the odd last one is the caller's). `wk` scratch:
 * [group, 2D] field-order sums, then [2, K2_PAIRS, ng, 8] pair weights. */
static inline __attribute__((always_inline)) long k2_values(const float* scores, long T, const int group,
                                                            const uint8_t* codes, const uint16_t* sc,
                                                            const uint16_t* zr, long nq, int D, int G, float* acc,
                                                            long acc_js, float* zacc, float* wk, const int bits) {
    const int pb = 8 / bits, nb = D / pb, ng = D / G, F = 32 / bits, U = nb / 16;
    float *accT = wk, *pw = wk + (long)group * 2 * D;
    const long accT_js = 2L * D;
    memset(accT, 0, sizeof(float) * (size_t)group * 2 * D);
    for (long p0 = 0; p0 < nq / 2; p0 += K2_PAIRS) {
        const int npairs = nq / 2 - p0 < K2_PAIRS ? (int)(nq / 2 - p0) : K2_PAIRS;
        const uint8_t* rc = codes + 2 * p0 * nb;
        for (int o = 0; o < 2 * npairs * nb; o += 64) _mm_prefetch((const char*)(rc + KIVI_AHEAD + o), _MM_HINT_T0);
        for (int o = 0; o < 4 * npairs * ng; o += 64) {  /* the scale and zero streams, as far ahead in rows */
            _mm_prefetch((const char*)(sc + (2 * p0 + KIVI_AHEAD / nb) * ng) + o, _MM_HINT_T0);
            _mm_prefetch((const char*)(zr + (2 * p0 + KIVI_AHEAD / nb) * ng) + o, _MM_HINT_T0);
        }
        for (int j0 = 0; j0 < group; j0 += 2) {
            const int JB = group - j0 >= 2 ? 2 : 1;
            for (int h = 0; h < JB; h++)  /* the pairs' weights, and the zeros' sums */
                k2_pair_weights(scores + (long)(j0 + h) * T + 2 * p0, sc + 2 * p0 * ng, zr + 2 * p0 * ng, npairs, ng,
                                pw + (long)h * K2_PAIRS * ng * 8, zacc + (long)(j0 + h) * ng);
            float* at = accT + (long)j0 * accT_js;
            for (int u = 0; u < U; u++)
                for (int j = 0; j < F; j += 8 / JB) {
                    if (JB == 2) k2_value_fields(2, 4, bits, rc, npairs, nb, G, ng, u, j, pw, at, accT_js);
                    else k2_value_fields(1, 8, bits, rc, npairs, nb, G, ng, u, j, pw, at, accT_js);
                }
        }
    }
    for (int h = 0; h < group; h++)  /* field order back to channels: both halves summed, times 2^(-bits j) */
        for (int u = 0; u < U; u++)
            for (int p = 0; p < pb; p++) {
                __m128 r[4];
                for (int m = 0; m < 4; m++) {
                    const int j = m * pb + p;
                    const float* t = accT + h * accT_js + ((long)u * F + j) * 8;
                    r[m] = _mm_mul_ps(_mm_add_ps(_mm_loadu_ps(t), _mm_loadu_ps(t + 4)), _mm_set1_ps(k2_unit(j, bits)));
                }
                _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
                float* o = acc + h * acc_js + p * nb + 16 * u;
                for (int l = 0; l < 4; l++) _mm_storeu_ps(o + 4 * l, _mm_add_ps(_mm_loadu_ps(o + 4 * l), r[l]));
            }
    return 2 * (nq / 2);
}

/* The full-precision residual (D % 8 == 0), as key_scores_f / value_acc_f: four keys at a time (independent
 * sums), and the value sums kept in registers across the tokens (not loaded and stored once per token). */
static inline void k2_key_residual(const float* qw, const float* k, long n, int D, float* s, int add) {
    long t = 0;
    for (; t + 4 <= n; t += 4) {
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int d = 0; d < D; d += 8) {
            const __m256 x = _mm256_loadu_ps(qw + d);
            for (int r = 0; r < 4; r++) a[r] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + (t + r) * D + d), a[r]);
        }
        float dots[4];
        v_sum4(a[0], a[1], a[2], a[3], dots);
        for (int r = 0; r < 4; r++) s[t + r] = (add ? s[t + r] : 0.f) + dots[r];
    }
    for (; t < n; t++) {
        __m256 a = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qw + d), _mm256_loadu_ps(k + t * D + d), a);
        s[t] = (add ? s[t] : 0.f) + V_SUM(a);
    }
}

static inline void k2_value_residual(const float* p, const float* v, long n, int D, float* acc) {
    for (int d0 = 0; d0 < D; d0 += 32) {
        const int w = D - d0 < 32 ? (D - d0) / 8 : 4;
        __m256 a[4];
        for (int i = 0; i < w; i++) a[i] = _mm256_loadu_ps(acc + d0 + 8 * i);
        for (long t = 0; t < n; t++) {
            const __m256 pt = _mm256_set1_ps(p[t]);
            for (int i = 0; i < w; i++) a[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + t * D + d0 + 8 * i), a[i]);
        }
        for (int i = 0; i < w; i++) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
    }
}
