"""benchmarks/quantized_quality.py: a row trained by the reproduce recipe (tiny preset, toy Multi30k) scored in fp32
and after quantize_int8() with each engine; each int8 precision quantises with its own engine, and the change and
agreement against fp32 are checked by hand on canned outputs."""

import json

import pytest
import torch

from hf_hardattn.int8 import Int8Mixin
from hf_hardattn.int8_traced import int_mm_is_exact
from hf_hardattn.tools import reproduce

from common import benchmark_script
from test_recipes import tiny_argv


pytestmark = pytest.mark.usefixtures("one_thread")


def load_script():
    return benchmark_script("quantized_quality")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized_quality")
    torch.manual_seed(0)
    reproduce.main(tiny_argv(root, "--rows", "soft", "--max-steps", "3", "--output-dir", str(root / "out")))
    return root


def quantize_spy(monkeypatch):
    engines, quantize = [], Int8Mixin.quantize_int8

    def spy(model, *args, **kwargs):
        engines.append(args[0] if args else kwargs.get("engine", "fbgemm"))
        return quantize(model, *args, **kwargs)

    monkeypatch.setattr(Int8Mixin, "quantize_int8", spy)
    return engines


PRECISIONS = ["fp32", "int8", "int8_onednn"] + (["int8_traced"] if int_mm_is_exact() else [])


def test_each_precision_decodes_a_model_quantised_with_its_own_engine(trained, monkeypatch, tmp_path):
    """End to end on the trained row: each int8 precision quantises a freshly loaded model with its engine (fbgemm,
    onednn, traced where this CPU's int8 products are exact) before it is scored; the JSON holds the results."""
    script = load_script()
    engines = quantize_spy(monkeypatch)
    output = tmp_path / "q.json"
    results = script.main(["soft", "--folder", str(trained / "out"), "--data", str(trained / "data"), "--threads", "1",
                           "--precisions", *PRECISIONS, "--output", str(output)])
    assert engines == ["fbgemm", "onednn", "traced"][: len(PRECISIONS) - 1]
    assert set(results["soft"]) == set(PRECISIONS)
    written = json.loads(output.read_text())
    assert written["results"] == results and set(written["machine"]) >= {"cpu", "threads"}
    assert written["examples"] == 8 and written["task"] == "multi30k"


def test_score_change_and_agreement_are_measured_against_fp32(trained, monkeypatch, tmp_path):
    """The scoring replaced by canned outputs (4 sentences): the change and the share of outputs identical to fp32's,
    by hand; every int8 precision is scored after its own quantisation, fp32 before any."""
    script = load_script()
    engines = quantize_spy(monkeypatch)
    canned = {"fp32": (30.0, ["a", "b", "c", "d"]), "int8": (29.5, ["a", "b", "x", "d"]),
              "int8_onednn": (31.25, ["a", "y", "x", "z"]), "int8_traced": (30.0, ["a", "b", "c", "d"])}
    calls = []

    def evaluate(task, model, tokenizer, test, recipe, return_hypotheses):
        precision = PRECISIONS[len(calls)]
        calls.append(len(engines))
        score, hypotheses = canned[precision]
        return dict(metric="BLEU", score=score, sentences_per_s=1.0, hypotheses=hypotheses)

    monkeypatch.setattr(script, "evaluate", evaluate)
    results = script.main(["soft", "--folder", str(trained / "out"), "--data", str(trained / "data"), "--threads", "1",
                           "--precisions", *PRECISIONS, "--output", str(tmp_path / "q.json")])["soft"]
    assert calls == list(range(len(PRECISIONS)))  # fp32 before any quantisation, then one engine per precision
    want = {"int8": (-0.5, 0.75), "int8_onednn": (1.25, 0.25), "int8_traced": (0.0, 1.0)}
    for precision in PRECISIONS[1:]:
        assert (results[precision]["score_change"], results[precision]["identical_to_fp32"]) == want[precision]
    assert "score_change" not in results["fp32"]


def test_an_unknown_precision_and_a_missing_row_are_refused(trained, capsys):
    script = load_script()
    with pytest.raises(SystemExit):
        script.main(["soft", "--folder", str(trained / "out"), "--precisions", "int4"])
    assert "int4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["hard_cross", "--folder", str(trained / "out")])
    assert "no trained model for ['hard_cross']" in capsys.readouterr().err
