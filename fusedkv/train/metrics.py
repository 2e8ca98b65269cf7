"""Run outputs for people: `metrics.csv`, TensorBoard events, the learning-curve PNG, the summary.

Only rank 0 writes. The CSV has one row per optimiser step (validation columns filled on evaluation
steps) and is rewritten from the checkpointed history on resume, so rows logged after the last
checkpoint by a killed run never survive next to the resumed run's rows. TensorBoard gets
`purge_step` on resume for the same reason.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from ..utils import human_bytes as _human_bytes
from ..utils import save_figure

FIELDS = ("step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_ppl", "elapsed_s")


class MetricsLogger:
    def __init__(self, out_dir: Path, history: list[dict], start_step: int, enabled: bool = True):
        self.enabled = enabled
        self.csv_path = out_dir / "metrics.csv"
        self._tb = None
        if not enabled:
            return
        # Rewrite from the (checkpointed) history: drops rows a killed run wrote after its checkpoint.
        with self.csv_path.open("w", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            w.writeheader()
            for row in history:
                w.writerow({k: _fmt(row.get(k)) for k in FIELDS})
        self._file = self.csv_path.open("a", newline="")
        self._csv = csv.DictWriter(self._file, FIELDS)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        except ImportError:  # tensorboard is a dependency, but a missing one must not stop training
            self._tb = None

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        try:
            self._csv.writerow({k: _fmt(row.get(k)) for k in FIELDS})
            self._file.flush()
        except OSError as e:  # name the file (a failed write() does not)
            raise OSError(e.errno, e.strerror, str(self.csv_path)) from e
        if self._tb is not None:
            step = row["step"]
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_ppl"):
                if row.get(key) is not None:
                    self._tb.add_scalar(
                        f"{'val' if key.startswith('val') else 'train'}/{key}", row[key], step
                    )
            if row.get("val_loss") is not None:
                self._tb.add_scalar("val/loss_vs_tokens", row["val_loss"], row["tokens"])

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}" if not math.isfinite(v) or abs(v) >= 1e-3 or v == 0 else f"{v:.6e}"
    return v


def plot_learning_curves(history: list[dict], path: Path, title: str) -> Path | None:
    """Train loss (raw and smoothed) and validation loss against tokens seen."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display needed; never opens a window
    import matplotlib.pyplot as plt

    tokens = [r["tokens"] for r in history]
    loss = [r["loss"] for r in history]
    smooth, ema = [], None
    for v in loss:
        ema = v if ema is None else 0.9 * ema + 0.1 * v
        smooth.append(ema)
    val = [(r["tokens"], r["val_loss"]) for r in history if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(tokens, loss, color="tab:blue", alpha=0.25, linewidth=0.8, label="train loss")
    ax.plot(tokens, smooth, color="tab:blue", linewidth=1.5, label="train loss (EMA 0.9)")
    if val:
        ax.plot(*zip(*val), "o-", color="tab:orange", linewidth=1.5, markersize=4, label="validation loss")
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def human_bytes(n: float) -> str:
    return _human_bytes(n, digits=2)


def format_summary(result: dict) -> str:
    """The end-of-run lines: validation loss/perplexity next to the KV-cache cost vs vanilla."""
    ctx = result["context_length"]
    lines = [
        f"plan {result['plan']}: {result['steps']} steps, {result['tokens_seen']:,} tokens, "
        f"{result['tokens_per_s']:,.0f} tokens/s, {result['num_params'] / 1e6:.2f}M parameters",
    ]
    if result.get("val_loss") is not None:
        lines.append(f"validation loss {result['val_loss']:.4f}   perplexity {result['val_ppl']:.2f}")
    lines.append(
        f"KV cache (bf16): {result['kv_cache_bytes_per_token']:,} bytes/token, "
        f"{human_bytes(result['kv_cache_bytes_full_context'])} for a full {ctx}-token context   |   MHA of this shape: "
        f"{result['kv_cache_bytes_per_token_vanilla']:,} bytes/token, "
        f"{human_bytes(result['kv_cache_bytes_full_context_vanilla'])}   "
        f"({result['kv_cache_ratio']:.2f}x MHA)"
    )
    if result.get("checkpoint"):
        lines.append(f"model: {result['checkpoint']}")
    return "\n".join(lines)


def kv_cache_report(mc, bytes_per_element: int = 2) -> dict:
    """KV-cache bytes per token and for a full context, for this plan and for its baseline, MHA of the
    same shape (`FusedKVConfig.mha_kv_cache_bytes_per_token`; the "_vanilla" keys hold that baseline)."""
    mine = mc.kv_cache_bytes_per_token(bytes_per_element)
    vanilla = mc.mha_kv_cache_bytes_per_token(bytes_per_element)
    ctx = mc.max_position_embeddings
    return {
        "kv_cache_bytes_per_token": mine,
        "kv_cache_bytes_per_token_vanilla": vanilla,
        "kv_cache_ratio": mc.kv_cache_fraction(),
        "context_length": ctx,
        "kv_cache_bytes_full_context": mine * ctx,
        "kv_cache_bytes_full_context_vanilla": vanilla * ctx,
    }
