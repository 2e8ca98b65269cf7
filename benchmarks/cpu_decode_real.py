"""CPU decode of a real pretrained model next to llama.cpp on the same weights, with quality on every row.

`benchmarks/cpu_decode.py --model SRC` lands here. SRC is a transformers checkpoint directory (Llama family,
e.g. SmolLM2-135M-Instruct as `fusedkv convert` or transformers saved it) or a GGUF file (loaded through
transformers' GGUF loader, dequantised to float32, saved as a transformers checkpoint in a scratch folder).

Rows:
- fusedkv: the model imported with `fusedkv convert --plan vanilla`, and each other plan of `--plans` (a
  checkpoint per plan from `--plan-checkpoints PLAN=DIR,...`, e.g. an uptrained one; otherwise the plan's
  untrained conversion, whose quality column then says how far from usable it is), at each `--weights`
  format (f32, bf16/f16, int8, int4) with a 16-bit cache (f32 weights: also an f32 cache).
- llama.cpp: the shipped GGUF (`--gguf FILE`, e.g. the Q4_1 file the model came in) and the files its own
  converter and quantizer make from the same float weights (`--llama-rows`: f16, q8_0, q4_0, q4_k_m).

Speed: TTFT and TPOT per (threads, prompt), all rows round-robin with the order rotated per repeat, medians
and per-round ratios to llama.cpp at the same weight bits (`cpu_decode.peer_of`; Q4_1 is a 4-bit peer too).
Quality, next to each row: perplexity on held-out windows of `--text` files (full forward; llama.cpp through
its batch path) and top-1 agreement / mean KL with the f32 vanilla model, so speed is never shown alone.

    python benchmarks/cpu_decode.py --model ~/smollm2/hf --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text prose.txt,code.txt --threads 1,2 --prompt-lens 512,2048 --repeats 3 --json real.json
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fusedkv.engine.precision import half_dtype, weight_nbytes
from fusedkv.model import FusedKVForCausalLM
from fusedkv.utils import processor

WEIGHT_PEERS = {"f32": ["f32"], "bf16": ["f16"], "f16": ["f16"], "int8": ["q8_0"],
                "int4": ["q4_0", "q4_1", "q4_k_m"]}


def hf_checkpoint(src: str, work: Path) -> Path:
    """SRC as a transformers checkpoint directory (a GGUF file is loaded and saved in `work`)."""
    path = Path(src)
    if path.is_dir():
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer, model.is_quantized = None, False  # dequantised: an ordinary float checkpoint now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out = work / "hf"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def fusedkv_models(hf_dir: Path, plans: list[str], plan_checkpoints: dict[str, str], work: Path) -> dict:
    """plan -> FusedKVForCausalLM (float32): the vanilla import and each other plan's model."""
    from fusedkv.convert import convert_checkpoint

    models = {}
    for plan in plans:
        if plan in plan_checkpoints:
            models[plan] = FusedKVForCausalLM.from_pretrained(plan_checkpoints[plan], dtype=torch.float32).eval()
            continue
        out = work / f"fusedkv-{plan}"
        if not out.is_dir():
            convert_checkpoint(str(hf_dir), str(out), kv_sharing=plan)
        models[plan] = FusedKVForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return models


def llama_files(hf_dir: Path, types: list[str], shipped: str | None, src: str | None, work: Path) -> dict[str, Path]:
    """GGUF type -> file: llama.cpp's converter / quantizer on the float weights, and the shipped file."""
    from fusedkv.speed.llamacpp import convert_to_gguf, find_converter

    files = {}
    if types:
        root = find_converter(src, work, fetch=True)
        files = {t: convert_to_gguf(hf_dir, work / f"model-{t}.gguf", t, root) for t in types}
    if shipped:
        files.setdefault(gguf_file_type(shipped), Path(shipped))
    return files


def gguf_file_type(path: str) -> str:
    """A GGUF file's weight type as llama.cpp names it (`general.file_type`: q4_1 for SmolLM2's shipped file)."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).fields.get("general.file_type")
    if field is None:
        return "shipped"
    return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_").lower()


# ---- quality --------------------------------------------------------------------------------------------
def text_windows(tokenizer_dir: Path, texts: list[str], window: int, per_text: int) -> list[tuple[str, torch.Tensor]]:
    """(text name, [1, window + 1] ids) for the first `per_text` windows of each file."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = []
    for path in texts:
        ids = tok(Path(path).read_text(), return_tensors="pt")["input_ids"][0]
        n = min(per_text, (len(ids) - 1) // window)
        if n < 1:
            raise SystemExit(f"{path}: {len(ids)} tokens, fewer than one window of {window}")
        out += [(Path(path).stem, ids[i * window:(i + 1) * window + 1][None]) for i in range(n)]
    return out


def _score(logits: torch.Tensor, labels: torch.Tensor, ref: torch.Tensor) -> tuple[float, int, float]:
    """(summed NLL, top-1 agreements with ref, summed KL(ref || logits)) over the positions."""
    nll = F.cross_entropy(logits, labels, reduction="sum").item()
    agree = (logits.argmax(-1) == ref.argmax(-1)).sum().item()
    p = torch.log_softmax(ref.double(), -1)
    kl = (p.exp() * (p - torch.log_softmax(logits.double(), -1))).sum().item()
    return nll, agree, kl


def quality(ours: dict, llama: dict[str, Path], windows: list, reference, sources: dict[str, str],
            store: Path | None = None) -> dict[str, dict]:
    """Row name -> {ppl per text, top1 (agreement with the f32 vanilla model), kl (nats/token)}. With `store`
    (a JSON file in the work directory) a row already measured on the same windows and weights (`sources`:
    plan -> where its float model came from) is read back, so a killed or repeated run redoes only the rest."""
    from fusedkv.speed.llamacpp import window_logits
    from fusedkv.utils import write_json_atomic

    texts = sorted({t for t, _ in windows})
    span = f"{','.join(texts)} {len(windows)}x{windows[0][1].shape[1] - 1}"

    def key(name: str) -> str:
        src = str(llama[name.split("w=")[1]]) if name.startswith("llama.cpp") else sources[name.split()[0]]
        return f"{name} | {src} | {span}"

    done = json.loads(store.read_text()) if store is not None and store.is_file() else {}
    # The full forward does not read the cache's dtype: one quality per (plan, weights), under its 16-bit row.
    per_weights: dict[str, str] = {}
    for n in ours:
        if n.split(" kv=")[0] not in per_weights or not n.endswith("kv=f32"):
            per_weights[n.split(" kv=")[0]] = n
    names = list(per_weights.values()) + [f"llama.cpp w={ty}" for ty in llama]
    todo = [n for n in names if key(n) not in done]
    table = {n: done[key(n)] for n in names if n not in todo}
    if not todo:
        return table
    with torch.inference_mode():
        refs = [reference(ids[:, :-1]).logits[0] for _, ids in windows]
    for name in todo:
        if name.startswith("llama.cpp"):
            got = window_logits(llama[name.split("w=")[1]], [ids[0, :-1].tolist() for _, ids in windows],
                                torch.get_num_threads(), "f16")
            logits = [torch.from_numpy(x).float() for x in got]
        else:
            with torch.inference_mode():
                logits = [ours[name]["model"](ids[:, :-1]).logits[0] for _, ids in windows]
        table[name] = _summary(windows, logits, refs)
        print(f"quality {name}: {table[name]}", file=sys.stderr)
        if store is not None:
            done[key(name)] = table[name]
            write_json_atomic(store, done)
    return table


def _summary(windows: list, logits: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
    """Perplexity per text, top-1 agreement and mean KL (nats/token) against the reference logits."""
    per_text: dict[str, list[float]] = {}
    agree = kl = n = 0
    for (text, ids), out, ref in zip(windows, logits, refs):
        nll, a, k = _score(out, ids[0, 1:], ref)
        per_text.setdefault(text, [0.0, 0])
        per_text[text][0] += nll
        per_text[text][1] += ids.shape[1] - 1
        agree, kl, n = agree + a, kl + k, n + ids.shape[1] - 1
    return dict(ppl={t: math.exp(s / c) for t, (s, c) in per_text.items()}, top1=agree / n, kl=kl / n)


# ---- the run --------------------------------------------------------------------------------------------
def run(args) -> dict:
    """Build every row, measure quality, then speed; returns the JSON the script writes."""
    import cpu_decode as cd  # the sibling script: its row builders, timing loop and table

    work = Path(args.workdir or tempfile.mkdtemp(prefix="fusedkv-real-"))
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = hf_checkpoint(args.model, work)
    plans = args.plans.split(",")
    if "vanilla" not in plans:
        plans = ["vanilla", *plans]
    plan_cks = dict(x.split("=", 1) for x in args.plan_checkpoints.split(",")) if args.plan_checkpoints else {}
    base = fusedkv_models(hf_dir, plans, plan_cks, work)
    sources = {plan: plan_cks.get(plan, str(hf_dir) + f" --plan {plan}") for plan in plans}
    weights = [cd.weight_spec(w) for w in args.weights.split(",")]
    half = cd.SHORT[str(half_dtype()).removeprefix("torch.")]
    kvs = ["f32" if k in ("float32", "f32") else half for k in args.kv.split(",")]
    ours = {}
    for plan, model in base.items():
        for fmt in weights:
            reduced = cd.reduced(model, fmt)
            for kv in (kvs if fmt == "float32" else [half]):  # an f32 cache only next to f32 weights
                kv_dtype = torch.float32 if kv == "f32" else half_dtype()
                ours[f"{plan} w={cd.short(fmt)} kv={kv}"] = dict(model=reduced, kv_dtype=kv_dtype,
                                                               weight_bytes=weight_nbytes(reduced))
    from fusedkv.speed.llamacpp import available
    from fusedkv.utils import write_json_atomic

    why = None if args.no_llama else available()
    if why:
        print(why, file=sys.stderr)
    types = [] if args.no_llama or why else list(dict.fromkeys(s.split("/")[0] for s in args.llama_rows.split(",")))
    llama = {} if args.no_llama or why else llama_files(hf_dir, types, args.gguf, args.llamacpp_src, work)
    texts = [t for t in (args.text or "").split(",") if t]
    windows = text_windows(hf_dir, texts, args.window, args.windows) if texts else []
    qual = quality(ours, llama, windows, base["vanilla"], sources, work / "quality.json") if windows else {}
    print(f"quality done ({len(qual)} rows)", file=sys.stderr)
    load = {"start": os.getloadavg()}

    def result(rows: list[dict]) -> dict:
        return dict(model=str(args.model), plans=sources, date=time.strftime("%Y-%m-%d %H:%M"),
                    processor=processor(), texts=texts, window=args.window, windows_per_text=args.windows,
                    quality=qual, rows=rows, repeats=args.repeats, new_tokens=args.new_tokens,
                    load_average=load, llama_cpp=_llama_version(llama))

    def cell_done(rows: list[dict]) -> None:  # the cells measured so far survive a run stopped later
        if args.json:
            write_json_atomic(args.json, result(rows), default=str)

    rows = speed(args, cd, ours, llama, base["vanilla"].config.vocab_size, load, cell_done)
    load["end"] = os.getloadavg()
    return result(rows)


def _llama_version(llama: dict) -> str | None:
    if not llama:
        return None
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}"


def speed(args, cd, ours: dict, llama: dict[str, Path], vocab: int, load: dict, cell_done) -> list[dict]:
    """cpu_decode's interleaved loop over our rows and llama.cpp runners of every GGUF file (f16 KV). The load
    average after each cell goes into `load` (the machine is shared: speeds are read next to it); `cell_done`
    is called with the rows so far after each (threads, prompt) cell."""
    from fusedkv.speed.llamacpp import LlamaCppRunner, gguf_weight_nbytes

    threads = [int(t) for t in args.threads.split(",")]
    prompts = [int(p) for p in args.prompt_lens.split(",")]
    max_len = max(prompts) + args.new_tokens + 8
    gen = torch.Generator().manual_seed(0)
    out = []
    for t in threads:
        torch.set_num_threads(t)
        runners = {f"llama.cpp w={ty} kv=f16": (LlamaCppRunner(path, max_len, t, "f16"), ty, "f16",
                                                 gguf_weight_nbytes(path)) for ty, path in llama.items()}
        names = list(ours) + list(runners)
        for name in names:
            cd._one(name, ours, runners, torch.randint(1, vocab, (1, 32), generator=gen), 4)
        ceiling = cd.streaming_ceiling(max(r["weight_bytes"] for r in ours.values()))
        for s in prompts:
            samples: dict[str, list[dict]] = {n: [] for n in names}
            for r in range(args.repeats):
                ids = torch.randint(1, vocab, (1, s), generator=gen)
                shift = r % len(names)
                for name in names[shift:] + names[:shift]:
                    samples[name].append(cd._one(name, ours, runners, ids, args.new_tokens))
                print(f"threads {t} prompt {s}: repeat {r + 1}/{args.repeats}", file=sys.stderr)
            for name, runs in samples.items():
                out.append(cd.make_row(name, runs, ours, runners, t, 1, s, s + args.new_tokens // 2, ceiling))
            load[f"threads {t} prompt {s}"] = os.getloadavg()
            cell_done(out)
        for runner, *_ in runners.values():
            runner.close()
    return out


def peers(name: str) -> list[str]:
    """llama.cpp rows at the same weight bits as a fusedkv row (16-bit KV on both sides)."""
    w = name.split(" w=")[1].split()[0].split("@")[0]
    return [f"llama.cpp w={ty} kv=f16" for ty in WEIGHT_PEERS[w]]


def table(result: dict) -> str:
    """The markdown table: speed, ratios to each same-bits llama.cpp row, and the row's quality."""
    import cpu_decode as cd

    rows, qual = result["rows"], result["quality"]
    texts = [Path(t).stem for t in result["texts"]]
    head = ["threads", "prompt", "engine", "TTFT ms", "TPOT ms", "TTFT / llama.cpp", "TPOT / llama.cpp",
            *[f"ppl {t} (vs f32)" for t in texts], "top-1 vs f32", "KL vs f32"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    by = {(r["threads"], r["prompt"], r["name"]): r for r in rows}
    ref = next((v for k, v in qual.items() if k.startswith("vanilla w=f32 ")), None)
    for r in rows:
        key = (r["threads"], r["prompt"])
        ps = [] if r["name"].startswith("llama.cpp") else [by[(*key, p)] for p in peers(r["name"]) if (*key, p) in by]
        ttft = ", ".join(f"{cd.round_ratio(r, p, 'ttft'):.2f} ({p['name'].split('w=')[1].split()[0]})" for p in ps)
        tpot = ", ".join(f"{cd.round_ratio(r, p, 'tpot'):.2f} ({p['name'].split('w=')[1].split()[0]})" for p in ps)
        qname = r["name"].removesuffix(" kv=f16") if r["name"].startswith("llama.cpp") else r["name"]
        q = qual.get(qname) or next((v for k, v in qual.items() if k.split(" kv=")[0] == qname.split(" kv=")[0]), {})
        ppl = [_ppl(q, ref, t) for t in texts]
        lines.append(f"| {r['threads']} | {r['prompt']} | {r['name']} | {r['ttft_s'] * 1e3:.0f} | "
                     f"{r['tpot_s'] * 1e3:.2f} | {ttft or '-'} | {tpot or '-'} | " + " | ".join(ppl)
                     + (f" | {q['top1']:.3f} | {q['kl']:.4f} |" if q else " | - | - |"))
    return "\n".join(lines)


def _ppl(q: dict, ref: dict | None, text: str) -> str:
    """A row's perplexity on `text` and its change from the f32 vanilla model's."""
    if not q:
        return "-"
    p = q["ppl"][text]
    return f"{p:.2f}" + (f" ({100 * (p / ref['ppl'][text] - 1):+.1f}%)" if ref else "")


def kivi(args) -> None:
    """`--kivi` on the real model: cpu_decode's KIVI-4 / KIVI-2 against bf16 cache table, with the model's own
    weights (f32) and shape; each cache's perplexity is `fusedkv compare`'s (docs/real-model.md)."""
    import cpu_decode as cd

    work = Path(args.workdir or tempfile.mkdtemp(prefix="fusedkv-real-"))
    work.mkdir(parents=True, exist_ok=True)
    plan_cks = dict(x.split("=", 1) for x in args.plan_checkpoints.split(",")) if args.plan_checkpoints else {}
    plans = args.plans.split(",")
    models = fusedkv_models(hf_checkpoint(args.model, work), plans, plan_cks, work)
    longest = max(int(c) for c in args.prompt_lens.split(",")) + args.steps * (args.repeats + 1) + 1
    for model in models.values():  # a step's cost does not depend on the position: time past the trained context
        if model.config.max_position_embeddings < longest:
            print(f"timing {longest} positions, past the model's max_position_embeddings "
                  f"({model.config.max_position_embeddings}); the caches hold random K/V", file=sys.stderr)
            model.config.max_position_embeddings = longest
    cells, start = [], os.getloadavg()
    for t in [int(x) for x in args.threads.split(",")]:
        print(cd.kivi_table(plans, t, [int(c) for c in args.prompt_lens.split(",")], args.steps, args.repeats,
                            models, record=cells))
    print(f"{args.model}; 1-minute load average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        from fusedkv.utils import write_json_atomic

        write_json_atomic(args.json, dict(model=str(args.model), plans=plans, date=time.strftime("%Y-%m-%d %H:%M"),
                                          processor=processor(), steps=args.steps, repeats=args.repeats,
                                          load_average=dict(start=start, end=os.getloadavg()), cells=cells))


def main(args) -> None:
    from fusedkv.utils import write_json_atomic

    if args.kivi:
        kivi(args)
        return
    result = run(args)
    if args.json:
        write_json_atomic(args.json, result, default=str)
    load = ", ".join(f"{v[0]:.1f}" for v in result["load_average"].values())
    print(f"\n{result['model']} on {result['processor']}, {args.new_tokens} new tokens, medians of {args.repeats} "
          f"interleaved repeats (ratios: medians of per-round ratios); 1-minute load average at the start, after "
          f"each cell, at the end: {load}; quality on {args.windows} windows of {args.window} tokens per text\n")
    print(table(result))
    if any(r["name"].startswith("llama.cpp") for r in result["rows"]):
        return
    print("(no llama.cpp rows: install fusedkv[llamacpp])", file=sys.stderr)
