"""examples/: every script run end to end on tiny local data, offline. A tiny random MarianMTModel and a tokenizer
trained on the toy sentences stand in for Helsinki-NLP/opus-mt-en-de. The scripts run as a user runs them, each in
its own process (those that do not depend on each other at the same time, one torch thread each); publishing runs
in this process with the Hub calls recorded (nothing leaves the machine). Each test asserts what its script is for:
the fine-tuned model's loss went down, the pipeline gives generate()'s text, the saved folders load with the Auto
classes, the push carried the files of a local save. Where a check needs a fit that is not degenerate (distinct
translations to compare, BLEUs that are not 0 against 0), the fixture reruns that script with --seed 1, then 2, until
one fit meets the stated criterion (first_fit), instead of relying on how one fit rounds."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import sacrebleu
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, MarianConfig, MarianMTModel

import hf_hardattn
from hf_hardattn.gaussian import length_ratio
from hf_hardattn.tools.tokenization import train_tokenizer
from hf_hardattn.tools.training import translate

from test_pipelines_hub import hub  # noqa: F401  (fixture: HfApi uploads recorded, nothing leaves)
from test_reproduce import DE, EN

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TRAIN_EN, TRAIN_DE = EN * 6, DE * 6  # 48 pairs
pytestmark = pytest.mark.usefixtures("one_thread")


def start(script, argv, cwd):
    """``python examples/SCRIPT.py ARGV`` in ``cwd``, offline, one torch thread, this checkout first on the path."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    log = open(cwd / f"{script}.log", "w")
    process = subprocess.Popen([sys.executable, str(EXAMPLES / f"{script}.py"), *map(str, argv)], cwd=cwd, env=env,
                               stdout=log, stderr=subprocess.STDOUT)
    process.log_path = cwd / f"{script}.log"
    return process


def finish(process):
    process.wait(timeout=600)
    return process.returncode, process.log_path.read_text()


def first_fit(script, argv, root, output, measure, holds, process=None):
    """Runs ``examples/SCRIPT.py ARGV --seed S --output-dir FOLDER`` for S = 0, 1, 2 (FOLDER: OUTPUT, then
    OUTPUT-seed1, OUTPUT-seed2) until ``holds(measure(root / FOLDER))``; ``process``: the seed-0 run, already
    started. Returns ``(exit code, log)`` of the last run, its folder and ``[(seed, measured), ...]`` of the seeds
    tried (a failing run stops the search: the test reports its log)."""
    tried = []
    for seed in (0, 1, 2):
        folder = output if seed == 0 else f"{output}-seed{seed}"
        if process is None or seed > 0:
            process = start(script, [*argv, "--seed", seed, "--output-dir", folder], root)
        result = finish(process)
        if result[0] != 0:
            break
        tried.append((seed, measure(root / folder)))
        if holds(tried[-1][1]):
            break
    return result, folder, tried


def beam2_translations(folder):
    """generate()'s beam-2 translations of EN in the batches examples/translate.py makes (4 a batch, right-padded)."""
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = []
    for batch in (EN[:4], EN[4:]):
        with torch.no_grad():
            ids = model.generate(**tokenizer(batch, padding=True, return_tensors="pt"), num_beams=2, max_new_tokens=12)
        texts += tokenizer.batch_decode(ids, skip_special_tokens=True)
    return texts


def distinct(texts):
    return len({text.strip() for text in texts})


MIN_DISTINCT = 3  # translate's batches vs generate() compare something only if the outputs differ between sources


def row_bleus(folder):
    return [row["bleu"] for row in json.loads((folder / "results.json").read_text())["results"].values()]


def bleus_discriminate(bleus):
    """The rows' BLEUs can only tell a wrong scoring from a right one if each is strictly between 0 and 100 (not
    empty or garbage output, not a memorised test set) and the three differ (a row scored on another row's model)."""
    return all(0 < b < 100 for b in bleus) and len(set(bleus)) == len(bleus)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    data = root / "data"
    data.mkdir()
    for split, (en, de) in dict(train=(TRAIN_EN, TRAIN_DE), test=(EN, DE)).items():
        (data / f"{split}.en").write_text("\n".join(en) + "\n")
        (data / f"{split}.de").write_text("\n".join(de) + "\n")
    tokenizer = train_tokenizer([str(data / "train.en"), str(data / "train.de")], vocab_size=300)
    torch.manual_seed(0)
    marian = MarianMTModel(MarianConfig(  # opus-mt's settings (swish, scaled embeddings, decoding starts with pad)
        vocab_size=len(tokenizer), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id, activation_function="swish", scale_embedding=True))
    marian.save_pretrained(root / "opus-mt-tiny")
    tokenizer.save_pretrained(root / "opus-mt-tiny")
    (root / "sentences.en").write_text("\n".join(EN) + "\n")

    finetune = start("finetune_hard_retrieval", [
        "--model-name-or-path", "opus-mt-tiny", "--train-file", "data/train", "--max-steps", 30, "--batch-size", 8,
        "--learning-rate", 3e-3, "--warmup-steps", 1, "--output-dir", "hard-ft"], root)
    scratch_argv = [
        "--model-type", "gaussian_transformer", "--set", "cross_attention=gaussian", "--train", "data/train",
        "--validation", "data/test", "--vocab-size", 300, "--d-model", 32, "--layers", 1, "--heads", 4,
        "--ffn-dim", 64, "--max-steps", 40, "--batch-size", 8, "--learning-rate", 3e-3, "--warmup-steps", 5]
    scratch = start("train_from_scratch", [*scratch_argv, "--seed", 0, "--output-dir", "scratch"], root)
    # 60 steps at up to 1e-2 (warm-up over all of them) and 10 KD steps: the 48 pairs are partly learnt, so each row's
    # BLEU on the 8 test pairs (among them) lies inside (0, 100) and the rows differ (bleus_discriminate)
    distill_argv = [
        "--data", "data", "--test-split", "test", "--size", "tiny", "--max-steps", 60, "--learning-rate", 1e-2,
        "--kd-steps", 10, "--kd-learning-rate", 3e-3, "--test-examples", 8, "--batch-size", 8, "--kd-beams", 2,
        "--speed-repeats", 1]
    distill = start("distill_hybrid", [*distill_argv, "--seed", 0, "--output-dir", "distill"], root)
    results = dict(root=root)
    results["scratch"], results["scratch_folder"], results["scratch_seeds"] = first_fit(
        "train_from_scratch", scratch_argv, root, "scratch", lambda folder: distinct(beam2_translations(folder)),
        lambda count: count >= MIN_DISTINCT, scratch)
    translate = None
    if results["scratch"][0] == 0:  # inference on the model trained from scratch (source-dependent outputs)
        translate = start("translate", [results["scratch_folder"], "--input", "sentences.en", "--output", "hyp.de",
                                        "--num-beams", 2, "--max-new-tokens", 12, "--batch-size", 4], root)
    results["distill"], results["distill_folder"], results["distill_seeds"] = first_fit(
        "distill_hybrid", distill_argv, root, "distill", row_bleus, bleus_discriminate, distill)
    results.update(finetune=finish(finetune),
                   translate=finish(translate) if translate else (None, "not run: training from scratch failed"))
    return results


def succeeded(runs, name):
    code, log = runs[name]
    assert code == 0, f"examples/{name} failed (exit {code}):\n{log[-3000:]}"
    return runs["root"]


def bleu_of(model, tokenizer):
    """sacrebleu's corpus BLEU of the model's beam-4 translations of the test sentences (what the scripts report)."""
    return sacrebleu.corpus_bleu(translate(model.eval(), tokenizer, EN, num_beams=4), [DE]).score


def loss_on(model, tokenizer, sources, targets):
    """The model's loss (eval mode: hard retrieval takes the argmax) on the pairs, as one padded batch."""
    batch = tokenizer(sources, text_target=targets, padding=True, return_tensors="pt")
    batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
    with torch.no_grad():
        return model.eval()(**batch).loss.item()


def test_finetune_converts_marian_to_hard_retrieval_and_lowers_its_loss(runs):
    root = succeeded(runs, "finetune")
    tuned = AutoModelForSeq2SeqLM.from_pretrained(root / "hard-ft")
    tokenizer = AutoTokenizer.from_pretrained(root / "hard-ft")
    assert tuned.config.model_type == "hard_retrieval_transformer"
    assert (tuned.config.decoder_attention, tuned.config.cross_attention) == ("hard_retrieval", "hard_retrieval")
    converted = hf_hardattn.convert(str(root / "opus-mt-tiny"), "hard_retrieval_transformer")
    before, after = (loss_on(m, tokenizer, EN, DE) for m in (converted, tuned))
    assert after < before - 0.5, f"loss on the training data {before:.3f} -> {after:.3f}"
    metrics = json.loads((root / "hard-ft" / "all_results.json").read_text())
    assert metrics["after_loss"] < metrics["before_loss"] and metrics["train_loss"] > 0
    assert {"README.md", "modeling_hardattn.py", "tokenizer.json", "model.safetensors"} <= set(
        os.listdir(root / "hard-ft"))


def test_translate_gives_what_generate_gives(runs):
    """The pipeline's translations, written one a line, are generate()'s on the same batches of 4 (right-padded)."""
    root = succeeded(runs, "translate")
    expected = beam2_translations(root / runs["scratch_folder"])
    assert distinct(expected) >= MIN_DISTINCT, (
        f"no fit of train_from_scratch gives {MIN_DISTINCT} distinct beam-2 translations of the 8 sentences, so the "
        f"check could not fail; (seed, distinct translations) tried: {runs['scratch_seeds']}; last: {expected}")
    assert (root / "hyp.de").read_text(encoding="utf-8") == "".join(text + "\n" for text in expected)


def test_train_from_scratch_trains_a_tokenizer_and_a_model_that_load_with_auto_classes(runs):
    folder = succeeded(runs, "scratch") / runs["scratch_folder"]
    results = json.loads((folder / "results.json").read_text())
    assert results["steps"] == 40 and results["last_loss"] < results["first_loss"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder)
    assert results["bleu"] == pytest.approx(bleu_of(model, tokenizer), abs=0.01)  # the saved model's, on --validation
    assert isinstance(model, hf_hardattn.GaussianForConditionalGeneration)
    assert model.config.cross_attention == "gaussian" and model.config.d_model == 32  # --set and the size flags
    assert model.config.vocab_size == len(tokenizer) == results["vocab_size"]
    assert tokenizer.decode(tokenizer(EN[0])["input_ids"], skip_special_tokens=True) == EN[0]
    data = datasets.Dataset.from_dict({"source": TRAIN_EN, "target": TRAIN_DE})
    assert model.config.length_ratio == pytest.approx(length_ratio(data, tokenizer))  # hc-all's gamma, fitted
    torch.manual_seed(0)
    untrained = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(folder))
    before, after = (loss_on(m, tokenizer, EN, DE) for m in (untrained, model))
    assert after < before - 0.5, f"loss on the training data {before:.3f} (new model) -> {after:.3f} (trained)"


def test_distill_hybrid_runs_every_stage_on_given_data(runs):
    root = succeeded(runs, "distill") / runs["distill_folder"]
    summary = json.loads((root / "results.json").read_text())
    assert list(summary["results"]) == ["teacher (soft Transformer)", "hybrid (MLE)", "hybrid + KD (eq1_sequence)"]
    # each row's speed is 8 test sentences over one timed generate() (--speed-repeats 1): the three timed runs lie
    # inside the whole run, whose wall time is written to 0.1 min (a speed off by a factor, e.g. s/sentence, fails)
    assert all(row["sentences_per_s"] > 0 for row in summary["results"].values())
    assert sum(8 / row["sentences_per_s"] for row in summary["results"].values()) <= 60 * summary["minutes"] + 3
    assert summary["stage2"]["eq1_sequence"]["steps"] == 10
    distilled = datasets.load_from_disk(str(root / "kd_data" / "dataset"))
    assert sorted(distilled["source"]) == sorted(TRAIN_EN) and sorted(distilled["reference"]) == sorted(TRAIN_DE)
    teacher = AutoModelForSeq2SeqLM.from_pretrained(root / "teacher")
    mle, kd = (AutoModelForSeq2SeqLM.from_pretrained(root / name) for name in ("hybrid_mle", "hybrid_kd_eq1_sequence"))
    assert teacher.config.model_type == "soft_transformer"
    assert mle.config.model_type == kd.config.model_type == "hybrid_transformer"
    assert any(not torch.equal(a, b) for a, b in zip(mle.state_dict().values(), kd.state_dict().values()))
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    bleus = [row["bleu"] for row in summary["results"].values()]
    assert bleus_discriminate(bleus), (
        "no fit of distill_hybrid gives three different BLEUs strictly between 0 and 100, so a wrongly scored row "
        f"could match its model's; (seed, rows' BLEU) tried: {runs['distill_seeds']}")
    for name, model in zip(summary["results"], (teacher, mle, kd)):  # each row's BLEU is its saved model's
        assert summary["results"][name]["bleu"] == pytest.approx(bleu_of(model, tokenizer), abs=0.01), name


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_publish_dry_run_then_push_one_commit_of_those_files(runs, hub, monkeypatch, tmp_path, capsys):  # noqa: F811
    folder = succeeded(runs, "finetune") / "hard-ft"
    publish = load_script("publish")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit, match="HF_HUB_OFFLINE is set"):
        publish.main([str(folder), "--repo-id", "you/tiny-hard"])
    files = publish.main([str(folder), "--repo-id", "you/tiny-hard", "--dry-run", "--dry-run-dir", str(tmp_path)])
    assert "nothing pushed" in capsys.readouterr().out and hub.repos == [] and hub.commits == []
    assert {"model.safetensors", "config.json", "modeling_hardattn.py", "tokenizer.json", "README.md"} <= set(files)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    publish.main([str(folder), "--repo-id", "you/tiny-hard", "--private", "--commit-message", "v1"])
    assert [(repo["repo_id"], repo["private"]) for repo in hub.repos] == [("you/tiny-hard", True)]
    (commit,) = hub.commits
    assert commit["commit_message"] == "v1" and sorted(commit["files"]) == files
    assert commit["files"]["README.md"] == (tmp_path / "README.md").read_bytes()
    assert commit["files"]["tokenizer.json"] == (folder / "tokenizer.json").read_bytes()
    pushed, saved = load_file(tmp_path / "model.safetensors"), load_file(folder / "model.safetensors")
    assert pushed.keys() == saved.keys() and all(torch.equal(pushed[k], saved[k]) for k in saved)
    assert commit["files"]["model.safetensors"] == (tmp_path / "model.safetensors").read_bytes()
