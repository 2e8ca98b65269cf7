"""Run by tests/serving/conftest.py with the vLLM environment's Python: one process for the whole test session
that imports vLLM and the plugin once, then runs the jobs the serving tests send it, one after another.

Every vLLM process pays its imports (seconds of CPU) and, on the first prompt log-probabilities, the
compilation of vLLM's `gather_logprobs` (a C++ build by torch inductor); one process pays them once for all
the offline runs of the session, at its start (`compile_the_logprob_ranks`), which the serving tests' warm-up
overlaps with other tests. A job is one line of JSON on stdin, answered by one line on the protocol
pipe (the original stdout; the job's own writes to file descriptor 1 go to stderr, the log):

    {"module": "fusedkv.serving.offline", "argv": [...]}  -> the module's main(argv), as `python -m` runs it
    {"script": "path.py"}                                  -> the script, as `python path.py` runs it
    {"code": "..."}                                        -> the code, as `python -c` runs it
    answer: {"rc": 0 or 1, "stdout": what the job printed, "error": the traceback if it raised}

Garbage collection: every vLLM engine runs several full collections while it starts and stops (a third of
an engine's CPU time here), each walking the whole heap of vLLM's, torch's and transformers' modules. The
worker freezes what its imports made (`gc.freeze`: no longer walked), and since vLLM unfreezes the heap at
every engine's shutdown, that unfreeze is deferred to the end of each job, where the job's garbage is
collected and the survivors frozen again. What the engines compute is unchanged; a job's dead engines
are freed at its end instead of one by one.
"""

import contextlib
import gc
import importlib
import io
import json
import os
import runpy
import sys
import traceback

proto = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # print() of vLLM and of the jobs cannot garble the answers
sys.stdout = os.fdopen(1, "w", buffering=1)

import vllm  # noqa: E402,F401  (the slow imports, paid once)
from vllm import LLM  # noqa: E402,F401

import fusedkv.serving.offline  # noqa: E402,F401


def compile_the_logprob_ranks() -> None:
    """The compilation of vLLM's prompt-log-probability ranks (`batched_count_greater_than`, torch.compile), paid
    here while the worker starts in the background rather than by its first job: two vocabulary sizes, so that it
    is compiled for any size (dynamo makes the vocabulary dimension dynamic at the second), as a session's jobs
    of several vocabularies would have it compiled."""
    import torch
    from vllm.v1.sample.sampler import Sampler

    for vocab in (320, 321):
        Sampler.gather_logprobs(torch.randn(3, vocab).log_softmax(-1), 0, torch.zeros(3, dtype=torch.long))


compile_the_logprob_ranks()
unfreeze = gc.unfreeze
gc.unfreeze = lambda: None  # vLLM's, at each engine's shutdown: done once per job below instead
gc.collect()
gc.freeze()

proto.write(json.dumps({"ready": True}) + "\n")
proto.flush()
for line in sys.stdin:
    req = json.loads(line)
    out, rc, error = io.StringIO(), 0, ""
    try:
        with contextlib.redirect_stdout(out):
            if "module" in req:
                rc = importlib.import_module(req["module"]).main(req["argv"]) or 0
            elif "script" in req:
                runpy.run_path(req["script"], run_name="__main__")
            else:
                exec(compile(req["code"], "<-c>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        rc, error = 1, traceback.format_exc()
    unfreeze()
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    proto.write(json.dumps({"rc": rc, "stdout": out.getvalue(), "error": error}) + "\n")
    proto.flush()
