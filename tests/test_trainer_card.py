"""`Seq2SeqCardTrainer.push_to_hub()` after training: the pushed card (a mocked `HfApi` that records the commit) is
this package's card plus what the Trainer measured, checked against independent references: its model-index (parsed
by huggingface_hub's `model_index_to_eval_results`) holds the Trainer's evaluation of the checkpoint it loaded at the
end, as read from `trainer.state.log_history`; its training-results table equals the evaluations of `log_history`; its
hyperparameters equal the `TrainingArguments`; its framework versions are the installed ones; every section and YAML
key transformers writes for a stock `MarianMTModel` through the same Trainer is there; the snippets load the repo
pushed to. Data that is not on the Hub gets a model-index dataset type that no Hub dataset id can be."""

import json
import re

import pytest
import torch
import transformers
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

from common import randomize, toy_tokenizer
from hf_hardattn.model_card import CARD_METADATA, LOCAL_DATASET, RESULTS_FILE, render_model_card
from hf_hardattn.tools.trainer_card import CARD_PARAMETERS, EVALUATION_SET, Seq2SeqCardTrainer
from test_hub_cards import validated  # noqa: F401  (the recording HfApi that checks the card's YAML)
from test_pipelines_hub import MODELS, hub  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

BLEUS = [3.0, 1.0]  # the evaluations' BLEU at steps 2 and 4: the best (loaded at the end) is step 2's
REPO = "me/tiny"


def train_and_push(model, output_dir, **push):
    """4 steps, evaluated (generate) at steps 2 and 4 with the BLEUs of ``BLEUS``, the best checkpoint loaded at the
    end; then ``push_to_hub(**push)``. Returns the trainer."""
    tokenizer = toy_tokenizer()
    data = [dict(input_ids=[5 + i, 9, 13, 2], labels=[13, 9, 5 + i, 2]) for i in range(16)]
    bleus = iter(BLEUS)
    args = Seq2SeqTrainingArguments(
        output_dir=str(output_dir), hub_model_id=REPO, report_to="none", use_cpu=True, max_steps=4, logging_steps=1,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
        metric_for_best_model="bleu", predict_with_generate=True, generation_max_length=8,
        per_device_train_batch_size=4, per_device_eval_batch_size=2, learning_rate=2e-3, seed=3, warmup_steps=1)
    trainer = Seq2SeqCardTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=data,
                                 eval_dataset=data[:4], data_collator=DataCollatorForSeq2Seq(tokenizer, model),
                                 compute_metrics=lambda prediction: {"bleu": next(bleus)})
    trainer.train()
    trainer.push_to_hub(**push)
    return trainer


def pushed_card(hub_record) -> str:  # noqa: F811
    (commit,) = hub_record.commits
    text = commit["files"]["README.md"].decode()
    assert hub_record.validated == [text]  # the YAML passed the Hub's check (ModelCardData, model-index)
    return text


def section(text: str, heading: str) -> str:
    """The body of markdown section ``heading`` (to the next heading)."""
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(r"\n#{1,3} ", body, maxsplit=1)[0]


def markdown_table(text: str) -> list:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    head = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(head, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def headings(text: str, start: str) -> list:
    return [line for line in text[text.index(start):].splitlines() if line.startswith("#")]


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """What transformers writes for a stock MarianMTModel trained and pushed the same way (transformers' own card)."""
    import huggingface_hub
    from unittest import mock

    output_dir = tmp_path_factory.mktemp("stock") / "out"
    written = {}

    def upload_folder(self, *, folder_path, **kwargs):
        with open(f"{folder_path}/README.md") as handle:
            written["card"] = handle.read()

    with mock.patch.object(huggingface_hub.HfApi, "create_repo",
                           lambda self, repo_id, **k: type("Repo", (), {"repo_id": repo_id})()), \
            mock.patch.object(huggingface_hub.HfApi, "upload_folder", upload_folder):
        torch.manual_seed(0)
        train_and_push(MODELS["marian"](), output_dir, dataset_tags="someone/data")
    assert "generated_from_trainer" in written["card"]
    return written["card"]


@pytest.mark.parametrize("name", sorted(set(MODELS) - {"marian"}))
def test_pushed_card_has_what_the_trainer_measured(name, stock, validated, tmp_path):  # noqa: F811
    torch.manual_seed(0)
    trainer = train_and_push(randomize(MODELS[name](), std=0.1), tmp_path / "out", dataset_tags="someone/data")
    text = pushed_card(validated)
    card, stock_card = ModelCard(text), ModelCard(stock)
    history, args = trainer.state.log_history, trainer.args
    evaluations = [entry for entry in history if "eval_loss" in entry]
    assert [entry["step"] for entry in evaluations] == [2, 4] and trainer.state.best_global_step == 2

    # model-index: the evaluation of the checkpoint loaded at the end (step 2), named by the repo, on the Hub dataset
    model_name, (result,) = model_index_to_eval_results(card.data.to_dict()["model-index"])
    assert model_name == "tiny"
    assert (result.task_type, result.dataset_type, result.dataset_name) == ("translation", "someone/data",
                                                                           "someone/data")
    assert (result.metric_type, result.metric_value) == ("bleu", evaluations[0]["eval_bleu"]) == ("bleu", BLEUS[0])
    assert "It achieves the following results on the evaluation set (step 2):\n- Loss: " in text
    assert f"- Bleu: {BLEUS[0]}" in text
    assert f"- Bleu: {BLEUS[1]}" in stock  # transformers' own card reports the last evaluation, not the loaded one

    # the training results table: one row per evaluation of log_history
    rows = markdown_table(section(text, "### Training results"))
    assert len(rows) == len(evaluations)
    for row, entry in zip(rows, evaluations):
        losses = [e["loss"] for e in history if "loss" in e and e["step"] <= entry["step"]]
        assert int(row["Step"]) == entry["step"] and float(row["Epoch"]) == entry["epoch"]
        assert float(row["Validation Loss"]) == pytest.approx(entry["eval_loss"], abs=5e-5)
        assert float(row["Training Loss"]) == pytest.approx(losses[-1], abs=5e-5)
        assert float(row["Bleu"]) == entry["eval_bleu"]

    # hyperparameters: the TrainingArguments
    listed = dict(line[2:].split(": ", 1) for line in section(text, "### Training hyperparameters").splitlines()
                  if line.startswith("- "))
    assert float(listed["learning_rate"]) == args.learning_rate
    assert {key: int(listed[key]) for key in ("train_batch_size", "eval_batch_size", "seed", "training_steps",
                                              "lr_scheduler_warmup_steps")} == dict(
        train_batch_size=args.train_batch_size, eval_batch_size=args.eval_batch_size, seed=args.seed,
        training_steps=args.max_steps, lr_scheduler_warmup_steps=args.warmup_steps)
    assert listed["lr_scheduler_type"] == args.lr_scheduler_type.value
    assert f"betas=({args.adam_beta1},{args.adam_beta2})" in listed["optimizer"]

    versions = section(text, "### Framework versions")
    assert f"- Transformers {transformers.__version__}\n" in versions and f"- Pytorch {torch.__version__}" in versions

    # transformers' sections and YAML keys for a stock model, and ours
    assert headings(stock, "## Training procedure") == headings(text, "## Training procedure")[:-1]  # + Citation
    assert set(stock_card.data.to_dict()) <= set(card.data.to_dict())
    assert card.data.metrics == stock_card.data.metrics == ["bleu"]
    assert card.data.datasets == stock_card.data.datasets == ["someone/data"]
    assert "## Architecture" in text and "## Citation" in text and "generated_from_trainer" not in text
    assert card.data.tags[:2] == ["hf_hardattn", trainer.model.config.model_type]
    # the snippets load the repo pushed to
    assert text.count(f'"{REPO}"') == 3 and "PATH_OR_REPO" not in text


def test_trainer_card_on_local_data_names_no_dataset_id(validated, tmp_path):  # noqa: F811
    train_and_push(randomize(MODELS["soft"](), std=0.1), tmp_path / "out")
    card = ModelCard(pushed_card(validated))
    _, (result,) = model_index_to_eval_results(card.data.to_dict()["model-index"])
    assert (result.dataset_type, result.dataset_name) == (LOCAL_DATASET + EVALUATION_SET, EVALUATION_SET)
    with pytest.raises(HFValidationError):
        validate_repo_id(result.dataset_type)
    assert card.data.datasets is None


def test_local_eval_rows_get_a_type_no_hub_dataset_id_can_be():
    model = MODELS["soft"]()
    rows = [dict(task_type="translation", dataset_name="valid", dataset_split="validation", metric_type="bleu",
                 metric_value=12.5),
            dict(task_type="translation", dataset_type="wmt14", dataset_name="WMT14", metric_type="bleu",
                 metric_value=20.0)]
    data = ModelCard(render_model_card(model, {CARD_METADATA: dict(eval_results=rows)})).data
    _, (local, hub_row) = model_index_to_eval_results(data.to_dict()["model-index"])
    assert (local.dataset_type, local.dataset_name, local.metric_value) == ("local:valid", "valid", 12.5)
    with pytest.raises(HFValidationError):
        validate_repo_id(local.dataset_type)
    assert hub_row.dataset_type == "wmt14"
    with pytest.raises(ValueError, match="neither `dataset_type`.*nor `dataset_name`"):
        render_model_card(model, {CARD_METADATA: dict(eval_results=[dict(task_type="translation", metric_type="bleu",
                                                                         metric_value=1.0)])})


def test_folder_results_win_over_the_trainers_for_their_metrics(tmp_path):
    """A folder's model-index rows were measured on the saved model: the Trainer's rows join only for other metrics."""
    model = MODELS["soft"]()
    own = [dict(task_type="translation", dataset_type="someone/data", dataset_name="someone/data",
                dataset_split="test", metric_type="bleu", metric_value=1.5)]
    (tmp_path / RESULTS_FILE).write_text(json.dumps({CARD_METADATA: dict(eval_results=own)}))
    trainer_rows = [dict(task_type="translation", dataset_name=EVALUATION_SET, metric_type=metric, metric_value=value,
                         metric_name=metric.capitalize()) for metric, value in (("bleu", 9.0), ("accuracy", 0.5))]
    model.trainer_model_card(tmp_path, eval_results=trainer_rows, metrics=["bleu", "accuracy"])
    data = ModelCard((tmp_path / "README.md").read_text()).data
    _, results = model_index_to_eval_results(data.to_dict()["model-index"])
    assert [(r.metric_type, r.metric_value) for r in results] == [("bleu", 1.5), ("accuracy", 0.5)]
    assert data.metrics == ["bleu", "accuracy"]


def test_remote_code_of_an_older_release_gets_the_arguments_it_takes(tmp_path):
    """A model whose trainer_model_card (remote code saved by an earlier release) takes only the Trainer's card
    parameters is called with those alone."""
    model, calls = MODELS["soft"](), []

    def trainer_model_card(output_dir, *, language=None, license=None, tags=None, model_name=None,
                           finetuned_from=None, tasks=None, dataset_tags=None, dataset=None, dataset_args=None):
        calls.append(dict(language=language, model_name=model_name))

    model.trainer_model_card = trainer_model_card
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    Seq2SeqCardTrainer(model=model, args=args).create_model_card(language="fr", model_name="m")
    assert calls == [dict(language="fr", model_name="m")] and len(CARD_PARAMETERS) == 9
