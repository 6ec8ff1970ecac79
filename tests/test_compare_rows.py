"""benchmarks/compare_rows.py: means, standard errors and paired differences of reproduce rows over seeds and sets,
checked against hand computations; parity only when every set supports it."""

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import compare_rows  # noqa: E402


def write(tmp_path, name, row, seed, init_std, test, val, embed_init_std=None):
    row_json = dict(row=row, seed=seed, init_std=init_std, embed_init_std=embed_init_std, metric="BLEU", score=test,
                    scores={"test_2016_flickr": test, "val": val}, chrf={"test_2016_flickr": test + 20, "val": val + 20})
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(dict(task="multi30k", rows={row: row_json})))
    return str(path)


def test_paired_differences_and_parity_on_every_set(tmp_path, capsys):
    files = [write(tmp_path, "a0", "soft", 0, 0.02, 33.6, 33.7), write(tmp_path, "a1", "soft", 1, 0.02, 33.8, 33.9),
             write(tmp_path, "b0", "hard_cross", 0, 0.02, 33.4, 33.2), write(tmp_path, "b1", "hard_cross", 1, 0.02, 33.6, 33.3),
             write(tmp_path, "c0", "soft", 0, None, 32.8, 33.2)]
    out = tmp_path / "summary.json"
    compare_rows.main(files + ["--compare", "hard_cross:soft", "--compare-init", "soft", "--margin", "0.5",
                               "--output", str(out)])
    summary = json.loads(out.read_text())
    soft = summary["groups"]["soft [N(0,0.02)]"]["BLEU val"]
    assert soft["mean"] == pytest.approx(33.8) and soft["se"] == pytest.approx(0.1, abs=1e-3)  # sd 0.1414 / sqrt(2)
    pair = summary["comparisons"]["hard_cross [N(0,0.02)] - soft [N(0,0.02)]"]
    # test: -0.2, -0.2 (mean -0.2, SE 0); val: -0.5, -0.6 (mean -0.55, SE sd/sqrt(2) = 0.0707/1.414 = 0.05)
    assert pair["BLEU test_2016_flickr"]["mean"] == pytest.approx(-0.2) and pair["BLEU test_2016_flickr"]["se"] == pytest.approx(0, abs=1e-9)
    assert pair["BLEU val"]["mean"] == pytest.approx(-0.55) and pair["BLEU val"]["se"] == pytest.approx(0.05, abs=1e-3)
    assert pair["BLEU test_2016_flickr"]["within_margin"] and not pair["BLEU val"]["within_margin"]
    assert pair["parity_on_every_set"] is False  # within 0.5 on test, not on val: no parity
    init = summary["comparisons"]["soft [N(0,0.02)] - soft [xavier]"]
    assert init["BLEU test_2016_flickr"]["seeds"] == [0] and init["BLEU test_2016_flickr"]["se"] is None  # one seed
    assert init["BLEU test_2016_flickr"]["mean"] == pytest.approx(0.8)
    assert "| hard_cross [N(0,0.02)] - soft [N(0,0.02)] | BLEU val | [-0.5, -0.6] | -0.55 | 0.05 | no |" in capsys.readouterr().out


def test_the_same_row_and_seed_twice_is_refused(tmp_path, capsys):
    files = [write(tmp_path, "a", "soft", 0, None, 1, 2), write(tmp_path, "b", "soft", 0, None, 1, 2),
             write(tmp_path, "c", "marian", 0, 0.02, 3, 4)]
    with pytest.raises(ValueError, match="seed 0 appears twice"):
        compare_rows.main(files)
    compare_rows.main(files[1:] + ["--rows", "marian"])  # --rows reads only the rows named: no duplicate left
    out = capsys.readouterr().out
    assert "marian [N(0,0.02)]" in out and "soft" not in out


def test_embeddings_only_init_is_its_own_group_and_named_inits_compare_across(tmp_path):
    """embed_init_std makes a third initialisation (not merged with Xavier or N(0, 0.02)); ROW@INIT:ROW@INIT pairs two
    named initialisations (soft's embeddings-only init against Marian's own), by seed, on every set."""
    emb = "xavier, emb N(0,0.02)"
    files = [write(tmp_path, "e0", "soft", 0, None, 33.7, 34.0, 0.02), write(tmp_path, "e1", "soft", 1, None, 33.6, 34.8, 0.02),
             write(tmp_path, "x0", "soft", 0, None, 32.8, 33.2), write(tmp_path, "x1", "soft", 1, None, 33.3, 33.4),
             write(tmp_path, "m0", "marian", 0, 0.02, 34.4, 33.9), write(tmp_path, "m1", "marian", 1, 0.02, 34.4, 34.0)]
    out = tmp_path / "summary.json"
    compare_rows.main(files + ["--compare", f"soft@{emb}:marian@N(0,0.02)", "--compare-init", "soft",
                               "--margin", "0.5", "--output", str(out)])
    summary = json.loads(out.read_text())
    assert set(summary["groups"]) == {f"soft [{emb}]", "soft [xavier]", "marian [N(0,0.02)]"}
    init = summary["comparisons"][f"soft [{emb}] - soft [xavier]"]
    assert init["BLEU test_2016_flickr"]["differences"] == [0.9, 0.3] and init["BLEU val"]["mean"] == pytest.approx(1.1)
    across = summary["comparisons"][f"soft [{emb}] - marian [N(0,0.02)]"]
    assert across["BLEU test_2016_flickr"]["mean"] == pytest.approx(-0.75)  # (-0.7 - 0.8) / 2
    assert across["BLEU val"]["mean"] == pytest.approx(0.45)  # (0.1 + 0.8) / 2
    assert across["BLEU val"]["se"] == pytest.approx(0.35, abs=1e-3)  # sd 0.495 / sqrt(2)
    assert across["parity_on_every_set"] is False


def test_an_older_row_without_sets_counts_for_its_tables_test_set():
    """Rows stored before the scores on two sets have one ``score``: Multi30k's is test_2016_flickr's BLEU (pairs with
    newer rows' test set, never with val), nouns' is its test accuracy."""
    old = dict(row="soft", seed=0, metric="BLEU", score=33.1, task="multi30k")
    assert compare_rows.scores_of(old) == {("BLEU", "test_2016_flickr"): 33.1}
    assert compare_rows.scores_of(dict(old, task="nouns", metric="accuracy")) == {("accuracy", "test"): 33.1}
    new = dict(row="soft", seed=0, embed_init_std=0.02, task="multi30k", scores={"test_2016_flickr": 34.0, "val": 35.0})
    pair = compare_rows.paired({0: compare_rows.scores_of(new)}, {0: compare_rows.scores_of(old)}, None)
    assert list(pair) == [("BLEU", "test_2016_flickr")] and pair[("BLEU", "test_2016_flickr")]["mean"] == pytest.approx(0.9)
