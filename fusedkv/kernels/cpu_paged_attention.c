/* Attention of FusedKV reconstruction layers over vLLM's paged CPU KV cache, read in place through the
 * block table: the factored form of paper Sec. 3.3 (key weights on the query, value weights on the
 * output) over 1-2 key and 1-2 value sources, nothing fused and nothing gathered.
 *
 * Every query row n (a decode token, or one token of a prefill chunk) belongs to block-table row
 * row_seq[n] and sees that sequence's first row_len[n] keys (causality of a chunk is its rows' lengths),
 * or with a sliding window W only the last W of them (blocks wholly left of the window are not read):
 *     s_t   = sum_k (a_k[g] (.) q_h) . K_k[t] * scale            (one softmax over the SUM of the scores,
 *                                                                  soft-capped, c tanh(s_t / c), in Gemma 2)
 *     out_h = sum_v b_v[g] (.) (sum_t p_t V_v[t])
 * Token t of a sequence is slot t % bs of block block_table[row, t / bs]. vLLM's CPU backend keeps each
 * (block, kv head) of bs tokens in one of three layouts (`layout`; the caller learns which from the backend's
 * own cache-write op, fusedkv.serving.paged_blocks.block_layout):
 *   PAGED_ROWS        keys and values as [bs, D] rows;
 *   PAGED_KEYS_T      keys transposed, [D, bs] (its "vec" ISAs), values as rows;
 *   PAGED_AMX         its "amx" ISA (bf16): keys as AMX B tiles [bs/16][D/2][16 tokens][2 channels] (VNNI pairs
 *                     of channels), values as [D/16][bs/2][16 channels][2 tokens] (pairs of tokens).
 * Elements are f32 or bf16 (widened as read), or the 8-bit codes of vLLM's fp8 caches (`--kv-cache-dtype fp8`:
 * e4m3fn or e5m2, decoded as read through a 256-entry table; vLLM's per-layer scales are folded into the fusion
 * weights by the caller), arithmetic f32. One task per (row, kv head) covers the query
 * heads sharing it (GQA); tasks are split across threads.
 *
 * With AVX-512, f32 caches (what vLLM's "vec" ISA keeps) and D a multiple of 16 take register-blocked loops
 * (`scores_t_f32`, `values_f32`): the scores of 32 tokens in 8 independent accumulators with both key
 * sources in one pass, and the values of both sources for 64 channels at a time held in registers across
 * a block's tokens. AMX-packed bf16 caches take the same shape of loops (`scores_amx_bf16`, `values_amx_bf16`):
 * one 64-byte line is 16 tokens x 2 channels (keys) or 16 channels x 2 tokens (values), widened to two f32
 * vectors by a shift and a mask. With AVX2 (and for bf16 "vec" blocks on AVX-512 without AMX), f32 and bf16 "vec"
 * blocks take grouped loops (`scores_group_*`, `values_group_*`): the query heads of a kv head together, the two
 * sources fused in registers as they are read, so each element is loaded and widened once. The generic loops
 * below (the macros) read every other case; `choose_loops` decides, `paged_loops` reports it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#define MAX_GROUP_PAGED 64

enum { PAGED_ROWS = 0, PAGED_KEYS_T = 1, PAGED_AMX = 2 };  /* `layout` (fusedkv.kernels.native.PAGED_LAYOUTS) */
/* Element (token i, channel d) of one (block, head) in the AMX-packed layout (D, bs in scope). */
#define AMX_KEY(i, d) (((i) >> 4) * 16L * D + ((d) >> 1) * 32 + ((i) & 15) * 2 + ((d) & 1))
#define AMX_VALUE(i, d) (((d) >> 4) * 16L * bs + ((i) >> 1) * 32 + ((d) & 15) * 2 + ((i) & 1))

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGED_AVX512 1

static inline __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* s[i] = sum_k sum_d qk[k * D + d] * K_k[d * bs + i] for i < cnt: keys transposed ([D, bs] per block and head),
 * f32; `bases[k]` at the block and head. Tokens in pairs of 16-lane tiles, channels in 4 chains. */
static inline __attribute__((always_inline)) void scores_t_f32(const float* const* bases, const int NK,
                                                                const float* qk, int D, int bs, int cnt, float* s) {
    for (int i0 = 0; i0 < cnt; i0 += 32) {
        const __mmask16 m0 = lanes(cnt - i0), m1 = lanes(cnt - i0 - 16);
        __m512 a[4][2];
        for (int c = 0; c < 4; c++) a[c][0] = a[c][1] = _mm512_setzero_ps();
        for (int k = 0; k < NK; k++) {
            const float* base = bases[k] + i0;
            const float* q = qk + (long)k * D;
            int d = 0;
            for (; d + 4 <= D; d += 4)
                for (int c = 0; c < 4; c++) {
                    const __m512 qd = _mm512_set1_ps(q[d + c]);
                    const float* row = base + (long)(d + c) * bs;
                    a[c][0] = _mm512_fmadd_ps(qd, _mm512_maskz_loadu_ps(m0, row), a[c][0]);
                    a[c][1] = _mm512_fmadd_ps(qd, _mm512_maskz_loadu_ps(m1, row + 16), a[c][1]);
                }
            for (; d < D; d++) {
                const __m512 qd = _mm512_set1_ps(q[d]);
                const float* row = base + (long)d * bs;
                a[0][0] = _mm512_fmadd_ps(qd, _mm512_maskz_loadu_ps(m0, row), a[0][0]);
                a[0][1] = _mm512_fmadd_ps(qd, _mm512_maskz_loadu_ps(m1, row + 16), a[0][1]);
            }
        }
        for (int t = 0; t < 2; t++) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[0][t], a[1][t]), _mm512_add_ps(a[2][t], a[3][t]));
            _mm512_mask_storeu_ps(s + i0 + 16 * t, t ? m1 : m0, sum);
        }
    }
}

/* Channels d0 .. d0 + 16 nz of every value source's accumulator (acc[v * D + d]) into registers, and back. */
static inline __attribute__((always_inline)) void acc_load(__m512 o[2][4], const float* acc, int NV, int D, int d0,
                                                           int nz) {
    for (int v = 0; v < NV; v++)
        for (int z = 0; z < 4; z++)
            o[v][z] = z < nz ? _mm512_loadu_ps(acc + (long)v * D + d0 + 16 * z) : _mm512_setzero_ps();
}
static inline __attribute__((always_inline)) void acc_store(__m512 o[2][4], float* acc, int NV, int D, int d0,
                                                            int nz) {
    for (int v = 0; v < NV; v++)
        for (int z = 0; z < nz; z++) _mm512_storeu_ps(acc + (long)v * D + d0 + 16 * z, o[v][z]);
}

/* acc[v * D + d] += sum_i p[i] * V_v[i * D + d] for i < cnt: value rows [bs, D] per block and head, f32, D a
 * multiple of 16; `bases[v]` at the block and head. 64 channels of every source in registers at a time. */
static inline __attribute__((always_inline)) void values_f32(const float* const* bases, const int NV,
                                                              const float* p, int cnt, int D, int bs, float* acc) {
    (void)bs;
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int nz = D - d0 >= 64 ? 4 : (D - d0) / 16;
        __m512 o[2][4];
        acc_load(o, acc, NV, D, d0, nz);
        for (int i = 0; i < cnt; i++) {
            const __m512 pi = _mm512_set1_ps(p[i]);
            for (int v = 0; v < NV; v++) {
                const float* row = bases[v] + (long)i * D + d0;
                for (int z = 0; z < 4; z++)
                    if (z < nz) o[v][z] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(row + 16 * z), o[v][z]);
            }
        }
        acc_store(o, acc, NV, D, d0, nz);
    }
}

/* The two f32 vectors in one 64-byte line of an AMX-packed bf16 block (32 values, 16 pairs): the first of each
 * pair (the low half of each 32-bit word) and the second (the high half); a bf16 is the top half of an f32. */
static inline __attribute__((always_inline)) void widen_pairs(const uint16_t* line, __m512* first, __m512* second) {
    const __m512i w = _mm512_loadu_si512(line);
    *first = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    *second = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* s[i] = sum_k sum_d qk[k * D + d] * K_k(i, d) for i < cnt: keys AMX-packed bf16 ([bs/16][D/2][16 tokens]
 * [2 channels] per block and head, D a multiple of 16); `bases[k]` at the block and head. A tile of 16 tokens
 * at a time, its channel pairs in 4 chains; lanes past cnt are computed from whatever the slots hold and
 * never stored. */
static inline __attribute__((always_inline)) void scores_amx_bf16(const uint16_t* const* bases, const int NK,
                                                                   const float* qk, int D, int bs, int cnt, float* s) {
    (void)bs;
    for (int i0 = 0; i0 < cnt; i0 += 16) {
        __m512 a[4];
        for (int c = 0; c < 4; c++) a[c] = _mm512_setzero_ps();
        for (int k = 0; k < NK; k++) {
            const uint16_t* tile = bases[k] + (long)i0 * D;  /* tile i0 / 16 starts at (i0 / 16) * 16 * D */
            const float* q = qk + (long)k * D;
            for (int d = 0; d < D; d += 4) {  /* channel pairs d / 2 and d / 2 + 1 */
                __m512 e0, o0, e1, o1;
                widen_pairs(tile + (long)d * 16, &e0, &o0);
                widen_pairs(tile + (long)d * 16 + 32, &e1, &o1);
                a[0] = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), e0, a[0]);
                a[1] = _mm512_fmadd_ps(_mm512_set1_ps(q[d + 1]), o0, a[1]);
                a[2] = _mm512_fmadd_ps(_mm512_set1_ps(q[d + 2]), e1, a[2]);
                a[3] = _mm512_fmadd_ps(_mm512_set1_ps(q[d + 3]), o1, a[3]);
            }
        }
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
        _mm512_mask_storeu_ps(s + i0, lanes(cnt - i0), sum);
    }
}

/* acc[v * D + d] += sum_i p[i] * V_v(i, d) for i < cnt: values AMX-packed bf16 ([D/16][bs/2][16 channels]
 * [2 tokens] per block and head, D a multiple of 16); `bases[v]` at the block and head. 64 channels of every
 * source in registers at a time, tokens in pairs; of an odd count's last pair only the first token is read. */
static inline __attribute__((always_inline)) void values_amx_bf16(const uint16_t* const* bases, const int NV,
                                                                   const float* p, int cnt, int D, int bs,
                                                                   float* acc) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int nz = D - d0 >= 64 ? 4 : (D - d0) / 16;
        __m512 o[2][4];
        acc_load(o, acc, NV, D, d0, nz);
        int i = 0;
        for (; i + 2 <= cnt; i += 2) {
            const __m512 p0 = _mm512_set1_ps(p[i]), p1 = _mm512_set1_ps(p[i + 1]);
            for (int v = 0; v < NV; v++)
                for (int z = 0; z < 4; z++)
                    if (z < nz) {
                        __m512 first, second;
                        widen_pairs(bases[v] + (long)(d0 / 16 + z) * 16 * bs + (long)i * 16, &first, &second);
                        o[v][z] = _mm512_fmadd_ps(p1, second, _mm512_fmadd_ps(p0, first, o[v][z]));
                    }
        }
        if (i < cnt) {  /* odd count: token i's partner slot is past the sequence (any bits, NaN included) */
            const __m512 p0 = _mm512_set1_ps(p[i]);
            for (int v = 0; v < NV; v++)
                for (int z = 0; z < nz; z++) {
                    __m512 first, second;
                    widen_pairs(bases[v] + (long)(d0 / 16 + z) * 16 * bs + (long)i * 16, &first, &second);
                    o[v][z] = _mm512_fmadd_ps(p0, first, o[v][z]);
                }
        }
        acc_store(o, acc, NV, D, d0, nz);
    }
}

#endif


#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGED_AVX2 1

/* 8 f32 lanes from 8 f32 or 8 bf16 elements (a bf16 is the top half of an f32). */
static inline __attribute__((always_inline)) __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __attribute__((always_inline)) __m256 load8_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* The grouped AVX2 loops over "vec" blocks (keys transposed, values in rows): all the query heads of one kv head
 * (up to GROUP_AVX2 at a time) in one pass over a block, and the two sources fused as they are read (Eq. 4-5 of
 * the paper in the inner loop: K~ = a_0 (.) K_0 + a_1 (.) K_1, V~ = b_0 (.) V_0 + b_1 (.) V_1, a vector of 8
 * tokens or channels at a time, in registers, never stored). Each cache element is loaded and widened once per
 * kv head rather than once per query head and source, which is what a bf16 cache costs on AVX2 (no AVX-512's
 * wide loads, and a widening shuffle per load). */
#define GROUP_AVX2 4

/* s[j * S + i] = sum_d q[j * D + d] * K~[d, i] for the nj <= GROUP_AVX2 heads j and tokens i < cnt, K~ the fusion
 * of NK transposed key blocks (`bases[k]` at the block and head; NK = 2: weighted by w[k * D + d], NK = 1: the
 * weight is on the query). 16 tokens at a time (bs a multiple of 16: a tile never leaves its block; lanes past
 * cnt are computed from whatever the slots hold and never stored). */
#define AVX2_SCORES_GROUP(NAME, T, LOAD)                                                                  \
    static inline __attribute__((always_inline)) void NAME(const T* const* bases, const int NK, const float* w, \
                                                           const float* q, const int nj, int D, int bs, int cnt, \
                                                           float* s, long S) {                            \
        for (int i0 = 0; i0 < cnt; i0 += 16) {                                                            \
            __m256 a[GROUP_AVX2][2];                                                                      \
            for (int j = 0; j < GROUP_AVX2; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();                 \
            const T* k0 = bases[0] + i0;                                                                  \
            const T* k1 = bases[NK - 1] + i0;                                                             \
            for (int d = 0; d < D; d++) {                                                                 \
                __m256 x0 = LOAD(k0 + (long)d * bs), x1 = LOAD(k0 + (long)d * bs + 8);                   \
                if (NK == 2) {                                                                            \
                    const __m256 w0 = _mm256_set1_ps(w[d]), w1 = _mm256_set1_ps(w[D + d]);                \
                    x0 = _mm256_fmadd_ps(w1, LOAD(k1 + (long)d * bs), _mm256_mul_ps(w0, x0));             \
                    x1 = _mm256_fmadd_ps(w1, LOAD(k1 + (long)d * bs + 8), _mm256_mul_ps(w0, x1));         \
                }                                                                                         \
                for (int j = 0; j < GROUP_AVX2; j++)                                                      \
                    if (j < nj) {                                                                         \
                        const __m256 qd = _mm256_set1_ps(q[(long)j * D + d]);                             \
                        a[j][0] = _mm256_fmadd_ps(qd, x0, a[j][0]);                                       \
                        a[j][1] = _mm256_fmadd_ps(qd, x1, a[j][1]);                                       \
                    }                                                                                     \
            }                                                                                             \
            const int n = cnt - i0 < 16 ? cnt - i0 : 16;                                                  \
            for (int j = 0; j < GROUP_AVX2; j++)                                                          \
                if (j < nj) {                                                                             \
                    float tile[16];                                                                       \
                    _mm256_storeu_ps(tile, a[j][0]);                                                      \
                    _mm256_storeu_ps(tile + 8, a[j][1]);                                                  \
                    for (int t = 0; t < n; t++) s[(long)j * S + i0 + t] = tile[t];                        \
                }                                                                                         \
        }                                                                                                 \
    }

/* acc[j * accs + d] += sum_i p[j * S + i] * V~[i, d] for the nj <= GROUP_AVX2 heads j and tokens i < cnt, V~ the
 * fusion of NV value row blocks ([bs, D], `bases[v]` at the block and head; NV = 2: weighted by w[v * D + d],
 * NV = 1: the weight is applied to the output). D a multiple of 8; 16 channels of every head in registers. */
#define AVX2_VALUES_GROUP(NAME, T, LOAD)                                                                  \
    static inline __attribute__((always_inline)) void NAME(const T* const* bases, const int NV, const float* w, \
                                                           const float* p, long S, const int nj, int cnt, int D, \
                                                           float* acc, long accs) {                       \
        for (int d0 = 0; d0 < D; d0 += 16) {                                                              \
            const int nz = D - d0 >= 16 ? 2 : 1;                                                          \
            __m256 o[GROUP_AVX2][2], w0[2], w1[2];                                                        \
            for (int j = 0; j < GROUP_AVX2; j++)                                                          \
                for (int z = 0; z < 2; z++)                                                               \
                    o[j][z] = j < nj && z < nz ? _mm256_loadu_ps(acc + j * accs + d0 + 8 * z) : _mm256_setzero_ps(); \
            for (int z = 0; z < 2; z++) {                                                                 \
                w0[z] = NV == 2 && z < nz ? _mm256_loadu_ps(w + d0 + 8 * z) : _mm256_setzero_ps();        \
                w1[z] = NV == 2 && z < nz ? _mm256_loadu_ps(w + D + d0 + 8 * z) : _mm256_setzero_ps();    \
            }                                                                                             \
            for (int i = 0; i < cnt; i++) {                                                               \
                const T* r0 = bases[0] + (long)i * D + d0;                                                \
                const T* r1 = bases[NV - 1] + (long)i * D + d0;                                           \
                __m256 x[2];                                                                              \
                for (int z = 0; z < 2; z++)                                                               \
                    if (z < nz) {                                                                         \
                        x[z] = LOAD(r0 + 8 * z);                                                          \
                        if (NV == 2) x[z] = _mm256_fmadd_ps(w1[z], LOAD(r1 + 8 * z), _mm256_mul_ps(w0[z], x[z])); \
                    }                                                                                     \
                for (int j = 0; j < GROUP_AVX2; j++)                                                      \
                    if (j < nj) {                                                                         \
                        const __m256 pj = _mm256_set1_ps(p[(long)j * S + i]);                             \
                        for (int z = 0; z < 2; z++)                                                       \
                            if (z < nz) o[j][z] = _mm256_fmadd_ps(pj, x[z], o[j][z]);                     \
                    }                                                                                     \
            }                                                                                             \
            for (int j = 0; j < GROUP_AVX2; j++)                                                          \
                for (int z = 0; z < 2; z++)                                                               \
                    if (j < nj && z < nz) _mm256_storeu_ps(acc + j * accs + d0 + 8 * z, o[j][z]);         \
        }                                                                                                 \
    }

AVX2_SCORES_GROUP(scores_group_f32_avx2, float, load8_f32)
AVX2_SCORES_GROUP(scores_group_bf16_avx2, uint16_t, load8_bf16)
AVX2_VALUES_GROUP(values_group_f32_avx2, float, load8_f32)
AVX2_VALUES_GROUP(values_group_bf16_avx2, uint16_t, load8_bf16)

/* The block loops of the grouped functions: each block once per GROUP_AVX2 query heads (a full chunk with the
 * count a constant after inlining). qg: [group, D] queries (scaled; with one K source also weighted); fw: [2, D]
 * key then [2, D] value fusion weights (1 where a source has none). */
#define GROUP_SCORES(T, FN, NK)                                                                           \
    for (int blk = blk0; blk * bs < L; blk++) {                                                           \
        const long off = (long)table[blk] * block_stride + g * head_stride;                               \
        const T* b[2] = {(const T*)k_ptr[0] + off, (const T*)k_ptr[NK - 1] + off};                        \
        const int t0 = blk * bs, cnt = L - t0 < bs ? L - t0 : bs;                                         \
        for (int j0 = 0; j0 < group; j0 += GROUP_AVX2) {                                                  \
            float* s = scores + (long)j0 * S + t0 - first;                                                \
            if (group - j0 >= GROUP_AVX2) FN(b, NK, fw, qg + (long)j0 * D, GROUP_AVX2, D, bs, cnt, s, S); \
            else FN(b, NK, fw, qg + (long)j0 * D, group - j0, D, bs, cnt, s, S);                          \
        }                                                                                                 \
    }
#define GROUP_VALUES(T, FN, NV)                                                                           \
    for (int blk = blk0; blk * bs < L; blk++) {                                                           \
        const long off = (long)table[blk] * block_stride + g * head_stride;                               \
        const T* b[2] = {(const T*)v_ptr[0] + off, (const T*)v_ptr[NV - 1] + off};                        \
        const int t0 = blk * bs, cnt = L - t0 < bs ? L - t0 : bs;                                         \
        for (int j0 = 0; j0 < group; j0 += GROUP_AVX2) {                                                  \
            const float* p = scores + (long)j0 * S + t0 - first;                                          \
            float* o = acc + (long)j0 * n_v * D;                                                          \
            if (group - j0 >= GROUP_AVX2) FN(b, NV, fw + 2 * D, p, S, GROUP_AVX2, cnt, D, o, (long)n_v * D); \
            else FN(b, NV, fw + 2 * D, p, S, group - j0, cnt, D, o, (long)n_v * D);                       \
        }                                                                                                 \
    }
#endif

/* The two loops over a sequence's blocks for the register-blocked AVX-512 functions (element type T), for 1 or 2
 * sources (constants after inlining). */
#define FAST_SCORES(T, FN, NK)                                                                            \
    for (int blk = blk0; blk * bs < L; blk++) {                                                           \
        const long off = (long)table[blk] * block_stride + g * head_stride;                               \
        const T* b[2] = {(const T*)k_ptr[0] + off, (const T*)k_ptr[NK - 1] + off};                        \
        const int t0 = blk * bs, cnt = L - t0 < bs ? L - t0 : bs;                                         \
        for (int j = 0; j < group; j++)                                                                   \
            FN(b, NK, qs + (long)j * n_k * D, D, bs, cnt, scores + (long)j * S + t0 - first);             \
    }
#define FAST_VALUES(T, FN, NV)                                                                            \
    for (int blk = blk0; blk * bs < L; blk++) {                                                           \
        const long off = (long)table[blk] * block_stride + g * head_stride;                               \
        const T* b[2] = {(const T*)v_ptr[0] + off, (const T*)v_ptr[NV - 1] + off};                        \
        const int t0 = blk * bs, cnt = L - t0 < bs ? L - t0 : bs;                                         \
        for (int j = 0; j < group; j++)                                                                   \
            FN(b, NV, scores + (long)j * S + t0 - first, cnt, D, bs, acc + (long)j * n_v * D);            \
    }

#define EL_F32(p, i) ((p)[i])
#define EL_BF16(p, i) bf16_to_f32((p)[i])
#define EL_CODE8(p, i) (code8[(p)[i]])

enum { KV_E4M3 = 3, KV_E5M2 = 4 };  /* 8-bit float codes (fusedkv.kernels.native.PAGED_KINDS) */

/* The value of every 8-bit code of OCP fp8 e4m3fn (bias 7, no infinities, S.1111.111 NaN) or e5m2 (bias 15, the
 * top byte of an IEEE half), as torch's float8_e4m3fn / float8_e5m2 define them. */
static void code8_table(int kind, float* table) {
    for (int c = 0; c < 256; c++) {
        const int sign = c >> 7, e = kind == KV_E4M3 ? (c >> 3) & 15 : (c >> 2) & 31;
        const int m = kind == KV_E4M3 ? c & 7 : c & 3, mbits = kind == KV_E4M3 ? 3 : 2;
        const int bias = kind == KV_E4M3 ? 7 : 15, emax = kind == KV_E4M3 ? 15 : 31;
        float v;
        if (kind == KV_E4M3 && e == 15 && m == 7) v = NAN;
        else if (kind == KV_E5M2 && e == emax) v = m ? NAN : INFINITY;
        else if (e == 0) v = ldexpf((float)m, 1 - bias - mbits);
        else v = ldexpf((float)((1 << mbits) + m), e - bias - mbits);
        table[c] = sign ? -v : v;
    }
}

/* scores[j * S + t - first] for the query heads j of one kv head, over the blocks from key `first` on. */
#define SCORES(T, EL)                                                                                     \
    for (int blk = blk0; blk * bs < L; blk++) {                                                           \
        const long block = table[blk];                                                                    \
        const int t0 = blk * bs, cnt = L - t0 < bs ? L - t0 : bs;                                         \
        for (int k = 0; k < n_k; k++) {                                                                   \
            const T* base = (const T*)k_ptr[k] + block * block_stride + g * head_stride;                  \
            for (int j = 0; j < group; j++) {                                                             \
                const float* qk = qs + ((long)j * n_k + k) * D;                                           \
                float* s = scores + (long)j * S + t0 - first;                                             \
                if (layout == PAGED_AMX) {                                                                \
                    for (int i = 0; i < cnt; i++) {                                                       \
                        float a = 0.f;                                                                    \
                        for (int d = 0; d < D; d++) a += qk[d] * EL(base, AMX_KEY(i, d));                 \
                        s[i] = k == 0 ? a : s[i] + a;                                                     \
                    }                                                                                     \
                } else if (layout == PAGED_KEYS_T) {                                                      \
                    if (k == 0) memset(s, 0, sizeof(float) * cnt);                                        \
                    for (int d = 0; d < D; d++) {                                                         \
                        const float qd = qk[d];                                                           \
                        const T* row = base + (long)d * bs;                                               \
                        _Pragma("omp simd")                                                               \
                        for (int i = 0; i < cnt; i++) s[i] += qd * EL(row, i);                            \
                    }                                                                                     \
                } else {                                                                                  \
                    for (int i = 0; i < cnt; i++) {                                                       \
                        const T* row = base + (long)i * D;                                                \
                        float a = 0.f;                                                                    \
                        _Pragma("omp simd reduction(+:a)")                                                \
                        for (int d = 0; d < D; d++) a += qk[d] * EL(row, d);                              \
                        s[i] = k == 0 ? a : s[i] + a;                                                     \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }

#define VALUES(T, EL)                                                                                     \
    for (int blk = blk0; blk * bs < L; blk++) {                                                           \
        const long block = table[blk];                                                                    \
        const int t0 = blk * bs, cnt = L - t0 < bs ? L - t0 : bs;                                         \
        for (int v = 0; v < n_v; v++) {                                                                   \
            const T* base = (const T*)v_ptr[v] + block * block_stride + g * head_stride;                  \
            for (int j = 0; j < group; j++) {                                                             \
                const float* p = scores + (long)j * S + t0 - first;                                       \
                float* o = acc + ((long)j * n_v + v) * D;                                                 \
                for (int i = 0; i < cnt; i++) {                                                           \
                    const float pi = p[i];                                                                \
                    if (layout == PAGED_AMX) {                                                            \
                        for (int d = 0; d < D; d++) o[d] += pi * EL(base, AMX_VALUE(i, d));               \
                        continue;                                                                         \
                    }                                                                                     \
                    const T* row = base + (long)i * D;                                                    \
                    _Pragma("omp simd")                                                                   \
                    for (int d = 0; d < D; d++) o[d] += pi * EL(row, d);                                  \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }

/* The loops that read a layer's scores (which = 0) or values (which = 1): register-blocked AVX-512 over f32
 * "vec" blocks (values also in rows) or AMX-packed bf16 blocks; the grouped AVX2 loops over f32 and bf16 "vec"
 * blocks (values also in rows) that AVX-512's do not take; else the generic loops (the macros above: fp8 codes,
 * odd shapes). One decision for the kernel and for its report (`paged_loops`, fusedkv.kernels.native). */
enum { LOOPS_GENERIC = 0, LOOPS_AVX512 = 1, LOOPS_AVX512_AMX = 2, LOOPS_AVX2_GROUP = 3 };
static int choose_loops(int kind, int layout, int D, int bs, int which) {
    (void)D, (void)bs, (void)which;
#ifdef PAGED_AVX512
    if (kind == KV_F32 && D % 16 == 0 && layout != PAGED_AMX && (which || layout == PAGED_KEYS_T)) return LOOPS_AVX512;
    if (kind == KV_BF16 && layout == PAGED_AMX && bs % 16 == 0 && D % 16 == 0) return LOOPS_AVX512_AMX;
#endif
#ifdef PAGED_AVX2
    if ((kind == KV_F32 || kind == KV_BF16) && D % 8 == 0 && bs % 16 == 0 && layout != PAGED_AMX
        && (which || layout == PAGED_KEYS_T))
        return LOOPS_AVX2_GROUP;
#endif
    return LOOPS_GENERIC;
}

int paged_loops(int kind, int layout, int D, int bs, int which) { return choose_loops(kind, layout, D, bs, which); }

/* q [N, H_q, D] f32 contiguous; out [N, H_q, D] f32 contiguous; `window` W > 0: row n sees only its last W keys
 * (row_len[n] - W <= t, the model's p - W < t <= p), 0: all; `softcap` c > 0: scores -> c tanh(scores / c) after
 * the scale (Gemma 2), 0: none; `layout` one of PAGED_ROWS, PAGED_KEYS_T,
 * PAGED_AMX (which takes bs and D multiples of 16); every source cache has the same (block, head) strides in
 * elements, a value source's pointer already at its value half; block_table
 * [rows, bt_stride] int32; fusion weights f32 [H_kv, D] (`*_hs` elements between kv heads, 0: shared) or
 * NULL for 1. Returns 0, 1 on a bad argument, 2 when a buffer could not be allocated. */
int paged_attention(const float* q, int N, int H_q, int H_kv, int D, float scale, int window, float softcap, int kind,
                    const int32_t* row_seq, const int32_t* row_len, const int32_t* block_table, long bt_stride,
                    int bs, long block_stride, long head_stride, int layout,
                    int n_k, const void* k0, const void* k1, const float* ka0, const float* ka1, long ka_hs,
                    int n_v, const void* v0, const void* v1, const float* vb0, const float* vb1, long vb_hs,
                    float* out, int threads) {
    const void* k_ptr[2] = {k0, k1};
    const void* v_ptr[2] = {v0, v1};
    const float* k_w[2] = {ka0, ka1};
    const float* v_w[2] = {vb0, vb1};
    if (H_kv < 1 || H_q % H_kv || n_k < 1 || n_k > 2 || n_v < 1 || n_v > 2 || bs < 1)
        return 1;
    if (window < 0 || !(softcap >= 0.f)) return 1;
    if (kind != KV_F32 && kind != KV_BF16 && kind != KV_E4M3 && kind != KV_E5M2) return 1;
    float code8[256];
    if (kind == KV_E4M3 || kind == KV_E5M2) code8_table(kind, code8);
    if (layout != PAGED_ROWS && layout != PAGED_KEYS_T && layout != PAGED_AMX) return 1;
    if (layout == PAGED_AMX && (bs % 16 || D % 16)) return 1;
    const int group = H_q / H_kv;
    if (group > MAX_GROUP_PAGED) return 1;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (N * H_kv > 1 && threads > 1)
    for (int task = 0; task < N * H_kv; task++) {
        const int n = task / H_kv, g = task % H_kv;
        const int L = row_len[n];
        const int32_t* table = block_table + (long)row_seq[n] * bt_stride;
        float* o_rows = out + ((long)n * H_q + (long)g * group) * D;
        if (L <= 0) {  /* no key at all: zeros */
            memset(o_rows, 0, sizeof(float) * (size_t)group * D);
            continue;
        }
        /* Keys [lo, L): with a window only the last W. The loops run over whole blocks from lo's (`first` = its
         * first token), so no block left of the window is read; the few keys of that block left of lo (tokens
         * of this sequence, written) get probability 0. scores: [group, S] over keys first .. L - 1. */
        const int lo = window > 0 && L > window ? L - window : 0;
        const int blk0 = lo / bs, first = blk0 * bs, S = L - first, skip = lo - first;
        /* scores [group, S], qs, acc, and the grouped AVX2 loops' qg [group, D] and fw [4, D] */
        float* scores = malloc(sizeof(float) * ((size_t)group * S + (size_t)group * (n_k + n_v + 1) * D + 4 * (size_t)D));
        if (!scores) { failed = 1; continue; }
        float* qs = scores + (size_t)group * S;        /* [group, n_k, D]: query with key weights and scale */
        float* acc = qs + (size_t)group * n_k * D;     /* [group, n_v, D] */
        for (int j = 0; j < group; j++)
            for (int k = 0; k < n_k; k++)
                for (int d = 0; d < D; d++) {
                    const float w = k_w[k] ? k_w[k][(long)g * ka_hs + d] : 1.f;
                    qs[((long)j * n_k + k) * D + d] = q[((long)n * H_q + g * group + j) * D + d] * w * scale;
                }
        const int score_loops = choose_loops(kind, layout, D, bs, 0), value_loops = choose_loops(kind, layout, D, bs, 1);
#ifdef PAGED_AVX2
        /* The grouped loops' queries (scaled; with one K source its weight on the query) and fusion weights. */
        float* qg = acc + (size_t)group * n_v * D;    /* [group, D] */
        float* fw = qg + (size_t)group * D;           /* [2, D] key then [2, D] value weights, 1 for none */
        for (int k = 0; k < 2; k++)
            for (int d = 0; d < D; d++) {
                fw[k * D + d] = k < n_k && k_w[k] ? k_w[k][(long)g * ka_hs + d] : 1.f;
                fw[(2 + k) * D + d] = k < n_v && v_w[k] ? v_w[k][(long)g * vb_hs + d] : 1.f;
            }
        for (int j = 0; j < group; j++)
            for (int d = 0; d < D; d++)
                qg[(long)j * D + d] = q[((long)n * H_q + g * group + j) * D + d] * scale * (n_k == 1 ? fw[d] : 1.f);
#endif
        switch (score_loops) {
#ifdef PAGED_AVX512
        case LOOPS_AVX512:
            if (n_k == 2) { FAST_SCORES(float, scores_t_f32, 2) } else { FAST_SCORES(float, scores_t_f32, 1) }
            break;
        case LOOPS_AVX512_AMX:
            if (n_k == 2) { FAST_SCORES(uint16_t, scores_amx_bf16, 2) } else { FAST_SCORES(uint16_t, scores_amx_bf16, 1) }
            break;
#endif
#ifdef PAGED_AVX2
        case LOOPS_AVX2_GROUP:
            if (kind == KV_F32 && n_k == 2) { GROUP_SCORES(float, scores_group_f32_avx2, 2) }
            else if (kind == KV_F32) { GROUP_SCORES(float, scores_group_f32_avx2, 1) }
            else if (n_k == 2) { GROUP_SCORES(uint16_t, scores_group_bf16_avx2, 2) }
            else { GROUP_SCORES(uint16_t, scores_group_bf16_avx2, 1) }
            break;
#endif
        default:
            if (kind == KV_F32) { SCORES(float, EL_F32) }
            else if (kind == KV_BF16) { SCORES(uint16_t, EL_BF16) }
            else { SCORES(uint8_t, EL_CODE8) }
        }
        for (int j = 0; j < group; j++) {  /* softmax over keys [lo, L): s[skip, S) */
            float* s = scores + (long)j * S;
            float m = -INFINITY, sum = 0.f;
            if (softcap > 0.f) {  /* on the fused (summed) score, before the softmax */
                const float inv_cap = 1.f / softcap;
                for (int t = skip; t < S; t++) s[t] = softcap * tanhf(s[t] * inv_cap);
            }
            for (int t = 0; t < skip; t++) s[t] = 0.f;
            for (int t = skip; t < S; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+:sum)
            for (int t = skip; t < S; t++) { s[t] = exp_poly(s[t] - m); sum += s[t]; }
            const float inv = 1.f / sum;
#pragma omp simd
            for (int t = skip; t < S; t++) s[t] *= inv;
        }
        memset(acc, 0, sizeof(float) * (size_t)group * n_v * D);
        /* acc[j, v]: P V_v of each source, weighted at the end, except where the grouped loops fused two sources
         * (their weights applied in the loop, the sum in acc[j, 0]). */
        const int fused_values = value_loops == LOOPS_AVX2_GROUP && n_v == 2;
        switch (value_loops) {
#ifdef PAGED_AVX512
        case LOOPS_AVX512:
            if (n_v == 2) { FAST_VALUES(float, values_f32, 2) } else { FAST_VALUES(float, values_f32, 1) }
            break;
        case LOOPS_AVX512_AMX:
            if (n_v == 2) { FAST_VALUES(uint16_t, values_amx_bf16, 2) } else { FAST_VALUES(uint16_t, values_amx_bf16, 1) }
            break;
#endif
#ifdef PAGED_AVX2
        case LOOPS_AVX2_GROUP:
            if (kind == KV_F32 && n_v == 2) { GROUP_VALUES(float, values_group_f32_avx2, 2) }
            else if (kind == KV_F32) { GROUP_VALUES(float, values_group_f32_avx2, 1) }
            else if (n_v == 2) { GROUP_VALUES(uint16_t, values_group_bf16_avx2, 2) }
            else { GROUP_VALUES(uint16_t, values_group_bf16_avx2, 1) }
            break;
#endif
        default:
            if (kind == KV_F32) { VALUES(float, EL_F32) }
            else if (kind == KV_BF16) { VALUES(uint16_t, EL_BF16) }
            else { VALUES(uint8_t, EL_CODE8) }
        }
        for (int j = 0; j < group; j++)
            for (int d = 0; d < D; d++) {
                float y = 0.f;
                if (fused_values) y = acc[(long)j * n_v * D + d];
                else
                    for (int v = 0; v < n_v; v++)
                        y += (v_w[v] ? v_w[v][(long)g * vb_hs + d] : 1.f) * acc[((long)j * n_v + v) * D + d];
                o_rows[(long)j * D + d] = y;
            }
        free(scores);
    }
    return failed ? 2 : 0;
}
