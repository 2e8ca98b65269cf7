"""Tokenizers: train a byte-level BPE on a document stream, and load any Hugging Face tokenizer.

The trained tokenizer is a Hugging Face ``tokenizers`` byte-level BPE (GPT-2 style: every byte is
representable, so there is no unknown token and ``decode(encode(text)) == text``). It is saved as a
``transformers.PreTrainedTokenizerFast`` directory, so ``AutoTokenizer.from_pretrained(dir)`` -- and
therefore the model, the evaluation harness and any HF tooling -- load it without fusedkv code.

Special tokens:

* ``<|endoftext|>`` -- the document separator. It is both BOS and EOS: the token shards put it after
  every document, so for a sampled window it also marks the start of the next document.
* ``<|pad|>`` -- padding for batched evaluation/generation; never appears in the training shards.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..utils import hub_unreachable_reason, replace_dir

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]  # ids 0 and 1 in a tokenizer trained here


def _limit_chars(documents: Iterable[str], max_chars: int | None) -> Iterator[str]:
    total = 0
    for doc in documents:
        if max_chars is not None and total >= max_chars:
            return
        if max_chars is not None:
            doc = doc[: max_chars - total]
        total += len(doc)
        yield doc


def train_bpe_tokenizer(
    documents: Iterable[str],
    vocab_size: int,
    out_dir: str | Path,
    *,
    min_frequency: int = 2,
    max_chars: int | None = None,
):
    """Train a byte-level BPE with ``vocab_size`` entries (special tokens included) and save it.

    ``documents`` is any iterable of strings (e.g. a :class:`~fusedkv.data.sources.Source`); it is
    consumed once, in a streaming fashion. ``max_chars`` caps how much text is used, which keeps
    training fast on huge streamed corpora (BPE merges stabilise after a few hundred MB).
    The result is written to ``out_dir`` via a temporary directory that is renamed into place, so an
    interrupted run never leaves a half-written tokenizer. Returns the loaded
    ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # 256 byte symbols + special tokens is the smallest vocabulary a byte-level BPE can have.
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE; use at least "
                         f"{256 + len(SPECIAL_TOKENS)} (e.g. 8192).")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(x)) == x exactly; use_regex splits words, digits and
    # punctuation like GPT-2 so merges never cross word boundaries.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even unseen ones
        show_progress=False,
    )
    tok.train_from_iterator(_limit_chars(documents, max_chars), trainer=trainer)
    fast = wrap_tokenizer_object(tok)
    save_tokenizer(fast, out_dir)
    return fast


# The chat template `fusedkv train` saves with a tokenizer that has none (and `fusedkv serve` uses for a checkpoint
# without one): a plain transcript, "Role: text" paragraphs, ending in "Assistant:" for the model to continue.
# Documented in docs/serving.md.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def with_chat_template(tokenizer):
    """`tokenizer` with `DEFAULT_CHAT_TEMPLATE` where it has no chat template of its own (an imported model's
    template is kept), so a saved checkpoint answers chat requests (`/v1/chat/completions`, transformers'
    `apply_chat_template`) without one given separately."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def wrap_tokenizer_object(tok):
    """Wrap a raw ``tokenizers.Tokenizer`` trained here as a ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # The default cleanup rewrites " ." into "." etc., which would break exact round-trips.
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,  # the model, not the tokenizer, decides the context length
    )


def save_tokenizer(tokenizer, out_dir: str | Path) -> Path:
    """``save_pretrained`` into ``out_dir`` atomically (temp dir in the same parent, then rename)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private (0700); the tokenizer is ordinary shared output
        tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def load_tokenizer(dir_or_name):
    """Load a tokenizer: a ``PreTrainedTokenizer`` object is returned as is, a local directory (for
    example ``<prepared data>/tokenizer``) or a hub name goes through ``AutoTokenizer.from_pretrained``.

    Raises ``ValueError`` with a hint when a local path is missing or holds no tokenizer.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    if isinstance(dir_or_name, PreTrainedTokenizerBase):
        return dir_or_name
    s = str(dir_or_name)
    path = Path(s).expanduser()
    if path.exists() or not _looks_like_hub_id(s):
        if not path.is_dir():
            raise ValueError(
                f"tokenizer directory {s!r} does not exist. Train one with "
                f"fusedkv.data.train_bpe_tokenizer(...) or prepare_dataset(...) (which writes "
                f"<out_dir>/tokenizer), or pass a Hugging Face tokenizer name."
            )
        if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            raise ValueError(
                f"{s!r} exists but holds no tokenizer (no tokenizer.json / tokenizer_config.json). "
                f"Point at the directory written by save_pretrained, e.g. <prepared data>/tokenizer."
            )
        return AutoTokenizer.from_pretrained(str(path))
    reason = hub_unreachable_reason()
    if reason is not None:
        raise ValueError(
            f"tokenizer {s!r} is not a local directory and {reason}. Pass the path of a tokenizer "
            f"directory (e.g. <prepared data>/tokenizer), or set HF_HUB_OFFLINE=1 to use the HF cache."
        )
    try:
        return AutoTokenizer.from_pretrained(s)
    except Exception as e:  # hub errors come in many types; all mean "could not get it"
        raise ValueError(
            f"could not load tokenizer {s!r}: {type(e).__name__}: {e}. If it is meant to be a local "
            f"directory, check the path; hub names need network access or a local HF cache."
        ) from e


def _looks_like_hub_id(s: str) -> bool:
    # Hub ids are "name" or "org/name"; absolute, "./", "~/" or deeper paths are local directories.
    return s.count("/") <= 1 and not s.startswith(("/", ".", "~")) and "\\" not in s


def tokenizer_sha256(tokenizer) -> str:
    """A content hash of a fast tokenizer (its full ``tokenizer.json`` serialisation), used to tell
    whether prepared shards were made with this very tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer; fusedkv needs one "
                         f"(AutoTokenizer.from_pretrained(..., use_fast=True)).")
    return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()


def check_same_tokenizer(recorded: str | None, tokenizer, data: str, model: str) -> bool:
    """Refuse (ValueError) token data whose metadata records another tokenizer's hash than `tokenizer`'s:
    its ids would mean other strings to the model, and every number computed from them would be silently
    wrong. Returns False when the data records no hash (nothing to compare)."""
    if recorded is None:
        return False
    if recorded != tokenizer_sha256(tokenizer):
        raise ValueError(f"{data} was tokenised with another tokenizer than {model}'s (tokenizer SHA-256 "
                         f"{recorded[:12]}... in its metadata, {tokenizer_sha256(tokenizer)[:12]}... for {model}): "
                         f"its token ids mean other text to this model. Prepare the data with {model}'s tokenizer "
                         "(fusedkv.data.prepare_dataset(source, out, tokenizer=MODEL_DIR))")
    return True


def eos_token_id(tokenizer) -> int:
    """The id used to terminate documents: the tokenizer's EOS, else ``<|endoftext|>`` if present."""
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    tid = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError("tokenizer has no EOS token; set tokenizer.eos_token before preparing data.")
    return int(tid)
