"""Weight-only quantisation for `fusedkv.engine.precision`: symmetric per-output-channel int8, and group-wise int4
in llama.cpp's Q4_0 format with its scale rule or a least-squares search (`INT4_RULES`), and the activation
dtype int8's product kernel runs fastest with here (`int8_activation_dtype`, measured once)."""

from __future__ import annotations

import functools

import torch

from ..kernels import cpu_gemv


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: W ~= q * scale[:, None], |q| <= 127. Returns (q, f32 scale)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


INT4_RULES = ("mse", "q4_0")
INT4_RULE = "mse"  # the default rule of `quantize_int4` (benchmarks/cpu_decode.py --int4-rule compares the two)


def quantize_int4(weight: torch.Tensor, group: int = cpu_gemv.GROUP, rule: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise int4 in llama.cpp's Q4_0 format: per group of `group` input channels one f16 scale d
    and levels q in -8..7, W ~= d q. Returns (q int8 [out, in], f16 d [out, groups]). No zero point: trained
    projection weights are centred on zero, and without one each group costs one multiply-add in the kernel and
    4.5 bits per weight (Q4_0's size).

    `rule` (default `INT4_RULE`) picks d. "q4_0" is llama.cpp's Q4_0 rule: the weight of largest magnitude m maps
    to level -8 (d = -m / 8). "mse" (the default) tries 9 level grids around it (m maps to -(8 + 0.2 s), s =
    -4..4, as llama.cpp's K-quants search theirs), takes for each the least-squares d of its levels, and keeps
    the grid of least squared error: 12% less error than Q4_0's rule on trained weights, same bytes and
    kernel. Either way d is rounded to f16 before the levels are chosen (q = round(w / d) clamped), so the
    stored scale is the one used."""
    rule = rule or INT4_RULE
    if rule not in INT4_RULES:
        raise ValueError(f"int4 rule {rule!r}: choose one of {', '.join(INT4_RULES)}")
    w = weight.detach().float()
    out_features, in_features = w.shape
    groups = -(-in_features // group)
    padded = torch.zeros(out_features, groups * group)
    padded[:, :in_features] = w
    g = padded.reshape(out_features, groups, group)
    m = g.gather(2, g.abs().argmax(dim=2, keepdim=True))
    scale = m.squeeze(2) / -8
    if rule == "mse":
        inverse = torch.where(m == 0, 0.0, -1.0 / m)
        best = torch.full_like(scale, -1.0)
        for s in range(-4, 5):
            levels = torch.round(g * (inverse * (8 + 0.2 * s))).clamp_(-8, 7)
            xl, ll = (g * levels).sum(2), (levels * levels).sum(2).clamp_(min=1e-30)
            gain = xl * xl / ll  # the squared error of the least-squares d = xl / ll is sum(w^2) - gain
            better = gain > best
            best, scale = torch.where(better, gain, best), torch.where(better, xl / ll, scale)
    scale = scale.half()
    inverse = torch.where(scale == 0, 0.0, 1.0 / scale.float())
    q = torch.round(g * inverse[..., None]).clamp_(-8, 7).to(torch.int8)
    return q.reshape(out_features, -1)[:, :in_features].contiguous(), scale


def _dequantize_int4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W = scale (.) q in f32 (exact: an f16 scale times a level -8..7), [out, in] as q."""
    return (q.reshape(q.shape[0], scale.shape[1], -1) * scale.float()[..., None]).reshape(q.shape)


@functools.lru_cache(maxsize=1)
def int8_activation_dtype() -> torch.dtype:
    """The activation dtype `_weight_int8pack_mm` runs fastest with on this processor, measured once
    on a decode-sized product (its speed differs several-fold between them, and by processor). The
    fastest of interleaved rounds counts, so other jobs on a shared machine do not sway the choice."""
    import time

    w = torch.randint(-127, 128, (1024, 512), dtype=torch.int8)
    args = {dt: (torch.randn(1, 512, dtype=dt), w, torch.rand(1024, dtype=dt))
            for dt in (torch.bfloat16, torch.float16, torch.float32)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per-core speed is what differs; a busy second core would only add noise
    try:
        for a in args.values():
            torch.ops.aten._weight_int8pack_mm(*a)  # first calls allocate
        best = dict.fromkeys(args, float("inf"))
        for _ in range(9):
            for dt, a in args.items():
                t0 = time.perf_counter()
                torch.ops.aten._weight_int8pack_mm(*a)
                best[dt] = min(best[dt], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return min(best, key=best.get)
