"""The teacher's top-k log-probabilities, stored next to the prepared data: its forward is paid once.

Distillation (`fusedkv.train.distill`) needs the teacher's next-token distribution at every position of
every training window. With `teacher_topk=K` the trainer draws windows from a fixed grid of the training
shard (window w: inputs tokens[wL : wL+L], labels shifted by one, L = seq_len; `WindowBatches`) and
keeps, per position, the teacher's K largest log-probabilities (float16) and their token ids:

    <prepared data>/teacher/<key>/meta.json      what the key stands for; written first
                                  logp.f16       [W, L, K] log-probabilities at the run's temperature
                                  ids.u16|.i32   [W, L, K] token ids (uint16 when the vocabulary fits)
                                  tail.f32       [W, L] the teacher's mass outside the K (float32)
                                  filled.u8      [W] 1 once window w is stored

`<key>` hashes the teacher's files (config and weights), the training tokens, L, K and the temperature:
a run of another seed or plan reuses the store; another teacher, other data or another setting gets its
own. Windows are filled when a step first needs them (the teacher runs on those only) and read
afterwards, so the first run costs what a live teacher costs and every later one (seeds, plans, epochs)
skips the teacher. The files are memory-mapped and written in place; a window is marked filled after its
values, so a killed run, or two runs filling the same store at once, at worst recompute a window.

The loss on the stored support (`topk_kl`) is the KL between teacher and student coarsened to K + 1
outcomes: the K stored tokens and one bucket for the rest (its teacher mass, stored in float32). Its
bound, by the chain rule of KL: 0 <= KL_full - KL_stored = E[p_tail * KL(p_tail || q_tail)], with
p_tail, q_tail the two distributions restricted to the tail and renormalised; the float16 values add
at most |log p| * 2^-11 per stored log-probability (tests/train/test_teacher_cache.py checks both
against the live teacher).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..data.loader import STATE_VERSION, _check_length, _gather, _open
from ..utils import write_json_atomic

FORMAT = 2  # 2: the tail mass stored (tail.f32)
# float16 keeps a log-probability to 2^-11 of its value (bfloat16: 2^-8): the bound above uses it.
FP16_REL = 2.0**-11

_FILE_HASHES: dict = {}


def _file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _FILE_HASHES[key] = h.hexdigest()
    return _FILE_HASHES[key]


def teacher_fingerprint(teacher_dir) -> str:
    """A hash of what decides the teacher's outputs: its config.json and every weight file."""
    d = Path(teacher_dir)
    files = [d / "config.json", *sorted(d.glob("*.safetensors")), *sorted(d.glob("*.bin"))]
    return hashlib.sha256("".join(f"{f.name}:{_file_sha256(f)};" for f in files if f.is_file()).encode()).hexdigest()


def store_key(teacher_dir, tokens: np.ndarray, seq_len: int, k: int, temperature: float) -> dict:
    data = hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()
    return {"format": FORMAT, "teacher": teacher_fingerprint(teacher_dir), "tokens": data, "seq_len": int(seq_len),
            "k": int(k), "temperature": float(temperature)}


class TeacherTopK:
    """The store for one (teacher, data, seq_len, K, temperature): open or create it under `root`."""

    def __init__(self, root, teacher_dir, tokens: np.ndarray, seq_len: int, k: int, temperature: float,
                 vocab_size: int):
        _check_length(tokens, seq_len, "the training shard")
        key = store_key(teacher_dir, tokens, seq_len, k, temperature)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = Path(root) / digest
        self.tokens, self.seq_len, self.k, self.temperature = tokens, int(seq_len), int(k), float(temperature)
        self.num_windows = (len(tokens) - 1) // self.seq_len
        id_dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
        shape = (self.num_windows, self.seq_len, self.k)
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = {**key, "teacher_dir": str(teacher_dir), "num_windows": self.num_windows,
                "id_dtype": np.dtype(id_dtype).name}
        if not (self.dir / "meta.json").is_file():
            write_json_atomic(self.dir / "meta.json", meta)
        ids_name = "ids.u16" if id_dtype == np.uint16 else "ids.i32"
        self.logp = _memmap(self.dir / "logp.f16", np.float16, shape)
        self.ids = _memmap(self.dir / ids_name, id_dtype, shape)
        self.tail = _memmap(self.dir / "tail.f32", np.float32, shape[:2])
        self.filled = _memmap(self.dir / "filled.u8", np.uint8, (self.num_windows,))

    def count_filled(self) -> int:
        return int(self.filled.sum())

    def window_inputs(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return _gather(self.tokens, np.asarray(windows, dtype=np.int64) * self.seq_len, self.seq_len)

    @torch.no_grad()
    def fill(self, teacher, windows: np.ndarray, device, batch_size: int = 8) -> int:
        """Run the teacher on the windows not stored yet (each once) and store them; returns how many."""
        todo = np.unique(np.asarray(windows, dtype=np.int64))
        todo = todo[self.filled[todo] == 0]
        for i in range(0, len(todo), batch_size):
            part = todo[i:i + batch_size]
            x, _ = self.window_inputs(part)
            logits = teacher(input_ids=x.to(device), use_cache=False).logits.float()
            logp, ids = F.log_softmax(logits / self.temperature, -1).topk(self.k, dim=-1)
            self.tail[part] = (1.0 - logp.exp().sum(-1)).clamp(min=0.0).cpu().numpy()
            self.logp[part] = logp.half().cpu().numpy()
            self.ids[part] = ids.cpu().numpy().astype(self.ids.dtype)
            self.filled[part] = 1  # after the values: a reader that sees the mark sees them
        return len(todo)

    def lookup(self, windows: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-probabilities float32 [B, L, K], token ids int64 [B, L, K], tail mass float32 [B, L]) of stored
        windows."""
        w = np.asarray(windows, dtype=np.int64)
        if not self.filled[w].all():
            raise RuntimeError(f"teacher store {self.dir}: windows {w[self.filled[w] == 0][:4]} are not filled")
        logp = torch.from_numpy(np.array(self.logp[w])).to(device).float()
        ids = torch.from_numpy(np.array(self.ids[w]).astype(np.int64)).to(device)
        tail = torch.from_numpy(np.array(self.tail[w])).to(device)
        return logp, ids, tail


def _memmap(path: Path, dtype, shape) -> np.memmap:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not path.exists() or path.stat().st_size != nbytes:
        # A sparse file of the full size; created under a temporary name so no reader sees a short one.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.truncate(nbytes)
        if not path.exists() or path.stat().st_size != nbytes:
            os.replace(tmp, path)
        else:
            tmp.unlink()
    return np.memmap(path, dtype=dtype, mode="r+", shape=shape)


def topk_kl(student_logits: torch.Tensor, teacher_logp: torch.Tensor, teacher_ids: torch.Tensor,
            teacher_tail: torch.Tensor, counted: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Sum over counted positions of KL(teacher || student) on the K stored tokens plus the tail bucket
    (module docstring). student_logits [N, V]; teacher_logp, teacher_ids [N, K]; teacher_tail, counted [N]."""
    s = student_logits[counted].float() / temperature
    lp, ids = teacher_logp[counted].float(), teacher_ids[counted]
    lse = torch.logsumexp(s, -1, keepdim=True)
    lq = s.gather(-1, ids) - lse
    kl = (lp.exp() * (lp - lq)).sum()
    if ids.shape[-1] == s.shape[-1]:  # the whole vocabulary stored: no tail
        return kl
    lq_tail = torch.logsumexp(s.scatter(-1, ids, float("-inf")), -1) - lse.squeeze(-1)
    p_tail = teacher_tail[counted].float()
    # 0 log 0 = 0: a tail the teacher gives no mass adds nothing
    return kl + torch.xlogy(p_tail, p_tail).sum() - (p_tail * lq_tail).sum()


class WindowBatches:
    """`TokenBatches` on the store's grid: the global batch at step s is the windows a generator seeded with
    (seed, s) draws (a pure function of the two, so a resumed run sees the same batches); yields
    (input_ids, labels, window indices) for this rank's rows."""

    def __init__(self, shard, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        self.tokens, self.targets = _open(shard)
        _check_length(self.tokens, seq_len, "the training shard")
        self.seq_len, self.batch_size, self.seed = int(seq_len), int(batch_size), int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.global_batch_size = self.batch_size * self.world_size
        self.num_windows = (len(self.tokens) - 1) // self.seq_len
        self.step = 0

    def global_windows(self, step: int) -> np.ndarray:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, int(step)]))
        return rng.integers(0, self.num_windows, size=self.global_batch_size, dtype=np.int64)

    def batch_at(self, step: int):
        w = self.global_windows(step)[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        x, y = _gather(self.tokens, w * self.seq_len, self.seq_len, self.targets)
        return x, y, torch.from_numpy(w)

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch_size": self.global_batch_size, "num_tokens": len(self.tokens), "grid": True}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "global_batch_size", "num_tokens", "grid"):
            mine = self.state_dict()[key]
            if state.get(key, False if key == "grid" else mine) != mine:
                raise ValueError(f"cannot resume: the checkpoint's batches had {key}={state.get(key)}, this run "
                                 f"{mine} (teacher_topk decides the grid); resume with the original settings")
        self.step = int(state["step"])


__all__ = ["FP16_REL", "TeacherTopK", "WindowBatches", "store_key", "teacher_fingerprint", "topk_kl"]
