"""benchmarks/gpu_speed.py's CPU smoke mode: every model of both sections timed, the JSON's ratios, claims and held
flags computed from its own medians (the GPU run writes the same structure)."""

import copy
import json
import math
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# written out here, not imported from the script: a model the script drops must fail the check
DECODE = {"soft", "attention_removed", "hard_retrieval", "sh_x", "hc_sa", "hybrid_additive", "hybrid_dot"}
RECURRENT = {f"recurrent_{v}" for v in ("concat_context", "concat_weight", "concat_accumulated", "expand_1",
                                         "expand_2", "expand_3", "expand_4", "continuity", "coverage")}
TRAIN = {"soft", "beam_joint_k6", "hybrid_rnn_soft", "beam_joint_rnn_k6"} | RECURRENT
CLAIMS = {  # (section, numerator, denominator) -> (op, paper's value)
    ("decoding", "hard_retrieval", "soft"): (">=", 1.43),
    ("decoding", "hard_retrieval", "attention_removed"): (">=", 0.8),
    ("decoding", "sh_x", "soft"): (">=", 1.30),
    ("decoding", "hc_sa", "soft"): (">=", 1.06),
    ("decoding", "hybrid_additive", "soft"): (">=", 4.0),
    ("decoding", "hybrid_dot", "soft"): (">=", 4.0),
    ("training", "beam_joint_k6", "soft"): ("<=", 1.3),
    ("training", "beam_joint_rnn_k6", "hybrid_rnn_soft"): ("<=", 1.3),
    **{("training", name, "soft"): ("<=", 7.9) for name in RECURRENT},
}


def holds(ratio, op, value):
    return ratio >= value if op == ">=" else ratio <= value


def check_times(entry, rounds):
    times = entry["times_s"]
    assert len(times) == rounds >= 1, (len(times), rounds)
    assert all(math.isfinite(t) and t > 0 for t in times), times
    assert math.isclose(entry["median_s"], statistics.median(times), rel_tol=1e-3, abs_tol=2e-6), entry


def check_result(data):
    assert data["environment"]["torch"] and data["environment"]["transformers"] and data["environment"]["device"]
    assert "matmul_allow_tf32" in data["environment"]["settings"]
    assert data["precision"]["name"] in ("bf16", "fp32")
    assert data["protocol"]["seeds"] == dict(model_weights=0, decode_source_ids=1, train_source_ids=2, train_labels=3)
    assert data["build_errors"] == {}
    assert set(data["models"]) == {f"decoding/{n}" for n in DECODE} | {f"training/{n}" for n in TRAIN}
    assert all(m["params"] > 0 for m in data["models"].values())
    sizes = data["sizes"]
    settings = [(row["mode"], row["batch_size"]) for row in data["decoding"]]
    assert settings == [(m, b) for m in ("greedy", "beam4") for b in sizes["decode_batch_sizes"]], settings
    assert sizes["decode_batch_sizes"][0] == 1 and len(sizes["decode_batch_sizes"]) == 2
    for row in data["decoding"]:
        assert row["errors"] == {} and set(row["models"]) == DECODE, (row["mode"], row["batch_size"], row["errors"])
        assert row["num_beams"] == (4 if row["mode"] == "beam4" else 1)
        for entry in row["models"].values():
            check_times(entry, row["rounds"])
            assert math.isclose(entry["sentences_per_s"], row["batch_size"] / entry["median_s"], rel_tol=1e-9)
    training = data["training"]
    assert training["errors"] == {} and set(training["models"]) == TRAIN, training["errors"]
    assert training["batch_size"] == sizes["train_batch"]
    for entry in training["models"].values():
        check_times(entry, training["rounds"])
    seen = {}
    for claim in data["claims"]:
        key = (claim["section"], claim["numerator"], claim["denominator"])
        assert key in CLAIMS, key
        seen[key] = seen.get(key, 0) + 1
        op, value = CLAIMS[key]
        assert (claim["claim"]["op"], claim["claim"]["value"]) == (op, value), claim
        if claim["section"] == "decoding":
            row = next(r for r in data["decoding"] if (r["mode"], r["batch_size"]) == (claim["mode"],
                                                                                        claim["batch_size"]))
            expected = (row["models"][claim["numerator"]]["sentences_per_s"]
                        / row["models"][claim["denominator"]]["sentences_per_s"])
        else:
            expected = (training["models"][claim["numerator"]]["median_s"]
                        / training["models"][claim["denominator"]]["median_s"])
        assert math.isfinite(claim["ratio"]) and claim["ratio"] > 0, claim
        assert math.isclose(claim["ratio"], expected, rel_tol=1e-9), (claim, expected)
        assert claim["held"] is holds(claim["ratio"], op, value), claim
        if claim["numerator"] in RECURRENT:
            assert claim["target_met"] is holds(claim["ratio"], "<=", 1.5), claim
    assert seen == {k: (4 if k[0] == "decoding" else 1) for k in CLAIMS}, seen
    held = [c["held"] for c in data["claims"]]
    summary = data["summary"]
    assert (summary["claims"], summary["held"], summary["not_held"], summary["missing"]) == (
        len(held), held.count(True), held.count(False), 0), summary


def run_smoke(path, *args, timeout=300):
    """benchmarks/gpu_speed.py --smoke on the CPU, offline, writing ``path``; returns the finished process."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_speed.py"), "--smoke", "--device",
                           "cpu", *args, "--output", path], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpu_speed") / "smoke.json")
    proc = run_smoke(path)
    assert "wrote " + path in proc.stdout
    with open(path) as handle:
        return json.load(handle), proc.stdout


def test_smoke_times_every_model_and_derives_every_claim(smoke):
    data, stdout = smoke
    check_result(data)
    assert data["environment"]["smoke"] is True and data["environment"]["device"] == "cpu"
    assert data["sizes"]["dims"]["d_model"] == 32  # smoke dims, not Transformer-base
    assert "| hard_retrieval / soft | greedy b1 |" in stdout


@pytest.mark.parametrize("break_it", ["drop_model", "wrong_ratio", "flip_held", "nonpositive_time", "drop_claim"])
def test_check_catches_a_broken_result(smoke, break_it):
    data = copy.deepcopy(smoke[0])
    if break_it == "drop_model":
        del data["decoding"][0]["models"]["hc_sa"]
    elif break_it == "wrong_ratio":
        data["claims"][0]["ratio"] *= 1.01
    elif break_it == "flip_held":
        data["claims"][-1]["held"] = not data["claims"][-1]["held"]
    elif break_it == "nonpositive_time":
        data["training"]["models"]["beam_joint_k6"]["times_s"][0] = 0.0
    else:
        data["claims"].pop()
    with pytest.raises(AssertionError):
        check_result(data)


COMPILED_CLAIMS = {  # --compiled --compiled-models soft marian: the claims whose two models were asked for
    ("decoding", "soft_compiled", "soft"): (">=", 4.0),
    ("decoding", "soft_compiled", "marian_compiled"): (">=", 1.0),
}


def test_compiled_smoke_times_eager_and_compiled_twins(tmp_path):
    """--compiled: each asked model eagerly and as <name>_compiled (static cache, compiled step), the compiled
    claims derived from the medians, and per setting each model's first call, each compiled model's tokens against
    its eager twin's and torch's compile counters."""
    path = str(tmp_path / "compiled.json")
    run_smoke(path, "--compiled", "--compiled-models", "soft", "marian", "--sections", "decoding", "--batch-sizes", "1",
              "--modes", "greedy", timeout=600)
    with open(path) as handle:
        data = json.load(handle)
    names = {"soft", "soft_compiled", "marian", "marian_compiled"}
    assert data["build_errors"] == {} and set(data["models"]) == {f"decoding/{n}" for n in names}
    assert data["protocol"]["compiled"] is True and data["training"] == {}
    [row] = data["decoding"]
    assert (row["mode"], row["batch_size"], row["errors"]) == ("greedy", 1, {}) and set(row["models"]) == names
    for entry in row["models"].values():
        check_times(entry, row["rounds"])
    assert set(row["first_call_s"]) == names and all(t > 0 for t in row["first_call_s"].values())
    assert set(row["agreement_with_eager"]) == {"soft_compiled", "marian_compiled"}
    assert all(0 <= a["rows"] <= a["tokens"] <= 1 for a in row["agreement_with_eager"].values())
    assert row["counters"]["unique_graphs"] >= 2 and row["counters"]["cudagraph_skips"] == 0  # one graph per model
    claims = {(c["section"], c["numerator"], c["denominator"]): c for c in data["claims"]}
    assert set(claims) == set(COMPILED_CLAIMS), set(claims)
    for key, claim in claims.items():
        expected = row["models"][key[1]]["sentences_per_s"] / row["models"][key[2]]["sentences_per_s"]
        assert math.isclose(claim["ratio"], expected, rel_tol=1e-9), (claim, expected)
        assert (claim["claim"]["op"], claim["claim"]["value"]) == COMPILED_CLAIMS[key], claim
        assert claim["held"] is holds(claim["ratio"], *COMPILED_CLAIMS[key]), claim
    assert data["summary"]["missing"] == 0 and data["summary"]["claims"] == 2
