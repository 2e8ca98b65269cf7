"""The verdict rule (fusedkv.experiments.verdicts): Student's t p-values, Holm's correction, the vocabulary."""

from __future__ import annotations

import math

import pytest

from fusedkv.experiments import verdicts as v
from fusedkv.experiments.report import _T_CRIT_05


def test_t_p_values_match_the_critical_values_and_known_points():
    # At the two-sided 5% critical value of each df the p-value is 0.05 (the runner's table, 3 decimals).
    for df, crit in enumerate(_T_CRIT_05, start=1):
        assert v.t_two_sided_p(crit, df) == pytest.approx(0.05, abs=2e-4)
    assert v.t_two_sided_p(0.0, 3) == 1.0 and v.t_two_sided_p(math.inf, 2) == 0.0
    assert v.t_two_sided_p(1.0, 1) == pytest.approx(0.5)  # Cauchy: P(|T| > 1) = 1/2
    assert v.t_two_sided_p(-2.0, 2) == pytest.approx(1 - 2 / math.sqrt(6))  # df 2 closed form: |t| / sqrt(2 + t^2)
    scipy = pytest.importorskip("scipy.stats")
    for t, df in [(3.6, 2), (1.8, 2), (8.0, 2), (2.5, 5), (0.3, 7), (12.0, 4), (2.1, 30)]:
        assert v.t_two_sided_p(t, df) == pytest.approx(2 * scipy.t.sf(t, df), rel=1e-9)


def test_paired_test_on_the_documented_long_budget_differences():
    # docs/evidence.md, the long budget: FusedKV - vanilla per seed, "t = -3.6, p ≈ 0.07"
    r = v.paired_test([4.2059 - 4.2592, 4.2034 - 4.2424, 4.2052 - 4.2234])
    assert r.t == pytest.approx(-3.6, abs=0.05) and 0.06 < r.p < 0.08
    with pytest.raises(ValueError, match="two seeds"):
        v.paired_test([0.1])
    same = v.paired_test([-0.01, -0.01, -0.01])  # no spread, a direction: t infinite, p 0
    assert same.t == -math.inf and same.p == 0.0


def test_holm_step_down():
    # m = 4: sorted 0.01, 0.02, 0.03, 0.5 -> 0.04, 0.06, 0.06 (monotone), 0.5
    assert v.holm([0.03, None, 0.01, 0.5, 0.02]) == [pytest.approx(0.06), None, pytest.approx(0.04),
                                                     pytest.approx(0.5), pytest.approx(0.06)]
    assert v.holm([0.4, 0.6]) == [pytest.approx(0.8), pytest.approx(0.8)]  # capped monotone
    assert v.holm([0.9, 0.8]) == [1.0, 1.0]
    assert v.holm([]) == [] and v.holm([None]) == [None]


@pytest.mark.parametrize("mean,p,sign,expected", [
    (-0.03, 0.01, -1, v.REPRODUCED),
    (-0.03, 0.20, -1, v.SAME_INCONCLUSIVE),
    (+0.03, 0.20, -1, v.OPPOSITE_INCONCLUSIVE),
    (+0.03, 0.01, -1, v.NOT_REPRODUCED),
    (+0.03, 0.01, +1, v.REPRODUCED),
    (+0.03, 0.01, None, v.BEYOND),
    (0.0, 1.0, +1, v.OPPOSITE_INCONCLUSIVE),  # no difference is not the paper's direction
])
def test_the_rule(mean, p, sign, expected):
    assert v.verdict(mean, p, sign) == expected
    assert v.verdict(mean, p, sign, not_testable="vanilla never learned the lookup") == v.NOT_TESTABLE


def test_the_rule_refuses_what_it_cannot_judge():
    with pytest.raises(ValueError, match="-1 or"):
        v.verdict(0.1, 0.01, 2)
    with pytest.raises(ValueError, match="paired mean"):
        v.verdict(None, None, -1)
    # One seed: a direction, no test, never more than inconclusive.
    assert v.verdict(-0.2, None, -1) == v.SAME_INCONCLUSIVE and v.verdict(0.2, None, -1) == v.OPPOSITE_INCONCLUSIVE
    with pytest.raises(ValueError, match="no direction"):
        v.verdict_rows([v.Claim("a − b", 0.0, diffs=[0.1, 0.2])])


def test_verdict_table_applies_holm_over_the_tests_only():
    claims = [
        v.Claim("fusedkv − vanilla", -0.020, "Table 2", [-0.053, -0.039, -0.018]),       # p ≈ 0.07
        v.Claim("lite − vanilla", -0.016, "Table 2", [-0.050, -0.049, -0.051]),          # p < 0.001
        v.Claim("cla − vanilla", +0.017, "Table 2", [-0.006, -0.020, +0.011]),
        v.Claim("distil − lm", None, "", [-0.04, -0.03, -0.04]),                          # beyond
        v.Claim("lite − vanilla (MQAR)", -6.8, "Table 16", [40.0, 30.0, 20.0], not_testable="format 1"),
    ]
    claims.append(v.Claim("reversed − lite", +0.01, "Fig. 8", [0.26]))  # one seed: no test, not in the family
    rows = v.verdict_rows(claims)
    assert [r["verdict"] for r in rows] == [v.SAME_INCONCLUSIVE, v.REPRODUCED, v.OPPOSITE_INCONCLUSIVE, v.BEYOND,
                                           v.NOT_TESTABLE, v.SAME_INCONCLUSIVE]
    assert [r["p"] is None for r in rows] == [False, False, False, True, True, True]  # 3 tests in the family
    lite = rows[1]
    assert lite["holm"] == pytest.approx(3 * lite["p"]) and lite["verdict_holm"] == v.REPRODUCED
    table = v.verdict_table(claims)
    assert "Holm p (3 tests)" in table and "3 tests in this table" in table
    assert "| lite − vanilla (MQAR) | -6.8 (Table 16) |" in table and "not testable here (format 1)" in table
    assert "| distil − lm | no claim |" in table and "| +0.2600 | one seed, no test |" in table


def test_experiment_claims_measure_loss_and_mqar_with_the_floor_rule():
    def res(name, seed, loss, acc):
        mqar = {2: {64: acc, 128: acc / 2}, 4: {64: acc, 128: acc / 2}}
        return {"name": name, "seed": seed, "val_loss": loss,
                "retrieval": {"lengths": [64, 128], "pairs": [2, 4], "num_samples": 50, "mqar": mqar}}

    results = [res("vanilla", s, 4.0 + s / 100, 95.0) for s in range(3)]
    results += [res("lite", s, 3.9 + s / 100 + (s == 1) / 1000, 80.0 + s) for s in range(3)]
    spec = {"claims": [{"pair": ["lite", "vanilla"], "paper": -0.016, "source": "Table 2"},
                       {"pair": ["lite", "vanilla"], "metric": "mqar", "paper": -6.8, "source": "Table 16"},
                       {"pair": ["yoco", "vanilla"], "paper": 0.003}]}  # yoco did not run: left out
    loss, mqar = v.experiment_claims(spec, results)
    assert loss.diffs == pytest.approx([-0.1, -0.099, -0.1]) and loss.not_testable is None
    # At 128 tokens (the longest both were scored at) vanilla is at its floor (47.5 for 2 pairs, floor 50):
    # no retrieval there to lose, so not testable; at 64, where every vanilla seed retrieves, it is.
    assert mqar.diffs == pytest.approx([-7.5, -7.0, -6.5]) and mqar.label == "lite − vanilla (MQAR score at 128)"
    assert mqar.not_testable == ("vanilla has not learned the lookup at 128 tokens in every seed (0 of 3 above "
                                 "the random-copy floor)")
    spec["claims"][1]["length"] = 64
    _, mqar = v.experiment_claims(spec, results)
    assert mqar.diffs == pytest.approx([-15.0, -14.0, -13.0]) and mqar.not_testable is None
    assert v.verdict_rows([mqar])[0]["verdict"] == v.REPRODUCED
    spec["claims"][1]["length"] = v.LONGEST_LEARNED  # the rule picks 64, where every vanilla seed learned
    _, longest = v.experiment_claims(spec, results)
    assert longest.diffs == mqar.diffs and longest.not_testable is None
    assert longest.label == "lite − vanilla (MQAR score at 64, the longest length the baseline learned)"
    for r in results[:3]:  # now vanilla retrieves at 128 too (every pair count above its floor)
        r["retrieval"]["mqar"] = {2: {64: 95.0, 128: 90.0}, 4: {64: 95.0, 128: 90.0}}
    _, longest = v.experiment_claims(spec, results)
    assert "at 128, the longest" in longest.label and longest.not_testable is None
    spec["claims"][1]["length"] = 64
    # A vanilla seed at its random-copy floor (50% for 2 pairs, 25% for 4 at 64 tokens): not testable.
    results[2]["retrieval"]["mqar"] = {2: {64: 50.0, 128: 50.0}, 4: {64: 25.0, 128: 25.0}}
    _, mqar = v.experiment_claims(spec, results)
    assert "vanilla has not learned the lookup at 64 tokens in every seed (2 of 3" in mqar.not_testable
    assert v.verdict_rows([mqar])[0]["verdict"] == v.NOT_TESTABLE
    spec["claims"][1]["length"] = 256  # a length nobody was scored at: the claim is left out
    assert len(v.experiment_claims(spec, results)) == 1
    # A claim between two plans is gated on the baseline named by `gate`, not on its reference.
    gated = {"claims": [{"pair": ["lite", "yoco"], "metric": "mqar", "paper": 25.0, "gate": "vanilla",
                         "length": 64}]}
    results += [res("yoco", s, 4.0, 60.0) for s in range(3)]
    (claim,) = v.experiment_claims(gated, results)
    assert "vanilla has not learned" in claim.not_testable
    results[2]["retrieval"]["mqar"] = {2: {64: 95.0, 128: 50.0}, 4: {64: 95.0, 128: 25.0}}
    (claim,) = v.experiment_claims(gated, results)
    assert claim.not_testable is None and len(claim.diffs) == 3


@pytest.mark.slow
def test_claims_from_a_json_record(tmp_path):
    import json

    from tests import _cli as cli_process
    from tests.train.train_helpers import subprocess_env

    record = tmp_path / "claims.json"
    record.write_text(json.dumps([{"label": "fusedkv − vanilla", "paper": -0.02, "source": "Table 2",
                                   "diffs": [-0.053, -0.039, -0.018]}]))
    assert v.claims_from_json(record)[0].diffs == [-0.053, -0.039, -0.018]
    # The environment of test_chained's CLI runs: their forking process (tests/_cli.py) serves this one too.
    r = cli_process.run_module("fusedkv.experiments.verdicts", record, env=subprocess_env())
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "| fusedkv − vanilla | -0.02 (Table 2) |" in out and "same direction, inconclusive" in out


@pytest.mark.parametrize("entry,msg", [
    ({"pair": ["a"]}, "pair: \\[RUN, REFERENCE\\]"),
    ({"pair": ["a", "b"], "metric": "ppl"}, "val_loss or mqar"),
    ({"pair": ["a", "b"], "paper": 0}, "nonzero"),
    ({"pair": ["a", "b"], "paper": "lower"}, "nonzero"),
    ({"pair": ["a", "b"], "papr": -1}, "unknown key"),
    ({"pair": ["a", "b"], "paper": -1, "length": 64}, "length is for metric: mqar"),
    ({"pair": ["a", "b"], "paper": -1, "metric": "mqar", "length": "longest"}, "or 'longest learned'"),
    ({"pair": ["a", "b"], "paper": -1, "metric": "mqar", "length": "512"}, "a positive number of tokens"),
])
def test_claims_are_checked_when_the_file_is_read(entry, msg):
    with pytest.raises(ValueError, match=msg):
        v.check_claims({"claims": [entry]})


def test_the_shipped_claims_are_well_formed():
    from fusedkv.experiments.spec import load_experiment

    for name in ("main", "long", "uptrain", "retrieval", "passkey"):
        spec = load_experiment(name)
        v.check_claims(spec)
        runs = {r["name"] for r in spec["runs"]}
        assert all(set(c["pair"]) <= runs and c.get("gate", c["pair"][1]) in runs for c in spec["claims"]), name


def test_the_committed_record_is_what_its_script_writes():
    """docs/compare/claims.json (every verdict in docs/evidence.md and docs/results.md) is regenerated from
    the committed tables and per-run scores by scripts/evidence_claims.py, not edited by hand: the retrieval
    rows go through the same `experiment_claims` as `fusedkv compare retrieval`."""
    import importlib.util
    import json

    from tests.train.train_helpers import REPO

    spec = importlib.util.spec_from_file_location("evidence_claims", REPO / "scripts" / "evidence_claims.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    written = json.loads(json.dumps(script.claims(), ensure_ascii=False))
    assert written == json.loads((REPO / "docs" / "compare" / "claims.json").read_text())
    labels = [c["label"] for c in written]
    assert any(label.startswith("retrieval, format 2: fusedkv @512 − vanilla @512 (MQAR score at 512)")
               for label in labels)
