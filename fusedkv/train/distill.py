"""Distillation for uptraining: a converted model learns from the full-cache model it was converted from.

Most users own a pretrained full-cache model. `fusedkv convert` turns it into Lite or FusedKV by
dropping the upper layers' K/V projections (paper Sec. 3); the converted model then has to recover.
SwiftKV (Qiao et al., 2024, arXiv:2410.03960) recovers such a model by distilling from the original:
the student matches the teacher's next-token distribution. Here:

    loss = alpha * T^2 * KL(p_teacher^T || p_student^T) + (1 - alpha) * CE(student, labels)
           + hidden_weight * mean over layers of MSE(h_student, h_teacher)

with p^T = softmax(logits / T) (Hinton et al., 2015; the T^2 keeps the gradient scale independent of
T), KL averaged over the positions the CE term counts (a label of `IGNORE_INDEX`, e.g. the context of a
`loss=answers` mixture, counts in neither), and the optional hidden-state term over the outputs of every
decoder layer as transformers returns them, at the same positions (the last one after the final norm;
the architectures match layer for layer, only the upper layers' K/V source differs). The teacher is
frozen, in eval mode, and runs under no_grad on the same micro-batch.

`fusedkv train --init-from CONVERTED --distill-from ORIGINAL [--distill-alpha 0.5]
[--distill-temperature 1.0] [--distill-hidden-weight 0]` uses it (the trainer calls `Distiller` in place
of its plain language-modelling loss). ORIGINAL is a fusedkv checkpoint or a Hugging Face checkpoint of
any family `fusedkv convert` imports (`fusedkv.convert.MODEL_TYPES`), which then runs as transformers' own
model (`AutoModelForCausalLM`): the teacher is the original, not a re-implementation of it.

A teacher must mean by every token id what the student means: `check_teacher` refuses, before any data is
prepared or model built, a teacher of another vocabulary size or another tokenizer (its content hash
against the student's tokenizer or the prepared data's), and gives a run without a tokenizer of its own
the teacher's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import FusedKVConfig
from ..convert import MODEL_TYPES, family_for, fusedkv_to_plan_config
from ..data import load_tokenizer
from ..data.tokenizer import tokenizer_sha256
from ..model.loss import IGNORE_INDEX, lm_loss
from ..model_dirs import check_checkpoint_dir
from ..plan import VANILLA
from .data import has_tokenizer, is_prepared_dir
from .teacher_cache import topk_kl

# What --distill-from takes: a fusedkv model, or a checkpoint of any imported family, run by transformers itself.
TEACHER_MODEL_TYPES = (FusedKVConfig.model_type, *MODEL_TYPES)


def teacher_student_configs(hf: dict, plan: str, origin: str = "checkpoint") -> tuple[FusedKVConfig, FusedKVConfig]:
    """(the teacher as a vanilla FusedKVConfig, the student: the teacher converted to `plan`) from the
    teacher's config.json alone, the family registry deciding as `fusedkv convert` does."""
    if hf.get("model_type") == FusedKVConfig.model_type:
        return fusedkv_to_plan_config(hf, VANILLA, origin=origin), fusedkv_to_plan_config(hf, plan, origin=origin)
    family = family_for(hf)
    return family.to_config(hf, VANILLA), family.to_config(hf, plan)


def teacher_vocab_size(teacher_dir) -> int | None:
    """The vocabulary size a teacher's config.json declares (top level, or a multimodal text_config's)."""
    hf = json.loads((Path(teacher_dir) / "config.json").read_text())
    return hf.get("vocab_size", (hf.get("text_config") or {}).get("vocab_size"))


def check_teacher(teacher_dir, vocab_size: int, tokenizer=None, data=None):
    """Refuse a teacher whose token ids mean other strings than the student's (issue 27 #6); returns the
    tokenizer the run must use: `tokenizer` as given, or the teacher's when the run has none and its data
    is raw text (so the corpus is tokenised as the teacher reads it). Reads configs and tokenizers only."""
    check_checkpoint_dir(teacher_dir, model_types=TEACHER_MODEL_TYPES)
    found = teacher_vocab_size(teacher_dir)
    if found != vocab_size:
        raise ValueError(f"distill_from={teacher_dir} has a vocabulary of {found} tokens, the student {vocab_size}; "
                         "distil from the model the student was converted from (same tokenizer)")
    if not has_tokenizer(teacher_dir):
        return tokenizer  # nothing more to compare: the vocabulary size has to do
    theirs = tokenizer_sha256(load_tokenizer(str(teacher_dir)))
    if tokenizer is not None:
        mine, what = tokenizer_sha256(load_tokenizer(str(tokenizer))), f"the student's tokenizer ({tokenizer})"
    elif data is not None and is_prepared_dir(data):
        mine = json.loads((Path(str(data)) / "meta.json").read_text()).get("tokenizer_sha256")
        what = f"the tokenizer of the prepared data {data}"
    else:
        return str(teacher_dir)
    if mine != theirs:
        raise ValueError(f"distill_from={teacher_dir} has another tokenizer than {what}: the same {vocab_size} ids "
                         "mean other strings, so the KL would compare unrelated tokens; distil from the model the "
                         "student was converted from, with data tokenised by its tokenizer")
    return tokenizer


def load_teacher(teacher_dir, device):
    """The teacher as transformers runs it (`AutoModelForCausalLM`, fusedkv's own class for a fusedkv
    checkpoint), frozen, in eval mode: float32 on CPU, the checkpoint's dtype on an accelerator."""
    from transformers import AutoModelForCausalLM  # resolves fusedkv too: `import fusedkv` registers it

    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else "auto"
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=dtype).to(device).eval()
    return teacher.requires_grad_(False)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      alpha: float = 0.5, temperature: float = 1.0, student_hidden=None, teacher_hidden=None,
                      hidden_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The loss above and its parts {"kl", "lm", "hidden"} (detached floats). Logits are [B, T, V];
    `labels` [B, T] are already shifted (the data loader's); hidden states are sequences of [B, T, H].
    Positions labelled `IGNORE_INDEX` count in no term; with none left every term is 0 (as `lm_loss`)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"distill_alpha={alpha}: must be in [0, 1] (1: distillation only, 0: LM loss only)")
    if temperature <= 0:
        raise ValueError(f"distill_temperature={temperature}: must be positive")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ; teacher and student need the same vocabulary")
    s = student_logits.flatten(0, 1).float()
    t = teacher_logits.flatten(0, 1).float()
    counted = labels.flatten() != IGNORE_INDEX
    n = counted.sum().clamp(min=1)
    log_p_s = F.log_softmax(s[counted] / temperature, -1)
    log_p_t = F.log_softmax(t[counted] / temperature, -1)
    # KL(teacher || student) per counted token, averaged over them (as the CE term averages).
    kl = F.kl_div(log_p_s, log_p_t, log_target=True, reduction="sum") / n * temperature**2
    lm = lm_loss(s, labels.flatten())
    loss = alpha * kl + (1.0 - alpha) * lm
    hidden = torch.zeros((), device=s.device)
    if hidden_weight > 0:
        if student_hidden is None or teacher_hidden is None or len(student_hidden) != len(teacher_hidden):
            raise ValueError("hidden_weight > 0 needs the hidden states of every layer of both models, "
                             "and the same number of layers")
        # Index 0 is the embedding output, shared by construction after conversion: skip it.
        pairs = list(zip(student_hidden, teacher_hidden))[1:]
        keep = counted.view(labels.shape)
        width = student_hidden[0].shape[-1]
        hidden = torch.stack([F.mse_loss(hs[keep].float(), ht[keep].float(), reduction="sum") / (n * width)
                              for hs, ht in pairs]).mean()
        loss = loss + hidden_weight * hidden
    return loss, {"kl": float(kl.detach()), "lm": float(lm.detach()), "hidden": float(hidden.detach())}


class Distiller:
    """The trainer's loss function for a distillation run: `distiller(model, input_ids, labels) -> loss`.

    Loads the teacher once (frozen, eval mode, the student's device, float32 or the autocast the step
    runs under); refuses a teacher whose vocabulary or layer count does not match the student's."""

    def __init__(self, teacher_dir: str, student_config, device, alpha: float = 0.5, temperature: float = 1.0,
                 hidden_weight: float = 0.0, store=None):
        check_checkpoint_dir(teacher_dir, model_types=TEACHER_MODEL_TYPES)
        if store is not None and hidden_weight > 0:
            raise ValueError("teacher_topk stores the teacher's logits only: it cannot serve the hidden-state term; "
                             "use --set teacher_topk=0 with distill_hidden_weight > 0")
        self.store, self.device = store, device  # a teacher_cache.TeacherTopK, or None: the live teacher
        self.teacher = load_teacher(teacher_dir, device)
        tc = self.teacher.config
        if tc.vocab_size != student_config.vocab_size:
            raise ValueError(f"distill_from={teacher_dir} has a vocabulary of {tc.vocab_size} tokens, the student "
                             f"{student_config.vocab_size}; distil from the model the student was converted from")
        if hidden_weight > 0 and tc.num_hidden_layers != student_config.num_hidden_layers:
            raise ValueError(f"distill_hidden_weight > 0 needs teacher and student of the same depth (teacher "
                             f"{tc.num_hidden_layers} layers, student {student_config.num_hidden_layers})")
        self.alpha, self.temperature, self.hidden_weight = alpha, temperature, hidden_weight
        self.last_parts: dict = {}

    def __call__(self, model, input_ids: torch.Tensor, labels: torch.Tensor, windows=None) -> torch.Tensor:
        if self.store is not None:
            return self._from_store(model, input_ids, labels, windows)
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


    def _from_store(self, model, input_ids, labels, windows) -> torch.Tensor:
        """The loss with the teacher's stored top-k (teacher_cache): windows not stored yet are run first."""
        if windows is None:
            raise ValueError("teacher_topk: the batches must say which stored windows they are (WindowBatches)")
        w = windows.cpu().numpy()
        self.store.fill(self.teacher, w, self.device)
        t_logp, t_ids, t_tail = self.store.lookup(w, input_ids.device)
        s_out = model(input_ids=input_ids, use_cache=False)
        loss, self.last_parts = topk_distillation_loss(s_out.logits, t_logp, t_ids, t_tail, labels, self.alpha,
                                                       self.temperature)
        aux = getattr(s_out, "aux_loss", None)
        if aux is not None:
            loss = loss + _unwrap(model).config.router_aux_loss_coef * aux
        return loss


def topk_distillation_loss(student_logits, teacher_logp, teacher_ids, teacher_tail, labels, alpha: float = 0.5,
                           temperature: float = 1.0) -> tuple[torch.Tensor, dict]:
    """`distillation_loss` with the teacher given as its stored top-k log-probabilities and ids ([B, T, K]) and
    the mass outside them ([B, T]):
    the KL term on the K tokens plus the tail bucket (`teacher_cache.topk_kl`, whose module docstring states
    the truncation's bound), averaged over the counted positions; the LM term as before."""
    s = student_logits.flatten(0, 1)
    counted = labels.flatten() != IGNORE_INDEX
    n = counted.sum().clamp(min=1)
    kl = topk_kl(s, teacher_logp.flatten(0, 1), teacher_ids.flatten(0, 1), teacher_tail.flatten(), counted,
                 temperature) / n * temperature**2
    lm = lm_loss(s.float(), labels.flatten())
    loss = alpha * kl + (1.0 - alpha) * lm
    return loss, {"kl": float(kl.detach()), "lm": float(lm.detach()), "hidden": 0.0}


def _unwrap(model):
    return getattr(model, "module", model)
