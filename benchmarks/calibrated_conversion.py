"""The conversion gap of every fusion initialisation: perplexity before any training of a converted model on
held-out texts, for `--fusion-init equivalent` / `normal` and the stages of `--fusion-init calibrated`
(fusion weights alone; + o_proj refit; + MLP down_proj refit; with calibrated sources), against the original.

    python benchmarks/calibrated_conversion.py /work/realmodel/vanilla \\
        --text prose=/work/realmodel/heldout/prose.txt --text code=/work/realmodel/heldout/code.txt \\
        --calib-data calib.txt --plans fusedkv,fusedkv-lite \\
        --variants teacher,equivalent,fusion,o_proj,o_proj+mlp,sources:o_proj+mlp --json gap.json

VANILLA is a vanilla fusedkv import of the model (`fusedkv convert SRC VANILLA --plan vanilla`). Every variant is
built in memory from it with the functions `fusedkv convert --fusion-init calibrated` runs
(`fusedkv.calibrate`); the first `--eval-tokens` tokens of each text are scored in non-overlapping windows of
`--window` tokens. The fusion fit is shared by the variants of one plan (and source choice).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from fusedkv.calibrate import calibration_batches, fit_fusion, refit_layers, set_fusion, source_map
from fusedkv.convert import fusedkv_to_plan_config, model_from_state
from fusedkv.data.tokenizer import load_tokenizer
from fusedkv.eval.perplexity import sliding_window_perplexity
from fusedkv.model import FusedKVForCausalLM

SOURCES = "sources:"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("vanilla", help="a vanilla fusedkv import of the model")
    p.add_argument("--text", action="append", required=True, metavar="NAME=FILE", help="held-out text (repeatable)")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--calib-data", required=True, help="calibration text, any `--data` spec")
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--plans", default="fusedkv")
    p.add_argument("--variants", default="teacher,equivalent,fusion,o_proj,o_proj+mlp")
    p.add_argument("--ridge", type=float, default=1e-2)
    p.add_argument("--json", required=True)
    args = p.parse_args()

    tok = load_tokenizer(args.vanilla)
    teacher = FusedKVForCausalLM.from_pretrained(args.vanilla, dtype=torch.float32).eval()
    texts = {}
    for item in args.text:
        name, path = item.split("=", 1)
        ids = tok(Path(path).read_text(), add_special_tokens=False)["input_ids"][: args.eval_tokens]
        texts[name] = torch.tensor(ids)
    batches = calibration_batches(tok, args.calib_data, args.calib_tokens, args.window)
    out = json.loads(Path(args.json).read_text()) if Path(args.json).is_file() else {}

    def record(key: str, model, **info) -> None:
        started = time.perf_counter()
        ppl = {k: round(sliding_window_perplexity(model, v, args.window, args.window)["ppl"], 2)
               for k, v in texts.items()}
        out[key] = dict(ppl=ppl, eval_seconds=round(time.perf_counter() - started, 1), **info)
        print(key, ppl, {k: v for k, v in info.items() if k != "layers"}, flush=True)
        Path(args.json).write_text(json.dumps(out, indent=1))

    variants = args.variants.split(",")
    if "teacher" in variants:
        record("teacher", teacher)
    saved = teacher.config.to_dict()
    for plan in args.plans.split(","):
        fusion_fits = {}
        for variant in (v for v in variants if v != "teacher"):
            choose = variant.startswith(SOURCES)
            stages = variant.removeprefix(SOURCES)
            started = time.perf_counter()
            if stages in ("equivalent", "normal"):
                torch.manual_seed(0)
                config = fusedkv_to_plan_config(saved, plan, fusion_init=stages)
                record(f"{plan}/{variant}", model_from_state(teacher.state_dict(), config).eval())
                continue
            config = fusedkv_to_plan_config(saved, plan)
            if choose not in fusion_fits:
                fusion_fits[choose] = fit_fusion(teacher, config.plan, batches, choose, config.tie_rope_pairs)
            fits = copy.deepcopy(fusion_fits[choose])
            if choose:
                config = fusedkv_to_plan_config(saved, "custom", kv_source_map=source_map(config.plan, fits))
            model = model_from_state(teacher.state_dict(), config).eval()
            set_fusion(model, fits)
            refits = tuple(s for s in stages.split("+") if s != "fusion")
            if refits:
                refit_layers(teacher, model, batches, fits, refits, args.ridge)
            record(f"{plan}/{variant}", model, fit_seconds=round(time.perf_counter() - started, 1),
                   layers=[f.summary() for f in fits])


if __name__ == "__main__":
    main()
