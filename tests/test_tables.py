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
    cut = text.index("| no (", start)  # a verdict typed by hand instead of the rule's
    readme.write_text(text[:cut] + "| holds (" + text[cut + len("| no ("):])
    assert tables.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "+" in out and "| holds (" in out and "README.md (committed)" in out
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


def record(converged, steps):
    """A convergence record as reproduce.py stores it (patience 5 on the validation loss, 250 steps apart)."""
    best = steps - 1250 if converged else steps
    return dict(converged=converged, metric="val_loss", patience=5, eval_steps=250, min_steps=0, steps_reached=steps,
                best=0.03, best_step=best, curve=[[250, 2.0], [best, 0.03], [steps, 0.04]])


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
                  converged=True, convergence=record(True, 1500))
        write_run(tmp_path / f"s{seed}-soft", "soft", seed, 30.2, 31.1, recipe_name="hard_retrieval",
                  converged=True, convergence=record(True, 1500))
    emb = "xavier, emb N(0,0.02)"
    claim = tables.Claim("x", "000", "hard within 0.5 of soft", tables.Bound(low=-0.5), "quality")
    evidence = tables.Rows("paper", ("s*-{hard,soft}/reproduce_multi30k_cpu.json",), f"hard_cross@{emb}", f"soft@{emb}")
    entry = tables.judge_rows(claim, evidence)
    assert entry["recipe"] == "paper (hard_retrieval)" and entry["converged"] is True
    assert tables.verdict_cell(entry).endswith("(paper's recipe, converged at 1500 steps)")
    write_run(tmp_path / "s1-soft", "soft", 1, 30.2, 31.1, recipe_name="hard_retrieval", converged=False,
              convergence=record(False, 1500))
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
            assert entry["converged"] is False or entry["recipe"].startswith("paper (")
            assert "not converged" not in entry["verdict"]
            if len(entry["seeds"]) == 1:
                assert entry["verdict"] == "one seed"


def quality_entry(evidence, seeds, steps, recipe="ours: a fixed budget", converged=False):
    return dict(task="multi30k", evidence=evidence, seeds=seeds, steps=steps, recipe=recipe, converged=converged)


def test_the_headline_rule_by_hand():
    """Quality: the most seeds (4 seeds at 1500 steps over 2 seeds at 3000), then the longest training (a group's
    fewest steps: 2000 over 1500 / 3000), then today's default init, then the group listed first."""
    claim = tables.Claim("x", "000", "hard within 0.5 of soft", tables.Bound(low=-0.5), "quality")
    few, many = quality_entry("earlier init", [0, 1], [3000]), quality_entry("earlier init", [0, 1, 2, 3], [1500])
    assert tables.headline(claim, [few, many]) is many and tables.headline(claim, [many, few]) is many
    long, mixed = quality_entry("earlier init", [0, 1], [2000]), quality_entry("earlier init", [0, 1], [1500, 3000])
    assert tables.headline(claim, [mixed, long]) is long
    earlier, default = quality_entry("earlier init", [0, 1], [1500]), quality_entry("default init", [0, 1], [1500])
    assert tables.headline(claim, [earlier, default]) is default
    assert tables.headline(claim, [quality_entry("each type's default init", [0, 1], [1500]), earlier])["evidence"] \
        == "each type's default init"
    twin = quality_entry("earlier init", [0, 1], [1500])
    assert tables.headline(claim, [earlier, twin]) is earlier and tables.headline(claim, [twin, earlier]) is twin
    with pytest.raises(ValueError, match="claim x: no evidence entry"):
        tables.headline(claim, [])


def test_the_headline_prefers_the_task_the_paper_made_the_claim_on():
    """After the earned rule and before the seed count: the claim's task (translation, our Multi30k, unless a claim
    says otherwise); a claim the paper made on both tasks (task None) ranks by seeds and training alone."""
    translation = tables.Claim("x", "001", "beam-joint above soft (Table 1)", tables.Bound(low=0.0), "quality")
    assert translation.task == "multi30k"
    nouns = dict(quality_entry("earlier init", [0, 1, 2, 3], [9000]), task="nouns")
    m30k = quality_entry("earlier init", [0, 1], [1500])
    assert tables.headline(translation, [nouns, m30k]) is m30k
    paper = dict(recipe="paper (beam_joint)", converged=True, seeds=[0, 1, 2], steps=[6000])
    earned_nouns, earned_m30k = dict(nouns, **dict(paper, steps=[9000])), dict(m30k, **paper)
    assert tables.headline(translation, [m30k, earned_nouns]) is earned_nouns  # earned comes first
    assert tables.headline(translation, [earned_nouns, earned_m30k]) is earned_m30k
    either = tables.Claim("y", "001", "full-joint above soft", tables.Bound(low=0.0), "quality", task=None)
    assert tables.headline(either, [m30k, nouns]) is nouns and tables.headline(either, [earned_m30k, earned_nouns]) \
        is earned_nouns  # longer training
    on_nouns = tables.Claim("z", "001", "full-joint above soft", tables.Bound(low=0.0), "quality", task="nouns")
    assert tables.headline(on_nouns, [earned_m30k, earned_nouns]) is earned_nouns
    assert tables.headline(on_nouns, [dict(nouns, seeds=[0, 1], steps=[500]), m30k])["task"] == "nouns"
    with pytest.raises(ValueError, match=r"Claim w: task='wmt'; allowed: 'multi30k' \(translation\), 'nouns'"):
        tables.Claim("w", "001", "c", tables.Bound(low=0.0), "quality", task="wmt")


def test_the_speed_headline_is_timed_rounds_on_the_papers_device(tmp_path, monkeypatch):
    """Speed: rounds before figures; the GPU's rounds (fewer) where the claim's paper timed a GPU, a CPU's otherwise;
    then the most rounds."""
    monkeypatch.setattr(tables, "RESULTS", str(tmp_path))
    (tmp_path / "gpu.json").write_text(json.dumps(dict(environment=dict(gpu_name="NVIDIA H200"))))
    (tmp_path / "cpu.json").write_text(json.dumps(dict(machine=dict(cpu="AMD EPYC", cpu_capability="AVX512"))))
    gpu = dict(task="speed", rounds=[5], rows=[dict(file="gpu.json")])
    gpu_more = dict(task="speed", rounds=[15], rows=[dict(file="gpu.json")])
    cpu = dict(task="speed", rounds=[10], rows=[dict(file="cpu.json")])
    figures = dict(task="speed", rows=[dict(file="cpu.json")])
    on_gpu = tables.Claim("g", "000", "fast on a GPU", tables.Bound(low=1.4), "speed", device="GPU")
    unstated = tables.Claim("c", "004", "slow", tables.Bound(low=5.4), "cost")
    assert tables.headline(on_gpu, [figures, cpu, gpu]) is gpu
    assert tables.headline(on_gpu, [gpu, gpu_more, cpu]) is gpu_more
    assert tables.headline(unstated, [figures, gpu_more, cpu]) is cpu
    assert tables.headline(unstated, [figures, gpu_more]) is gpu_more  # no CPU rounds: the GPU's before figures
    assert tables.headline(unstated, [figures]) is figures
    with pytest.raises(ValueError, match="device='TPU'"):
        tables.Claim("t", "000", "fast", tables.Bound(low=1.4), "speed", device="TPU")


def generated(path, name):
    text = open(path).read()
    return text.split(f"<!-- tables.py: {name} -->\n", 1)[1].split("\n<!-- /tables.py -->", 1)[0]


def table_rows(body):
    return [line for line in body.splitlines() if line.startswith("| ") and not line.startswith(("| paper's", "| ---"))]


def test_the_readme_has_one_row_per_claim_and_docs_results_every_group():
    """Every claim of verdicts.json: one README row (its headline's numbers and word, and a link to the claim's
    anchor in docs/results.md when it has more groups); every group: one row of docs/results.md's full tables."""
    with open(tables.VERDICTS) as handle:
        entries = json.load(handle)["verdicts"]
    claims = {claim.id: claim for claim in tables.CLAIMS + [tables.BASELINE]}
    ids = list(dict.fromkeys(entry["id"] for entry in entries))
    assert sorted(ids) == sorted(claims)
    readme_rows = [row for paper in tables.TABLES for row in table_rows(generated(tables.README, f"paper {paper}"))]
    baseline = generated(tables.README, "baseline")
    docs = generated(tables.DOCS_RESULTS, "groups")
    docs_rows = table_rows(docs)
    assert len(readme_rows) == len(ids) - 1 and len(docs_rows) == len(entries)
    for claim_id in ids:
        claim, group = claims[claim_id], [entry for entry in entries if entry["id"] == claim_id]
        top = tables.headline(claim, group)
        cells = [f"`{tables.measure_text(top)}` {top['bound']}", tables.short_rows(top),
                 tables.sets_cell(top, tables.kind_of(top), compact=True), tables.readme_word(top["verdict"])]
        if claim.paper == "baseline":
            assert baseline.count(claim.claim) == 1 and all(cell in baseline for cell in cells)
        else:
            mine = [row for row in readme_rows if row.startswith(f"| {claim.claim}: `")]
            assert len(mine) == 1, (claim_id, mine)
            cut = mine[0].split(" | ")
            assert cut[0] == f"| {claim.claim}: {cells[0]}" and cut[1:3] == cells[1:3]
            link = f" ([{len(group) - 1} more](docs/results.md#{tables.anchor(claim)}))" if len(group) > 1 else ""
            assert cut[3] == f"{cells[3]}{link} |", (cut[3], cells[3])
        assert docs.count(f'<a id="{tables.anchor(claim)}"></a>') == 1
        for entry in group:
            row = (f"`{tables.measure_text(entry)}`; {tables.rows_cell(entry)} | "
                   f"{tables.sets_cell(entry, tables.kind_of(entry))} | {tables.verdict_cell(entry)} |")
            found = [line for line in docs_rows if line.endswith(row)]
            assert len(found) == 1, (claim_id, row)
            assert ("**headline:** " in found[0]) == (entry == top)


# ----------------------------------------------------------------------------------------------- paper-recipe rows
EPYC = dict(cpu="AMD EPYC", cpu_capability="AVX512", cpu_bf16_matmul=True, threads=1, torch="x", gpu=None)
H200 = dict(cpu="Intel Xeon", cpu_capability="AVX512", cpu_bf16_matmul=True, threads=1, torch="x", gpu="NVIDIA H200")


def write_paper(results, seed, rows, recipe="beam_joint", task="nouns", machine=EPYC, kind="epyc_avx512"):
    """A reproduce.py --recipe file as it lands: results/paper_RECIPE_TASK_KIND_sN/reproduce_TASK_cpu_RECIPE.json.
    rows: {name: dict(score, steps, converged: bool or {stage: bool} or None (no record), decoded_from, init_std,
    recipe_name, flag (a stored ``converged`` that disagrees))}."""
    fields = dict(name=recipe, max_steps=12000, minutes=None, bf16=False, label_smoothing=0.0, init_std="model",
                  patience=5, eval_steps=250)
    out = {}
    for name, spec in rows.items():
        row = dict(row=name, seed=seed, recipe_name=spec.get("recipe_name", recipe), recipe=fields, machine=machine,
                   command=f"python benchmarks/reproduce.py --task {task} --preset cpu --rows {name} --seed {seed} "
                           f"--recipe {recipe} --output-dir OUT/s{seed}",
                   init_std=spec.get("init_std"), embed_init_std=None)
        if task == "nouns":
            row.update(metric="accuracy", score=spec["score"])
        else:
            row.update(metric="BLEU", score=spec["score"], scores={"test_2016_flickr": spec["score"],
                                                                   "val": spec["score"] + 1.0})
        if "decoded_from" in spec:  # reproduce.py: a derived row carries its source's steps, no convergence of its own
            row.update(decoded_from=spec["decoded_from"], steps=rows[spec["decoded_from"]]["steps"])
        else:
            row["steps"] = spec["steps"]
            converged = spec.get("converged", True)
            if isinstance(converged, dict):  # a two-stage row: one record per stage
                row["convergence"] = {stage: record(c, spec["steps"] // 2) for stage, c in converged.items()}
                row["converged"] = all(converged.values())
            elif converged is not None:
                row.update(convergence=record(converged, spec["steps"]), converged=converged)
        if "flag" in spec:
            row["converged"] = spec["flag"]
        out[name] = row
    folder = results / f"paper_{recipe}_{task}_{kind}_s{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    payload = dict(task=task, preset="cpu", recipe_name=recipe, recipe=fields, rows=out)
    (folder / f"reproduce_{task}_cpu_{recipe}.json").write_text(json.dumps(payload))


BJ = dict(rnn_luong_soft=80.0, beam_joint_rnn_k6=(81.0, 82.0, 83.0))  # beam-joint - soft: +1, +2, +3 over seeds 0-2
RNN = tables.Claim("r", "001", "beam-joint above soft", tables.Bound(low=0.0), "quality", (
    tables.PaperRows("beam_joint", "beam_joint_rnn_k6", "rnn_luong_soft"),))
K1 = tables.Claim("k", "001", "K=1 above soft", tables.Bound(low=0.0), "quality", (
    tables.PaperRows("beam_joint", "beam_joint_rnn_k6_decoded_k1", "rnn_luong_soft"),))


def write_beam_joint(results, seeds=(0, 1, 2), overrides=None):
    """Seeds of the beam-joint recipe on nouns (soft 80, beam-joint 81 + seed, its K=1 decoding 79 + seed); overrides:
    {(row, seed): spec fields}."""
    for seed in seeds:
        rows = dict(rnn_luong_soft=dict(score=BJ["rnn_luong_soft"], steps=6000 + 500 * seed),
                    beam_joint_rnn_k6=dict(score=BJ["beam_joint_rnn_k6"][seed], steps=7000 + 500 * seed),
                    beam_joint_rnn_k6_decoded_k1=dict(score=79.0 + seed, decoded_from="beam_joint_rnn_k6"))
        for (name, s), spec in (overrides or {}).items():
            if s == seed:
                rows[name].update(spec)
        write_paper(results, seed, rows)


def test_paper_recipe_rows_form_one_group_per_recipe_and_machine(tmp_path, monkeypatch):
    """Three converged seeds of the beam-joint recipe: one group, its differences by hand (+1, +2, +3: mean 2, sd 1,
    2 +- 2.920 / sqrt(3) = [0.314, 3.686], holds >= 0), recipe "paper (beam_joint)", converged, the steps reached;
    the same rows of our recipe, of another recipe and of another machine are not pooled into it."""
    monkeypatch.setattr(tables, "RESULTS", str(tmp_path))
    assert tables.verdicts([RNN, K1]) == []  # no file yet: no group, the committed tables unchanged
    write_paper(tmp_path, 1, dict(rnn_luong_soft=dict(score=80.0, steps=6000)))  # seed 1's soft alone: no pair yet
    assert tables.verdicts([RNN, K1]) == []
    write_beam_joint(tmp_path, seeds=(0,))  # soft and beam-joint of seed 0
    [entry] = tables.verdicts([RNN])
    assert entry["seeds"] == [0] and entry["verdict"] == "one seed"
    write_paper(tmp_path, 5, dict(beam_joint_rnn_k6=dict(score=90.0, steps=100)), kind="b")  # no soft of seed 5
    assert len(tables.verdicts([RNN])) == 1
    write_beam_joint(tmp_path)
    for seed in (0, 1):  # our recipe's rows of the same names (in a reproduce_nouns_cpu.json) and another recipe's
        write_run(tmp_path / f"today-s{seed}", "beam_joint_rnn_k6", seed, 10.0, 10.0)
        write_paper(tmp_path, seed, dict(rnn_luong_soft=dict(score=10.0, steps=100),
                                         beam_joint_rnn_k6=dict(score=50.0, steps=100)), recipe="hybrid")
    write_paper(tmp_path, 0, dict(rnn_luong_soft=dict(score=70.0, steps=900),  # seed 0 again, on another machine
                                  beam_joint_rnn_k6=dict(score=75.0, steps=900)), machine=H200, kind="h200")
    epyc, h200 = tables.verdicts([RNN])
    assert epyc["recipe"] == "paper (beam_joint)" and epyc["converged"] is True and epyc["machine"] == "AVX512 EPYC"
    test = epyc["sets"]["nouns test"]
    assert test["differences"] == [1.0, 2.0, 3.0] and test["interval"] == pytest.approx([0.314, 3.686], abs=1e-3)
    assert epyc["verdict"] == "holds" and epyc["seeds"] == [0, 1, 2] and epyc["steps"] == [6000, 6500, 7000, 7500, 8000]
    assert {r["file"].split("/")[0] for r in epyc["rows"]} == {f"paper_beam_joint_nouns_epyc_avx512_s{s}" for s in
                                                              (0, 1, 2)} and len(epyc["rows"]) == 6
    assert h200["machine"] == "H200" and h200["seeds"] == [0] and h200["sets"]["nouns test"]["differences"] == [5.0]
    assert tables.short_rows(epyc) == ("nouns, paper's recipe (beam_joint); AVX512 EPYC fp32, 6000-8000 steps "
                                       "reached, converged, 3 seeds")
    assert tables.PaperRows("beam_joint", "a", "b", "Luong LSTM").label == "Luong LSTM, paper's recipe (beam_joint)"
    assert tables.rows_cell(epyc).endswith("fp32, 6000-8000 steps reached, converged, seeds 0-2")
    assert tables.verdict_cell(epyc) == "holds (paper's recipe, converged at 6000-8000 steps)"
    [k1] = tables.verdicts([K1])  # the H200 file has no K=1 row; the decoded row: its source's steps and convergence
    assert k1["sets"]["nouns test"]["differences"] == [-1.0, 0.0, 1.0] and k1["converged"] is True
    assert k1["steps"] == [6000, 6500, 7000, 7500, 8000]


def test_a_paper_group_is_converged_only_when_every_row_converged(tmp_path, monkeypatch):
    """One row of one seed short of convergence (or without a record) makes the group not converged; a decoded row
    follows its source; a two-stage row needs every stage; a stored flag that disagrees with its records is an
    error; a row of another recipe among the recipe's files is never pooled."""
    monkeypatch.setattr(tables, "RESULTS", str(tmp_path))
    write_beam_joint(tmp_path)
    assert [e["converged"] for e in tables.verdicts([RNN, K1])] == [True, True]
    write_beam_joint(tmp_path, overrides={("beam_joint_rnn_k6", 2): dict(converged=False)})
    assert [e["converged"] for e in tables.verdicts([RNN, K1])] == [False, False]  # K=1 decodes that model
    assert tables.verdict_cell(tables.verdicts([RNN])[0]) == "holds (paper's recipe, not converged at 6000-8000 steps)"
    write_beam_joint(tmp_path, overrides={("rnn_luong_soft", 1): dict(converged=None)})  # no record: a fixed budget
    assert [e["converged"] for e in tables.verdicts([RNN, K1])] == [False, False]
    write_beam_joint(tmp_path, overrides={("rnn_luong_soft", 1): dict(flag=True, converged=None)})
    with pytest.raises(ValueError, match="rnn_luong_soft \\(seed 1\\) has converged=True but its convergence records"):
        tables.verdicts([RNN])
    write_beam_joint(tmp_path, overrides={("rnn_luong_soft", 0): dict(recipe_name="today")})
    with pytest.raises(ValueError, match="rows of recipes \\['beam_joint', 'today'\\] pooled"):
        tables.verdicts([RNN])
    eq1 = tables.Claim("e", "002", "Eq. 1 within 0.5", tables.Bound(low=-0.5), "quality", (
        tables.PaperRows("hybrid", "hybrid_dot_kd_eq1", "soft"),))
    for seed in (0, 1, 2):
        write_paper(tmp_path, seed, dict(soft=dict(score=30.0, steps=4000), hybrid_dot_kd_eq1=dict(
            score=29.9, steps=8000, converged=dict(mle=True, kd=seed != 1))), recipe="hybrid", task="multi30k")
    [entry] = tables.verdicts([eq1])
    assert entry["converged"] is False and set(entry["sets"]) == {"test", "val"}
    for seed in (0, 1, 2):
        write_paper(tmp_path, seed, dict(soft=dict(score=30.0, steps=4000), hybrid_dot_kd_eq1=dict(
            score=29.9, steps=8000, converged=dict(mle=True, kd=True))), recipe="hybrid", task="multi30k")
    assert tables.verdicts([eq1])[0]["converged"] is True


def test_hard_retrieval_rows_of_the_authors_init_pair_by_seed(tmp_path, monkeypatch):
    """The hard-retrieval recipe's rows carry init_std "lipschitz" (a named init): paired as any other."""
    monkeypatch.setattr(tables, "RESULTS", str(tmp_path))
    claim = tables.Claim("h", "000", "hard within 0.5", tables.Bound(low=-0.5), "quality", (
        tables.PaperRows("hard_retrieval", "hard_cross", "soft"),))
    for seed in (0, 1, 2):
        write_paper(tmp_path, seed, dict(soft=dict(score=35.0, steps=5000, init_std="lipschitz"), hard_cross=dict(
            score=35.0 - 0.1 * seed, steps=5250, init_std="lipschitz")), recipe="hard_retrieval", task="multi30k")
    [entry] = tables.verdicts([claim])
    assert entry["measure"] == "hard_cross@lipschitz - soft@lipschitz" and entry["converged"] is True
    assert entry["sets"]["test"]["differences"] == [0.0, -0.1, -0.2] and entry["verdict"] == "holds"


def test_a_converged_paper_group_of_three_seeds_is_the_headline(tmp_path, monkeypatch):
    """Before any other group, even one with more seeds and longer training; not when a row did not converge, nor
    with two seeds; the README's status line counts the quality verdicts resting on such a group."""
    claim = tables.Claim("x", "001", "beam-joint above soft", tables.Bound(low=0.0), "quality")
    more = quality_entry("default init", [0, 1, 2, 3], [9000])
    paper = quality_entry("paper's recipe (beam_joint)", [0, 1, 2], [6000, 8000], "paper (beam_joint)", True)
    assert tables.headline(claim, [more, paper]) is paper
    assert tables.headline(claim, [more, dict(paper, converged=False)]) is more
    assert tables.headline(claim, [more, dict(paper, seeds=[0, 1])]) is more
    assert tables.headline(claim, [dict(paper, seeds=[0, 1]), quality_entry("default init", [0, 1], [500])])[
        "seeds"] == [0, 1]  # short of the rule: ranked as any group (longest training)
    monkeypatch.setattr(tables, "RESULTS", str(tmp_path))
    monkeypatch.setattr(tables, "CLAIMS", [RNN, K1, tables.Claim("o", "001", "other", tables.Bound(low=0.0),
                                                                 "quality")])
    write_beam_joint(tmp_path, overrides={("beam_joint_rnn_k6", 2): dict(converged=False)})
    entries = tables.verdicts([RNN, K1])
    entries.append(dict(quality_entry("default init", [0, 1, 2, 3], [1500]), id="o"))
    assert tables.status_line(entries).startswith("**No quality verdict yet rests on rows trained to convergence")
    assert "; 2 of the 3 rest on paper-recipe rows not all converged" in tables.status_line(entries)
    write_beam_joint(tmp_path)
    entries = tables.verdicts([RNN, K1]) + [dict(quality_entry("default init", [0, 1, 2, 3], [1500]), id="o")]
    assert tables.status_line(entries).startswith("**2 of the 3 quality verdicts rest on converged paper-recipe rows")
    assert "1 of the 3 is of our recipe" in tables.status_line(entries)
