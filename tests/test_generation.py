"""The lean, timed generation loop agrees with transformers' generate() and with itself across caches."""

import pytest
import torch

from fusedkv.generation import generate, sample_next
from tests.conftest import tiny_model


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv-lite", "fusedkv", "cla"])
def test_lean_loop_matches_hf_generate_with_left_padding(plan):
    model = tiny_model(plan)
    ids = torch.randint(1, 97, (2, 9))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    for static in (True, False):
        out = generate(model, ids, 7, attention_mask=mask, static_cache=static)
        assert torch.equal(out.tokens, ref)
        assert len(out.step_s) == 6 and out.ttft_s > 0
    assert out.cache_bytes > 0


def test_eos_stops_and_context_limit_is_checked():
    model = tiny_model("fusedkv")
    ids = torch.randint(1, 97, (1, 5))
    first = generate(model, ids, 3).tokens[0, 5].item()
    stopped = generate(model, ids, 20, eos_token_id=first)
    assert stopped.tokens.shape[1] == 6  # the first new token was EOS: nothing after it
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        generate(model, torch.randint(1, 97, (1, 120)), 20)


def test_sampling_respects_top_k():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, temperature=1.0, top_k=2, generator=g).item() for _ in range(50)}
    assert picks <= {1, 2} and sample_next(logits).item() == 1


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv", "fusedkv-lite"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_each_row_alone(plan, side):
    # Rows of different lengths padded on either side continue exactly as each prompt does unpadded.
    model = tiny_model(plan)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 97, (n,), generator=g) for n in (4, 9, 6)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        cols = slice(0, len(p)) if side == "right" else slice(width - len(p), width)
        ids[i, cols], mask[i, cols] = p, 1
    out = generate(model, ids, 6, attention_mask=mask)
    assert torch.equal(out.tokens[:, :width], ids)  # the caller's prompt layout is kept
    for i, p in enumerate(prompts):
        alone = generate(model, p[None], 6).tokens[0, len(p):]
        assert torch.equal(out.tokens[i, width:], alone), f"row {i} ({side} padding)"


def test_padding_inside_a_row_is_refused():
    model = tiny_model("fusedkv")
    ids = torch.randint(1, 97, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, 2] = 0
    with pytest.raises(ValueError, match="padding between real tokens"):
        generate(model, ids, 2, attention_mask=mask)


def test_sampling_respects_top_p_and_stops_on_any_eos():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])  # probabilities ~0.005, 0.73, 0.27, 0.002
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, temperature=1.0, top_p=0.5, generator=g).item() for _ in range(50)}
    assert picks == {1}  # the top token alone already holds more than half the mass
    picks = {sample_next(logits, temperature=1.0, top_p=0.95, generator=g).item() for _ in range(200)}
    assert picks == {1, 2}
    model = tiny_model("fusedkv")
    ids = torch.randint(1, 97, (1, 5))
    first = generate(model, ids, 3).tokens[0, 5].item()
    assert generate(model, ids, 20, eos_token_id=[96 if first != 96 else 95, first]).tokens.shape[1] == 6


@pytest.mark.slow  # the fast tier's only run of the `fusedkv` command with the test's own environment: a zygote
def test_cli_generate_uses_the_package_loop_quietly(tmp_path):
    # `fusedkv generate --greedy` prints what the model's greedy continuation is (checked against
    # transformers' generate on the same weights), through fusedkv.generation, with no warning printed.
    from transformers import AutoTokenizer

    from tests.test_cli import run_cli, save_tokenizer

    save_tokenizer(tmp_path, 300)
    model = tiny_model("fusedkv", vocab_size=300)
    model.save_pretrained(tmp_path)
    r = run_cli("generate", str(tmp_path), "--prompt", "ROMEO:", "--max-new-tokens", "6", "--greedy",
                "--num-samples", "2")
    assert r.returncode == 0, r.stderr
    assert "warn" not in r.stderr.lower() and "deprecat" not in r.stderr.lower(), r.stderr
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = tok(["ROMEO:"], return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    text = tok.decode(ref[0], skip_special_tokens=True)
    assert r.stdout.count(text + "\n" + "-" * 40) == 2, (r.stdout, text)
    assert "KV cache held" in r.stderr
