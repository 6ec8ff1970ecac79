"""benchmarks/pretrained_hard.py: a tiny MarianMTModel trained by the reproduce recipe, converted to soft (translating
exactly as the source), hard retrieval and hc-sa, fine-tuned and scored at several step counts, timed, recorded. And
the README's quick start (pretrained Marian -> fine-tuned hard retrieval -> Hub), run as written on a tiny local
MarianMTModel with the uploads faked."""

import json
import os
import re
import shlex

import pytest
import sacrebleu
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, MarianConfig, MarianMTModel

import hf_hardattn  # noqa: F401
from hf_hardattn.tools import reproduce
from hf_hardattn.tools.tokenization import train_tokenizer
from hf_hardattn.tools.training import translate
from hf_hardattn_cli.command import main as cli_main

from common import benchmark_script
from test_pipelines_hub import hub  # noqa: F401  (fixture: HfApi uploads recorded, nothing leaves)
from test_reproduce import DE, EN, write_toy_multi30k

README = os.path.join(os.path.dirname(__file__), "..", "docs", "usage.md")  # (the full guide holds the quick start)


def load_script():
    return benchmark_script("pretrained_hard")


def script_argv(root, data, out, results, *extra):
    return ["--source", str(root / "m" / "models" / "marian"), "--preset", "tiny", "--data", str(data),
            "--warmup-steps", "1", "--learning-rate", "1e-3", "--output-dir", str(out), "--results", str(results),
            "--threads", "1", "--quiet", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained_hard")
    data = write_toy_multi30k(root)
    threads = torch.get_num_threads()  # one thread: tiny ops on two threads crawl when the cores are shared
    torch.manual_seed(0)
    reproduce.main(["--task", "multi30k", "--preset", "tiny", "--data", str(data), "--output-dir", str(root / "m"),
                    "--rows", "marian", "--threads", "1", "--quiet"])
    script = load_script()
    argv = script_argv(root, data, root / "out", root / "results" / "run", "--steps", "2", "1", "--speed-rounds", "1")
    rows = script.main(argv)
    with open(root / "results" / "run.json") as handle:
        stored = json.load(handle)
    yield dict(root=root, data=data, script=script, argv=argv, rows=rows, stored=stored)
    torch.set_num_threads(threads)


def test_every_row_is_scored_and_recorded(run):
    stored = run["stored"]
    names = ["source", "soft", "hard", "hard_ft1", "hard_ft2", "soft_ft1", "soft_ft2", "hc_sa", "hc_sa_ft1",
             "hc_sa_ft2"]
    assert list(stored["rows"]) == names
    assert stored["command"].startswith("python benchmarks/pretrained_hard.py --source ")
    assert stored["machine"]["threads"] == torch.get_num_threads()
    assert stored["fine_tuning"] == dict(learning_rate=1e-3, warmup_steps=1, schedule="constant_with_warmup",
                                         batch_size=stored["fine_tuning"]["batch_size"], bf16=False,
                                         label_smoothing=0.1, seed=0, steps=[1, 2])
    assert set(stored["recovered_within_half_bleu_at"]) == {"hard", "hc_sa"}
    for name, row in stored["rows"].items():
        assert row["metric"] == "BLEU" and row["examples"] == 8 and "hypotheses" not in row
        assert row["steps"] == (int(name.split("_ft")[1]) if "_ft" in name else 0)
    assert stored["rows"]["source"]["model_type"] == "marian"
    assert stored["rows"]["hard"]["model_type"] == "hard_retrieval_transformer"
    assert stored["rows"]["hc_sa_ft2"]["model_type"] == "gaussian_transformer"
    assert any("q_proj" in item for item in stored["rows"]["hc_sa"]["dropped"])  # Gaussian heads drop query/key
    assert stored["rows"]["hard"]["dropped"] == [] and stored["rows"]["hard"]["initialised"] == []
    speed = stored["speed"]["models"]
    assert set(speed) == {"source", "soft", "hard", "hc_sa", "hard_ft2", "hc_sa_ft2"}
    assert all(s["test_set_sentences_per_s"] > 0 and s["forced_sentences_per_s"] > 0 for s in speed.values())
    forced_only = run["script"].main(script_argv(
        run["root"], run["data"], run["root"] / "out_forced", run["root"] / "results" / "forced", "--steps", "1",
        "--targets", "hard", "--speed-rounds", "1", "--speed-forced-only"))
    with open(run["root"] / "results" / "forced.json") as handle:
        forced = json.load(handle)["speed"]["models"]
    assert set(forced) == {"source", "soft", "hard", "hard_ft1"} and list(forced_only) == ["source", "soft", "hard",
                                                                                          "hard_ft1"]
    assert all(s["test_set_sentences_per_s"] is None and s["test_set_rounds"] == [] for s in forced.values())
    assert all(s["forced_sentences_per_s"] > 0 for s in forced.values())
    table = (run["root"] / "results" / "run.md").read_text()
    assert "| hard_ft2 | hard_retrieval_transformer | 2 |" in table and stored["command"] in table
    assert "| soft_ft2 | soft_transformer | 2 |" in table


def test_soft_conversion_translates_as_the_source(run):
    """The soft row is an exact conversion (nothing initialised or dropped), and the source and its conversion
    translate the test set alike (as the run decodes: beam 4, batches of 8) in float64, where the two code paths agree
    to ~1e-12 and no rounding can decide a near tie. The run's own fp32 comparison (`identical_to_source`) is what
    its recorded hypotheses say."""
    soft, source = run["rows"]["soft"], run["rows"]["source"]
    assert soft["exact_conversion"]
    assert soft["identical_to_source"] == (soft["hypotheses"] == source["hypotheses"])
    assert not soft["identical_to_source"] or soft["score"] == source["score"]
    folder = run["root"] / "m" / "models" / "marian"
    marian = AutoModelForSeq2SeqLM.from_pretrained(folder).eval().double()
    converted = hf_hardattn.convert(marian, "soft_transformer")
    assert next(converted.parameters()).dtype == torch.float64
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = translate(marian, tokenizer, EN, num_beams=4, batch_size=8, max_length=32)
    tokens = {token for line in tokenizer(expected)["input_ids"] for token in line}
    assert len(tokens) >= 4, f"degenerate output, the check could not fail: {expected}"
    assert translate(converted, tokenizer, EN, num_beams=4, batch_size=8, max_length=32) == expected


def test_scores_match_the_saved_fine_tuned_models(run):
    """The score at the last N is that of the saved model, loaded anew and decoded in fp32; the untrained hard row
    is the source's weights decoded hard."""
    folder = run["root"] / "out" / "models" / "hard_ft2"
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hypotheses = translate(model, tokenizer, EN, num_beams=4, batch_size=8, max_length=32)
    assert hypotheses == run["rows"]["hard_ft2"]["hypotheses"]
    assert run["stored"]["rows"]["hard_ft2"]["score"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [DE]).score,
                                                                       abs=0.01)
    soft = hf_hardattn.convert(str(run["root"] / "m" / "models" / "marian"), "soft_transformer").eval()
    hard = soft.with_attention(decoder_attention="hard_retrieval", cross_attention="hard_retrieval")
    assert translate(hard, tokenizer, EN, num_beams=4, batch_size=8, max_length=32) == run["rows"]["hard"]["hypotheses"]


def test_the_score_at_n_does_not_depend_on_the_other_n(run, tmp_path):
    """Scoring at step 1 leaves the training's random state alone: a run asked for step 2 only ends with the same
    weights."""
    run["script"].main(script_argv(run["root"], run["data"], tmp_path / "out", tmp_path / "run", "--steps", "2",
                                   "--targets", "hard", "--speed-rounds", "0"))
    first = load_file(run["root"] / "out" / "models" / "hard_ft2" / "model.safetensors")
    second = load_file(tmp_path / "out" / "models" / "hard_ft2" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("extra, message", [
    (["--steps", "0"], "--steps must be positive"),
    (["--learning-rate", "0"], "--learning-rate must be > 0"),
    (["--speed-models", "soft", "nope"], "--speed-models ['nope']"),
])
def test_bad_arguments_name_the_flag(run, capsys, extra, message):
    with pytest.raises(SystemExit):
        run["script"].parse_args(run["argv"] + extra)
    assert message in capsys.readouterr().err


def test_a_source_without_a_model_is_refused(run, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run["script"].parse_args(["--source", str(tmp_path)])
    error = capsys.readouterr().err
    assert "--source" in error and "no config.json" in error


# ---------------------------------------------------------------------------------------------------------------
# README quick start
# ---------------------------------------------------------------------------------------------------------------
def quick_start_blocks():
    """The fenced code blocks of the quick start in docs/usage.md, as (language, code)."""
    with open(README, encoding="utf-8") as handle:
        text = handle.read()
    section = text.split("### Quick start: from a pretrained Marian / BART checkpoint")[1].split("\n### ")[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def test_readme_quick_start_runs_as_written(hub, tmp_path, monkeypatch):  # noqa: F811
    """Every command of the quick start, in order, in a folder holding a tiny MarianMTModel + tokenizer
    (``opus-mt-en-de``) and ``data/train.{en,de}``; only ``max_steps=300`` becomes 2. Route 1 ends with a fine-tuned
    hard_retrieval_transformer (changed by training; its upload: weights, remote code, tokenizer), route 2 with a
    fine-tuned MarianMTModel that decodes with hard retrieval again once reloaded with the attention implementation."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.en").write_text("\n".join(EN * 4) + "\n")
    (tmp_path / "data" / "train.de").write_text("\n".join(DE * 4) + "\n")
    tokenizer = train_tokenizer(["data/train.en", "data/train.de"], vocab_size=260)
    torch.manual_seed(0)
    source = MarianMTModel(MarianConfig(
        vocab_size=len(tokenizer), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id, activation_function="swish", scale_embedding=True))
    source.save_pretrained("opus-mt-en-de")
    tokenizer.save_pretrained("opus-mt-en-de")

    blocks = quick_start_blocks()
    assert [language for language, _ in blocks] == ["bash", "python", "python"]
    threads = torch.get_num_threads()
    try:
        for language, code in blocks:
            if language == "bash":
                for line in code.strip().splitlines():
                    argv = shlex.split(line)
                    assert argv[0] == "hf-hardattn"
                    assert cli_main(argv[1:]) == 0
            else:
                assert code.count("max_steps=300") == 1
                exec(compile(code.replace("max_steps=300", "max_steps=2"), "README.md quick start", "exec"), {})
    finally:
        torch.set_num_threads(threads)

    converted = load_file(tmp_path / "opus-hard" / "model.safetensors")
    tuned = AutoModelForSeq2SeqLM.from_pretrained("opus-hard-ft")
    assert tuned.config.model_type == "hard_retrieval_transformer"
    assert (tuned.config.decoder_attention, tuned.config.cross_attention) == ("hard_retrieval", "hard_retrieval")
    assert any(not torch.equal(tensor, tuned.state_dict()[key]) for key, tensor in converted.items())
    route1, model2, tokenizer2 = hub.commits
    assert {"model.safetensors", "modeling_hardattn.py", "tokenizer.json", "README.md"} <= set(route1["files"])
    assert route1["repo_id"] == model2["repo_id"] == tokenizer2["repo_id"] == "you/opus-mt-en-de-hard"
    assert "model.safetensors" in model2["files"] and "tokenizer.json" in tokenizer2["files"]

    # route 2: the saved MarianMTModel, reloaded with the attention implementation, decodes as the same weights
    # converted to hard_retrieval_transformer (and not as they decode soft); in float64, where the two code paths
    # agree to ~1e-12, so that no last-bit difference can flip a hard-retrieval argmax between them
    stock = MarianMTModel.from_pretrained("opus-mt-hard-ft", attn_implementation="hard_retrieval").eval().double()
    hard = hf_hardattn.convert("opus-mt-hard-ft", "hard_retrieval_transformer").eval().double()
    soft = MarianMTModel.from_pretrained("opus-mt-hard-ft").eval().double()
    batch = tokenizer(EN[:4], return_tensors="pt", padding=True)
    labels = tokenizer(text_target=DE[:4], return_tensors="pt", padding=True)["input_ids"]
    with torch.no_grad():
        logits = {name: model(**batch, labels=labels).logits for name, model in
                  dict(stock=stock, hard=hard, soft=soft).items()}
    assert logits["stock"].dtype == torch.float64
    torch.testing.assert_close(logits["stock"], logits["hard"], atol=1e-10, rtol=0)
    assert not torch.allclose(logits["stock"], logits["soft"], atol=1e-3)


def test_recovery_is_the_first_step_count_within_half_a_bleu_of_soft():
    """By hand: soft 30.0; the hard rows at 50, 100, 200, 300 steps score 29.0, 29.49, 29.5, 31.0 -> 200 (29.5 is
    within 0.5, 29.49 is not); rows of other targets do not count; none within 0.5 -> None."""
    script = load_script()
    rows = {"soft": dict(steps=0, score=30.0), "hard": dict(steps=0, score=20.0),
            "hard_ft300": dict(steps=300, score=31.0), "hard_ft50": dict(steps=50, score=29.0),
            "hard_ft200": dict(steps=200, score=29.5), "hard_ft100": dict(steps=100, score=29.49),
            "soft_ft50": dict(steps=50, score=35.0), "hc_sa_ft50": dict(steps=50, score=10.0)}
    assert script.recovery(rows, "hard", 30.0) == 200
    assert script.recovery(rows, "hc_sa", 30.0) is None
