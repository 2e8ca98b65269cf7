"""Wanda: pruning by weights and activations (Sun et al. 2024, "A Simple and Effective Pruning Approach
for Large Language Models"), as the FusedKV paper applies it on top of cross-layer fusion (App. A.6).

For a linear layer y = W x, the importance of weight W_ij is S_ij = |W_ij| * ||X_j||_2, where X_j is
input feature j over every calibration token. Within each output row the lowest-scoring weights are
zeroed: a fraction `sparsity` of them (unstructured), or N of every M consecutive inputs (N:M, e.g.
2:4). Layers are pruned bottom-up: the input norms of decoder layer l are measured by running the
model with layers < l already pruned, so each layer sees the activations it will get at inference.
All linear maps of a decoder layer are pruned together from one measurement (as Wanda's code does).

In a FusedKV model the reconstruction layers have only q/o projections and the MLP to prune; they
read K/V that the (pruned) storage layers produced in the same forward, which the model's own
forward takes care of. Embeddings, the LM head, norms and fusion weights are left dense (Wanda
prunes only the linear layers of the blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import RunError

# The decoder block's linear maps, by their name inside a `DecoderLayer`.
PRUNABLE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def parse_nm(text: str | None) -> tuple[int, int] | None:
    """"2:4" -> (2, 4): zero N of every M consecutive weights in a row."""
    if text is None:
        return None
    try:
        n, m = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--nm {text!r}: write N:M with whole numbers, e.g. 2:4") from None
    if not 0 < n < m:
        raise ValueError(f"--nm {text!r}: need 0 < N < M (N of every M weights are zeroed), e.g. 2:4")
    return n, m


def block_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """The prunable linear maps of one decoder layer (reconstruction layers have no k/v_proj; a
    sparse-MoE layer's experts are not `nn.Linear` and are left dense)."""
    modules = dict(layer.named_modules())
    return {name: modules[name] for name in PRUNABLE if isinstance(modules.get(name), nn.Linear)}


@torch.no_grad()
def input_square_norms(model, layer_idx: int, calibration: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """sum over calibration tokens of x_j^2 for the input of each prunable linear of decoder layer
    `layer_idx`, from full forwards of the model as it is now (layers below already pruned)."""
    linears = block_linears(model.model.layers[layer_idx])
    sums = {name: torch.zeros(lin.in_features, dtype=torch.float64) for name, lin in linears.items()}

    def hook(name):
        def accumulate(module, args):
            x = args[0].detach().to(torch.float64)
            sums[name] += x.reshape(-1, x.shape[-1]).pow(2).sum(0).cpu()
        return accumulate

    handles = [lin.register_forward_pre_hook(hook(name)) for name, lin in linears.items()]
    try:
        for ids in calibration:
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return sums


def wanda_scores(weight: torch.Tensor, input_sq_norm: torch.Tensor) -> torch.Tensor:
    """S_ij = |W_ij| * ||X_j||_2 (Wanda Eq. 1)."""
    return weight.detach().abs().to(torch.float64) * input_sq_norm.to(weight.device).sqrt()[None, :]


def prune_mask(scores: torch.Tensor, sparsity: float | None = None, nm: tuple[int, int] | None = None) -> torch.Tensor:
    """Boolean [out, in] mask of the weights to zero: per output row, the int(in * sparsity) lowest
    scores, or under N:M the N lowest of every M consecutive inputs. Ties go to the lower index."""
    out_f, in_f = scores.shape
    if nm is not None:
        n, m = nm
        if in_f % m:
            raise ValueError(f"N:M pruning needs the input width {in_f} to be a multiple of M={m}")
        grouped = scores.reshape(out_f, in_f // m, m)
        lowest = grouped.argsort(dim=-1, stable=True)[..., :n]
        return torch.zeros_like(grouped, dtype=torch.bool).scatter_(-1, lowest, True).reshape(out_f, in_f)
    k = int(in_f * sparsity)
    lowest = scores.argsort(dim=-1, stable=True)[:, :k]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, lowest, True)


@dataclass
class PrunedMatrix:
    name: str
    shape: tuple[int, int]
    zeros: int

    @property
    def sparsity(self) -> float:
        return self.zeros / (self.shape[0] * self.shape[1])


def check_prune_settings(sparsity: float | None, nm: tuple[int, int] | None) -> float:
    """The fraction of weights to zero; a one-line ValueError for settings that cannot be met."""
    if nm is not None:
        n, m = nm
        if sparsity is not None and abs(sparsity - n / m) > 1e-9:
            raise ValueError(f"--sparsity {sparsity} contradicts --nm {n}:{m} (which zeroes {n / m:g}); give one")
        return n / m
    if sparsity is None or not 0 <= sparsity < 1:
        raise ValueError(f"--sparsity {sparsity}: give the fraction of weights to zero, in [0, 1), e.g. 0.5")
    return sparsity


@torch.no_grad()
def wanda_prune(model, calibration: list[torch.Tensor], sparsity: float | None = 0.5,
                nm: tuple[int, int] | None = None, progress=None) -> list[PrunedMatrix]:
    """Prune `model` in place, decoder layer by decoder layer from the bottom; returns the measured
    zeros of every pruned matrix. `calibration`: batches of token ids [B, T]."""
    check_prune_settings(sparsity, nm)
    report = []
    model.eval()
    for idx, layer in enumerate(model.model.layers):
        norms = input_square_norms(model, idx, calibration)
        if not all(bool(torch.isfinite(n).all()) for n in norms.values()):
            raise RunError(f"the inputs of decoder layer {idx} are not finite (NaN or inf) on the calibration "
                           "windows: the model's activations overflow, so Wanda's scores mean nothing; nothing "
                           "was written")
        for name, lin in block_linears(layer).items():
            mask = prune_mask(wanda_scores(lin.weight, norms[name]), sparsity, nm)
            lin.weight.masked_fill_(mask.to(lin.weight.device), 0.0)
            full = f"model.layers.{idx}.{name}.weight"
            report.append(PrunedMatrix(full, tuple(lin.weight.shape), int((lin.weight == 0).sum())))
        if progress:
            progress(idx)
    return report


def calibration_batches(tokens, num_seqs: int, seq_len: int, batch_size: int = 8, seed: int = 0) -> list[torch.Tensor]:
    """`num_seqs` windows of `seq_len` tokens at random offsets of a 1-D token array (Wanda samples
    random windows of its calibration text the same way), in batches."""
    n = len(tokens)
    if n < seq_len + 1:
        raise ValueError(f"the calibration text has {n} tokens, fewer than --calib-len {seq_len}; lower it")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - seq_len, (num_seqs,), generator=g).tolist()
    windows = torch.stack([torch.as_tensor(tokens[s:s + seq_len].astype("int64")) for s in starts])
    return list(windows.split(batch_size))


def builtin_calibration_tokens(tokenizer, num_tokens: int, seed: int = 0):
    """About 2 x `num_tokens` tokens of the built-in corpus's training works (its held-out works are
    never used), whole works in a seeded random order, each followed by EOS."""
    import numpy as np

    from ..data import BUILTIN_VAL_DOCS, BuiltinSource

    docs = [text for name, text in BuiltinSource().iter_named() if name not in BUILTIN_VAL_DOCS]
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    tokens: list[int] = []
    for i in order:
        tokens += tokenizer(docs[i]).input_ids + eos
        if len(tokens) >= 2 * num_tokens:
            break
    return np.asarray(tokens, dtype=np.int64)
