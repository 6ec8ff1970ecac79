"""benchmarks/reproduce.py (hf_hardattn.tools.reproduce): rows, dependencies, resumability, stored commands, scores that
match an independent evaluation of the saved models."""

import argparse
import json
import os

import pytest
import sacrebleu
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import hf_hardattn  # noqa: F401
from hf_hardattn.tools import recipes, reproduce
from hf_hardattn.tools.training import translate

EN = ["a man is riding a bike .", "two dogs play in the snow .", "a woman is reading a book .",
      "children are running on the beach .", "a girl is eating an apple .", "the man is cooking dinner .",
      "a dog is jumping over a fence .", "people are walking in the park ."]
DE = ["ein mann fährt fahrrad .", "zwei hunde spielen im schnee .", "eine frau liest ein buch .",
      "kinder rennen am strand .", "ein mädchen isst einen apfel .", "der mann kocht das abendessen .",
      "ein hund springt über einen zaun .", "leute gehen im park spazieren ."]


def write_toy_multi30k(root):
    """root/data with Multi30k's file names: the sentences above, 6 times as train, once as test_2016_flickr, the
    last five (reversed) as val."""
    data = root / "data"
    data.mkdir()
    for split, en, de in (("train", EN * 6, DE * 6), ("test_2016_flickr", EN, DE), ("val", EN[:2:-1], DE[:2:-1])):
        (data / f"{split}.en").write_text("\n".join(en) + "\n")
        (data / f"{split}.de").write_text("\n".join(de) + "\n")
    return data


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("reproduce")
    data = write_toy_multi30k(root)
    out = root / "out"
    argv = ["--task", "multi30k", "--preset", "tiny", "--data", str(data), "--output-dir", str(out), "--quiet",
            "--rows", "soft_decoded_hard", "hybrid_dot_kd", "hybrid_dot_kd_eq1", "beam_joint_k6_decoded_k1", "marian"]
    torch.manual_seed(0)
    moved, on_accelerator = [], reproduce.on_accelerator  # which loaded models would go to a GPU
    reproduce.on_accelerator = lambda model: moved.append(model.config.model_type) or on_accelerator(model)
    try:
        reproduce.main(argv)
    finally:
        reproduce.on_accelerator = on_accelerator
    return dict(root=root, data=data, out=out, argv=argv, moved=moved)


def load_results(out):
    with open(os.path.join(out, "reproduce_multi30k_tiny.json")) as handle:
        return json.load(handle)


def test_dependencies_run_first_and_every_row_is_recorded(run_dir):
    rows = load_results(run_dir["out"])["rows"]
    # soft: source of soft_decoded_hard and KD teacher; beam_joint_k6: source of the K=1 decoding
    assert set(rows) == {"soft", "soft_decoded_hard", "hybrid_dot_kd", "hybrid_dot_kd_eq1", "beam_joint_k6",
                         "beam_joint_k6_decoded_k1", "marian"}
    for name, row in rows.items():
        assert f"--rows {name}" in row["command"] and "--preset tiny" in row["command"]
        assert row["metric"] == "BLEU" and row["examples"] == 8 and row["params"] > 0
        assert "nrefs:1" in row["signature"]
        assert row["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert row["machine"]["threads"] == torch.get_num_threads() and row["machine"]["torch"] == torch.__version__
    for name in rows:  # the parameter count and type of the model each row saved
        model = AutoModelForSeq2SeqLM.from_pretrained(run_dir["out"] / "models" / name)
        assert rows[name]["params"] == sum(p.numel() for p in model.parameters()), name
        assert rows[name]["model_type"] == model.config.model_type
    assert rows["soft_decoded_hard"]["decoded_from"] == "soft"
    assert rows["soft_decoded_hard"]["steps"] == rows["soft"]["steps"] == 3
    assert rows["marian"]["model_type"] == "marian"
    table = (run_dir["out"] / "reproduce_multi30k_tiny.md").read_text()
    assert "| soft_decoded_hard |" in table and "| marian |" in table
    # every model loaded from disk decodes where the trained ones do: the soft teacher (once, for both KD rows) and
    # the two derived rows (soft decoded hard, beam-joint decoded K=1)
    assert sorted(run_dir["moved"]) == ["beam_joint_transformer", "soft_transformer", "soft_transformer"]


def test_on_accelerator_moves_a_model_to_the_gpu_where_there_is_one(monkeypatch):
    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert reproduce.on_accelerator(model) is model
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model, "cuda", lambda: "on the GPU")
    assert reproduce.on_accelerator(model) == "on the GPU"


@pytest.mark.parametrize("name, kinds", [
    ("soft", {}),
    ("soft_decoded_hard", dict(decoder_attention="hard_retrieval", cross_attention="hard_retrieval")),
])
def test_scores_match_an_independent_evaluation(run_dir, name, kinds):
    """The row's outputs are the saved model's own (decoded as the row says), and its score is their BLEU. The tiny
    models' outputs are near-empty, so their BLEU is ~0 whatever was decoded: the check that can fail is on the
    outputs themselves (the three samples each row keeps), which differ between the soft and the hard decoding of the
    one soft model, so a row decoded with the other attention, beam or length fails it."""
    folder = run_dir["out"] / "models" / "soft"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    decoded = {}
    for kind in ({}, dict(decoder_attention="hard_retrieval", cross_attention="hard_retrieval")):
        model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
        model = model.with_attention(**kind) if kind else model
        decoded[bool(kind)] = translate(model, tokenizer, EN, num_beams=4, batch_size=8, max_length=32)
    hypotheses, other = decoded[bool(kinds)], decoded[not kinds]
    assert hypotheses != other, "soft and hard decoding give the same outputs: the sample check could not fail"
    row = load_results(run_dir["out"])["rows"][name]
    assert row["samples"] == [[s, h, r] for s, h, r in zip(EN[:3], hypotheses[:3], DE[:3])]
    assert row["score"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [DE]).score, abs=0.01)


@pytest.mark.parametrize("name, kinds", [
    ("soft", {}),
    ("soft_decoded_hard", dict(decoder_attention="hard_retrieval", cross_attention="hard_retrieval")),
])
def test_rows_score_bleu_and_chrf_on_test_and_validation(run_dir, name, kinds):
    """Every Multi30k row scores BLEU and chrF on test_2016_flickr and on the validation split, each equal
    to sacrebleu's scores of the saved model's own translations (the table shows both sets)."""
    folder = run_dir["out"] / "models" / "soft"
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    if kinds:
        model = model.with_attention(**kinds)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    row = load_results(run_dir["out"])["rows"][name]
    assert set(row["scores"]) == set(row["chrf"]) == {"test_2016_flickr", "val"}
    for split, (en, de) in {"test_2016_flickr": (EN, DE), "val": (EN[:2:-1], DE[:2:-1])}.items():
        hypotheses = translate(model, tokenizer, en, num_beams=4, batch_size=8, max_length=32)
        assert row["scores"][split] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [de]).score, abs=0.01), split
        assert row["chrf"][split] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [de]).score, abs=0.01), split
    assert row["scores"]["test_2016_flickr"] == row["score"] and "nc:6" in row["chrf_signature"]
    # the outputs scored above are the row's (its samples): BLEU and chrF of near-empty outputs are ~0 whatever was
    # decoded, the outputs are not
    test_outputs = translate(model, tokenizer, EN, num_beams=4, batch_size=8, max_length=32)
    assert [sample[1] for sample in row["samples"]] == test_outputs[:3]
    header = (run_dir["out"] / "reproduce_multi30k_tiny.md").read_text().splitlines()[2]
    assert "BLEU val" in header and "chrF test_2016_flickr / val" in header


def test_evaluate_scores_each_set_on_its_own_translations(monkeypatch):
    """The scores of each set are sacrebleu's BLEU and chrF of that set's outputs against that set's references (the
    tiny rows above translate to near-empty outputs, so this checks the bookkeeping with outputs that score in the
    middle of the range): a set's outputs never meet another set's references."""
    import datasets

    outputs = {tuple(EN): [" ".join(d.split()[:-2]) for d in DE], tuple(EN[:2:-1]): [" ".join(d.split()[1:]) for d in DE[:2:-1]]}
    monkeypatch.setattr(reproduce.training, "translate", lambda model, tokenizer, sources, **kw: outputs[tuple(sources)])
    test = datasets.Dataset.from_dict({"source": EN, "target": DE})
    val = datasets.Dataset.from_dict({"source": EN[:2:-1], "target": DE[:2:-1]})
    out = reproduce.evaluate("multi30k", None, None, test, recipes.PRESETS["multi30k"]["tiny"],
                             other_sets={"val": val})
    for split, hypotheses, references in (("test_2016_flickr", outputs[tuple(EN)], DE),
                                          ("val", outputs[tuple(EN[:2:-1])], DE[:2:-1])):
        bleu, chrf = sacrebleu.corpus_bleu(hypotheses, [references]).score, sacrebleu.corpus_chrf(hypotheses, [references]).score
        assert 1 < bleu < 99 and 1 < chrf < 99
        assert out["scores"][split] == pytest.approx(bleu, abs=0.005) and out["chrf"][split] == pytest.approx(chrf, abs=0.005)
    assert out["score"] == out["scores"]["test_2016_flickr"] and out["scores"]["val"] != out["score"]


def test_init_std_reaches_every_hf_hardattn_row_and_is_recorded(tmp_path):
    """--init-std STD: the rows' models start from N(0, STD) weights (config init_std, stored in the row); 'xavier' is
    the other initialisation; --embed-init-std STD sets the embeddings alone (config embed_init_std, stored); marian
    keeps its own (0.02); a bad value is refused by the parser."""
    data = write_toy_multi30k(tmp_path)
    common = ["--task", "multi30k", "--preset", "tiny", "--data", str(data), "--quiet", "--max-steps", "1"]
    seen = {}
    build = reproduce.run_row

    def spy(row, ctx):
        original = row.build
        if original is not None:
            def record(ctx):
                model = original(ctx)
                key = ctx["args"].init_std if ctx["args"].embed_init_std is None else "embed"
                seen[(key, row.name)] = model.get_input_embeddings().weight.detach().std().item()
                return model
            row = reproduce.dataclasses.replace(row, build=record)
        return build(row, ctx)

    reproduce.run_row = spy
    try:
        for init in ("0.005", "xavier"):
            reproduce.main(common + ["--rows", "soft", "hc_sa", "marian", "--init-std", init,
                                     "--output-dir", str(tmp_path / init)])
        reproduce.main(common + ["--rows", "soft", "marian", "--init-std", "xavier", "--embed-init-std", "0.01",
                                 "--output-dir", str(tmp_path / "embed")])
        reproduce.main(common + ["--rows", "soft", "hybrid_dot", "--output-dir", str(tmp_path / "default")])
    finally:
        reproduce.run_row = build
    for row in ("soft", "hc_sa"):
        assert seen[(0.005, row)] == pytest.approx(0.005, rel=0.1)
        assert seen[("xavier", row)] == pytest.approx(32 ** -0.5, rel=0.1)  # N(0, d_model^-1/2), d_model 32
    assert seen[(0.005, "marian")] == pytest.approx(0.02, rel=0.1)  # MarianMTModel's own init
    rows = load_results(tmp_path / "0.005")["rows"]
    assert rows["soft"]["init_std"] == rows["hc_sa"]["init_std"] == 0.005 and rows["marian"]["init_std"] == 0.02
    assert "--init-std 0.005" in rows["soft"]["command"]
    assert load_results(tmp_path / "xavier")["rows"]["soft"]["init_std"] is None
    assert seen[("embed", "soft")] == pytest.approx(0.01, rel=0.1) and seen[("embed", "marian")] == pytest.approx(0.02, rel=0.1)
    rows = load_results(tmp_path / "embed")["rows"]
    assert rows["soft"]["embed_init_std"] == 0.01 and rows["soft"]["init_std"] is None
    assert "--embed-init-std 0.01" in rows["soft"]["command"]
    # no flag: each model type's default (Transformer decoders 0.02, RNN decoders N(0, d^-1/2)), recorded
    assert seen[(None, "soft")] == pytest.approx(0.02, rel=0.1) and seen[(None, "hybrid_dot")] == pytest.approx(32 ** -0.5, rel=0.1)
    rows = load_results(tmp_path / "default")["rows"]
    assert rows["soft"]["embed_init_std"] == 0.02 and rows["hybrid_dot"]["embed_init_std"] is None
    # the nouns recipes keep N(0, d^-1/2) embeddings for every type (0.02 measured lower there), recorded in the recipe
    assert all(recipe.embed_init_std is None for recipe in recipes.PRESETS["nouns"].values())
    assert rows["soft"]["recipe"]["embed_init_std"] == "model"
    nouns = dict(recipe=recipes.PRESETS["nouns"]["cpu"])
    nouns["tokenizer"] = type("Tok", (list,), dict(pad_token_id=0, bos_token_id=1, eos_token_id=2))(["x"] * 50)
    assert reproduce._common(nouns)["embed_init_std"] is None
    assert "embed_init_std" not in reproduce._common(dict(nouns, recipe=recipes.PRESETS["multi30k"]["cpu"]))
    for flag, value in (("--init-std", "-1"), ("--embed-init-std", "0"), ("--embed-init-std", "xavier")):
        with pytest.raises(SystemExit):
            reproduce.main(common + [flag, value, "--output-dir", str(tmp_path / "bad")])


def test_decoded_k1_row_uses_k1(run_dir):
    folder = run_dir["out"] / "models" / "beam_joint_k6_decoded_k1"
    config = json.loads((folder / "config.json").read_text())
    assert config["joint_k"] == 6 and config["joint_inference_k"] == 1
    assert "## Results" in (folder / "README.md").read_text()


def test_kd_rows_train_on_the_teachers_translations(run_dir):
    import datasets

    distilled = datasets.load_from_disk(str(run_dir["out"] / "kd_data" / "dataset"))
    folder = run_dir["out"] / "models" / "soft"
    teacher = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert distilled["source"] == EN * 6
    assert distilled["target"] == translate(teacher, tokenizer, EN * 6, num_beams=4, batch_size=8, max_length=32)


def test_kd_rows_are_labelled_by_their_scheme(run_dir):
    """hybrid_*_kd: sequence-level KD only (teacher outputs from scratch, one stage); hybrid_*_kd_eq1: the paper's two
    stages, MLE for half the budget (3 tiny steps: 1), then Eq. 1 (2 steps); the table says which is which."""
    rows = load_results(run_dir["out"])["rows"]
    old, eq1 = rows["hybrid_dot_kd"], rows["hybrid_dot_kd_eq1"]
    assert old["kd_scheme"] == "sequence_only" and old["stages"] == {"mle": 0, "kd": 3} and old["teacher"] == "soft"
    assert eq1["kd_scheme"] == "eq1_sequence" and eq1["stages"] == {"mle": 1, "kd": 2} and eq1["steps"] == 3
    assert eq1["stage_warmup_steps"] == 1 and old["stage_warmup_steps"] == 2  # tiny: 2 warm-up steps, halved per stage
    lines = {line.split(" | ")[0][2:]: line for line in (run_dir["out"] / "reproduce_multi30k_tiny.md").read_text()
             .splitlines() if line.startswith("| hybrid")}
    assert "sequence-level KD only, not Eq. 1" in lines["hybrid_dot_kd"]
    assert "Eq. 1, two stages" in lines["hybrid_dot_kd_eq1"] and "not Eq. 1" not in lines["hybrid_dot_kd_eq1"]


def test_rerun_skips_finished_rows(run_dir, monkeypatch):
    def fail(row, ctx):
        raise AssertionError(f"row {row.name} was rerun")

    monkeypatch.setattr(reproduce, "run_row", fail)
    before = load_results(run_dir["out"])
    reproduce.main(run_dir["argv"])
    assert load_results(run_dir["out"])["rows"] == before["rows"]


def test_a_fresh_output_folder_adds_to_the_results_dir_table(run_dir, tmp_path):
    """A run whose output folder is new (a fresh machine) keeps the rows already stored in --results-dir."""
    results = tmp_path / "results"
    common = ["--task", "multi30k", "--preset", "tiny", "--data", str(run_dir["data"]), "--quiet",
              "--results-dir", str(results)]
    reproduce.main(common + ["--output-dir", str(tmp_path / "first"), "--rows", "soft"])
    reproduce.main(common + ["--output-dir", str(tmp_path / "second"), "--rows", "hc_sa"])
    rows = load_results(results)["rows"]
    assert set(rows) == {"soft", "hc_sa"}
    assert rows["soft"] == load_results(tmp_path / "first")["rows"]["soft"]
    assert "| soft |" in (results / "reproduce_multi30k_tiny.md").read_text()


def test_runs_that_share_the_results_dir_keep_each_others_rows(run_dir, tmp_path, monkeypatch):
    """Two runs side by side, each with its own output folder and the same --results-dir: the second finishes a row
    while the first trains; the first's write then keeps that row (read back from --results-dir, which its own output
    folder does not hold) instead of writing its older view over it."""
    results = tmp_path / "results"
    common = ["--task", "multi30k", "--preset", "tiny", "--data", str(run_dir["data"]), "--quiet",
              "--results-dir", str(results)]
    real_run_row = reproduce.run_row

    def while_another_run_finishes(row, ctx):
        monkeypatch.setattr(reproduce, "run_row", real_run_row)
        reproduce.main(common + ["--output-dir", str(tmp_path / "second"), "--rows", "hc_sa"])
        assert set(load_results(results)["rows"]) == {"hc_sa"}
        return real_run_row(row, ctx)

    monkeypatch.setattr(reproduce, "run_row", while_another_run_finishes)
    reproduce.main(common + ["--output-dir", str(tmp_path / "first"), "--rows", "soft"])
    assert set(load_results(results)["rows"]) == {"soft", "hc_sa"}
    assert load_results(results)["rows"]["hc_sa"] == load_results(tmp_path / "second")["rows"]["hc_sa"]
    assert "| hc_sa |" in (results / "reproduce_multi30k_tiny.md").read_text()


def test_a_row_rerun_elsewhere_is_not_put_back_by_a_stale_copy(run_dir, tmp_path):
    """A row rerun (--force) by a second process into the shared --results-dir, while the first process's output
    folder keeps a copy of its earlier version: the first process's next run keeps the rerun (the later ``finished``)
    in --results-dir and in its own table, rather than writing the stale copy back."""
    results = tmp_path / "results"
    common = ["--task", "multi30k", "--preset", "tiny", "--data", str(run_dir["data"]), "--quiet",
              "--results-dir", str(results)]
    first, second = tmp_path / "first", tmp_path / "second"
    reproduce.main(common + ["--output-dir", str(first), "--rows", "soft", "hc_sa"])
    stale = load_results(first)["rows"]["hc_sa"]
    reproduce.main(common + ["--output-dir", str(second), "--rows", "hc_sa", "--force"])
    rerun = load_results(second)["rows"]["hc_sa"]
    assert rerun["finished"] > stale["finished"] and load_results(results)["rows"]["hc_sa"] == rerun
    reproduce.main(common + ["--output-dir", str(first), "--rows", "soft", "--force"])
    assert load_results(results)["rows"]["hc_sa"] == rerun == load_results(first)["rows"]["hc_sa"]
    # rows stored before rows recorded `finished` count as the oldest: a held row is kept over them
    held = {"hc_sa": rerun}
    (tmp_path / "old").mkdir()
    old = dict(rerun, score=-1.0)
    del old["finished"]
    (tmp_path / "old" / "reproduce_multi30k_tiny.json").write_text(json.dumps({"rows": {"hc_sa": old}}))
    assert reproduce.add_stored_rows(held, [tmp_path / "old"], "reproduce_multi30k_tiny")["hc_sa"] == rerun
    assert reproduce.add_stored_rows({}, [tmp_path / "old", results], "reproduce_multi30k_tiny")["hc_sa"] == rerun


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="`rows`.*full_joint_rnn"):  # full-joint is a nouns-only row
        reproduce.main(["--task", "multi30k", "--preset", "tiny", "--rows", "full_joint_rnn",
                        "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--minutes"):
        reproduce.main(["--task", "nouns", "--preset", "tiny", "--minutes", "0", "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--learning-rate"):
        reproduce.main(["--task", "nouns", "--preset", "tiny", "--learning-rate", "-1", "--output-dir", str(tmp_path)])


class StopTraining(Exception):
    pass


@pytest.fixture
def training_kwargs(monkeypatch):
    """train_seq2seq replaced by a stub that records its keyword arguments and stops the run (StopTraining)."""
    import hf_hardattn.tools.training

    seen = {}

    def capture(*args, **kwargs):
        seen.update(kwargs)
        raise StopTraining

    monkeypatch.setattr(hf_hardattn.tools.training, "train_seq2seq", capture)
    return seen


def test_learning_rate_override_reaches_training_and_the_stored_command(run_dir, tmp_path, monkeypatch,
                                                                        training_kwargs):
    import hf_hardattn.tools.training

    seen = training_kwargs
    monkeypatch.setattr(hf_hardattn.tools.training, "cpu_has_bf16_matmul", lambda: True)
    argv = ["--task", "multi30k", "--preset", "tiny", "--data", str(run_dir["data"]), "--output-dir", str(tmp_path),
            "--quiet", "--rows", "soft", "--learning-rate", "3e-4", "--precision", "bf16"]
    with pytest.raises(StopTraining):
        reproduce.main(argv)
    assert seen["learning_rate"] == 3e-4 != recipes.PRESETS["multi30k"]["tiny"].learning_rate
    assert seen["bf16"] is True and recipes.PRESETS["multi30k"]["tiny"].bf16 is False
    args = argparse.ArgumentParser()
    reproduce.add_arguments(args)
    ctx = dict(args=args.parse_args(argv), task="multi30k", preset="tiny")
    command = reproduce.row_command(ctx, "soft")
    assert "--learning-rate 0.0003" in command and f"--output-dir {tmp_path}" in command
    assert "--precision bf16" in command


def test_bf16_preset_refused_without_bf16_matmul_unless_fp32(run_dir, tmp_path, monkeypatch, training_kwargs):
    """The Multi30k cpu preset trains in bf16: on a CPU without native bf16 GEMMs it stops before any work and names
    --precision fp32, which then trains in fp32."""
    import hf_hardattn.tools.training

    seen = training_kwargs
    monkeypatch.setattr(hf_hardattn.tools.training, "cpu_has_bf16_matmul", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--task", "multi30k", "--preset", "cpu", "--data", str(run_dir["data"]), "--output-dir", str(tmp_path),
            "--quiet", "--rows", "soft"]
    with pytest.raises(ValueError, match="--preset cpu.*--precision fp32"):
        reproduce.main(argv)
    assert not os.path.exists(tmp_path / "tokenizer")  # refused before training a tokenizer
    assert recipes.PRESETS["multi30k"]["cpu"].bf16 is True
    with pytest.raises(StopTraining):
        reproduce.main(argv + ["--precision", "fp32", "--max-steps", "1", "--eval-size", "2"])
    assert seen["bf16"] is False


def test_table_shows_the_rows_current_paper_direction():
    """A row run before its paper direction was corrected shows the corrected one; rows keep the ROWS order."""
    stored = dict(score=35.74, sentences_per_s=74.4, decoded_from="hard_self_cross", steps=2982, params=7577600,
                  paper="old paper", expect="stale direction")
    soft = dict(stored, decoded_from=None, train_minutes=35.0, score=36.05)
    table = reproduce.row_table("multi30k", "cpu", {"hard_decoded_soft": stored, "soft": soft})
    row = next(r for r in reproduce.ROWS if r.name == "hard_decoded_soft")
    lines = table.splitlines()
    assert lines[2].startswith("| soft | 36.05 |") and lines[3].startswith("| hard_decoded_soft | 35.74 |")
    assert lines[3].endswith(f"| {row.paper} | {row.expect} |  |") and "stale direction" not in table
    assert "(= hard_self_cross)" in lines[3] and "27.80" in row.expect


def test_table_puts_each_rows_difference_to_its_baseline_beside_the_direction():
    """The "ours vs" column: score minus the score of the row the paper compares with (soft unless the row says
    otherwise), blank for the baseline itself and when that row is not in the table."""
    def result(score):
        return dict(score=score, sentences_per_s=1.0, train_minutes=3.0, steps=10, params=100)

    results = {"soft": result(85.25), "recurrent_continuity": result(71.25), "hybrid_additive": result(75.60),
               "beam_joint_rnn_bahdanau_k6_decoded_k1": result(83.65), "hard_self_cross": result(80.05)}
    lines = {line.split(" | ")[0][2:]: line for line in reproduce.row_table("nouns", "cpu", results).splitlines()[2:]}
    assert lines["recurrent_continuity"].endswith("| about equal to soft | -14.00 vs soft |")
    assert lines["beam_joint_rnn_bahdanau_k6_decoded_k1"].endswith("| +8.05 vs hybrid_additive |")
    assert lines["soft"].endswith("| baseline | baseline |  |")
    assert lines["hybrid_additive"].endswith("| -9.65 vs soft |")
    only = reproduce.row_table("nouns", "cpu", {"recurrent_coverage": result(81.6)})
    assert only.splitlines()[2].endswith("| about equal to soft |  |")


def expected_model(name, recipe):
    """(model_type, config fields) that the row ``name`` stands for, from its paper's setting."""
    hard, gaussian = "hard_retrieval", "gaussian"
    kinds = dict(soft=("soft", "soft", "soft"), hard_cross=("soft", "soft", hard),
                 hard_self_cross=("soft", hard, hard), hard_enc_dec=(hard, hard, hard))
    if name == "marian":
        return "marian", dict(d_model=recipe.dims["d_model"], scale_embedding=True)
    if name in kinds:
        fields = dict(zip(("encoder_attention", "decoder_attention", "cross_attention"), kinds[name]))
        return ("soft_transformer" if name == "soft" else "hard_retrieval_transformer"), fields
    layers = recipe.dims["decoder_layers"]
    gaussians = {"hc_sa": "soft", "hc_all": gaussian, "sh_x": ["none"] * (layers - 1) + ["soft"]}
    if name in gaussians:
        return "gaussian_transformer", dict(encoder_attention=gaussian, decoder_attention=gaussian,
                                            cross_attention=gaussians[name])
    if name.startswith("recurrent_"):
        return "recurrent_transformer", dict(recurrent_variant=name[len("recurrent_"):], cross_attention="recurrent")
    paper_rnn = dict(rnn_decoder_style="luong", rnn_cell="lstm", rnn_attention="dot", label_smoothing=0.0)
    earlier_rnn = dict(rnn_decoder_style="bahdanau", rnn_cell="gru", rnn_attention="additive",
                       label_smoothing=recipe.label_smoothing)
    if name.startswith("hybrid_"):
        return "hybrid_transformer", dict(rnn_attention=name.split("_")[1], rnn_decoder_style="bahdanau",
                                          rnn_cell="gru", decoder_layers=1)
    if name == "rnn_luong_soft":
        return "hybrid_transformer", paper_rnn
    if name in ("beam_joint_rnn_k6", "full_joint_rnn"):
        return "beam_joint_rnn", dict(paper_rnn, joint_k=6, full_joint=name.startswith("full"))
    if name in ("beam_joint_rnn_bahdanau_k6", "full_joint_rnn_bahdanau"):
        return "beam_joint_rnn", dict(earlier_rnn, joint_k=6, full_joint=name.startswith("full"))
    if name == "beam_joint_k6":
        return "beam_joint_transformer", dict(joint_k=6, label_smoothing=0.0, joint_inference_k=None)
    raise AssertionError(f"no expectation for row {name}")


@pytest.mark.usefixtures("one_thread")  # (tests/conftest.py) tiny models: much faster on one thread
def test_every_row_builds_for_its_tasks():
    """Each row of each task builds, at the task's tiny preset, the model its name stands for (model type, attention
    kinds, decoder, K; the recipe's sizes and vocabulary), whose loss on a batch of the task's data is finite with a
    gradient for every trainable parameter; a decoded-differently row derives from its source row's model the
    decoding it names, with the same weights, leaving the source model as it was."""
    import datasets

    from hf_hardattn.tools.tokenization import train_tokenizer

    names = [row.name for row in reproduce.ROWS]
    assert len(names) == len(set(names))
    for task in recipes.TASKS:
        recipe = recipes.PRESETS[task]["tiny"]
        train = datasets.Dataset.from_dict({"source": EN, "target": DE})
        tokenizer = train_tokenizer(EN + DE, **recipe.tokenizer)
        ctx = dict(recipe=recipe, tokenizer=tokenizer, train=train)
        batch = tokenizer(EN[:3], text_target=DE[:3], padding=True, return_tensors="pt")
        batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
        rows = reproduce.rows_for(task)
        assert {row.name for row in rows} == set(names) - (set() if task == "nouns" else
                                                            {"full_joint_rnn", "full_joint_rnn_bahdanau"})
        built = {}
        for row in rows:
            assert (row.build is None) != (row.source is None), row.name
            if row.source is not None:
                continue
            torch.manual_seed(0)
            model = built[row.name] = row.build(ctx)
            model_type, fields = expected_model(row.name, recipe)
            config = model.config
            assert config.model_type == model_type, row.name
            assert {name: getattr(config, name) for name in fields} == fields, row.name
            assert config.vocab_size == len(tokenizer) and config.d_model == recipe.dims["d_model"], row.name
            if row.name == "hc_all":  # gamma: the training corpus' target/source length ratio, fitted here
                assert config.length_ratio is not None and config.length_ratio > 0
            loss = model.train()(**batch).loss
            loss.backward()
            assert torch.isfinite(loss), row.name
            assert all(p.grad is not None for p in model.parameters() if p.requires_grad), row.name
        for row in rows:
            if row.source is None:
                continue
            assert row.source in built and row.derive is not None, row.name
            source = built[row.source].eval()
            before = source.config.to_dict()
            derived = row.derive(source)
            assert source.config.to_dict() == before, row.name  # the source row's model is left as it was
            for (name, weight), (other, kept) in zip(derived.state_dict().items(), source.state_dict().items()):
                assert name == other and torch.equal(weight, kept), (row.name, name)
            config = derived.config
            if row.name == "soft_decoded_hard":
                assert (config.decoder_attention, config.cross_attention) == ("hard_retrieval", "hard_retrieval")
            elif row.name == "hard_decoded_soft":
                assert (config.decoder_attention, config.cross_attention) == ("soft", "soft")
            else:
                assert row.name.endswith("_decoded_k1") and config.joint_inference_k == 1, row.name
                assert source.config.joint_inference_k != 1


def test_cli_entry():
    from hf_hardattn_cli.command import build_parser

    args = build_parser().parse_args(["reproduce", "--task", "nouns", "--preset", "tiny", "--rows", "soft"])
    assert args.func is reproduce.run and args.task == "nouns" and args.rows == ["soft"]


def test_every_preset_exists_for_every_task():
    """--preset accepts PRESET_NAMES for every --task: each task has each of them (no KeyError after parsing)."""
    for task in recipes.TASKS:
        assert set(recipes.PRESETS[task]) == set(recipes.PRESET_NAMES), task
    small = recipes.PRESETS["multi30k"]["small"]
    assert (small.dims["d_model"], small.max_tokens, small.bf16, small.minutes) == (128, 1024, False, 20.0)


def test_kd_rows_ask_for_their_mle_stage_explicitly(monkeypatch, tmp_path):
    """train_two_stage runs the MLE stage by default (the hybrid paper's schedule): the hybrid_*_kd rows, sequence-level
    KD only with no MLE stage on purpose, pass mle=False, the hybrid_*_kd_eq1 rows half the budget as a dict; so a
    row's recorded stages ({"mle": 0} for the former) do not change with the default. (Fast: no training.)"""
    from types import SimpleNamespace

    from hf_hardattn.tools import distill

    calls = {}

    def trainer(steps):
        return SimpleNamespace(state=SimpleNamespace(global_step=steps, log_history=[]),
                               args=SimpleNamespace(warmup_steps=1))

    def two_stage(model, tokenizer, distilled, kd_scheme, mle=True, kd=None, **kwargs):
        calls[kd_scheme] = mle
        return (None if mle is False else trainer(mle["max_steps"])), trainer(kd["max_steps"])

    monkeypatch.setattr(distill, "train_two_stage", two_stage)
    recipe = recipes.PRESETS["multi30k"]["tiny"]
    ctx = dict(recipe=recipe, args=SimpleNamespace(seed=0, quiet=True), batch_size=2, tokenizer=None,
               out=str(tmp_path), kd_data="distilled")
    rows = {row.name: row for row in reproduce.ROWS}
    for attention in ("additive", "dot", "multihead"):
        old = reproduce.train_row(rows[f"hybrid_{attention}_kd"], ctx, None, None)
        assert calls["sequence_only"] is False and old["stages"] == {"mle": 0, "kd": recipe.max_steps}
        eq1 = reproduce.train_row(rows[f"hybrid_{attention}_kd_eq1"], ctx, None, None)
        assert isinstance(calls["eq1_sequence"], dict) and eq1["stages"]["mle"] == recipe.max_steps // 2
