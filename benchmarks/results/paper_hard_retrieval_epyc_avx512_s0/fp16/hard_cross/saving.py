"""Saving and sharing a model: ``save_pretrained`` into a folder replaced in one step, with a model card, weight checksums
(checked by ``from_pretrained``), the tokenizer, and the files of the attention kinds its config uses; the Hub upload.

Runtime code shipped with saved models (``trust_remote_code``): keep it flat, same-folder relative imports only.
"""

import json
import os
import shutil
import tempfile

from huggingface_hub import ModelCard
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils.hub import hf_api

from .model_card import CARD_METADATA, RESULTS_FILE, name_repo, write_model_card
from .registry import kind_files, runtime_module
from .safe_io import atomic_folder, stale_weights, target_folder, verify_folder, write_checksums


def check_folder_or_repo_id(path: str):
    """FileNotFoundError naming ``path`` when it is no folder and cannot be a Hub repo id either (an absolute or
    relative path, ``~``, ``..``): a missing folder, rather than transformers' "Repo id must be in the form ..."."""
    if os.path.exists(path):
        return
    try:
        validate_repo_id(path)
        return  # a repo id: transformers looks it up on the Hub
    except HFValidationError:
        pass
    parent = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    raise FileNotFoundError(f"`pretrained_model_name_or_path`={path!r} is no folder (the nearest existing folder on that "
                            f"path is {parent!r}) and cannot be a Hub repo id; allowed: a folder written by "
                            f"save_pretrained, or a Hub repo id 'name' or 'namespace/name'.")


class SavingMixin:
    """Saving and loading of ``HardAttnPreTrainedModel`` (mixed in before transformers' ``PreTrainedModel``)."""

    # arguments of save_pretrained(push_to_hub=True) that go to the upload (``token`` also goes to transformers)
    PUSH_ARGUMENTS = ("repo_id", "commit_message", "commit_description", "private", "revision", "create_pr", "tags")

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, tokenizer=None, **kwargs):
        """``PreTrainedModel.save_pretrained`` (safetensors, config, remote code) plus a model card (README.md), the
        sha256 of the weights (``hardattn_checksums.json``, checked by ``from_pretrained``) and the ``tokenizer`` when
        given. The files are written into a new sibling folder that then replaces ``save_directory`` in one step
        (``safe_io.atomic_folder``): a process killed at any point of the save leaves the old or the new complete
        model, and the folder's other files are kept. With ``push_to_hub=True`` the files it writes go to the Hub in
        one commit, as in transformers, but with this card: ``repo_id`` (default: the folder's name) and
        ``push_to_hub``'s arguments (``commit_message``, ``commit_description``, ``private``, ``token``,
        ``revision``, ``create_pr``, ``tags``)."""
        if self.is_int8:
            raise ValueError("save_pretrained: an int8 model (quantize_int8) is not saved; save the fp32 model and call "
                             "quantize_int8() after loading it.")
        if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
            raise TypeError(f"`tokenizer` must be a tokenizer with save_pretrained(), got {type(tokenizer).__name__}")
        hub = {key: kwargs.pop(key) for key in self.PUSH_ARGUMENTS if key in kwargs} if push_to_hub else {}
        if not kwargs.get("is_main_process", True):  # another rank's call: transformers' own (it writes nothing)
            return super().save_pretrained(save_directory, *args, **kwargs)
        final = target_folder(save_directory)
        # transformers' rule: push the files this call (re)writes, not older ones in the folder
        before = self._get_files_timestamps(final) if os.path.isdir(final) else {}
        with atomic_folder(final, drop=stale_weights(kwargs.get("variant"))) as staging:
            self.add_base_model_auto_map()
            super().save_pretrained(staging, *args, **kwargs)
            if self._auto_class is not None:  # (as transformers: it has copied the model type's file and its imports)
                self.save_kind_files(staging)
            results = os.path.join(final, RESULTS_FILE)
            if os.path.isfile(results):  # the card shows the folder's results
                shutil.copy2(results, os.path.join(staging, RESULTS_FILE))
            write_model_card(self, staging)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            write_checksums(staging)
        if push_to_hub:
            repo_id = hub.pop("repo_id", os.path.basename(os.path.normpath(str(save_directory))))
            self.upload_folder_to_hub(final, repo_id, before, token=kwargs.get("token"), **hub)

    def add_base_model_auto_map(self):
        """A full model registered for remote code also names its bare encoder-decoder (its ``.model``, registered
        for ``AutoModel``) in the config's ``auto_map``, as transformers names the saved class itself: the saved
        folder then loads with ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` too."""
        base = self.base_model
        if self._auto_class is None or base is self or getattr(base, "_auto_class", None) is None:
            return
        entry = f"{type(base).__module__.rpartition('.')[2]}.{type(base).__name__}"
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), base._auto_class: entry}

    def trainer_model_card(self, output_dir, *, language=None, license=None, tags=None, model_name=None,
                           finetuned_from=None, tasks=None, dataset_tags=None, dataset=None, dataset_args=None,
                           eval_results=None, metrics=None, training=None, repo_id=None):
        """``Trainer.create_model_card`` for this model (``hf_hardattn.tools.trainer_card.Seq2SeqCardTrainer`` calls it
        in place of transformers' ``generated_from_trainer`` card): this package's card in
        ``output_dir`` (with the folder's ``hardattn_results.json``), its metadata joined with the Trainer's
        arguments (language, license, tags, the repo name for the model-index, datasets, a Hub ``finetuned_from``
        as ``base_model``). ``tasks`` and ``dataset_args`` have no field in this card (the task is translation).
        What the Trainer measured: ``eval_results`` (EvalResult fields) join the model-index for each metric the
        folder's results do not report (those were measured on the saved model), ``metrics`` the YAML's metric ids,
        ``training`` (markdown: hyperparameters, training results, framework versions) goes after the results;
        ``repo_id`` is the repo the snippets load."""
        if isinstance(finetuned_from, str) and os.path.isdir(finetuned_from):
            finetuned_from = None  # a local folder is no Hub id (and must not leak into the card)
        datasets = dataset_tags if dataset_tags is not None else dataset
        own = []
        path = os.path.join(str(output_dir), RESULTS_FILE)
        if eval_results and os.path.isfile(path):
            with open(path) as handle:
                own = (json.load(handle).get(CARD_METADATA) or {}).get("eval_results") or []
        reported = {row.get("metric_type") for row in own}
        evals = own + [row for row in eval_results or [] if row.get("metric_type") not in reported]
        return write_model_card(self, output_dir, metadata=dict(
            language=language, license=license, tags=tags, model_name=model_name, base_model=finetuned_from,
            datasets=[datasets] if isinstance(datasets, str) else datasets, metrics=metrics,
            eval_results=evals or None), training=training, repo_id=repo_id)

    def save_kind_files(self, folder):
        """Copy into ``folder`` the runtime file of every attention kind the config uses (with that file's relative
        imports) that the model type's own files lack: so a saved folder carries the files its config uses and no
        other (a soft model decoding with hard retrieval carries hard_retrieval.py; a plain soft model does not)."""
        for name in sorted(kind_files(self.config)):
            source = runtime_module(name, self.config).__file__
            for path in [source, *get_relative_import_files(source)]:
                target = os.path.join(folder, os.path.basename(path))
                if not os.path.exists(target):
                    shutil.copyfile(path, target)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, verify_checksums: bool = True, **kwargs):
        """``PreTrainedModel.from_pretrained``; a local folder is checked first: a truncated or malformed safetensors
        file, or one whose sha256 differs from the one ``save_pretrained`` recorded (``hardattn_checksums.json``),
        raises ``safe_io.CorruptFileError`` naming the file (``verify_checksums=False`` skips the sha256, not the
        header check). Hub downloads are not re-hashed here."""
        if pretrained_model_name_or_path is not None:
            folder = os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
            if os.path.isdir(folder):
                verify_folder(folder, checksums=verify_checksums)
            else:
                check_folder_or_repo_id(os.fspath(pretrained_model_name_or_path))
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def push_to_hub(self, repo_id: str, *, commit_message=None, commit_description=None, private=None, token=None,
                    revision=None, create_pr: bool = False, max_shard_size="50GB", tags=None, tokenizer=None):
        """``PreTrainedModel.push_to_hub`` (same arguments) plus ``tokenizer``: weights, config, modeling code, this
        package's model card (not transformers' generic template) and the tokenizer when given, in one commit.
        Returns the commit's ``CommitInfo``."""
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, max_shard_size=max_shard_size, tokenizer=tokenizer)
            return self.upload_folder_to_hub(folder, repo_id, {}, private=private, token=token, tags=tags,
                                       commit_message=commit_message, commit_description=commit_description,
                                       revision=revision, create_pr=create_pr)

    def upload_folder_to_hub(self, folder, repo_id, files_timestamps, *, private=None, token=None, tags=None,
                             **commit):
        """Create the repo if needed, name it in the card's snippets, add the model's and the given ``tags`` to the card
        (as transformers does), and upload the files of ``folder`` written after ``files_timestamps`` in one commit
        (``_upload_modified_files``)."""
        repo_id = hf_api().create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        tags = list(self.model_tags or []) + ([tags] if isinstance(tags, str) else list(tags or []))
        path = os.path.join(folder, "README.md")
        if os.path.isfile(path):  # the card's snippets load the repo pushed to, not the placeholder
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
            if name_repo(text, repo_id) != text:
                with open(path, "w", encoding="utf-8") as handle:
                    handle.write(name_repo(text, repo_id))
        if tags:
            card = ModelCard.load(path)
            card.data.tags = list(dict.fromkeys((card.data.tags or []) + tags))
            card.save(path)
        return self._upload_modified_files(folder, repo_id, files_timestamps, token=token, **commit)


__all__ = ["SavingMixin"]
