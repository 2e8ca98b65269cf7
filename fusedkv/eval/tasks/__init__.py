"""Tiny local lm-evaluation-harness tasks (YAML + jsonl) shipped with fusedkv; see fusedkv.eval.harness."""
