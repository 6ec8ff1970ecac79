"""The model card a Trainer uploads: this package's, for a model that writes its own (tooling, not runtime code).

transformers' ``Trainer.push_to_hub`` saves the model into ``output_dir`` (our ``save_pretrained`` writes this
package's card there), then calls ``Trainer.create_model_card``, which overwrites README.md with its generic
``generated_from_trainer`` card, then uploads the folder. :class:`Seq2SeqCardTrainer` is ``Seq2SeqTrainer`` with
``create_model_card`` deferring to the model's ``trainer_model_card`` where the model has one (every hf_hardattn model,
loaded from the package or as remote code): the card keeps the folder's results and metadata and takes the Trainer's
arguments (language, license, tags, datasets, the repo name). Other models get the Trainer's own card. Only this
class changes: ``Trainer`` and ``Seq2SeqTrainer`` are left as transformers defines them.
"""

from transformers import Seq2SeqTrainer

# Trainer.create_model_card's parameters, in order (5.10 - 5.24): positional arguments are bound to these names
CARD_PARAMETERS = ("language", "license", "tags", "model_name", "finetuned_from", "tasks", "dataset_tags", "dataset",
                   "dataset_args")


class Seq2SeqCardTrainer(Seq2SeqTrainer):
    """``Seq2SeqTrainer`` whose ``push_to_hub`` uploads the model's own card (``trainer_model_card``) if it has one."""

    def create_model_card(self, *args, **kwargs):
        model = self.accelerator.unwrap_model(self.model) if getattr(self, "accelerator", None) else self.model
        if not hasattr(model, "trainer_model_card"):
            return super().create_model_card(*args, **kwargs)
        if len(args) > len(CARD_PARAMETERS):
            raise TypeError(f"create_model_card takes at most {len(CARD_PARAMETERS)} positional arguments "
                            f"({', '.join(CARD_PARAMETERS)}), got {len(args)}.")
        if self.is_world_process_zero():
            model.trainer_model_card(self.args.output_dir, **dict(zip(CARD_PARAMETERS, args)), **kwargs)
        return None


__all__ = ["CARD_PARAMETERS", "Seq2SeqCardTrainer"]
