"""A transformers `Cache` holding only a plan's storage layers, each as a layer of the caller's kind (the
reconstruction layers hold nothing: `DummyLayer`). Shared by the quantised caches (KIVI, fp8)."""

from __future__ import annotations

from collections.abc import Callable

from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer


class StorageLayersCache(Cache):
    def __init__(self, config, make_layer: Callable[[], CacheLayerMixin]):
        storage = set(config.plan.storage_layers)
        super().__init__(layers=[make_layer() if i in storage else DummyLayer()
                                 for i in range(config.num_hidden_layers)])
        self._first_storage = min(storage)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held; a reconstruction layer answers for the first storage layer (it holds nothing itself)."""
        layer = self.layers[layer_idx]
        if isinstance(layer, DummyLayer):
            layer = self.layers[self._first_storage]
        return layer.get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0
