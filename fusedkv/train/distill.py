"""Distillation for uptraining: a converted model learns from the full-cache model it was converted from.

Most users own a pretrained full-cache model. `fusedkv convert` turns it into Lite or FusedKV by
dropping the upper layers' K/V projections (paper Sec. 3); the converted model then has to recover.
SwiftKV (Qiao et al., 2024, arXiv:2410.03960) recovers such a model by distilling from the original:
the student matches the teacher's next-token distribution. Here:

    loss = alpha * T^2 * KL(p_teacher^T || p_student^T) + (1 - alpha) * CE(student, labels)
           + hidden_weight * mean over layers of MSE(h_student, h_teacher)

with p^T = softmax(logits / T) (Hinton et al., 2015; the T^2 keeps the gradient scale independent of
T), KL averaged over tokens, and the optional hidden-state term over the outputs of every decoder layer
as transformers returns them (the last one after the final norm; the architectures match layer for
layer, only the upper layers' K/V source differs). The teacher is
frozen, in eval mode, and runs under no_grad on the same micro-batch.

`fusedkv train --init-from CONVERTED --distill-from ORIGINAL [--distill-alpha 0.5]
[--distill-temperature 1.0] [--distill-hidden-weight 0]` uses it (the trainer calls `Distiller` in place
of its plain language-modelling loss). ORIGINAL is a fusedkv checkpoint or the Hugging Face Qwen3 (or
Qwen3-MoE) checkpoint itself, which then runs as transformers' own model: the teacher is the original,
not a re-implementation of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checkpoints import check_checkpoint_dir
from ..config import FusedKVConfig
from ..convert import QWEN3_MODEL_TYPES
from ..model.loss import lm_loss

# What --distill-from takes: a fusedkv model, or a Qwen3 or Qwen3-MoE checkpoint run by transformers itself.
TEACHER_MODEL_TYPES = (FusedKVConfig.model_type, *QWEN3_MODEL_TYPES)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      alpha: float = 0.5, temperature: float = 1.0, student_hidden=None, teacher_hidden=None,
                      hidden_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The loss above and its parts {"kl", "lm", "hidden"} (detached floats). Logits are [B, T, V];
    `labels` [B, T] are already shifted (the data loader's); hidden states are sequences of [B, T, H]."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"distill_alpha={alpha}: must be in [0, 1] (1: distillation only, 0: LM loss only)")
    if temperature <= 0:
        raise ValueError(f"distill_temperature={temperature}: must be positive")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ; teacher and student need the same vocabulary")
    s = student_logits.flatten(0, 1).float()
    t = teacher_logits.flatten(0, 1).float()
    log_p_s = F.log_softmax(s / temperature, -1)
    log_p_t = F.log_softmax(t / temperature, -1)
    # KL(teacher || student) per token, averaged over tokens ("batchmean" over the flattened tokens).
    kl = F.kl_div(log_p_s, log_p_t, log_target=True, reduction="batchmean") * temperature**2
    lm = lm_loss(s, labels.flatten())
    loss = alpha * kl + (1.0 - alpha) * lm
    hidden = torch.zeros((), device=s.device)
    if hidden_weight > 0:
        if student_hidden is None or teacher_hidden is None or len(student_hidden) != len(teacher_hidden):
            raise ValueError("hidden_weight > 0 needs the hidden states of every layer of both models, "
                             "and the same number of layers")
        # Index 0 is the embedding output, shared by construction after conversion: skip it.
        pairs = list(zip(student_hidden, teacher_hidden))[1:]
        hidden = torch.stack([F.mse_loss(hs.float(), ht.float()) for hs, ht in pairs]).mean()
        loss = loss + hidden_weight * hidden
    return loss, {"kl": float(kl.detach()), "lm": float(lm.detach()), "hidden": float(hidden.detach())}


class Distiller:
    """The trainer's loss function for a distillation run: `distiller(model, input_ids, labels) -> loss`.

    Loads the teacher once (frozen, eval mode, the student's device, float32 or the autocast the step
    runs under); refuses a teacher whose vocabulary or layer count does not match the student's."""

    def __init__(self, teacher_dir: str, student_config, device, alpha: float = 0.5, temperature: float = 1.0,
                 hidden_weight: float = 0.0):
        from transformers import AutoModelForCausalLM  # resolves fusedkv too: `import fusedkv` registers it

        check_checkpoint_dir(teacher_dir, model_types=TEACHER_MODEL_TYPES)
        self.teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).to(device).eval()
        self.teacher.requires_grad_(False)
        tc = self.teacher.config
        if tc.vocab_size != student_config.vocab_size:
            raise ValueError(f"distill_from={teacher_dir} has a vocabulary of {tc.vocab_size} tokens, the student "
                             f"{student_config.vocab_size}; distil from the model the student was converted from")
        if hidden_weight > 0 and tc.num_hidden_layers != student_config.num_hidden_layers:
            raise ValueError(f"distill_hidden_weight > 0 needs teacher and student of the same depth (teacher "
                             f"{tc.num_hidden_layers} layers, student {student_config.num_hidden_layers})")
        self.alpha, self.temperature, self.hidden_weight = alpha, temperature, hidden_weight
        self.last_parts: dict = {}

    def __call__(self, model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        want_hidden = self.hidden_weight > 0
        with torch.no_grad():
            t_out = self.teacher(input_ids=input_ids, use_cache=False, output_hidden_states=want_hidden)
        s_out = model(input_ids=input_ids, use_cache=False, output_hidden_states=want_hidden)
        loss, self.last_parts = distillation_loss(
            s_out.logits, t_out.logits, labels, self.alpha, self.temperature,
            getattr(s_out, "hidden_states", None), getattr(t_out, "hidden_states", None), self.hidden_weight)
        aux = getattr(s_out, "aux_loss", None)  # MoE students: the load-balancing loss, as compute_loss adds
        if aux is not None:
            loss = loss + _unwrap(model).config.router_aux_loss_coef * aux
        return loss


def _unwrap(model):
    return getattr(model, "module", model)
