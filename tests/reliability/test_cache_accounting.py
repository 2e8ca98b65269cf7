"""The reported cache size is the size the caches hold (#11): `kv_cache_fraction` / `kv_cache_bytes_per_token`
counted a sliding-window layer at W tokens while every cache keeps W - 1 (the query's own token makes W).
Checked against the bytes a real forward leaves in transformers' DynamicCache and in StaticKVCache."""

import pytest
import torch

from fusedkv.cache import StaticKVCache, kv_cache_nbytes
from fusedkv.plan import SLIDING
from tests.model.test_sliding_window import hybrid_model


@pytest.mark.parametrize("plan, shared", [("vanilla", None), ("fusedkv", None), ("fusedkv-lite", [SLIDING])])
@pytest.mark.parametrize("context", [3, 4, 5, 6, 23])
def test_reported_bytes_equal_the_bytes_the_caches_hold(plan, shared, context):
    model = hybrid_model(plan, shared).eval()  # window 5: layers alternate window / full
    cfg = model.config
    batch = 2
    ids = torch.randint(1, 97, (batch, context))
    expected = cfg.kv_cache_bytes_per_token(4, context) * context * batch  # float32: 4 bytes
    with torch.no_grad():
        dynamic = model(ids, use_cache=True).past_key_values
        static = StaticKVCache(cfg, batch, context)
        model(ids, past_key_values=static, use_cache=True)
    assert kv_cache_nbytes(dynamic) == expected
    assert static.nbytes() == expected
    mha = cfg.mha_kv_cache_bytes_per_token(4) * context * batch
    assert cfg.kv_cache_fraction(context) == pytest.approx(expected / mha)
