"""A real checkpoint served by `fusedkv serve`: chat completions with the checkpoint's own chat template, greedy,
in float32, against transformers' `generate` on the same templated prompt (the model loaded by fusedkv's own
transformers model, as `fusedkv generate` loads it).

    OMP_NUM_THREADS=1 python benchmarks/serving_real_model.py /work/realmodel/vanilla \
        --out docs/serving_real_model.json

Starts the server (eager, 127.0.0.1, a free port), sends each conversation to /v1/chat/completions with
temperature 0, stops the server, then decodes the same prompt tokens with transformers. Prints one row per
conversation: the reply, whether the token ids are the same, the server's start-up time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    p.add_argument("--port", type=int, default=None,
                   help="use a server already started by `fusedkv serve CHECKPOINT --served-model-name m` on this port")
    args = p.parse_args()
    if args.port is not None:
        replies = chat(args.port, args.max_tokens)
        return compare(args, replies, f"(already running on port {args.port})", None)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "fusedkv.cli", "serve", args.checkpoint, "--port", str(port), "--enforce-eager",
           "--max-model-len", "1024", "--kv-cache-memory", "256M", "--served-model-name", "m"]
    start = time.monotonic()
    server = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ready_line, replies = None, []
    try:
        for line in server.stderr:
            if "ready on" in line:
                ready_line = line.strip()
                break
        if ready_line is None:
            raise SystemExit(f"the server stopped before it was ready (exit {server.wait()})")
        ready_s = time.monotonic() - start
        replies = chat(port, args.max_tokens)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    return compare(args, replies, ready_line, ready_s)


def chat(port: int, max_tokens: int) -> list[dict]:
    replies = []
    for messages in CONVERSATIONS:
        r = post(f"http://127.0.0.1:{port}/v1/chat/completions",
                 {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                  "return_token_ids": True})
        choice = r["choices"][0]
        replies.append({"text": choice["message"]["content"], "token_ids": choice.get("token_ids"),
                        "prompt_token_ids": r.get("prompt_token_ids")})
    return replies


def compare(args, replies: list[dict], ready_line: str, ready_s: float | None) -> int:
    import torch
    from transformers import AutoTokenizer

    from fusedkv import FusedKVForCausalLM

    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    model = FusedKVForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    rows = []
    for messages, reply in zip(CONVERSATIONS, replies):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False)
        ref = out[0, len(ids):].tolist()
        if tok.eos_token_id in ref:  # the server stops at the end of the turn
            ref = ref[:ref.index(tok.eos_token_id) + 1]
        served = reply["token_ids"] or tok.encode(reply["text"], add_special_tokens=False)
        rows.append({"messages": messages, "reply": reply["text"], "same_tokens": served == ref,
                     "same_prompt": reply["prompt_token_ids"] in (None, ids), "served_tokens": served,
                     "transformers_tokens": ref})
        print(f"| {messages[-1]['content']!r} | {reply['text']!r} | {rows[-1]['same_tokens']} |")
    result = {"checkpoint": args.checkpoint, "ready_line": ready_line, "ready_s": ready_s, "rows": rows,
              "date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg()}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
