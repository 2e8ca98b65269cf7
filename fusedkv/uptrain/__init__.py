"""fusedkv.uptrain: a pretrained full-cache model to a half-size-cache plan in one resumable command.

    fusedkv uptrain SRC OUT --plan fusedkv

converts SRC (`fusedkv.convert`, any imported family), distils the converted model from SRC run by
transformers (`fusedkv.train` with `distill_from`, single process or torchrun DDP/FSDP2), evaluates the
teacher, the converted model before and after on held-out text, and reports the recovered share of the
conversion gap with the KV cache per token. Modules: :mod:`.pipeline` (the stages and what marks each
done), :mod:`.report` (report.md / report.json / curves.png), :mod:`.command` (the CLI).
"""

from .pipeline import Uptrain, run_uptrain
from .report import recovered_share

__all__ = ["Uptrain", "recovered_share", "run_uptrain"]
