"""The model card a Trainer uploads: this package's, for a model that writes its own, with what the Trainer measured
(tooling, not runtime code).

transformers' ``Trainer.push_to_hub`` saves the model into ``output_dir`` (our ``save_pretrained`` writes this
package's card there), then calls ``Trainer.create_model_card``, which overwrites README.md with its generic
``generated_from_trainer`` card (transformers' ``TrainingSummary``), then uploads the folder.
:class:`Seq2SeqCardTrainer` is ``Seq2SeqTrainer`` with ``create_model_card`` deferring to the model's
``trainer_model_card`` where the model has one (every hf_hardattn model, loaded from the package or as remote code):
the card keeps the folder's results and metadata, takes the Trainer's arguments (language, license, tags, datasets,
the repo name) and adds what ``TrainingSummary.from_trainer`` reads from the Trainer: the evaluation results (in the
model-index and the YAML's ``metrics``), the training hyperparameters, the training results table (the evaluations of
``log_history``) and the framework versions; its snippets load the repo being pushed to. Other models get the
Trainer's own card. Only this class changes: ``Trainer`` and ``Seq2SeqTrainer`` are left as transformers defines them.
"""

import inspect

from transformers import Seq2SeqTrainer
from transformers.modelcard import TrainingSummary, infer_metric_tags_from_eval_results

from .checkpointing import missing_untied

# Trainer.create_model_card's parameters, in order (5.10 - 5.24): positional arguments are bound to these names
CARD_PARAMETERS = ("language", "license", "tags", "model_name", "finetuned_from", "tasks", "dataset_tags", "dataset",
                   "dataset_args")
# the Trainer's evaluation set when no Hub dataset names it (a model-index row on local data, see model_card.py)
EVALUATION_SET = "evaluation set"
# keys of a log_history evaluation that transformers' card leaves out of its results (modelcard.parse_log_history)
NOT_RESULTS = ("runtime", "samples_per_second", "steps_per_second", "epoch", "step")


def _as_list(value) -> list:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def evaluation_at(log_history: list, step: int) -> dict | None:
    """The evaluation logged at ``step`` as transformers' card names its results (``eval_bleu`` -> ``Bleu``), or
    None."""
    for entry in reversed(log_history):
        if entry.get("step") == step and "eval_loss" in entry:
            return {" ".join(part.capitalize() for part in key.removeprefix("eval_").split("_")): value
                    for key, value in entry.items() if key.removeprefix("eval_") not in NOT_RESULTS}
    return None


def training_sections(summary: TrainingSummary, step: int | None = None) -> str:
    """transformers' own card text for ``summary`` from its evaluation results to the end: the results on the
    evaluation set (of ``step`` when given), "## Training procedure" (hyperparameters, training results, framework
    versions)."""
    text = summary.to_model_card()
    procedure = text[text.index("## Training procedure"):].strip()
    evaluation = ""
    if "It achieves the following results" in text:
        evaluation = text[text.index("It achieves the following results"):text.index("## Model description")].strip()
        if step is not None:
            evaluation = evaluation.replace("on the evaluation set:", f"on the evaluation set (step {step}):", 1)
    head, _, rest = procedure.partition("\n")
    return "\n\n".join(part for part in (head, evaluation, rest.strip()) if part)


def eval_rows(summary: TrainingSummary) -> list:
    """The model-index rows (EvalResult fields) of ``summary.eval_results``, one per metric with a Hub metric id and
    per dataset, as transformers' ``TrainingSummary.create_model_index`` (task: translation); a dataset without Hub id
    gets ``dataset_type`` None (model_card.py names it as local data) rather than being left out."""
    metrics = infer_metric_tags_from_eval_results(summary.eval_results)
    tags = _as_list(summary.dataset_tags)
    names, args, metadata = _as_list(summary.dataset), _as_list(summary.dataset_args), summary.dataset_metadata or []
    datasets = [(tag, names[i] if i < len(names) else tag, args[i] if i < len(args) else None,
                 metadata[i] if i < len(metadata) else {}) for i, tag in enumerate(tags)]
    datasets = datasets or [(None, names[0] if names else EVALUATION_SET, None, {})]
    return [dict(task_type="translation", task_name="Translation", dataset_type=tag, dataset_name=name,
                 dataset_config=meta.get("config") or config, dataset_split=meta.get("split"), metric_type=metric,
                 metric_name=pretty, metric_value=summary.eval_results[pretty])
            for tag, name, config, meta in datasets for metric, pretty in metrics.items()]


class Seq2SeqCardTrainer(Seq2SeqTrainer):
    """``Seq2SeqTrainer`` whose ``push_to_hub`` uploads the model's own card (``trainer_model_card``) if it has one,
    with what the Trainer measured (:meth:`card_measurements`), and which warns after loading a checkpoint only of
    weights truly missing (:meth:`_issue_warnings_after_load`)."""

    def _issue_warnings_after_load(self, load_result):
        """transformers' warnings after it loads a checkpoint into the model (``load_best_model_at_end``, a resumed
        run), less the tied copies that were loaded under another name (:func:`checkpointing.missing_untied`; stock
        BART, Marian or T5 models get the same warning from transformers' Trainer)."""
        if not hasattr(load_result, "_replace"):
            return super()._issue_warnings_after_load(load_result)
        kept = missing_untied(self.model, load_result.missing_keys)
        return super()._issue_warnings_after_load(load_result._replace(missing_keys=kept))

    def card_measurements(self, dataset_tags=None, dataset=None, dataset_args=None) -> dict:
        """``trainer_model_card``'s arguments from the Trainer: ``eval_results`` (model-index rows), ``metrics``,
        ``training`` (markdown) and ``repo_id``, read by transformers' ``TrainingSummary.from_trainer``. The
        evaluation results are those of the checkpoint the Trainer loaded at the end (``load_best_model_at_end``:
        the best step's evaluation), else of its last evaluation (transformers' rule)."""
        # license "": the card's own license stands, and from_trainer asks the Hub for none
        summary = TrainingSummary.from_trainer(self, license="", dataset_tags=dataset_tags, dataset=dataset,
                                               dataset_args=dataset_args)
        evaluated = [entry["step"] for entry in self.state.log_history if "eval_loss" in entry and "step" in entry]
        step = evaluated[-1] if evaluated else None
        best = getattr(self.state, "best_global_step", None)
        if self.args.load_best_model_at_end and best in evaluated:
            step, summary.eval_results = best, evaluation_at(self.state.log_history, best)
        rows = eval_rows(summary) if summary.eval_results else []
        return dict(eval_results=rows or None, metrics=sorted({row["metric_type"] for row in rows}) or None,
                    training=training_sections(summary, step), repo_id=self.hub_model_id or self.args.hub_model_id)

    def create_model_card(self, *args, **kwargs):
        model = self.accelerator.unwrap_model(self.model) if getattr(self, "accelerator", None) else self.model
        if not hasattr(model, "trainer_model_card"):
            return super().create_model_card(*args, **kwargs)
        if len(args) > len(CARD_PARAMETERS):
            raise TypeError(f"create_model_card takes at most {len(CARD_PARAMETERS)} positional arguments "
                            f"({', '.join(CARD_PARAMETERS)}), got {len(args)}.")
        if self.is_world_process_zero():
            arguments = {**dict(zip(CARD_PARAMETERS, args)), **kwargs}
            measured = self.card_measurements(*(arguments.get(k) for k in ("dataset_tags", "dataset", "dataset_args")))
            accepted = inspect.signature(model.trainer_model_card).parameters  # remote code saved by an older release
            model.trainer_model_card(self.args.output_dir, **arguments,
                                     **{key: value for key, value in measured.items() if key in accepted})
        return None


__all__ = ["CARD_PARAMETERS", "EVALUATION_SET", "NOT_RESULTS", "Seq2SeqCardTrainer", "eval_rows", "evaluation_at",
           "training_sections"]
