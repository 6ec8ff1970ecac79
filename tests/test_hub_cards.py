"""Model cards fit for the Hub, against a mocked `HfApi` that records what one commit
would upload: a model trained with `hf-hardattn train --source-lang en --target-lang de` pushes a card whose YAML
huggingface_hub parses into both languages, the license, the datasets and a model-index with that run's BLEU / chrF
(sacrebleu signatures) as in results.json; no local path of the run reaches the card; the metrics table escapes the
signatures' `|`; the card's own snippet loads the tokenizer at once in a fresh process without the package; and
`Seq2SeqCardTrainer.push_to_hub()` uploads this package's card, not transformers' `generated_from_trainer` one, for
every model type (a Marian model keeps the Trainer's card), while transformers' own `Seq2SeqTrainer` is left as is."""

import json
import os
import re
import subprocess
import sys
import time

import huggingface_hub
import pytest
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results
from transformers import MarianConfig, MarianMTModel, Seq2SeqTrainer, Seq2SeqTrainingArguments

from common import randomize, tiny_kwargs, toy_tokenizer
from hf_hardattn.model_card import CARD_METADATA, RESULTS_FILE, render_model_card
from hf_hardattn.tools.trainer_card import Seq2SeqCardTrainer
from hf_hardattn.tools.training import Seq2SeqLengthTrainer
from hf_hardattn_cli.command import main
from test_pipelines_hub import MODELS, hub  # noqa: F401  (the recording HfApi fixture)
from test_train_cli import SIZES, data  # noqa: F401  (the en/de reversal task fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def table_rows(card_text):
    """The cells of every markdown table row (split on unescaped `|`)."""
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            for line in card_text.splitlines() if line.startswith("|")]


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):  # noqa: F811
    """`hf-hardattn train` en -> de with validation (best checkpoint) and test, a tokenizer trained by the run."""
    out = tmp_path_factory.mktemp("runs") / "run_hr"
    argv = ["train", "--train", str(data / "train"), "--validation", str(data / "valid"), "--test",
            str(data / "small"), "--source-lang", "en", "--target-lang", "de", "--dataset", "someone/reversal",
            "--model-type", "hard_retrieval_transformer", *SIZES, "--output-dir", str(out), "--quiet", "--threads",
            "1", "--warmup-steps", "2", "--max-steps", "4", "--eval-steps", "2", "--num-beams", "1",
            "--tokenizer-kind", "char", "--vocab-size", "40", "--batch-size", "32"]
    assert main(argv) == 0
    return out, json.loads((out / "results.json").read_text())


def test_trained_model_pushes_a_card_with_hub_metadata_from_its_run(trained, hub, monkeypatch, tmp_path):  # noqa: F811
    out, results = trained
    assert results["best_checkpoint"] and results["tokenizer"] == str(out / "tokenizer")  # the paths that must not leak
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert main(["publish", str(out / "model"), "me/rev-en-de", "--sentence", "a b c"]) == 0
    (commit,) = hub.commits
    text = commit["files"]["README.md"].decode()
    card = ModelCard(text)
    assert card.data.language == ["en", "de"] and card.data.license == "apache-2.0"
    assert card.data.datasets == ["someone/reversal"]
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "translation"
    assert {"hf_hardattn", "hard_retrieval_transformer"} <= set(card.data.tags)
    name, evals = model_index_to_eval_results(card.data.to_dict()["model-index"])
    assert name == "rev-en-de"
    got = {(e.dataset_split, e.metric_type): (e.metric_value, e.metric_config) for e in evals}
    expected = {(split, metric): (results[f"{split}_{metric}"], results[f"{metric}_signature"].split(" (beam")[0])
                for split in ("validation", "test") for metric in ("bleu", "chrf")}
    assert got == expected
    assert all(e.task_type == "translation" and e.dataset_type == "someone/reversal" for e in evals)
    assert "nrefs:1|" in results["bleu_signature"] and "|" in results["chrf_signature"]
    # no local path of the run: not the folders, not the tokenizer's, not the best checkpoint's
    for local in (str(out), str(out.parent), "run_hr/tokenizer", "checkpoint-", str(tmp_path.parent.parent)):
        assert local not in text, local
    assert "hf-hardattn train --train train --validation valid" in text  # the command, paths cut to their names
    # the snippets load the repo pushed to
    assert text.count('"me/rev-en-de"') == 3 and "PATH_OR_REPO" not in text
    # every table row has its two cells: the signatures' `|` are escaped
    rows = [row for row in table_rows(card.text) if row[0] in ("bleu_signature", "chrf_signature")]
    assert len(rows) == 2 and all(len(row) == 2 and "\\|" in row[1] for row in rows)
    assert all(len(row) == 2 for row in table_rows(card.text) if row[0] != "role")


def test_results_table_escapes_the_signature_pipe():
    model = MODELS["soft"]()
    signature = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.4.0"
    text = render_model_card(model, {"test_bleu": 12.3, "bleu_signature": signature})
    assert table_rows(text)[-1] == ["bleu_signature", signature.replace("|", "\\|")]


def test_card_metadata_builds_through_model_card_data():
    model = MODELS["soft"]()
    evals = [dict(task_type="translation", dataset_type="wmt14", dataset_name="WMT14", dataset_config="de-en",
                  dataset_split="test", metric_type="bleu", metric_value=27.3, metric_config="nrefs:1|tok:13a")]
    text = render_model_card(model, {CARD_METADATA: dict(language=["en", "de"], license="mit", eval_results=evals)})
    data = ModelCard(text).data
    assert data.language == ["en", "de"] and data.license == "mit"
    name, (result,) = model_index_to_eval_results(data.to_dict()["model-index"])
    assert (name, result.metric_value, result.metric_config, result.dataset_config) == (
        "soft_transformer", 27.3, "nrefs:1|tok:13a", "de-en")
    assert CARD_METADATA not in text
    with pytest.raises(ValueError, match="unknown field 'licence'"):
        render_model_card(model, metadata=dict(licence="mit"))


SNIPPET_HARNESS = """
import sys, time
sys.modules["hf_hardattn"] = None  # a user without the package: the folder's remote code only
"""


def test_card_snippet_loads_the_tokenizer_at_once_without_the_package(tmp_path):
    model = randomize(MODELS["hard_retrieval"]())
    folder = tmp_path / "model"
    model.save_pretrained(folder, tokenizer=toy_tokenizer())
    card = (folder / "README.md").read_text()
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0].replace("PATH_OR_REPO", str(folder))
    snippet = snippet.replace("A man is riding a bike.", "t5 t9 t13")
    lines = []
    for line in snippet.splitlines():  # time the tokenizer line
        if line.startswith("tokenizer = AutoTokenizer.from_pretrained("):
            line = f"started = time.time()\n{line}\nprint('TOKENIZER_SECONDS', time.time() - started)"
        lines.append(line)
    script = tmp_path / "snippet.py"
    script.write_text(SNIPPET_HARNESS + "\n".join(lines) + "\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="", HF_MODULES_CACHE=str(tmp_path / "modules"))
    workdir = tmp_path / "fresh"
    workdir.mkdir()
    log = tmp_path / "log.txt"
    with open(log, "w") as handle:  # stdin stays open: a y/N prompt would wait its 15 s
        proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=handle,
                                stderr=subprocess.STDOUT, env=env, cwd=workdir)
        try:
            proc.wait(timeout=240)
        finally:
            proc.kill()
            proc.stdin.close()
    output = log.read_text()
    assert proc.returncode == 0, output[-3000:]
    assert "[y/N]" not in output and "model of type ``" not in output, output[-3000:]
    seconds = float(output.split("TOKENIZER_SECONDS", 1)[1].split()[0])
    assert seconds < 5, (seconds, output[-2000:])


@pytest.fixture
def validated(hub, monkeypatch):  # noqa: F811
    """The recording HfApi, with `upload_folder`'s README.md check (a POST to the Hub's validate-yaml) done here:
    the YAML must parse as huggingface_hub's ModelCardData, a model-index into EvalResults; recorded in
    `hub.validated`. Uploads take `upload_folder`'s one-commit path (`create_commit`, recorded), not the streamed
    xet pipeline."""
    hub.validated = []

    def validate_yaml(self, content, *, repo_type=None, token=None):
        data = ModelCard(content).data
        if "model-index" in data.to_dict():
            model_index_to_eval_results(data.to_dict()["model-index"])
        hub.validated.append(content)

    monkeypatch.setattr(huggingface_hub.HfApi, "_validate_yaml", validate_yaml)
    # upload_folder's one-commit path (create_commit, recorded) rather than the streamed xet pipeline
    monkeypatch.setattr(huggingface_hub.hf_api, "is_xet_available", lambda: False)
    return hub


def trainer_for(model, output_dir, tokenizer, trainer_class=Seq2SeqCardTrainer):
    args = Seq2SeqTrainingArguments(output_dir=str(output_dir), hub_model_id="me/tiny", report_to="none",
                                    use_cpu=True, save_strategy="no")
    return trainer_class(model=model, args=args, processing_class=tokenizer)


@pytest.mark.parametrize("trainer_class", [Seq2SeqCardTrainer, Seq2SeqLengthTrainer])  # the second: train_seq2seq's
@pytest.mark.parametrize("name", sorted(set(MODELS) - {"marian"}))
def test_trainer_push_to_hub_keeps_our_card_and_its_metadata(name, trainer_class, validated, tmp_path):
    model, tokenizer = randomize(MODELS[name]()), toy_tokenizer()
    model.add_model_tags(["distilled"])
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    evals = [dict(task_type="translation", dataset_type="someone/data", dataset_name="someone/data",
                  metric_type="bleu", metric_value=1.5, metric_config="nrefs:1|tok:13a")]
    results = {"test_bleu": 1.5, "bleu_signature": "nrefs:1|tok:13a",
               CARD_METADATA: dict(language=["en", "de"], license="apache-2.0", eval_results=evals)}
    (output_dir / RESULTS_FILE).write_text(json.dumps(results))  # a trained folder's results
    trainer = trainer_for(model, output_dir, tokenizer, trainer_class)
    trainer.push_to_hub(language="fr", tags="mine", dataset_tags="someone/data")
    (commit,) = validated.commits
    text = commit["files"]["README.md"].decode()
    assert validated.validated == [text]
    assert "generated_from_trainer" not in text
    pushed = ModelCard(text)
    # our card, with the results table, the Trainer's sections (tests/test_trainer_card.py) and the repo in its snippets
    training = trainer.card_measurements()["training"]
    assert pushed.text == ModelCard(render_model_card(model, results, training=training, repo_id="me/tiny")).text
    assert "## Training procedure" in training and "PATH_OR_REPO" not in text
    assert pushed.data.language == "fr" and pushed.data.license == "apache-2.0"  # the Trainer's argument wins
    assert pushed.data.datasets == ["someone/data"]
    assert pushed.data.tags[:3] == ["hf_hardattn", model.config.model_type, "trust_remote_code"]
    assert {"mine", "distilled"} <= set(pushed.data.tags)
    model_name, (result,) = model_index_to_eval_results(pushed.data.to_dict()["model-index"])
    assert model_name == "tiny" and result.metric_config == "nrefs:1|tok:13a"
    assert {"model.safetensors", "config.json", "modeling_hardattn.py", "tokenizer.json"} <= set(commit["files"])


def test_trainer_push_to_hub_of_other_models_keeps_the_trainers_card(validated, tmp_path):
    model = MarianMTModel(MarianConfig(**tiny_kwargs()))
    trainer_for(model, tmp_path / "out", toy_tokenizer()).push_to_hub()
    (commit,) = validated.commits
    assert "generated_from_trainer" in commit["files"]["README.md"].decode()


def test_transformers_own_trainer_keeps_its_card_for_our_models_too(validated, tmp_path):
    """Only Seq2SeqCardTrainer defers to the model: saving one of ours (as push_to_hub does first) leaves transformers'
    Seq2SeqTrainer writing its own card."""
    model = randomize(MODELS["soft"]())
    trainer_for(model, tmp_path / "out", toy_tokenizer(), trainer_class=Seq2SeqTrainer).push_to_hub()
    (commit,) = validated.commits
    text = commit["files"]["README.md"].decode()
    assert "generated_from_trainer" in text and ModelCard(text).text != ModelCard(render_model_card(model)).text


def test_card_trainer_binds_positional_arguments_and_refuses_extra_ones(tmp_path):
    model, tokenizer = randomize(MODELS["soft"]()), toy_tokenizer()
    trainer = trainer_for(model, tmp_path / "out", tokenizer)
    (tmp_path / "out").mkdir(exist_ok=True)
    trainer.create_model_card("fr", "mit", ["mine"])
    card = ModelCard((tmp_path / "out" / "README.md").read_text())
    assert card.data.language == "fr" and card.data.license == "mit" and "mine" in card.data.tags
    with pytest.raises(TypeError, match=r"at most 9 positional arguments .*got 10"):
        trainer.create_model_card(*[None] * 10)


def test_card_names_hub_datasets_and_cuts_local_paths(tmp_path):
    from hf_hardattn.tools.train_cli import hub_dataset, public_text

    assert hub_dataset("hf:wmt14:de-en:test") == ("wmt14", "de-en", "test")
    assert hub_dataset("hf:someone/data:train") == ("someone/data", None, "train")
    (tmp_path / "saved").mkdir()
    assert hub_dataset(f"hf:{tmp_path / 'saved'}:train") is None  # a local save_to_disk folder names no Hub dataset
    assert hub_dataset(str(tmp_path / "train")) is None
    command = (f"hf-hardattn train --train {tmp_path}/data/train --tokenizer={tmp_path / 'saved'} "
               f"--validation hf:{tmp_path / 'saved'}:validation --test hf:wmt14:de-en:test --source-lang en")
    assert public_text(command) == ("hf-hardattn train --train train --tokenizer=saved --validation hf:saved:validation "
                                    "--test hf:wmt14:de-en:test --source-lang en")
