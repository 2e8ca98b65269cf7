/* What the native CPU decode kernels share: their entry points (declared once, so a call from another
 * file is checked against the definition), the cache element kinds, and small vectorisable math. */
#ifndef FUSEDKV_CPU_KERNELS_H
#define FUSEDKV_CPU_KERNELS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };  /* cache element kinds (fusedkv.kernels.cpu_attention.KINDS) */

/* cpu_gemv.c */
void gemv_f32(const float* x, int rows, int in, const float* wt, long ldw, const float* bias, float* y, int out,
              int threads);
int gemv_blocks_isa(void);
int has_f16_blocks(void);
int gemv_f16_blocks(const float* x, int rows, int in, const uint16_t* wb, long block_stride, const float* bias,
                    float* y, int out, int threads);
int gemv_bf16_blocks(const uint16_t* x, int rows, int in, const uint16_t* wb, long block_stride, const float* scale,
                     const float* bias, float* y, int out, int threads);
int gemv_int8_blocks(const uint16_t* x, int rows, int in, const int8_t* wb, long block_stride, const float* scale,
                     const float* bias, float* y, int out, int threads);
int gemv_int4_blocks(const uint16_t* x, int rows, int in, const uint8_t* wb, long block_stride, const uint16_t* scale,
                     const float* bias, float* y, int out, int threads);

/* cpu_decode_attention.c */
int decode_attention(const float* q, int B, int H_q, int H_kv, int D, int T_len, float scale, int kind,
                     int n_k, const void* k0, const void* k1, long ksb, long ksh, long kst,
                     const float* ka0, const float* ka1, long ka_hs,
                     int n_v, const void* v0, const void* v1, long vsb, long vsh, long vst,
                     const float* vb0, const float* vb1, long vb_hs,
                     const int64_t* kv_start, float* out, int threads);
int decode_attention_capped(const float* q, int B, int H_q, int H_kv, int D, int T_len, float scale, float softcap,
                            int kind, int n_k, const void* k0, const void* k1, long ksb, long ksh, long kst,
                            const float* ka0, const float* ka1, long ka_hs,
                            int n_v, const void* v0, const void* v1, long vsb, long vsh, long vst,
                            const float* vb0, const float* vb1, long vb_hs,
                            const int64_t* kv_start, float* out, float* lse, int threads);

/* The softmax's max (*m_out) and sum of exp(s - max) over s[start, T), the exps written back (vectorised). */
float softmax_exp(float* s, int start, int T, float* m_out);

/* cpu_kivi_attention.c: a KIVI cache (fusedkv/quant/kivi.py) read in place; layouts in that file. */
typedef struct {
    int bits, group, residual, head_dim, n_kv_heads;
} KiviShape;
typedef struct {  /* one row of one storage layer: pointers at kv head 0 (fusedkv.kernels.cpu_kivi._Row) */
    uint8_t* k_codes; uint16_t* k_scale; uint16_t* k_zero; float* k_res;
    uint8_t* v_codes; uint16_t* v_scale; uint16_t* v_zero; float* v_res;
    long k_cap, v_cap;  /* tokens per kv head the key / value code buffers hold */
} KiviRow;
int kivi_attention(const float* q, int B, int H_q, int H_kv, float scale, const KiviShape* shape,
                   int n_k, const KiviRow* k0, const KiviRow* k1, const float* ka0, const float* ka1, long ka_hs,
                   int n_v, const KiviRow* v0, const KiviRow* v1, const float* vb0, const float* vb1, long vb_hs,
                   const int64_t* n_tokens, int pending, float* out, int threads);
void kivi_append(const KiviShape* shape, const KiviRow* r, int g, long n, const float* k, const float* v);
int kivi_flush(const KiviShape* shape, const KiviRow* r, long n);

/* A bf16 value (the top half of an f32) widened to f32: a shift. */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

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
