"""`fusedkv compare` on a nano budget: trains, evaluates, writes the table and curves, and resumes."""

import json
import statistics

import pytest

from fusedkv.cli import main
from fusedkv.experiments import load_experiment, paired_table, run_experiment, summary_table
from fusedkv.experiments.report import retrieval_report
from tests.experiments.nano_experiments import nano_experiment


def test_shipped_experiments_load():
    for name in ("main", "sources", "reversed", "init", "dense"):
        spec = load_experiment(name)
        assert spec["runs"] and spec["base"]["model"]["num_hidden_layers"] == 8
    assert [r["plan"] for r in load_experiment("main")["runs"]] == [
        "vanilla", "cla", "yoco", "gqa", "fusedkv-lite", "fusedkv"]


def test_an_experiment_extending_another_keeps_what_it_does_not_set(tmp_path):
    """`extends`: the parent's fields (its evaluation, seeds, runs) carry over unless the child sets them;
    `base` merges key by key, the child's values winning."""
    child = tmp_path / "probe.yaml"
    retrieval = load_experiment("retrieval")
    child.write_text(f"extends: {retrieval_path()}\nbase: {{max_steps: 7}}\nruns: [{{name: v, plan: vanilla}}]\n")
    spec = load_experiment(str(child))
    assert spec["evaluate"] == retrieval["evaluate"] and spec["seeds"] == retrieval["seeds"]
    assert spec["base"]["max_steps"] == 7 and spec["base"]["data"] == retrieval["base"]["data"]
    assert [r["name"] for r in spec["runs"]] == ["v"]
    child.write_text(f"extends: {retrieval_path()}\nseeds: [5]\n")
    spec = load_experiment(str(child))
    assert spec["runs"] == retrieval["runs"] and spec["seeds"] == [5]


def test_paired_differences_seed_by_seed():
    loss = {("base", 0): 4.0, ("base", 1): 4.2, ("base", 2): 4.1, ("a", 0): 3.9, ("a", 1): 4.15, ("a", 2): 3.97,
            ("b", 0): 4.3, ("b", 1): 4.1}
    results = [{"name": n, "seed": s, "val_loss": v} for (n, s), v in loss.items()]
    rows = paired_table(results).splitlines()[2:]  # default: every run against the first
    d = [-0.10, -0.05, -0.13]
    mean, sd = sum(d) / 3, (sum((x - sum(d) / 3) ** 2 for x in d) / 2) ** 0.5
    t = mean / (sd / 3 ** 0.5)
    assert rows[0] == (f"| a − base | 3 | {mean:+.4f} ± {sd:.4f} | -0.1000, -0.0500, -0.1300 | {t:+.1f} | "
                       f"{'yes' if abs(t) > 4.303 else 'no'} |")
    assert rows[1].startswith("| b − base | 2 | +0.1000 ± 0.2828 | +0.3000, -0.1000 | +0.5 | no |")  # only shared seeds
    assert paired_table(results, [["b", "a"]]).count("\n") == 2
    assert paired_table([r for r in results if r["seed"] == 0]) == ""  # one seed: nothing to pair


def test_paired_names_are_checked_when_the_file_is_read(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {retrieval_path()}\npaired: [[vanilla, yocoo]]\n")
    with pytest.raises(ValueError, match="paired entry"):
        load_experiment(str(bad))
    assert ["lite-uptrain-distill", "lite-uptrain-lm"] in load_experiment("uptrain")["paired"]


def test_a_subset_of_runs_keeps_the_parents_pairs_among_them(tmp_path):
    child = tmp_path / "subset.yaml"
    runs = "[{name: vanilla, plan: vanilla}, {name: yoco, plan: yoco}]"
    child.write_text(f"extends: {retrieval_path()}\nruns: {runs}\n")
    assert load_experiment(str(child))["paired"] == [["yoco", "vanilla"]]
    child.write_text(f"extends: {retrieval_path()}\nruns: [{{name: v, plan: vanilla}}, {{name: y, plan: yoco}}]\n")
    assert load_experiment(str(child))["paired"] is None  # none left: every run against the first


def test_retrieval_report_scores_and_pairs_seed_by_seed(tmp_path):
    """The MQAR score is the accuracy averaged over the pair counts that were scored at a length; the paired
    difference is taken at the longest length both runs share."""
    def scored(a2, a4, long=None):
        mqar = {2: {64: a2, 128: long}, 4: {64: a4, 128: None}}
        return {"lengths": [64, 128], "pairs": [2, 4], "mqar": mqar, "passkey": {64: 0.0, 128: 0.0}}

    acc = {("vanilla", 0): (90, 70), ("vanilla", 1): (80, 60), ("vanilla", 2): (100, 90),
           ("lite", 0): (95, 85), ("lite", 1): (70, 70), ("lite", 2): (100, 100)}
    results = [{"name": n, "seed": s, "val_loss": 1.0, "retrieval": scored(*a)} for (n, s), a in acc.items()]
    results.append({"name": "lite", "seed": 3, "val_loss": 1.0, "retrieval": scored(50, 50, long=40.0)})
    text = (tmp_path / "retrieval.md").read_text() if retrieval_report(results, tmp_path, "t") else ""
    lite = [(95 + 85) / 2, (70 + 70) / 2, 100, 50]  # seed 3: 50 at 64 and a lone 40 at 128
    mean, sd = statistics.mean(lite), statistics.stdev(lite)
    assert f"| lite | 4 | {mean:.1f} ± {sd:.1f} | 40.0 |" in text
    d = [90 - 80, 70 - 70, 100 - 95]  # seeds 0-2 only, at 64, the longest length both were scored at
    t = statistics.mean(d) / (statistics.stdev(d) / 3 ** 0.5)
    assert (f"| lite − vanilla @ 64 | 3 | {statistics.mean(d):+.1f} ± {statistics.stdev(d):.1f} | +10.0, +0.0, "
            f"+5.0 | {t:+.1f} | no |") in text
    assert "## lite (mean over seeds)" in text and (tmp_path / "retrieval.png").stat().st_size > 1000
    # The floors beside the scores: 2 and 4 pairs at 64 tokens (50 and 25), 2 pairs alone at 128.
    assert "| random copy (mean of 100/P over the pair counts scored) | 37.5 | 50.0 |" in text
    assert "| uniform guess over the 90 values | 1.1 | 1.1 |" in text
    assert "Seeds that learned the lookup" in text and "vanilla 0/3, lite 0/4" in text  # no sample counts given


def test_retrieval_report_marks_significance_only_on_one_seeds_table(tmp_path):
    """A run scored at one seed is a binomial sample: its table marks cells above the random-copy floor and
    names the sample count. A mean over seeds (the same questions answered by each) gets no marks."""
    def scored(a2, a4):
        return {"lengths": [64], "pairs": [2, 4], "num_samples": 50, "mqar": {2: {64: a2}, 4: {64: a4}},
                "passkey": {64: 0.0}}

    results = [{"name": "one", "seed": 0, "val_loss": 1.0, "retrieval": scored(100.0, 30.0)},
               {"name": "two", "seed": 0, "val_loss": 1.0, "retrieval": scored(100.0, 98.0)},
               {"name": "two", "seed": 1, "val_loss": 1.0, "retrieval": scored(100.0, 98.0)}]
    text = (tmp_path / "retrieval.md").read_text() if retrieval_report(results, tmp_path, "t") else ""
    one, two = text.split("## one (mean over seeds)")[1].split("## two (mean over seeds)")
    # 100% of 100 answers is above 50%; 30% of 200 answers is not significantly above 25% (p ~ 0.06).
    assert "| MQAR 2 pairs | 50.0 | 100.0* |" in one and "| MQAR 4 pairs | 25.0 | 30.0 |" in one
    assert "binomial test over the 50 x P answers" in one
    assert "| MQAR 2 pairs | 50.0 | 100.0 |" in two and "*" not in two.split("Floors")[0]
    assert "A mean over 2 seeds: no significance marks" in two
    # Who learned, seed by seed, beside the means: `†` where every pair count is above its floor.
    per_seed = text.split("Per seed (")[1].split("| floor of the MQAR score")[0]
    assert "| one | 0 | 1.0000 | 65.0 |" in per_seed and "| two | 1 | 1.0000 | 99.0† |" in per_seed


def retrieval_path() -> str:
    from fusedkv.experiments.spec import EXPERIMENTS_DIR

    return str(EXPERIMENTS_DIR / "retrieval")


def test_compatibility_experiments_build_the_variants_they_name():
    """Each pair of paper App. A.6 is the main table's budget with the variant's model; the cache fractions
    (against MHA of the same shape, at the training context) are the ones the results table reports."""
    from fusedkv.experiments.spec import merge_fields
    from fusedkv.train import TrainConfig

    main_base = load_experiment("main")["base"]
    expected = {"gqa": {"gqa": 0.5, "gqa-fusedkv": 0.25}, "moe": {"moe": 1.0, "moe-fusedkv": 0.5},
                "mla": {"mla": 0.5, "mla-fusedkv": 0.25}, "quant": {"vanilla": 1.0, "fusedkv": 0.5},
                # 6 window layers (W = 32) hold 31 of 128 tokens, 2 full layers all 128 (+W: 3 + 2 storage,
                # +WF: 3 + 1)
                "swa": {"swa": (6 * 31 + 2 * 128) / 1024, "swa-fusedkv-W": (3 * 31 + 2 * 128) / 1024,
                        "swa-fusedkv-WF": (3 * 31 + 128) / 1024}}
    for name, fractions in expected.items():
        spec = load_experiment(name)
        assert spec["base"] == main_base and spec["seeds"] == [0, 1, 2]
        got = {}
        for run in spec["runs"]:
            own = {k: v for k, v in run.items() if k != "name"}
            c = TrainConfig.from_dict(merge_fields(spec["base"], own)).model_config()
            got[run["name"]] = c.kv_cache_fraction(context=c.max_position_embeddings)
        assert got == pytest.approx(fractions), name
    moe_run = {k: v for k, v in load_experiment("moe")["runs"][1].items() if k != "name"}
    moe = TrainConfig.from_dict(merge_fields(main_base, moe_run)).model_config()
    assert (moe.num_experts, moe.num_experts_per_tok) == (8, 2)


@pytest.mark.slow
def test_compare_nano_end_to_end_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDKV_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FUSEDKV_COMPARE_CACHE", str(tmp_path / "cache"))
    spec_file = nano_experiment(
        tmp_path, "max_steps: 4, eval_every: 2, threads: 1",
        "seeds: [0, 1]\nruns:\n  - {name: vanilla, plan: vanilla}\n  - {name: fusedkv, plan: fusedkv}\n")
    out = tmp_path / "out"
    assert main(["compare", str(spec_file), "--out", str(out), "--seeds", "0", "--task-limit", "2"]) == 0
    table = (out / "results.md").read_text()
    assert "| vanilla | vanilla | 1 | 1 |" in table and "| fusedkv | fusedkv | 0.5 | 1 |" in table
    assert (out / "curves.png").stat().st_size > 10_000
    first = json.loads((out / "fusedkv" / "seed0" / "result.json").read_text())
    assert first["curve"] and 0 <= first["tasks"]["fkv_sciq_mini"] <= 1
    # A second call reuses finished runs instead of training again.
    again = run_experiment(load_experiment(str(spec_file)), out, seeds=[0], progress=False)
    assert [r["val_loss"] for r in again if r["name"] == "fusedkv"] == [first["val_loss"]]
    assert "±" not in summary_table(again)  # one seed: no spread to report
