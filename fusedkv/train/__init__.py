"""fusedkv.train: pre-training and continued training of FusedKV models (and every other KV plan).

    from fusedkv.train import TrainConfig, train
    result = train(TrainConfig(preset="nano", kv_sharing="fusedkv", out_dir="runs/nano", progress=False))
    result["val_loss"], result["tokens_per_s"], result["curve"]

Modules: :mod:`.config` (TrainConfig, YAML / key=value overrides; presets in presets/*.yaml),
:mod:`.trainer` (the step and the loop), :mod:`.run_setup` (everything the loop needs, resuming included),
:mod:`.run_checkpoints` (saving a run), :mod:`.validation` (validation loss during training), :mod:`.optim`
(AdamW groups, warm-up + cosine), :mod:`.full_checkpoint` (atomic, verified checkpoints gathered to rank 0,
RNG, stop signals), :mod:`.sharded_checkpoint` (every rank writes its shard, DCP), :mod:`.rundir` (the run
directory's lock, --overwrite, which checkpoint --resume continues from), :mod:`.distributed` (torchrun,
DDP, FSDP2), :mod:`.data` (data preparation and vocabulary checks), :mod:`.metrics` (CSV, TensorBoard,
plots, the KV-cache report), :mod:`.memory_estimate` (`fusedkv memory`), :mod:`.command` (`fusedkv train`).
The loss is fusedkv/model/loss.py.
"""

from .config import PRESET_NAMES, PRESETS, TrainConfig, resolve_config
from .trainer import TrainingDiverged, compute_loss, kv_cache_report, train

__all__ = [
    "PRESETS",
    "PRESET_NAMES",
    "TrainConfig",
    "TrainingDiverged",
    "compute_loss",
    "kv_cache_report",
    "resolve_config",
    "train",
]
