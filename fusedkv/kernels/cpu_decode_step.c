/* A whole decode step of the decoder layers in one call, for CPU decoding at batch <= 4.
 *
 * A one-token step is a chain of ~40 small operations per layer (norms, QK-norm, RoPE, the cache write,
 * SiLU, residual adds) around a few matrix-vector products. Run as PyTorch ops, each costs a dispatch
 * and an allocation; together they are a floor of milliseconds per step that no faster product removes.
 * Here the same step is one C loop over the layers, reusing preallocated buffers, calling the native
 * products (cpu_gemv.c) and attention (cpu_decode_attention.c) directly. The arithmetic is the model's,
 * in the same order of operations (fusedkv/model/layers.py, attention.py):
 *
 *   h = RMSNorm(x);  [q | k | v] = h W_qkv^T (+ b)                (storage layer; Q only otherwise)
 *   q = RoPE(RMSNorm_head(q)), k = RoPE(RMSNorm_head(k)), written with v into the cache at `length`
 *   a = attention of q over the layer's 1-2 K / V sources with their fusion weights (the factored form
 *       of cpu_decode_attention.c), keys from kv_start[b]
 *   x = x + a W_o^T;  h = RMSNorm(x);  x = x + (SiLU(h W_g^T) * h W_u^T) W_d^T
 *
 * The caller (fusedkv/engine/native_step.py) fills one `StepLayer` per layer once, with pointers to the
 * model's weights and to the static cache's buffers, and checks that the model is one this step covers;
 * it does the embedding, final norm and LM head itself. Each weight is a `Product` in one of the layouts
 * the native products read: f32 in the decode layout (W^T stored [in, out]), bf16 / int8 blocks
 * (cpu_gemv.c, processors with AVX-512 BF16) or int4 blocks (any), whose input the step rounds to bf16 itself.
 * RoPE tables [positions, D] come precomputed (the model's own `rope_cos_sin`), so they match exactly.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

enum { MAX_ROWS = 4 };

enum { W_F32 = 0, W_BF16_BLOCKS = 1, W_INT8_BLOCKS = 2, W_INT4_BLOCKS = 3 };

typedef struct {
    int fmt, in, in_padded, out;       /* blocks pair the input channels: in_padded = in rounded up to even
                                          (int4: to whole groups of 32) */
    const void* w; long ld;            /* f32: W^T [in, out], ld floats per row; blocks: elements per block */
    const void* scale;                 /* int8: f32 [out]; int4: f16 [out / 16, in_padded / 32, 16] */
    const float* bias;                 /* [out] or NULL */
} Product;

typedef struct {
    int stores;                        /* 1: projects, caches and attends over its own K/V */
    const float* attn_norm;            /* [H] */
    const float* mlp_norm;             /* [H] */
    Product proj;                      /* Q|K|V (storage layers) or Q: H_q D (+ 2 H_kv D) outputs */
    const float* q_norm;               /* [D] */
    const float* k_norm;               /* [D] (storage layers) */
    void* k_cache; void* v_cache;      /* storage layers: this layer's cache, [B, H_kv, S, D] contiguous */
    int n_k, n_v;                      /* K / V sources attended over (1-2 each) */
    const void* k_src[2]; const void* v_src[2];
    const float* k_w[2]; const float* v_w[2];  /* fusion weights, f32, NULL for plain reuse */
    long k_w_hs, v_w_hs;               /* elements between kv heads in those weights (0: one [D] weight) */
    Product o;                         /* H_q D -> H */
    Product gate_up;                   /* H -> 2 I */
    Product down;                      /* I -> H */
} StepLayer;

typedef struct {
    int n_layers, hidden, n_heads, n_kv_heads, head_dim, inter, batch, kind;
    long cache_len;                    /* S: positions the cache buffers hold */
    float eps, scale;
    const float* cos; const float* sin;  /* [S, D]: RoPE tables per cache position, sin signed as rotate-half */
    StepLayer* layers;
    /* scratch, preallocated by the caller: [B, H], [B, proj outputs max], [B, H_q D] twice, [B, 2 I], [B, I],
     * and [B, widest input + 1] uint16 for inputs rounded to bf16 */
    float *h, *proj, *q, *attn, *gu, *act;
    uint16_t* xb;
    const KiviShape* kivi;             /* a KIVI cache (cpu_kivi_attention.c): the layers' k_src / v_src are
                                          KiviRow[B] tables, the step appends, then flushes; NULL otherwise */
} Step;


static void rms_norm(const float* x, const float* w, float* y, int n, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+:ss)
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* RMSNorm over one head, then RoPE: y = n * cos + roll(n, D/2) * signed_sin (layers.apply_rope). */
static void norm_rope(const float* x, const float* w, const float* cos, const float* sin, float* y, int D,
                      float eps) {
    float n[512];
    rms_norm(x, w, n, D, eps);
    const int half = D / 2;
#pragma omp simd
    for (int d = 0; d < half; d++) y[d] = n[d] * cos[d] + n[d + half] * sin[d];
#pragma omp simd
    for (int d = half; d < D; d++) y[d] = n[d] * cos[d] + n[d - half] * sin[d];
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static int product(const Product* p, const float* x, int rows, float* y, uint16_t* xb, int threads) {
    if (p->fmt == W_F32) {
        gemv_f32(x, rows, p->in, (const float*)p->w, p->ld, p->bias, y, p->out, threads);
        return 0;
    }
    for (int r = 0; r < rows; r++) {
        uint16_t* row = xb + (long)r * p->in_padded;
        for (int i = 0; i < p->in; i++) row[i] = to_bf16(x[(long)r * p->in + i]);
        for (int i = p->in; i < p->in_padded; i++) row[i] = 0;
    }
    if (p->fmt == W_BF16_BLOCKS)
        return gemv_bf16_blocks(xb, rows, p->in_padded, (const uint16_t*)p->w, p->ld, NULL, p->bias, y, p->out,
                                threads);
    if (p->fmt == W_INT4_BLOCKS)
        return gemv_int4_blocks(xb, rows, p->in_padded, (const uint8_t*)p->w, p->ld, (const uint16_t*)p->scale,
                                p->bias, y, p->out, threads);
    return gemv_int8_blocks(xb, rows, p->in_padded, (const int8_t*)p->w, p->ld, (const float*)p->scale, p->bias, y,
                            p->out, threads);
}

static void store(void* dst, long at, const float* src, int n, int kind) {
    if (kind == KV_F32) memcpy((float*)dst + at, src, sizeof(float) * (size_t)n);
    else if (kind == KV_BF16) for (int i = 0; i < n; i++) ((uint16_t*)dst)[at + i] = to_bf16(src[i]);
    else for (int i = 0; i < n; i++) ((_Float16*)dst)[at + i] = (_Float16)src[i];
}

/* Attention of one layer over a KIVI cache: each row holds its own length - kv_start[b] tokens plus the
 * pending one (padding is never stored). */
static int kivi_layer_attention(const Step* s, const StepLayer* L, const int64_t* kv_start, long length,
                                int threads) {
    int64_t n[MAX_ROWS];
    for (int b = 0; b < s->batch; b++) n[b] = length - (kv_start ? kv_start[b] : 0);
    return kivi_attention(s->q, s->batch, s->n_heads, s->n_kv_heads, s->scale, s->kivi,
                          L->n_k, L->k_src[0], L->k_src[L->n_k - 1], L->k_w[0], L->k_w[1], L->k_w_hs,
                          L->n_v, L->v_src[0], L->v_src[L->n_v - 1], L->v_w[0], L->v_w[1], L->v_w_hs,
                          n, 1, s->attn, threads);
}

/* x [B, H]: the residual stream of one new token per row, updated in place through every layer. The
 * token is written into the cache at column `length` (the same for every row: rows are left-padded);
 * row b's first real key is kv_start[b] (NULL: 0), so its RoPE position is length - kv_start[b].
 * Returns 0, or non-zero on a bad argument or a failed allocation in attention. */
int decode_step(const Step* s, float* x, const int64_t* kv_start, long length, int threads) {
    const int B = s->batch, H = s->hidden, Hq = s->n_heads, Hkv = s->n_kv_heads, D = s->head_dim, I = s->inter;
    if (B < 1 || B > MAX_ROWS || D > 512 || D % 2 || length < 0 || length >= s->cache_len) return 1;
    const long S = s->cache_len, sb = (long)Hkv * S * D, sh = S * D;
    for (int b = 0; b < B; b++) {
        const long pos = length - (kv_start ? kv_start[b] : 0);
        if (pos < 0) return 1;  /* pos <= length < S: inside the RoPE tables */
    }
    for (int l = 0; l < s->n_layers; l++) {
        const StepLayer* L = &s->layers[l];
        for (int b = 0; b < B; b++) rms_norm(x + (long)b * H, L->attn_norm, s->h + (long)b * H, H, s->eps);
        if (product(&L->proj, s->h, B, s->proj, s->xb, threads)) return 3;
        for (int b = 0; b < B; b++) {
            const long pos = length - (kv_start ? kv_start[b] : 0);
            const float *cos = s->cos + pos * D, *sin = s->sin + pos * D;
            const float* row = s->proj + (long)b * L->proj.out;
            for (int h = 0; h < Hq; h++)
                norm_rope(row + (long)h * D, L->q_norm, cos, sin, s->q + ((long)b * Hq + h) * D, D, s->eps);
            if (!L->stores) continue;
            float k[512];
            for (int g = 0; g < Hkv; g++) {
                const long at = b * sb + g * sh + length * D;
                norm_rope(row + (long)(Hq + g) * D, L->k_norm, cos, sin, k, D, s->eps);
                if (s->kivi) {  /* this layer's own row table; the token joins the residuals at the row's end */
                    kivi_append(s->kivi, (const KiviRow*)L->k_src[0] + b, g, pos, k, row + (long)(Hq + Hkv + g) * D);
                    continue;
                }
                store(L->k_cache, at, k, D, s->kind);
                store(L->v_cache, at, row + (long)(Hq + Hkv + g) * D, D, s->kind);
            }
        }
        int status = s->kivi ? kivi_layer_attention(s, L, kv_start, length, threads)
                   : decode_attention(s->q, B, Hq, Hkv, D, (int)length + 1, s->scale, s->kind,
                                      L->n_k, L->k_src[0], L->k_src[L->n_k - 1], sb, sh, D,
                                      L->k_w[0], L->k_w[1], L->k_w_hs,
                                      L->n_v, L->v_src[0], L->v_src[L->n_v - 1], sb, sh, D,
                                      L->v_w[0], L->v_w[1], L->v_w_hs, kv_start, s->attn, threads);
        if (status) return 2;
        if (product(&L->o, s->attn, B, s->h, s->xb, threads)) return 3;
        for (long i = 0; i < (long)B * H; i++) x[i] += s->h[i];
        for (int b = 0; b < B; b++) rms_norm(x + (long)b * H, L->mlp_norm, s->h + (long)b * H, H, s->eps);
        if (product(&L->gate_up, s->h, B, s->gu, s->xb, threads)) return 3;
        for (int b = 0; b < B; b++) {
            const float *g = s->gu + (long)b * 2 * I, *u = g + I;
            float* a = s->act + (long)b * I;
#pragma omp simd
            for (int i = 0; i < I; i++) a[i] = g[i] / (1.f + exp_poly(-g[i])) * u[i];
        }
        if (product(&L->down, s->act, B, s->h, s->xb, threads)) return 3;
        for (long i = 0; i < (long)B * H; i++) x[i] += s->h[i];
    }
    for (int l = 0; s->kivi && l < s->n_layers; l++)  /* after every layer has read the new token */
        for (int b = 0; b < B && s->layers[l].stores; b++) {
            const KiviRow* rows = (const KiviRow*)s->layers[l].k_src[0];
            if (kivi_flush(s->kivi, rows + b, length - (kv_start ? kv_start[b] : 0))) return 4;
        }
    return 0;
}
