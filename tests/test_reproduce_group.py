"""benchmarks/reproduce_group.py: a comparison's chains of rows for several seeds, side by side, each in its own folder;
a row made there equals the row a plain reproduce.py run makes; a deadline stops what still runs and says so."""

import json
import os
import shutil
import tarfile

import pytest

from common import benchmark_script
from test_reproduce import write_toy_multi30k

group = benchmark_script("reproduce_group")


def test_chains_put_each_trained_row_with_the_rows_that_need_it():
    assert group.chains("multi30k", "hard_retrieval", None) == [
        ["soft", "soft_decoded_hard"], ["hard_cross"], ["hard_self_cross", "hard_decoded_soft"], ["hard_enc_dec"]]
    # a KD row needs the soft teacher: it runs after it, in its process and folder; under the hybrid recipe the hybrid
    # row (the teacher's budget) and the Eq. 1 row that continues it join them
    assert group.chains("multi30k", "hybrid", ["hybrid_dot", "hybrid_dot_kd_eq1"]) == [
        ["soft", "hybrid_dot", "hybrid_dot_kd_eq1"]]
    assert group.chains("multi30k", "today", ["hybrid_dot", "hybrid_dot_kd_eq1"]) == [
        ["hybrid_dot"], ["soft", "hybrid_dot_kd_eq1"]]
    # a decoded row alone pulls in the row it decodes
    assert group.chains("nouns", "beam_joint", ["beam_joint_rnn_k6_decoded_k1", "soft"]) == [
        ["beam_joint_rnn_k6", "beam_joint_rnn_k6_decoded_k1"], ["soft"]]
    with pytest.raises(ValueError, match=r"`rows` \['marian'\] are not rows of task 'multi30k' under recipe "
                                         r"'hard_retrieval'; allowed: \['soft'"):
        group.chains("multi30k", "hard_retrieval", ["soft", "marian"])


def test_bad_deadline_is_refused():
    with pytest.raises(ValueError, match=r"`--deadline` must be > 0, got 0.0"):
        group.main(["--deadline", "0"])


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("group")
    return dict(root=root, data=str(write_toy_multi30k(root)))


def argv(toy, runs, *extra):
    return ["--preset", "tiny", "--recipe", "hard_retrieval", "--data", toy["data"], "--runs", str(runs), *extra]


def test_side_by_side_rows_equal_a_plain_run_and_are_packed(toy, capsys):
    """Seeds 0 and 1, rows soft (with soft_decoded_hard) and hard_cross: four processes at once, one folder each, one
    tokenizer; each folder's results are those of a plain ``reproduce.py`` run of the same rows and seed (CPU, one
    thread: the same arithmetic), and the pack holds every results file."""
    from hf_hardattn.tools import reproduce

    runs, packed = toy["root"] / "runs", toy["root"] / "results.tgz"
    code = group.main(argv(toy, runs, "--rows", "hard_cross", "soft_decoded_hard", "--seeds", "0", "1", "--pack",
                           str(packed), "--", "--threads", "1", "--quiet"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert sorted(os.listdir(runs)) == ["s0-hard_cross", "s0-soft", "s1-hard_cross", "s1-soft",
                                        "tokenizer-multi30k-s0"]
    tokenizers = {(runs / f / "tokenizer" / "tokenizer.json").read_text() for f in os.listdir(runs) if f[0] == "s"}
    assert len(tokenizers) == 1
    name = "reproduce_multi30k_tiny_hard_retrieval.json"
    stored = {f: json.loads((runs / f / name).read_text())["rows"] for f in os.listdir(runs) if f[0] == "s"}
    assert {f: sorted(rows) for f, rows in stored.items()} == {
        "s0-hard_cross": ["hard_cross"], "s1-hard_cross": ["hard_cross"],
        "s0-soft": ["soft", "soft_decoded_hard"], "s1-soft": ["soft", "soft_decoded_hard"]}
    assert all(row["seed"] == int(f[1]) for f, rows in stored.items() for row in rows.values())
    assert "seed 1 soft soft_decoded_hard: done" in out
    with tarfile.open(packed) as tar:
        assert {m for m in tar.getnames() if m.endswith(".json")} == {f"{f}/{name}" for f in stored}
    # the reference: seed 1's hard_cross row by a plain run, with the same tokenizer
    plain = toy["root"] / "plain"
    shutil.copytree(runs / "tokenizer-multi30k-s0", plain / "tokenizer")
    reproduce.main(["--task", "multi30k", "--preset", "tiny", "--recipe", "hard_retrieval", "--data", toy["data"],
                    "--rows", "hard_cross", "--seed", "1", "--output-dir", str(plain), "--threads", "1", "--quiet"])
    want = json.loads((plain / name).read_text())["rows"]["hard_cross"]
    got = stored["s1-hard_cross"]["hard_cross"]
    for key in ("steps", "first_loss", "last_loss", "convergence", "scores", "samples"):
        assert got[key] == want[key], key


def test_deadline_stops_running_chains_and_names_them(toy, capsys):
    runs, packed = toy["root"] / "cut", toy["root"] / "cut.tgz"
    code = group.main(argv(toy, runs, "--rows", "soft", "--seeds", "0", "--deadline", "0.5", "--pack", str(packed),
                           "--", "--threads", "1"))
    out = capsys.readouterr().out
    assert code == 1
    assert "seed 0 soft: cut off at the deadline" in out
    assert not (runs / "s0-soft" / "reproduce_multi30k_tiny_hard_retrieval.json").exists()
    with tarfile.open(packed) as tar:
        assert tar.getnames() == ["s0-soft/run.log"]


@pytest.mark.parametrize("jobs, most", [(None, 4), (2, 2), (1, 1)])
def test_jobs_caps_the_chains_running_at_once(toy, monkeypatch, capsys, jobs, most):
    """Each chain's process stands in for a 0.3 s row: --jobs N keeps at most N alive (default: every chain at once),
    starts the next as one ends, in the order of seeds then chains, and runs every chain once."""
    import subprocess
    import sys

    started, real_popen = [], subprocess.Popen

    def popen(argv, **kwargs):
        alive = sum(p.poll() is None for _, p in started)
        process = real_popen([sys.executable, "-c", "import time; time.sleep(0.3)"], **kwargs)
        started.append((alive + 1, process))
        return process

    monkeypatch.setattr(group.subprocess, "Popen", popen)
    runs = toy["root"] / f"jobs{jobs}"
    extra = ["--jobs", str(jobs)] if jobs else []
    code = group.main(argv(toy, runs, "--rows", "soft", "hard_cross", "--seeds", "0", "1", *extra))
    out = capsys.readouterr().out
    assert code == 0, out
    assert len(started) == 4 and max(alive for alive, _ in started) == most
    order = [line.split("]")[0] for line in out.splitlines() if line.startswith("[")]
    assert order == ["[0 soft", "[0 hard_cross", "[1 soft", "[1 hard_cross"]


def test_chains_not_started_by_the_deadline_are_named(toy, monkeypatch, capsys):
    import subprocess
    import sys

    real_popen = subprocess.Popen
    monkeypatch.setattr(group.subprocess, "Popen",
                        lambda argv, **kw: real_popen([sys.executable, "-c", "import time; time.sleep(30)"], **kw))
    code = group.main(argv(toy, toy["root"] / "late", "--rows", "soft", "hard_cross", "--seeds", "0", "--jobs", "1",
                           "--deadline", "1"))
    out = capsys.readouterr().out
    assert code == 1
    assert "seed 0 soft: cut off at the deadline" in out
    assert "seed 0 hard_cross: not started before the deadline" in out


def test_bad_jobs_is_refused():
    with pytest.raises(ValueError, match=r"`--jobs` must be >= 1 \(chains running at once\), got 0"):
        group.main(["--jobs", "0"])
