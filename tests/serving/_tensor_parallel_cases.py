"""Run by test_tensor_parallel.py with the vLLM environment's Python: each checkpoint served by vLLM's CPU build with
tensor_parallel_size=2 (two worker processes, gloo, one core each: VLLM_CPU_OMP_THREADS_BIND="0|1"), float32, eager,
greedy; prints one JSON line: {checkpoint: [tokens per prompt]}. argv: prompts JSON file, checkpoints."""

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    prompts = json.loads(open(sys.argv[1]).read())
    result = {}
    for model in sys.argv[2:]:
        llm = LLM(model=model, dtype="float32", block_size=32, kv_cache_memory_bytes=32 << 20, enforce_eager=True,
                  seed=0, enable_prefix_caching=False, skip_tokenizer_init=True, tensor_parallel_size=2,
                  distributed_executor_backend="mp")
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        result[model] = [list(o.outputs[0].token_ids) for o in outputs]
        del llm
    print(json.dumps(result))


if __name__ == "__main__":  # vLLM's engine and workers are spawned: they re-import this file
    main()
