/* A whole decode step of the decoder layers in one call, for CPU decoding at batch <= 16.
 *
 * A one-token step is a chain of ~40 small operations per layer (norms, QK-norm, RoPE, the cache write,
 * SiLU, residual adds) around a few matrix-vector products. Run as PyTorch ops, each costs a dispatch
 * and an allocation; together they are a floor of milliseconds per step that no faster product removes.
 * Here the same step is one C loop over the layers, reusing preallocated buffers, calling the native
 * products (cpu_gemv.c) and attention (cpu_decode_attention.c) directly. The arithmetic is the model's,
 * in the same order of operations (fusedkv/model/layers.py, attention.py, modeling.py):
 *
 *   h = RMSNorm(x);  [q | k | v] = h W_qkv^T (+ b)                (storage layer; Q only otherwise)
 *   q = RoPE(RMSNorm_head(q)), k = RoPE(RMSNorm_head(k)) (QK-norm where the model has it), written with v
 *       into the cache at `length`
 *   a = attention of q over the layer's 1-2 K / V sources with their fusion weights (the factored form
 *       of cpu_decode_attention.c), keys from kv_start[b], scores soft-capped where the model caps them
 *   x = x + [RMSNorm](a W_o^T);  h = RMSNorm(x);  x = x + [RMSNorm](act(h W_g^T) * h W_u^T) W_d^T
 *
 * with act SiLU or GELU (GeGLU) and the bracketed norms Gemma's post-norms. Norm weights come as gains (Gemma's
 * 1 + w computed by the caller). Sliding-window layers read a ring buffer (`StepLayer.window`, below).
 * Over a KIVI cache (`Step.kivi`, cpu_kivi_attention.c; full-attention layers without MLA or soft-capping only,
 * as the caller checks) the token joins each row's residual, attention reads the packed codes in place, and
 * what leaves the residual window is quantised once every layer has read the token.
 *
 * The caller (fusedkv/engine/native_step.py) fills one `StepLayer` per layer once, with pointers to the
 * model's weights and to the static cache's buffers, and checks that the model is one this step covers;
 * it does the embedding, final norm and LM head itself. Each weight is a `Product` in one of the layouts
 * the native products read: f32 in the decode layout (W^T stored [in, out]), bf16 / int8 blocks
 * (cpu_gemv.c, processors with AVX-512 BF16 or AVX2) or int4 blocks (any), whose input the step rounds to bf16
 * itself, or f16 blocks (AVX2), which read the f32 input as it is.
 * RoPE tables [positions, D] come precomputed per layer (the model's own `rope_tables`, scaled RoPE and a
 * separate base for window layers included), so they match exactly.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

enum { MAX_ROWS = 16 };

enum { W_F32 = 0, W_BF16_BLOCKS = 1, W_INT8_BLOCKS = 2, W_INT4_BLOCKS = 3, W_F16_BLOCKS = 4 };

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_GELU = 2 };  /* SwiGLU; GeGLU with tanh-GELU or erf-GELU */

typedef struct {
    int fmt, in, in_padded, out;       /* blocks pair the input channels: in_padded = in rounded up to even
                                          (int4: to whole groups of 32) */
    const void* w; long ld;            /* f32: W^T [in, out], ld floats per row; blocks: elements per block */
    const void* scale;                 /* int8: f32 [out]; int4: f16 [out / 16, in_padded / 32, 16] */
    const float* bias;                 /* [out] or NULL */
} Product;

/* A sparse MoE MLP (fusedkv/model/moe.py, Qwen3-MoE and DeepSeekMoE): the router's scores, top-k routing
 * (method 0: softmax, Qwen3-MoE; 1: DeepSeek-V2's group_limited_greedy; 2: DeepSeek-V3's noaux_tc, sigmoid
 * scores chosen with the correction bias), the chosen weights renormalised (norm_topk) and scaled; then each
 * expert chosen by some row runs once over the rows that chose it (native GEMVs over its slice of the expert
 * tensors, in the decode layout: W^T [in, out] per expert), summed into the rows in expert order as the
 * module's `index_add_`; plus the always-on shared experts (a dense gated MLP). */
typedef struct {
    int n_experts, top_k, method, n_group, topk_group, norm_topk, inter;  /* inter: one expert's I */
    float routed_scaling;
    const float* gate;                 /* router W^T [H, E] */
    const float* score_bias;           /* noaux_tc: e_score_correction_bias [E]; else NULL */
    const float* gate_up; long gu_ld, gu_es;  /* experts' W_gate|up^T: expert e's [H, 2 I] at e * gu_es, rows gu_ld */
    const float* down; long d_ld, d_es;       /* experts' W_down^T: [I, H] per expert */
    int shared_inter;                  /* 0: no shared experts */
    Product shared_gate_up, shared_down;
} MoE;

/* Multi-head latent attention (fusedkv/model/mla.py, DeepSeek-V2/V3), absorbed as the engine's AbsorbedMLA
 * (fusedkv/engine/backends.py): the query's non-rotated part goes through W_UK into the latent space, so the
 * scores are read straight off the cached latents c and RoPE keys k_R (f32 caches), and W_UV is applied to the
 * softmax-weighted latent:
 *     s_t = scale (q_C,h W_UK,h) . sum_s b_s (.) c_s[t] + scale q_R,h . sum_s w_s (.) k_R,s[t]
 *     out_h = W_UV,h (sum_s b_s (.) sum_t p_t c_s[t])
 * A storage layer writes c = RMSNorm(latent) and RoPE(k_R) into its cache (keys: latents [B, 1, S, r];
 * values: RoPE keys [B, 1, S, d_R]); DeepSeek's interleaved RoPE layout is regrouped into rotate-half first. */
typedef struct {
    int heads, nope, rope, v_dim, rank, q_lora, interleave;
    Product q_a;                       /* q_lora: H -> q_lora (then q_a_norm); else unused */
    const float* q_a_norm;
    Product q;                         /* q_proj (H ->) or q_b_proj (q_lora ->) heads * (nope + rope) */
    Product kv_a;                      /* storage layers: H -> rank + rope */
    const float* kv_a_norm;
    const float* kv_b;                 /* kv_b_proj.weight [heads, nope + v_dim, rank] row-major: W_UK | W_UV */
    /* scratch: [B, max(q_lora, rank + rope)], [B, heads * (nope + rope)] (each (row, head) task allocates its own) */
    float *a, *q_out;
} Mla;

/* Sliding-window layers. A window storage layer's cache is a ring of C = W - 1 slots per row ([B, H_kv, C, D],
 * as fusedkv.cache.StaticKVCache keeps it): row b's token of column p lives in slot C - 1 - ((p - kv_start[b])
 * mod C), so the tokens a row holds are always the slots [C - held, C), one key range per row. A query at
 * column L sees the W keys of columns L - C .. L: the ring's C plus its own, whose slot still holds the
 * oldest of them. So the step's new K / V wait in `k_pend` / `v_pend` ([B, H_kv, 1, D], the cache's kind,
 * rounded as the cache rounds) while every layer reading them attends over the ring and over the pending
 * token apart and merges the two softmaxes by their log-sum-exps; they enter the ring when the step ends. */
typedef struct {
    int stores;                        /* 1: projects, caches and attends over its own K/V */
    int window;                        /* C: ring slots of this layer's (window) sources; 0: full attention */
    const float* attn_norm;            /* [H] gains (Gemma's 1 + w given as such) */
    const float* mlp_norm;             /* [H] */
    const float* post_attn_norm;       /* [H] or NULL: Gemma's norms of the block outputs */
    const float* post_mlp_norm;        /* [H] or NULL */
    const float* cos; const float* sin;  /* [S, D]: this layer's RoPE tables per cache column, sin signed as
                                            rotate-half */
    Product proj;                      /* Q|K|V (storage layers) or Q: H_q D (+ 2 H_kv D) outputs */
    const float* q_norm;               /* [D] or NULL (no QK-norm) */
    const float* k_norm;               /* [D] or NULL (storage layers) */
    void* k_cache; void* v_cache;      /* storage layers: this layer's cache, [B, H_kv, S or C, D] contiguous */
    void* k_pend; void* v_pend;        /* window storage layers: this step's K / V, [B, H_kv, 1, D] */
    int n_k, n_v;                      /* K / V sources attended over (1-2 each) */
    const void* k_src[2]; const void* v_src[2];
    const void* k_pend_src[2]; const void* v_pend_src[2];  /* window layers: those sources' pending K / V */
    const float* k_w[2]; const float* v_w[2];  /* fusion weights, f32, NULL for plain reuse */
    long k_w_hs, v_w_hs;               /* elements between kv heads in those weights (0: one [D] weight) */
    Product o;                         /* H_q D -> H */
    Product gate_up;                   /* H -> 2 I */
    Product down;                      /* I -> H */
    const MoE* moe;                    /* a sparse MLP instead of gate_up / down, or NULL */
    const Mla* mla;                    /* MLA instead of proj / q_norm / k_norm (sources as above), or NULL */
} StepLayer;

typedef struct {
    int n_layers, hidden, n_heads, n_kv_heads, head_dim, inter, batch, kind, act_kind;
    long cache_len;                    /* S: positions the full caches (and the RoPE tables) hold */
    float eps, scale, softcap;         /* softcap 0: scores not capped */
    StepLayer* layers;
    /* scratch, preallocated by the caller: [B, H], [B, proj outputs max], [B, H_q D] three times, [B, H_q]
     * twice, [B, 2 I], [B, I], [B] int64, and [B, widest input + 1] uint16 for inputs rounded to bf16 */
    float *h, *proj, *q, *attn, *attn2, *lse, *lse2, *gu, *act;
    int64_t* ring_start;
    uint16_t* xb;
    /* MoE scratch (NULL without MoE layers): [B, E] scores, [B, E] choice, [B, H] rows, [B, 2 I_max], [B, I_max],
     * [B, H] expert output, [B, H] sum; [B, k] experts and weights */
    float *m_scores, *m_choice, *m_x, *m_gu, *m_act, *m_y, *m_out;
    int* m_idx;
    float* m_w;
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

/* RMSNorm over one head (w NULL: none), then RoPE: y = n * cos + roll(n, D/2) * signed_sin (layers.apply_rope). */
static void norm_rope(const float* x, const float* w, const float* cos, const float* sin, float* y, int D,
                      float eps) {
    float n[512];
    if (w) rms_norm(x, w, n, D, eps);
    else memcpy(n, x, sizeof(float) * (size_t)D);
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
    if (p->fmt == W_F16_BLOCKS)  /* reads x in f32 */
        return gemv_f16_blocks(x, rows, p->in, (const uint16_t*)p->w, p->ld, p->bias, y, p->out, threads);
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

static inline int kind_size(int kind) { return kind == KV_F32 ? 4 : 2; }

static void store(void* dst, long at, const float* src, int n, int kind) {
    if (kind == KV_F32) memcpy((float*)dst + at, src, sizeof(float) * (size_t)n);
    else if (kind == KV_BF16) for (int i = 0; i < n; i++) ((uint16_t*)dst)[at + i] = to_bf16(src[i]);
    else for (int i = 0; i < n; i++) ((_Float16*)dst)[at + i] = (_Float16)src[i];
}

/* x [B, H] += (post-norm of) y [B, H]; y is overwritten. */
static void residual_add(float* x, float* y, const float* post_norm, int B, int H, float eps) {
    if (post_norm)
        for (int b = 0; b < B; b++) rms_norm(y + (long)b * H, post_norm, y + (long)b * H, H, eps);
    for (long i = 0; i < (long)B * H; i++) x[i] += y[i];
}

/* The layer's QKV product, QK-norm and RoPE: s->q [B, H_q, D]; a storage layer's K / V written into its
 * cache at column `length` (a window layer's into its pending buffers). */
static int project(const Step* s, const StepLayer* L, const int64_t* kv_start, long length, int threads) {
    const int B = s->batch, Hq = s->n_heads, Hkv = s->n_kv_heads, D = s->head_dim;
    if (product(&L->proj, s->h, B, s->proj, s->xb, threads)) return 3;
    const long S = s->cache_len;
    for (int b = 0; b < B; b++) {
        const long pos = length - (kv_start ? kv_start[b] : 0);
        const float *cos = L->cos + pos * D, *sin = L->sin + pos * D;
        const float* row = s->proj + (long)b * L->proj.out;
        for (int h = 0; h < Hq; h++)
            norm_rope(row + (long)h * D, L->q_norm, cos, sin, s->q + ((long)b * Hq + h) * D, D, s->eps);
        if (!L->stores) continue;
        float k[512];
        for (int g = 0; g < Hkv; g++) {
            void *kd = L->k_cache, *vd = L->v_cache;
            long at = ((long)b * Hkv + g) * S * D + length * D;
            if (L->window) kd = L->k_pend, vd = L->v_pend, at = ((long)b * Hkv + g) * D;
            norm_rope(row + (long)(Hq + g) * D, L->k_norm, cos, sin, k, D, s->eps);
            if (s->kivi) {  /* this layer's own row table; the token joins the residuals at the row's end */
                kivi_append(s->kivi, (const KiviRow*)L->k_src[0] + b, g, pos, k, row + (long)(Hq + Hkv + g) * D);
                continue;
            }
            store(kd, at, k, D, s->kind);
            store(vd, at, row + (long)(Hq + Hkv + g) * D, D, s->kind);
        }
    }
    return 0;
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

/* s->attn [B, H_q, D]: the layer's attention. Full layers: one pass over columns [kv_start[b], length].
 * Window layers: the ring (slots [C - held, C)) and the pending token, merged (see `StepLayer`). */
static int attend(const Step* s, const StepLayer* L, const int64_t* kv_start, long length, int threads) {
    const int B = s->batch, Hq = s->n_heads, Hkv = s->n_kv_heads, D = s->head_dim;
    if (s->kivi) return kivi_layer_attention(s, L, kv_start, length, threads);  /* full layers only */
    if (!L->window) {
        const long S = s->cache_len, sb = (long)Hkv * S * D, sh = S * D;
        return decode_attention_capped(s->q, B, Hq, Hkv, D, (int)length + 1, s->scale, s->softcap, s->kind,
                                       L->n_k, L->k_src[0], L->k_src[L->n_k - 1], sb, sh, D,
                                       L->k_w[0], L->k_w[1], L->k_w_hs,
                                       L->n_v, L->v_src[0], L->v_src[L->n_v - 1], sb, sh, D,
                                       L->v_w[0], L->v_w[1], L->v_w_hs, kv_start, s->attn, NULL, threads);
    }
    const long C = L->window, sb = (long)Hkv * C * D, sh = C * D;
    for (int b = 0; b < B; b++) {
        const long held = length - (kv_start ? kv_start[b] : 0);  /* the row's real tokens before this one */
        s->ring_start[b] = C - (held < C ? held : C);
    }
    int status = decode_attention_capped(s->q, B, Hq, Hkv, D, (int)C, s->scale, s->softcap, s->kind,
                                         L->n_k, L->k_src[0], L->k_src[L->n_k - 1], sb, sh, D,
                                         L->k_w[0], L->k_w[1], L->k_w_hs,
                                         L->n_v, L->v_src[0], L->v_src[L->n_v - 1], sb, sh, D,
                                         L->v_w[0], L->v_w[1], L->v_w_hs, s->ring_start, s->attn, s->lse, threads);
    if (status) return status;
    status = decode_attention_capped(s->q, B, Hq, Hkv, D, 1, s->scale, s->softcap, s->kind,
                                     L->n_k, L->k_pend_src[0], L->k_pend_src[L->n_k - 1], (long)Hkv * D, D, D,
                                     L->k_w[0], L->k_w[1], L->k_w_hs,
                                     L->n_v, L->v_pend_src[0], L->v_pend_src[L->n_v - 1], (long)Hkv * D, D, D,
                                     L->v_w[0], L->v_w[1], L->v_w_hs, NULL, s->attn2, s->lse2, threads);
    if (status) return status;
    for (long r = 0; r < (long)B * Hq; r++) {  /* softmax over both sets = the two, weighted by their sums */
        const float l1 = s->lse[r], l2 = s->lse2[r], m = l1 > l2 ? l1 : l2;
        const float w1 = l1 == -INFINITY ? 0.f : expf(l1 - m), w2 = expf(l2 - m), inv = 1.f / (w1 + w2);
        float *o = s->attn + r * D;
        const float* o2 = s->attn2 + r * D;
#pragma omp simd
        for (int d = 0; d < D; d++) o[d] = (w1 * o[d] + w2 * o2[d]) * inv;
    }
    return 0;
}

/* The window storage layers' pending K / V into their rings, once every layer has read them. */
static void commit_windows(const Step* s, const int64_t* kv_start, long length) {
    const int B = s->batch, Hkv = s->n_kv_heads, D = s->head_dim;
    const size_t row = (size_t)D * kind_size(s->kind);
    for (int l = 0; l < s->n_layers; l++) {
        const StepLayer* L = &s->layers[l];
        if (!L->stores || !L->window) continue;
        const long C = L->window;
        for (int b = 0; b < B; b++) {
            const long slot = C - 1 - (length - (kv_start ? kv_start[b] : 0)) % C;
            for (int g = 0; g < Hkv; g++) {
                const long from = ((long)b * Hkv + g) * (long)row, to = (((long)b * Hkv + g) * C + slot) * (long)row;
                memcpy((char*)L->k_cache + to, (const char*)L->k_pend + from, row);
                memcpy((char*)L->v_cache + to, (const char*)L->v_pend + from, row);
            }
        }
    }
}

/* The gated MLP's activation: act [B, I] from gu [B, 2 I] (gate | up). */
static void activate(const float* gu, float* act, int B, int I, int kind) {
    for (int b = 0; b < B; b++) {
        const float *g = gu + (long)b * 2 * I, *u = g + I;
        float* a = act + (long)b * I;
        if (kind == ACT_SILU) {
#pragma omp simd
            for (int i = 0; i < I; i++) a[i] = g[i] / (1.f + exp_poly(-g[i])) * u[i];
        } else if (kind == ACT_GELU_TANH) {  /* F.gelu(approximate="tanh") */
            for (int i = 0; i < I; i++)
                a[i] = 0.5f * g[i] * (1.f + tanhf(0.7978845608028654f * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) * u[i];
        } else {
            for (int i = 0; i < I; i++) a[i] = 0.5f * g[i] * (1.f + erff(g[i] * 0.7071067811865476f)) * u[i];
        }
    }
}

/* RoPE of one rotate-half vector (DeepSeek's interleaved pairs regrouped first): y = x cos + roll(x) sin. */
static void rope_one(const float* x, int D, int interleave, const float* cos, const float* sin, float* y) {
    float n[512];
    if (interleave)
        for (int d = 0; d < D / 2; d++) n[d] = x[2 * d], n[d + D / 2] = x[2 * d + 1];
    else memcpy(n, x, sizeof(float) * (size_t)D);
    const int half = D / 2;
    for (int d = 0; d < half; d++) y[d] = n[d] * cos[d] + n[d + half] * sin[d];
    for (int d = half; d < D; d++) y[d] = n[d] * cos[d] + n[d - half] * sin[d];
}

/* s->attn [B, heads * v_dim]: MLA's attention of this step (see `Mla`), the storage layer's c and k_R written. */
static int mla_attend(const Step* s, const StepLayer* L, const int64_t* kv_start, long length, int threads) {
    const Mla* m = L->mla;
    const int B = s->batch, R = m->rank, DR = m->rope, QK = m->nope + m->rope, S = (int)s->cache_len;
    const float* qin = s->h;
    if (m->q_lora) {
        if (product(&m->q_a, s->h, B, m->a, s->xb, threads)) return 3;
        for (int b = 0; b < B; b++) rms_norm(m->a + (long)b * m->q_lora, m->q_a_norm, m->a + (long)b * m->q_lora,
                                             m->q_lora, s->eps);
        qin = m->a;
    }
    if (product(&m->q, qin, B, m->q_out, s->xb, threads)) return 3;
    if (L->stores) {
        if (product(&m->kv_a, s->h, B, m->a, s->xb, threads)) return 3;
        for (int b = 0; b < B; b++) {
            const long pos = length - (kv_start ? kv_start[b] : 0);
            const float* row = m->a + (long)b * (R + DR);
            rms_norm(row, m->kv_a_norm, (float*)L->k_cache + ((long)b * S + length) * R, R, s->eps);
            rope_one(row + R, DR, m->interleave, L->cos + pos * DR, L->sin + pos * DR,
                     (float*)L->v_cache + ((long)b * S + length) * DR);
        }
    }
    int failed = 0;
    const int T = (int)length + 1, NV = L->n_v, NK = L->n_k;
#pragma omp parallel for num_threads(threads) schedule(static) if (B * m->heads > 1 && threads > 1)
    for (int task = 0; task < B * m->heads; task++) {
        const int b = task / m->heads, h = task % m->heads;
        const long pos = length - (kv_start ? kv_start[b] : 0);
        const int start = kv_start ? (int)kv_start[b] : 0;
        /* [NV, R] query in the latent space with each source's weights, [NK, DR] RoPE query likewise, [T] scores,
         * [NV, R] softmax-weighted latents */
        float* buf = malloc(sizeof(float) * ((size_t)2 * NV * R + (size_t)NK * DR + (size_t)T + R));
        if (!buf) { failed = 1; continue; }
        float *q_lat = buf, *q_rw = q_lat + (long)NV * R, *scores = q_rw + (long)NK * DR, *o_lat = scores + T;
        float* lat = o_lat + (long)NV * R;  /* [R] */
        const float* qh = m->q_out + ((long)b * m->heads + h) * QK;
        const float* w_uk = m->kv_b + (long)h * (m->nope + m->v_dim) * R;  /* [nope, R] */
        const float* w_uv = w_uk + (long)m->nope * R;                       /* [v_dim, R] */
        float q_rope[512];
        rope_one(qh + m->nope, DR, m->interleave, L->cos + pos * DR, L->sin + pos * DR, q_rope);
        memset(lat, 0, sizeof(float) * (size_t)R);
        for (int d = 0; d < m->nope; d++) {
            const float qd = qh[d] * s->scale;
#pragma omp simd
            for (int r = 0; r < R; r++) lat[r] += qd * w_uk[(long)d * R + r];
        }
        for (int v = 0; v < NV; v++)
            for (int r = 0; r < R; r++) q_lat[(long)v * R + r] = lat[r] * (L->v_w[v] ? L->v_w[v][r] : 1.f);
        for (int k = 0; k < NK; k++)
            for (int d = 0; d < DR; d++) q_rw[(long)k * DR + d] = q_rope[d] * s->scale * (L->k_w[k] ? L->k_w[k][d] : 1.f);
        float mx = -INFINITY;
        for (int t = start; t < T; t++) {
            float sc = 0.f;
            for (int v = 0; v < NV; v++) {
                const float *c = (const float*)L->v_src[v] + ((long)b * S + t) * R, *q = q_lat + (long)v * R;
#pragma omp simd reduction(+:sc)
                for (int r = 0; r < R; r++) sc += q[r] * c[r];
            }
            for (int k = 0; k < NK; k++) {
                const float *kr = (const float*)L->k_src[k] + ((long)b * S + t) * DR, *q = q_rw + (long)k * DR;
#pragma omp simd reduction(+:sc)
                for (int d = 0; d < DR; d++) sc += q[d] * kr[d];
            }
            scores[t] = sc;
            mx = sc > mx ? sc : mx;
        }
        float sum = 0.f;
#pragma omp simd reduction(+:sum)
        for (int t = start; t < T; t++) { scores[t] = exp_poly(scores[t] - mx); sum += scores[t]; }
        memset(o_lat, 0, sizeof(float) * (size_t)NV * R);
        for (int v = 0; v < NV; v++)
            for (int t = start; t < T; t++) {
                const float p = scores[t] / sum;
                const float* c = (const float*)L->v_src[v] + ((long)b * S + t) * R;
                float* o = o_lat + (long)v * R;
#pragma omp simd
                for (int r = 0; r < R; r++) o[r] += p * c[r];
            }
        for (int r = 0; r < R; r++) {
            float y = 0.f;
            for (int v = 0; v < NV; v++) y += (L->v_w[v] ? L->v_w[v][r] : 1.f) * o_lat[(long)v * R + r];
            lat[r] = y;
        }
        float* out = s->attn + ((long)b * m->heads + h) * m->v_dim;
        for (int d = 0; d < m->v_dim; d++) {
            float y = 0.f;
#pragma omp simd reduction(+:y)
            for (int r = 0; r < R; r++) y += w_uv[(long)d * R + r] * lat[r];
            out[d] = y;
        }
        free(buf);
    }
    return failed ? 2 : 0;
}

/* The `k` largest of v[0..n) (ties: the lower index, as the order torch.topk keeps in practice), into idx. */
static void top_k(const float* v, int n, int k, int* idx) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= idx[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        idx[j] = best;
    }
}

/* Keep, in choice [E], the experts of the topk_group best of n_group groups (ranked by their best score, or
 * by the sum of their two best with noaux_tc); the others get `fill`. SparseMoE._within_groups. */
static void within_groups(const MoE* m, float* choice, float fill) {
    if (m->n_group <= 1) return;
    const int per = m->n_experts / m->n_group;
    float rank[256];
    int keep[256];
    for (int g = 0; g < m->n_group; g++) {
        const float* c = choice + (long)g * per;
        int two[2];
        top_k(c, per, m->method == 2 ? 2 : 1, two);
        rank[g] = m->method == 2 ? c[two[0]] + c[two[1]] : c[two[0]];
    }
    top_k(rank, m->n_group, m->topk_group, keep);
    for (int g = 0; g < m->n_group; g++) {
        int kept = 0;
        for (int i = 0; i < m->topk_group; i++) kept |= keep[i] == g;
        if (!kept) for (int e = 0; e < per; e++) choice[(long)g * per + e] = fill;
    }
}

/* SparseMoE.route for each row of s->h: experts s->m_idx [B, k] and weights s->m_w [B, k]. */
static void route(const Step* s, const MoE* m, int threads) {
    const int B = s->batch, E = m->n_experts, k = m->top_k;
    gemv_f32(s->h, B, s->hidden, m->gate, E, NULL, s->m_scores, E, threads);
    for (int b = 0; b < B; b++) {
        float *sc = s->m_scores + (long)b * E, *choice = s->m_choice + (long)b * E, *w = s->m_w + (long)b * k;
        int* idx = s->m_idx + (long)b * k;
        if (m->method == 2) {  /* sigmoid scores; choose on scores + bias within groups; weights the scores */
            for (int e = 0; e < E; e++) {
                sc[e] = 1.f / (1.f + expf(-sc[e]));
                choice[e] = sc[e] + m->score_bias[e];
            }
            within_groups(m, choice, -INFINITY);
        } else {  /* softmax (f32, as the module routes) */
            float mx = -INFINITY, sum = 0.f;
            for (int e = 0; e < E; e++) mx = sc[e] > mx ? sc[e] : mx;
            for (int e = 0; e < E; e++) sum += (sc[e] = expf(sc[e] - mx));
            for (int e = 0; e < E; e++) choice[e] = sc[e] /= sum;
            if (m->method == 1) within_groups(m, choice, 0.f);
        }
        top_k(choice, E, k, idx);
        float total = 0.f;
        for (int j = 0; j < k; j++) total += (w[j] = m->method == 2 ? sc[idx[j]] : choice[idx[j]]);
        if (m->norm_topk)
            for (int j = 0; j < k; j++) w[j] = m->method == 2 ? w[j] / (total + 1e-20f) : w[j] / total;
        for (int j = 0; j < k; j++) w[j] *= m->routed_scaling;
    }
}

/* s->h [B, H] (the normed MLP input) -> the sparse MLP's output, into s->h. */
static int sparse_mlp(const Step* s, const MoE* m, int threads) {
    const int B = s->batch, H = s->hidden, I = m->inter, k = m->top_k;
    route(s, m, threads);
    memset(s->m_out, 0, sizeof(float) * (size_t)B * H);
    for (int e = 0; e < m->n_experts; e++) {
        int rows[MAX_ROWS], n = 0;
        float weight[MAX_ROWS];
        for (int b = 0; b < B; b++)
            for (int j = 0; j < k; j++)
                if (s->m_idx[(long)b * k + j] == e) { rows[n] = b; weight[n++] = s->m_w[(long)b * k + j]; }
        if (!n) continue;
        for (int r = 0; r < n; r++) memcpy(s->m_x + (long)r * H, s->h + (long)rows[r] * H, sizeof(float) * (size_t)H);
        gemv_f32(s->m_x, n, H, m->gate_up + e * m->gu_es, m->gu_ld, NULL, s->m_gu, 2 * I, threads);
        activate(s->m_gu, s->m_act, n, I, ACT_SILU);
        gemv_f32(s->m_act, n, I, m->down + e * m->d_es, m->d_ld, NULL, s->m_y, H, threads);
        for (int r = 0; r < n; r++) {
            float *o = s->m_out + (long)rows[r] * H;
            const float* y = s->m_y + (long)r * H;
#pragma omp simd
            for (int i = 0; i < H; i++) o[i] += y[i] * weight[r];
        }
    }
    if (m->shared_inter) {
        if (product(&m->shared_gate_up, s->h, B, s->m_gu, s->xb, threads)) return 3;
        activate(s->m_gu, s->m_act, B, m->shared_inter, ACT_SILU);
        if (product(&m->shared_down, s->m_act, B, s->m_y, s->xb, threads)) return 3;
        for (long i = 0; i < (long)B * H; i++) s->m_out[i] += s->m_y[i];
    }
    memcpy(s->h, s->m_out, sizeof(float) * (size_t)B * H);
    return 0;
}

/* x [B, H]: the residual stream of one new token per row, updated in place through every layer. The
 * token is written into the cache at column `length` (the same for every row: rows are left-padded);
 * row b's first real key is kv_start[b] (NULL: 0), so its RoPE position is length - kv_start[b].
 * Returns 0, or non-zero on a bad argument or a failed allocation in attention. */
int decode_step(const Step* s, float* x, const int64_t* kv_start, long length, int threads) {
    const int B = s->batch, H = s->hidden;
    if (B < 1 || B > MAX_ROWS || s->head_dim > 512 || s->head_dim % 2 || length < 0 || length >= s->cache_len)
        return 1;
    for (int b = 0; b < B; b++) {
        const long pos = length - (kv_start ? kv_start[b] : 0);
        if (pos < 0) return 1;  /* pos <= length < S: inside the RoPE tables */
    }
    for (int l = 0; l < s->n_layers; l++) {
        const StepLayer* L = &s->layers[l];
        for (int b = 0; b < B; b++) rms_norm(x + (long)b * H, L->attn_norm, s->h + (long)b * H, H, s->eps);
        if (L->mla) {
            int status = mla_attend(s, L, kv_start, length, threads);
            if (status) return status;
        } else {
            int status = project(s, L, kv_start, length, threads);
            if (status) return status;
            if (attend(s, L, kv_start, length, threads)) return 2;
        }
        if (product(&L->o, s->attn, B, s->h, s->xb, threads)) return 3;
        residual_add(x, s->h, L->post_attn_norm, B, H, s->eps);
        for (int b = 0; b < B; b++) rms_norm(x + (long)b * H, L->mlp_norm, s->h + (long)b * H, H, s->eps);
        if (L->moe) {
            if (sparse_mlp(s, L->moe, threads)) return 3;
        } else {
            if (product(&L->gate_up, s->h, B, s->gu, s->xb, threads)) return 3;
            activate(s->gu, s->act, B, s->inter, s->act_kind);
            if (product(&L->down, s->act, B, s->h, s->xb, threads)) return 3;
        }
        residual_add(x, s->h, L->post_mlp_norm, B, H, s->eps);
    }
    commit_windows(s, kv_start, length);
    for (int l = 0; s->kivi && l < s->n_layers; l++)  /* after every layer has read the new token */
        for (int b = 0; b < B && s->layers[l].stores; b++) {
            const KiviRow* rows = (const KiviRow*)s->layers[l].k_src[0];
            if (kivi_flush(s->kivi, rows + b, length - (kv_start ? kv_start[b] : 0))) return 4;
        }
    return 0;
}
