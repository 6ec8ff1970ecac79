"""benchmarks/compare_rows.py: means, standard errors and paired differences of reproduce rows over seeds and sets,
checked against hand computations; parity only when every set supports it."""

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import compare_rows  # noqa: E402


def write(tmp_path, name, row, seed, init_std, test, val):
    row_json = dict(row=row, seed=seed, init_std=init_std, metric="BLEU", score=test,
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


def test_the_same_row_and_seed_twice_is_refused(tmp_path):
    files = [write(tmp_path, "a", "soft", 0, None, 1, 2), write(tmp_path, "b", "soft", 0, None, 1, 2)]
    with pytest.raises(ValueError, match="seed 0 appears twice"):
        compare_rows.main(files)
