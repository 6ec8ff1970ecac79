"""benchmarks/tables.py: the committed verdicts and generated tables are what the script writes from the JSON, and
the rule (paired differences, 90% t interval, the word) agrees with hand computations."""

import json
import math
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import tables  # noqa: E402


def test_committed_verdicts_and_tables_are_what_tables_py_writes(capsys):
    assert tables.main(["--check"]) == 0, capsys.readouterr().out[:4000]


def test_check_fails_with_a_diff_when_a_generated_cell_is_edited_by_hand(tmp_path, monkeypatch, capsys):
    readme, verdicts = tmp_path / "README.md", tmp_path / "verdicts.json"
    shutil.copy(tables.README, readme)
    shutil.copy(tables.VERDICTS, verdicts)
    monkeypatch.setattr(tables, "README", str(readme))
    monkeypatch.setattr(tables, "VERDICTS", str(verdicts))
    assert tables.main(["--check"]) == 0
    text = readme.read_text()
    start = text.index("<!-- tables.py: paper 000 -->")
    cut = text.index("| no |", start)  # a verdict typed by hand instead of the rule's
    readme.write_text(text[:cut] + "| holds |" + text[cut + len("| no |"):])
    assert tables.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "+" in out and "| holds |" in out and "README.md (committed)" in out
    assert readme.read_text() != text  # --check writes nothing
    assert tables.main([]) == 0 and readme.read_text() == text  # writing restores the rule's table


def t_cdf(q, df, steps=20000):
    """P(T <= q) for Student's t with df degrees of freedom: 0.5 + the density integrated from 0 to q (Simpson)."""
    norm = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    density = lambda x: norm * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    h = q / steps
    total = density(0) + density(q) + sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
    return 0.5 + total * h / 3


@pytest.mark.parametrize("df", sorted(tables.T95))
def test_t_quantiles_are_the_095_quantiles_of_the_t_distribution(df):
    """Each table value q (3 decimals) has P(T <= q) = 0.95 within its rounding: the density times 0.0005."""
    q = tables.T95[df]
    assert t_cdf(q, df) == pytest.approx(0.95, abs=2e-4)


def test_t_quantile_beyond_the_table_and_bad_degrees_of_freedom():
    assert tables.t_quantile(200) == pytest.approx(1.6449, abs=1e-4)  # the normal quantile
    with pytest.raises(ValueError, match="df=0"):
        tables.t_quantile(0)


def test_three_seeds_by_hand():
    """Differences -0.2, -0.5, -0.8: mean -0.5, sd 0.3, s.e. 0.3 / sqrt(3) = 0.1732, t(0.95, 2) = 2.920:
    half-width 0.5058, interval [-1.0058, +0.0058]. (A 95% interval, t 4.303, would give [-1.245, +0.245].)"""
    result = tables.interval([-0.2, -0.5, -0.8])
    assert result["n"] == 3 and result["mean"] == pytest.approx(-0.5)
    assert result["low"] == pytest.approx(-1.00576, abs=1e-4) and result["high"] == pytest.approx(0.00576, abs=1e-4)
    low, high = result["low"], result["high"]
    assert tables.word(low, high, tables.Bound(low=-1.1), 3) == "holds"  # inside; a 95% interval is not
    assert tables.word(low, high, tables.Bound(low=-0.5), 3) == "not told apart (3 seeds)"
    assert tables.word(low, high, tables.Bound(low=0.1), 3) == "no"  # wholly below the bound
    assert tables.word(low, high, tables.Bound(high=-1.1), 3) == "no"  # wholly above it
    assert tables.word(low, high, tables.Bound(low=-1.1, high=0.1), 3) == "holds"
    assert tables.word(low, high, tables.Bound(low=-1.1, high=-0.1), 3) == "not told apart (3 seeds)"


def test_one_seed_gives_no_verdict():
    result = tables.interval([3.0])
    assert result == dict(n=1, mean=3.0, low=None, high=None)
    assert tables.word(None, None, tables.Bound(low=-0.5), 1) == "one seed"  # never "holds", however far inside
    with pytest.raises(ValueError, match="values=\\[\\]"):
        tables.interval([])


def test_bounds_and_the_word_over_sets():
    with pytest.raises(ValueError, match="low=1, high=0"):
        tables.Bound(low=1, high=0)
    with pytest.raises(ValueError, match="low, high or both"):
        tables.Bound()
    assert tables.overall({"test": "no", "val": "no"}) == "no"
    assert tables.overall({"test": "holds", "val": "not told apart (2 seeds)"}) == \
        "split: holds on test, not told apart (2 seeds) on val"


def write_run(folder, row, seed, test, val, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    recipe = dict(max_steps=1500, minutes=300.0, bf16=False, label_smoothing=0.1)
    machine = dict(cpu="AMD EPYC", cpu_capability="AVX512", cpu_bf16_matmul=True, threads=2, torch="x", gpu=None)
    payload = dict(task="multi30k", preset="cpu", recipe=recipe, rows={row: dict(
        row=row, seed=seed, init_std=None, embed_init_std=0.02, metric="BLEU", score=test, steps=1500,
        command="python benchmarks/reproduce.py --precision fp32 --max-steps 1500", recipe=recipe, machine=machine,
        scores={"test_2016_flickr": test, "val": val}, chrf={"test_2016_flickr": 50.0, "val": 50.0}, **fields)})
    (folder / "reproduce_multi30k_cpu.json").write_text(json.dumps(payload))


def test_a_claim_is_judged_on_paired_rows_a_minus_b(tmp_path, monkeypatch):
    """hard - soft per seed: test -0.2, -0.5, -0.8 (the hand example above), val +0.1, +0.2, +0.3 (mean +0.2, sd 0.1,
    interval 0.2 +- 2.920 * 0.1 / sqrt(3) = [+0.0314, +0.3686]); bound >= -1.1: holds on both sets."""
    monkeypatch.setattr(tables, "RESULTS", str(tmp_path))
    for seed, (hard, soft, hard_val, soft_val) in enumerate([(30.0, 30.2, 31.1, 31.0), (30.1, 30.6, 31.2, 31.0),
                                                             (29.9, 30.7, 31.4, 31.1)]):
        write_run(tmp_path / f"s{seed}-hard", "hard_cross", seed, hard, hard_val)
        write_run(tmp_path / f"s{seed}-soft", "soft", seed, soft, soft_val)
    emb = "xavier, emb N(0,0.02)"
    claim = tables.Claim("x", "000", "hard within 1.1 of soft", tables.Bound(low=-1.1), "quality")
    evidence = tables.Rows("default init", ("s*-{hard,soft}/reproduce_multi30k_cpu.json",), f"hard_cross@{emb}",
                           f"soft@{emb}")
    entry = tables.judge_rows(claim, evidence)
    test, val = entry["sets"]["test"], entry["sets"]["val"]
    assert test["differences"] == [-0.2, -0.5, -0.8] and test["mean"] == pytest.approx(-0.5)
    assert test["interval"] == pytest.approx([-1.006, 0.006], abs=1e-3)
    assert val["mean"] == pytest.approx(0.2) and val["interval"] == pytest.approx([0.031, 0.369], abs=1e-3)
    assert entry["verdict"] == "holds" and entry["seeds"] == [0, 1, 2] and entry["converged"] is False
    assert entry["machine"] == "AVX512 EPYC" and entry["precision"] == "fp32" and entry["steps"] == [1500]
    assert len(entry["rows"]) == 6 and {r["row"] for r in entry["rows"]} == {"hard_cross", "soft"}
    flipped = tables.judge_rows(claim, tables.Rows("x", evidence.files, evidence.b, evidence.a))  # soft - hard
    assert flipped["sets"]["test"]["mean"] == pytest.approx(0.5) and flipped["sets"]["val"]["mean"] == pytest.approx(-0.2)


def test_a_verdict_says_its_recipe_and_whether_its_rows_converged(tmp_path, monkeypatch):
    """Rows written under a paper's recipe that all converged give recipe "paper (NAME)" and converged true; one row
    short of convergence makes it false; rows of two recipes are not pooled."""
    monkeypatch.setattr(tables, "RESULTS", str(tmp_path))
    for seed in (0, 1):
        write_run(tmp_path / f"s{seed}-hard", "hard_cross", seed, 30.0 + seed, 31.0, recipe_name="hard_retrieval",
                  converged=True)
        write_run(tmp_path / f"s{seed}-soft", "soft", seed, 30.2, 31.1, recipe_name="hard_retrieval",
                  converged=True)
    emb = "xavier, emb N(0,0.02)"
    claim = tables.Claim("x", "000", "hard within 0.5 of soft", tables.Bound(low=-0.5), "quality")
    evidence = tables.Rows("paper", ("s*-{hard,soft}/reproduce_multi30k_cpu.json",), f"hard_cross@{emb}", f"soft@{emb}")
    entry = tables.judge_rows(claim, evidence)
    assert entry["recipe"] == "paper (hard_retrieval)" and entry["converged"] is True
    assert tables.verdict_cell(entry).endswith("(paper's recipe, converged at 1500 steps)")
    write_run(tmp_path / "s1-soft", "soft", 1, 30.2, 31.1, recipe_name="hard_retrieval", converged=False)
    entry = tables.judge_rows(claim, evidence)
    assert entry["converged"] is False and "(paper's recipe, not converged at 1500 steps)" in tables.verdict_cell(entry)
    write_run(tmp_path / "s1-soft", "soft", 1, 30.2, 31.1)  # an older row: our recipe
    with pytest.raises(ValueError, match="rows of recipes \\['hard_retrieval', 'today'\\] pooled"):
        tables.judge_rows(claim, evidence)


def test_speed_is_judged_on_interleaved_rounds_as_a_geometric_mean_ratio(tmp_path, monkeypatch):
    """Per round time(soft) / time(fast): 2.0, 2.0 * e^0.1, 2.0 * e^-0.1: log-mean log 2, sd 0.1, interval
    2 * exp(+-2.920 * 0.1 / sqrt(3)) = [1.7, 2.36]; a cost (time fast / time soft) is the reciprocal."""
    monkeypatch.setattr(tables, "RESULTS", str(tmp_path))
    soft = [1.0, 1.0, 1.0]
    fast = [0.5, 0.5 * math.exp(-0.1), 0.5 * math.exp(0.1)]
    payload = dict(environment=dict(gpu_name="NVIDIA H200"), precision=dict(name="bf16"),
                   protocol=dict(interleaved="models alternate within each round"),
                   decoding=[dict(mode="greedy", batch_size=1, models=dict(soft=dict(times_s=soft),
                                                                          fast=dict(times_s=fast)))])
    (tmp_path / "gpu.json").write_text(json.dumps(payload))
    speed = tables.Claim("s", "002", "fast decodes 1.5x", tables.Bound(low=1.5), "speed")
    entry = tables.judge_rounds(speed, tables.Rounds("x", "gpu.json", "decoding", "fast", "soft"))
    half = 2.920 * 0.1 / math.sqrt(3)
    cell = entry["sets"]["greedy b1"]
    assert cell["mean"] == pytest.approx(2.0, abs=1e-3)
    assert cell["interval"] == pytest.approx([2 * math.exp(-half), 2 * math.exp(half)], abs=1e-3)
    assert entry["verdict"] == "holds" and entry["machine"] == "H200" and entry["rounds"] == [3]
    cost = tables.Claim("c", "001", "fast costs at most 0.6x", tables.Bound(high=0.6), "cost")
    entry = tables.judge_rounds(cost, tables.Rounds("x", "gpu.json", "decoding", "fast", "soft"))
    assert entry["sets"]["greedy b1"]["mean"] == pytest.approx(0.5, abs=1e-3) and entry["verdict"] == "holds"
    payload["protocol"]["interleaved"] = "no"
    (tmp_path / "gpu.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="alternate"):
        tables.judge_rounds(speed, tables.Rounds("x", "gpu.json", "decoding", "fast", "soft"))


def test_every_verdict_entry_has_the_fields_the_issue_asks_for():
    with open(tables.VERDICTS) as handle:
        entries = json.load(handle)["verdicts"]
    assert {e["paper"] for e in entries} == {"000", "001", "002", "003", "004", "baseline"}
    for entry in entries:
        assert {"paper", "claim", "verdict", "seeds", "sets", "recipe", "converged", "rows", "machine", "precision",
                "steps"} <= set(entry)
        assert entry["rows"] and entry["sets"]
        if entry["task"] != "speed":
            assert entry["converged"] is False and "not converged" not in entry["verdict"]
            if len(entry["seeds"]) == 1:
                assert entry["verdict"] == "one seed"
