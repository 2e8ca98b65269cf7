"""Decode speed of two source trees of fusedkv, interleaved: did a refactor change it?

Times what `fusedkv bench` times (`fusedkv.generation.generate` with `weight_layout="auto"`: the bench
model shape, a random prompt, greedy decode, median TPOT) for vanilla, fusedkv-lite and fusedkv, twice
per plan: with the native decode step where it covers the model (the default) and with the model's
modules every step (`native_step=False`: the attention implementations the engine selects). Each tree
runs in its own process (its own `import fusedkv`); the trees alternate within a round and their order
rotates from round to round; every process warms up each model first. Per-round ratios after / before
and their median are printed as a Markdown table.

    OMP_NUM_THREADS=1 python benchmarks/engine_before_after.py --base <commit> --rounds 3
    OMP_NUM_THREADS=1 python benchmarks/engine_before_after.py --before /tmp/engine-before --after . --rounds 3

`--base COMMIT` exports that commit's tree (`git archive`: no worktree is registered) into a temporary
directory and uses it as the tree before; `--before DIR` takes a tree you made yourself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PLANS = ("vanilla", "fusedkv-lite", "fusedkv")
MODES = {"native step": True, "modules": False}


def worker(prompt: int, new_tokens: int, repeats: int) -> None:
    import torch

    import fusedkv
    from fusedkv.generation import generate
    # Choose by what this tree holds, not by trying: a failed import of fusedkv.speed would otherwise be
    # answered by the editable install's finder from the repository's own tree.
    if (Path(fusedkv.__file__).parent / "speed").is_dir():
        from fusedkv.speed.inference import BenchShape, build_models
    else:  # a tree from before fusedkv/bench/ was renamed fusedkv/speed/
        from fusedkv.bench.inference import BenchShape, build_models

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    models = build_models(BenchShape(), list(PLANS), prompt + new_tokens + 8, "cpu", torch.float32, include_hf=False)
    ids = torch.randint(1, 8000, (1, prompt), generator=torch.Generator().manual_seed(0))
    out = {"tree": str(Path(fusedkv.__file__).resolve().parents[1])}
    for plan in PLANS:
        for mode, native in MODES.items():
            run = lambda m=models[plan], n=native: generate(m, ids, new_tokens, weight_layout="auto",  # noqa: E731
                                                             native_step=n)
            run()  # warm-up: layout, kernels, allocator
            out[f"{plan}|{mode}"] = statistics.median(run().tpot_s for _ in range(repeats))
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, help="the tree before the change")
    p.add_argument("--base", help="a commit of this repository: its tree is the one before (instead of --before)")
    p.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1], help="the tree after it")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="generate() calls per model and process (median)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.prompt, args.new_tokens, args.repeats)
    if (args.before is None) == (args.base is None):
        p.error("give the tree before the change: --base COMMIT or --before DIR")
    if args.base is None:
        return compare(args, args.before, None)
    with tempfile.TemporaryDirectory(prefix="fusedkv-base-") as tmp:
        tree = Path(tmp) / "tree"
        commit = export_commit(args.base, tree)
        return compare(args, tree, commit)


def export_commit(commit: str, dest: Path) -> str:
    """The tree of `commit` (of the repository this script is in) written into `dest`; returns its hash."""
    root = Path(__file__).resolve().parents[1]
    full = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = dest.parent / "tree.tar"
    subprocess.run(["git", "-C", str(root), "archive", "--format=tar", "-o", str(archive), full], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return full


def compare(args, before: Path, base: str | None) -> None:
    trees = {"before": before.resolve(), "after": args.after.resolve()}
    results = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            env = {**os.environ, "PYTHONPATH": str(trees[name])}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--prompt", str(args.prompt),
                   "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
            done = subprocess.run(cmd, env=env, cwd=trees[name], capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if result.pop("tree") != str(trees[name]):
                raise SystemExit(f"the {name} process imported fusedkv from elsewhere: check PYTHONPATH")
            results[name].append(result)
            print(f"round {r + 1} {name}: done", file=sys.stderr)
    if base is not None:
        print(f"before: commit {base}")
    print(f"prompt {args.prompt}, {args.new_tokens} new tokens, batch 1, {args.rounds} rounds, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}\n")
    print("| plan | decode | TPOT before (ms) | TPOT after (ms) | after / before per round | median |")
    print("|---|---|---|---|---|---|")
    for key in results["before"][0]:
        before = [r[key] for r in results["before"]]
        after = [r[key] for r in results["after"]]
        ratios = [a / b for a, b in zip(after, before)]
        plan, mode = key.split("|")
        print(f"| {plan} | {mode} | {statistics.median(before) * 1e3:.2f} | {statistics.median(after) * 1e3:.2f} | "
              f"{', '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
