"""Knowledge distillation from a Transformer teacher into a (hybrid) student (hybrid paper, Sec. 2.2, Eq. 1).

The paper trains in two stages: (1) MLE on the bilingual data; (2) fine-tuning with Eq. 1, with the teacher fixed:

    L(theta_s) = sum_n log P(y^(n) | x^(n); theta_s) - lambda sum_n KL(P(y | x^(n); theta_t) || P(y | x^(n); theta_s))

(lambda = 1; we minimise -L). The KL between the two distributions over whole sequences is intractable, so it is
approximated; the paper calls its KD sequence-level (Kim & Rush, 2016). ``kd_scheme`` names the objective of stage 2:

* ``"eq1_sequence"`` (default, the paper's choice): Eq. 1 with Kim & Rush's sequence-level approximation.
  KL(P_t || P_s) = -H(P_t) - E_{y ~ P_t} log P_s(y); the entropy does not depend on the student, and P_t is replaced
  by a point mass on the teacher's beam output y_hat, so KL ~ -log P_s(y_hat) + const and the loss is
  NLL(reference) + lambda * NLL(y_hat) (:func:`hf_hardattn.hybrid.sequence_kd_loss`).
* ``"eq1_word"``: Eq. 1 with a word-level approximation: the KL summed over the positions of the reference,
  sum_t KL(P_t(. | y_<t, x) || P_s(. | y_<t, x)) along the reference prefix y_<t (:func:`hf_hardattn.hybrid.kd_loss`; the teacher
  model runs during training).
* ``"sequence_word"``: not Eq. 1: the teacher's beam output replaces the reference (no reference term), loss
  NLL(y_hat) + lambda * the word-level KL along y_hat's prefix.
* ``"sequence_only"``: not Eq. 1: pure sequence-level KD, ordinary training (the model's own loss, with its label
  smoothing) on the teacher's beam outputs only. The ``hybrid_*_kd`` rows of ``benchmarks/reproduce.py``, which also
  skip stage 1 (they train from scratch).

Every loss is a sum over target tokens divided by the number of target tokens of the batch's ``labels`` (the
reference for the Eq. 1 schemes; under gradient accumulation, ``num_items_in_batch``). The Eq. 1 schemes use the
plain likelihood (no label smoothing), as Eq. 1.

* :func:`translate_dataset`: the sequence-level KD data: the teacher's beam outputs ("target") beside the original
  targets ("reference"); resumable shards. CLI: ``hf-hardattn distill --teacher DIR --data FOLDER --split train
  --out DIR`` (or ``python -m hf_hardattn.tools.distill ...``).
* :func:`tokenize_kd_dataset`: that dataset -> the model inputs a scheme needs.
* :class:`DistillationTrainer`: a ``Seq2SeqTrainer`` with the scheme's loss; the teacher (``eq1_word`` and
  ``sequence_word``) is frozen (eval mode, ``requires_grad=False``, run under ``torch.no_grad``) and must share the
  student's tokenizer.
* :func:`train_two_stage`: the paper's schedule (MLE on the references, then the scheme; ``mle=False`` skips the MLE
  stage, which the paper does not); :func:`train_kd_stage`: stage 2 alone.

Tooling (not runtime code): may import datasets / tqdm.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import inspect
import json
import os
import shutil
import sys

import datasets
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from ..hybrid import kd_loss, sequence_kd_loss
from ..safe_io import write_bytes_atomic, write_json_atomic
from . import checkpointing, training
from .arguments import check_model_type
from .data import load_parallel
from .training import Seq2SeqLengthTrainer, tokenize_dataset, train_seq2seq

MANIFEST = "kd_manifest.json"

# scheme -> (uses the reference, uses the teacher's beam output, runs the teacher model, has lambda)
KD_SCHEMES = {
    "eq1_sequence": (True, True, False, True),
    "eq1_word": (True, False, True, True),
    "sequence_word": (False, True, True, True),
    "sequence_only": (False, True, False, False),
}
DEFAULT_KD_SCHEME = "eq1_sequence"
KD_SCHEME_LABELS = {
    "eq1_sequence": "Eq. 1 (reference NLL + lambda * NLL of the teacher's beam output: sequence-level KL)",
    "eq1_word": "Eq. 1 (reference NLL + lambda * per-token KL along the reference: word-level KL)",
    "sequence_word": "not Eq. 1: teacher's beam output NLL + lambda * per-token KL along it (no reference term)",
    "sequence_only": "sequence-level KD only, not Eq. 1 (trained on the teacher's beam outputs, no reference term)",
}


def check_kd_scheme(kd_scheme) -> str:
    if kd_scheme not in KD_SCHEMES:
        raise ValueError(f"`kd_scheme` must be one of {list(KD_SCHEMES)}, got {kd_scheme!r}.")
    return kd_scheme


def _special_ids(config):
    return {name: getattr(config, name, None) for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id")}


def check_compatible(student, teacher, student_tokenizer=None, teacher_tokenizer=None):
    """Raise a ValueError unless student and teacher score the same vocabulary with the same special tokens (and, when
    both tokenizers are given, the tokenizers have identical vocabularies)."""
    sizes = []
    for model in (student, teacher):
        head = model.get_output_embeddings()
        sizes.append(head.out_features if head is not None else model.config.vocab_size)
    if sizes[0] != sizes[1]:
        raise ValueError(f"`teacher_model` scores {sizes[1]} tokens but the student scores {sizes[0]}: student and "
                         "teacher must share one tokenizer/vocabulary.")
    s_ids, t_ids = _special_ids(student.config), _special_ids(teacher.config)
    if s_ids != t_ids:
        raise ValueError(f"`teacher_model` special token ids {t_ids} differ from the student's {s_ids}: student and "
                         "teacher must share one tokenizer.")
    if student_tokenizer is not None and teacher_tokenizer is not None:
        s_vocab, t_vocab = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
        if s_vocab != t_vocab:
            differing = sorted(set(s_vocab.items()) ^ set(t_vocab.items()))[:5]
            raise ValueError(f"`teacher_tokenizer` and the student's tokenizer (`processing_class`) have different "
                             f"vocabularies (e.g. {differing}); KD needs one shared tokenizer.")


# ----------------------------------------------------------------------------------------------------------------
# Data and trainer
# ----------------------------------------------------------------------------------------------------------------
def tokenize_kd_dataset(distilled, tokenizer, kd_scheme: str = DEFAULT_KD_SCHEME, max_length: int = 128):
    """The model inputs of ``kd_scheme`` from a :func:`translate_dataset` dataset ("source", "target" = the
    teacher's beam output, "reference" = the original target): ``labels`` are the reference for the Eq. 1 schemes
    (``eq1_sequence`` adds ``teacher_labels``, the teacher's output) and the teacher's output for the others."""
    uses_reference, uses_output, _, _ = KD_SCHEMES[check_kd_scheme(kd_scheme)]
    if uses_reference and "reference" not in distilled.column_names:
        raise ValueError(f"`kd_scheme`={kd_scheme!r} needs the reference translations (a 'reference' column, as "
                         f"translate_dataset writes when the data has targets); columns: {distilled.column_names}.")
    data = tokenize_dataset(distilled, tokenizer, max_length=max_length,
                            target_column="reference" if uses_reference else "target")
    if uses_reference and uses_output:
        outputs = tokenizer(text_target=list(distilled["target"]), max_length=max_length, truncation=True)
        data = data.add_column("teacher_labels", outputs["input_ids"])
    return data


class _PadTeacherLabels:
    """Wraps a data collator: pads ``teacher_labels`` with -100 on the right (the collator pads the rest)."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        features = [dict(f) for f in features]
        rows = [list(f.pop("teacher_labels")) for f in features]
        batch = self.collator(features)
        width = max(len(r) for r in rows)
        batch["teacher_labels"] = torch.tensor([r + [-100] * (width - len(r)) for r in rows], dtype=torch.long)
        return batch


def _pad_right(labels, width):
    return torch.nn.functional.pad(labels, (0, width - labels.shape[1]), value=-100)


class DistillationTrainer(Seq2SeqLengthTrainer):
    """``Seq2SeqTrainer`` (length-grouped, :class:`~hf_hardattn.tools.training.Seq2SeqLengthTrainer`) whose loss is the
    ``kd_scheme`` objective of stage 2 (module docstring; default ``"eq1_sequence"``, the paper's Eq. 1).

    Extra arguments: ``kd_scheme``; ``kd_lambda`` (default 1.0, the paper's; refused for ``sequence_only``, which
    has no lambda); ``teacher_model`` (required by ``eq1_word`` / ``sequence_word``, which run it; refused by the
    other schemes, which read the teacher's beam outputs from the data); ``teacher_tokenizer`` (optional; compared
    with ``processing_class``). The training data comes from :func:`tokenize_kd_dataset` with the same scheme
    (``eq1_sequence`` batches carry ``teacher_labels``). The last training step's loss parts are in
    ``trainer.kd_parts`` ({"nll", "kd"}: the NLL of ``labels`` and the lambda-free KD term)."""

    def __init__(self, *args, kd_scheme: str = DEFAULT_KD_SCHEME, teacher_model=None, kd_lambda=None,
                 teacher_tokenizer=None, **kwargs):
        _, _, runs_teacher, has_lambda = KD_SCHEMES[check_kd_scheme(kd_scheme)]
        if runs_teacher and teacher_model is None:
            raise ValueError(f"`teacher_model` is required for `kd_scheme`={kd_scheme!r} (a seq2seq model sharing "
                             "the student's tokenizer).")
        if not runs_teacher and teacher_model is not None:
            raise ValueError(f"`teacher_model` is not used by `kd_scheme`={kd_scheme!r}: it reads the teacher's beam "
                             "outputs from the data (translate_dataset); pass teacher_model=None, or use 'eq1_word' "
                             "/ 'sequence_word' to run the teacher during training.")
        if not has_lambda and kd_lambda is not None:
            raise ValueError(f"`kd_lambda` has no role in `kd_scheme`={kd_scheme!r} (plain training on the teacher's "
                             f"outputs); got {kd_lambda!r}, pass None.")
        if kd_lambda is None:
            kd_lambda = 1.0
        if not (isinstance(kd_lambda, (int, float)) and kd_lambda >= 0):
            raise ValueError(f"`kd_lambda` must be a number >= 0, got {kd_lambda!r}.")
        super().__init__(*args, **kwargs)
        self.kd_scheme, self.kd_lambda, self.kd_parts = kd_scheme, float(kd_lambda), {}
        self.teacher_model = None
        if runs_teacher:
            check_compatible(self.model, teacher_model, self.processing_class, teacher_tokenizer)
            self.teacher_model = teacher_model.to(self.args.device).eval()
            self.teacher_model.requires_grad_(False)
        if kd_scheme == "eq1_sequence":
            self.data_collator = _PadTeacherLabels(self.data_collator)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if "teacher_labels" not in self._signature_columns:  # keep the column for the collator / loss
            self._signature_columns.append("teacher_labels")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if "labels" not in inputs:
            raise ValueError("DistillationTrainer needs `labels` in every batch (tokenize_kd_dataset).")
        if self.kd_scheme == "sequence_only":  # ordinary training on the teacher's outputs: the model's own loss
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        teacher_labels = inputs.pop("teacher_labels", None)
        prepare = self.accelerator.unwrap_model(model).prepare_decoder_input_ids_from_labels
        # The Trainer divides by the accumulation steps itself unless the model takes loss kwargs (then
        # num_items_in_batch is the token count of the whole accumulated batch): normalise to match.
        scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        items = num_items_in_batch if scaled else None
        if self.kd_scheme == "eq1_sequence":
            if teacher_labels is None:
                raise ValueError("`kd_scheme`='eq1_sequence' needs `teacher_labels` (the teacher's beam outputs) in "
                                 "every batch: build the data with tokenize_kd_dataset(..., 'eq1_sequence').")
            # one forward over [references; teacher outputs], the source batch repeated
            width = max(labels.shape[1], teacher_labels.shape[1])
            both = torch.cat([_pad_right(labels, width), _pad_right(teacher_labels, width)])
            inputs.pop("decoder_input_ids", None)
            inputs = {k: torch.cat([v, v]) if torch.is_tensor(v) else v for k, v in inputs.items()}
            outputs = model(**inputs, decoder_input_ids=prepare(both), use_cache=False)
            ref_logits, out_logits = outputs.logits.split(labels.shape[0])
            loss, nll, kd = sequence_kd_loss(ref_logits, both[: labels.shape[0]], out_logits,
                                             both[labels.shape[0]:], self.kd_lambda, items, return_parts=True)
        else:  # eq1_word (labels: reference) / sequence_word (labels: the teacher's output)
            if inputs.get("decoder_input_ids") is None:
                inputs["decoder_input_ids"] = prepare(labels)
            outputs = model(**inputs, use_cache=False)
            self.teacher_model.eval()  # stays frozen even if someone called .train() on it
            with torch.no_grad():
                teacher_logits = self.teacher_model(**inputs, use_cache=False).logits
            loss, nll, kd = kd_loss(outputs.logits, teacher_logits.to(outputs.logits.device), labels,
                                    self.kd_lambda, items, return_parts=True)
        if scaled and self.args.average_tokens_across_devices:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        self.kd_parts = {"nll": nll.detach().item(), "kd": kd.detach().item()}
        outputs["loss"] = loss
        return (loss, outputs) if return_outputs else loss


def train_kd_stage(student, tokenizer, distilled, kd_scheme: str = DEFAULT_KD_SCHEME, kd_lambda=None,
                   teacher_model=None, teacher_tokenizer=None, max_length: int = 128,
                   output_dir: str = "outputs/kd", **train_kwargs):
    """Stage 2: train ``student`` on ``distilled`` (:func:`translate_dataset`) with the ``kd_scheme`` objective
    (:class:`DistillationTrainer`); ``train_kwargs`` go to :func:`~hf_hardattn.tools.training.train_seq2seq` (minutes,
    max_steps, learning_rate, lr_scheduler, bf16, ...). Returns the trainer."""
    check_kd_scheme(kd_scheme)
    data = tokenize_kd_dataset(distilled, tokenizer, kd_scheme, max_length=max_length)
    return train_seq2seq(student, tokenizer, data, output_dir=output_dir, trainer_class=DistillationTrainer,
                         trainer_kwargs=dict(kd_scheme=kd_scheme, kd_lambda=kd_lambda, teacher_model=teacher_model,
                                             teacher_tokenizer=teacher_tokenizer), **train_kwargs)


SCHEDULE_DEFAULTS = inspect.signature(train_seq2seq).parameters  # train_seq2seq's own defaults (a stage may omit one)


def train_two_stage(student, tokenizer, distilled, kd_scheme: str = DEFAULT_KD_SCHEME, kd_lambda=None,
                    teacher_model=None, teacher_tokenizer=None, mle: dict | bool = True, kd: dict | None = None,
                    max_length: int = 128, output_dir: str = "outputs/kd", resume_from_checkpoint: bool = False):
    """The paper's two-stage training (Sec. 2.2: "We use a two-stage training for our hybrid model: the pre-training
    and the knowledge distillation fine-tuning. In the first stage, our model is generally trained to maximize the
    likelihood estimation using the bilingual training data."): stage 1 maximises the likelihood of the bilingual data
    (the "reference" column of ``distilled``; the model's own loss), stage 2 fine-tunes the same student with the
    ``kd_scheme`` objective (default Eq. 1, :func:`train_kd_stage`). ``mle`` / ``kd``: keyword arguments of
    :func:`~hf_hardattn.tools.training.train_seq2seq` for each stage (its budget, learning rate, ...); ``mle=True`` (the
    default) runs stage 1 with train_seq2seq's defaults, as ``kd=None`` runs stage 2. Skipping stage 1 is not the
    paper's schedule and must be asked for: ``mle=False`` (a student trained with MLE already, or the
    ``sequence_only`` rows of the reproduction table, trained from scratch on the teacher's outputs). Returns
    (stage-1 trainer or None, stage-2 trainer).

    ``resume_from_checkpoint=True`` continues an interrupted run from the checkpoints in ``output_dir`` (``mle/`` and
    ``kd/``; each stage must save them with their optimizer, e.g. ``save_steps``): stage 2 from its last complete
    checkpoint; or, when stage 1 had finished (:func:`~hf_hardattn.tools.checkpointing.finished_run`) and stage 2
    had saved none, stage 2 from its start with stage 1's final weights, optimizer and schedule; or stage 1 from its last
    complete checkpoint; or from the start. The weights reached are an uninterrupted run's. A stage 1 that finished
    in an earlier process is returned as a :class:`~hf_hardattn.tools.checkpointing.FinishedRun` (its ``.state``),
    and its :class:`~hf_hardattn.tools.training.Convergence` callbacks take their state back from it. With an
    :class:`~hf_hardattn.tools.training.OptimizerCarry` in both stages, a resumed stage 2 rebuilds the schedule from
    its own arguments, so they must equal stage 1's (``learning_rate``, ``warmup_steps``, ``lr_scheduler``,
    ``weight_decay``: checked)."""
    check_kd_scheme(kd_scheme)
    if not isinstance(resume_from_checkpoint, bool):
        raise ValueError(f"`resume_from_checkpoint` must be True or False (the stages' checkpoints in `output_dir`), "
                         f"got {resume_from_checkpoint!r}.")
    if mle is None:  # None once skipped stage 1 and was the default: refused rather than reinterpreted
        raise ValueError("`mle=None` no longer skips stage 1: pass `mle=False` to skip the MLE stage (not the paper's "
                         "schedule), or `mle=True` / a dict of train_seq2seq arguments to run it.")
    if not isinstance(mle, (bool, dict)):
        raise ValueError(f"`mle` must be True (stage 1 with train_seq2seq's defaults), a dict of train_seq2seq "
                         f"arguments, or mle=False (no stage 1), got {mle!r}.")
    if mle is not False and "reference" not in distilled.column_names:
        raise ValueError("stage 1 (`mle`) trains on the bilingual data: `distilled` needs its 'reference' column "
                         f"(translate_dataset of a dataset with targets), or pass mle=False; columns: "
                         f"{distilled.column_names}.")
    mle_args = {} if mle is True else (dict(mle) if mle else None)
    kd_args = dict(kd or {})
    mle_dir, kd_dir = os.path.join(str(output_dir), "mle"), os.path.join(str(output_dir), "kd")
    first, resume_mle, resume_kd, continuation = None, False, None, None
    if resume_from_checkpoint:
        for name, stage in (("mle", mle_args), ("kd", kd_args)):
            if stage is not None and "resume_from_checkpoint" in stage:
                raise ValueError(f"`{name}` sets resume_from_checkpoint: pass train_two_stage(resume_from_checkpoint="
                                 f"True), which resumes each stage from its own folder.")
        ended = checkpointing.finished_run(mle_dir) if mle_args is not None else None
        kd_checkpoint = checkpointing.last_complete_checkpoint(kd_dir)
        if kd_checkpoint is not None and mle_args is not None and ended is None:
            raise ValueError(f"`resume_from_checkpoint`: {kd_dir!r} holds stage-2 checkpoints but stage 1 in {mle_dir!r} "
                             f"did not finish; allowed: the folder of one two-stage run (or resume_from_checkpoint=False "
                             f"in an empty `output_dir`).")
        if ended is not None:  # stage 1 finished in an earlier process
            first = ended
            for callback in mle_args.get("callbacks") or []:
                if isinstance(callback, training.Convergence):
                    callback.restore(ended.state)
            resume_kd = kd_checkpoint
            if resume_kd is None:  # stage 2 saved nothing yet: it starts from stage 1's end
                continuation = os.path.join(kd_dir, "continuation")
                resume_kd = checkpointing.continuation_checkpoint(ended, continuation)
        elif kd_checkpoint is not None:  # no stage 1 (mle=False)
            resume_kd = kd_checkpoint
        else:
            resume_mle = checkpointing.last_complete_checkpoint(mle_dir) is not None
        carry = kd_args.get("carry")
        if resume_kd is not None and carry is not None and carry.optimizer is None and mle_args is not None:
            pairs = {name: (mle_args.get(name, SCHEDULE_DEFAULTS[name].default),
                            kd_args.get(name, SCHEDULE_DEFAULTS[name].default))
                     for name in ("learning_rate", "warmup_steps", "lr_scheduler", "weight_decay")}
            differ = {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}
            if differ:
                raise ValueError(f"`resume_from_checkpoint`: stage 2 continues stage 1's optimizer (`carry`), and a resumed "
                                 f"stage 2 rebuilds its schedule from its own arguments, which differ from stage 1's "
                                 f"{differ} (stage 1, stage 2); allowed: the same values in `mle` and `kd`.")
    if mle_args is not None and first is None:
        references = tokenize_dataset(distilled, tokenizer, max_length=max_length, target_column="reference")
        first = train_seq2seq(student, tokenizer, references, output_dir=mle_dir,
                              **({"resume_from_checkpoint": True} if resume_mle else {}), **mle_args)
    if resume_kd is not None:
        kd_args["resume_from_checkpoint"] = resume_kd
    second = train_kd_stage(student, tokenizer, distilled, kd_scheme, kd_lambda, teacher_model, teacher_tokenizer,
                            max_length, kd_dir, **kd_args)
    if continuation is not None:
        shutil.rmtree(continuation)
    return first, second


# ----------------------------------------------------------------------------------------------------------------
# Sequence-level KD
# ----------------------------------------------------------------------------------------------------------------
def _fingerprint(sources) -> str:
    digest = hashlib.sha256()
    for text in sources:
        digest.update(text.encode("utf-8") + b"\0")
    return digest.hexdigest()


def _teacher_fingerprint(teacher) -> str:
    """The teacher by its weights (type, then every tensor's name, dtype, shape and bytes), not by the folder it was
    loaded from: a moved or copied output folder resumes, a retrained teacher in the same folder does not."""
    digest = hashlib.sha256(teacher.config.model_type.encode("utf-8"))
    for name, tensor in sorted(teacher.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode("utf-8"))
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def translate_dataset(teacher, tokenizer, dataset, output_dir, source_column: str = "source",
                      target_column: str | None = "target", num_beams: int = 4, batch_size: int = 64,
                      shard_size: int = 1000, max_new_tokens: int | None = None, max_length: int = 128,
                      progress: bool = True, **generate_kwargs):
    """Sequence-level KD data: translate ``dataset[source_column]`` with ``teacher`` (beam search) and return a
    ``datasets.Dataset`` with columns "source", "target" (the teacher's translation) and, when ``target_column`` is
    in the dataset, "reference" (the original target). It is also saved to ``output_dir/dataset``
    (``datasets.load_from_disk``).

    Resumable: rows are translated in shards of ``shard_size`` written atomically to ``output_dir/shards``; a rerun
    with the same sources, settings and teacher (by its weights, wherever it was loaded from) skips finished shards.
    Rerunning with other sources, settings or teacher in the same ``output_dir`` raises a ValueError (the shards
    would mix)."""
    if source_column not in dataset.column_names:
        raise ValueError(f"`source_column`={source_column!r} is not a column of the dataset; allowed: "
                         f"{dataset.column_names}.")
    for name, value in (("shard_size", shard_size), ("batch_size", batch_size), ("num_beams", num_beams)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    sources = list(dataset[source_column])
    shard_dir = os.path.join(str(output_dir), "shards")
    os.makedirs(shard_dir, exist_ok=True)
    manifest = dict(rows=len(sources), sources_sha256=_fingerprint(sources), shard_size=shard_size,
                    num_beams=num_beams, max_new_tokens=max_new_tokens, max_length=max_length,
                    teacher_sha256=_teacher_fingerprint(teacher),
                    generate_kwargs={k: repr(v) for k, v in sorted(generate_kwargs.items())})
    manifest_path = os.path.join(str(output_dir), MANIFEST)
    if os.path.exists(manifest_path):
        with open(manifest_path) as handle:
            previous = json.load(handle)
        if "teacher" in previous and "teacher_sha256" not in previous:  # written before teachers were known by weights
            loaded_from = str(getattr(teacher.config, "_name_or_path", "")) or teacher.config.model_type
            if previous.pop("teacher") == loaded_from:  # the old rule (same folder) still holds: upgrade the manifest
                previous["teacher_sha256"] = manifest["teacher_sha256"]
                if previous == manifest:
                    write_json_atomic(manifest_path, manifest)
        if previous != manifest:
            changed = sorted(k for k in manifest if previous.get(k) != manifest[k])
            raise ValueError(f"`output_dir`={str(output_dir)!r} holds a distillation run with other {changed}; use a "
                             "new output_dir (or delete it) to translate with these settings.")
    else:
        write_json_atomic(manifest_path, manifest)  # a kill never leaves half a manifest (resume would fail on it)

    shards = range(0, len(sources), shard_size)

    def shard_path(start):
        return os.path.join(shard_dir, f"shard-{start // shard_size:06d}.jsonl")

    done = sum(min(shard_size, len(sources) - s) for s in shards if os.path.exists(shard_path(s)))
    bar = tqdm(total=len(sources), initial=done, desc="distill", unit="sent", disable=not progress)
    for start in shards:
        path = shard_path(start)
        if os.path.exists(path):
            continue
        chunk = sources[start : start + shard_size]
        outputs = training.translate(teacher, tokenizer, chunk, num_beams=num_beams, batch_size=batch_size,
                            max_new_tokens=max_new_tokens, max_length=max_length, **generate_kwargs)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            for offset, text in enumerate(outputs):
                handle.write(json.dumps({"index": start + offset, "translation": text}, ensure_ascii=False) + "\n")
        os.replace(tmp, path)  # atomic: a shard is either complete or absent
        bar.update(len(chunk))
    bar.close()

    translations = []
    for start in shards:
        with open(shard_path(start), encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle]
        if [r["index"] for r in rows] != list(range(start, min(start + shard_size, len(sources)))):
            raise ValueError(f"shard {shard_path(start)} is incomplete or corrupt; delete it and rerun.")
        translations += [r["translation"] for r in rows]
    distilled = _distilled(sources, translations, dataset, target_column)
    distilled.save_to_disk(os.path.join(str(output_dir), "dataset"))
    return distilled


def save_translations(path, distilled, **identity):
    """Keep the translations of ``distilled`` (a :func:`translate_dataset` result) in one gzip file ``path``: a header
    line (the row count, the sources' sha256 and ``identity``: what made them), then one JSON string per row."""
    header = dict(rows=len(distilled), sources_sha256=_fingerprint(distilled["source"]), **identity)
    lines = [json.dumps(header)] + [json.dumps(text, ensure_ascii=False) for text in distilled["target"]]
    write_bytes_atomic(str(path), gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), mtime=0))


def load_translations(path, dataset, source_column: str = "source", target_column: str = "target", **identity):
    """:func:`translate_dataset`'s result for ``dataset`` rebuilt from a :func:`save_translations` file, or None where
    there is none; a ValueError naming what differs where the file is of other sources or another ``identity``."""
    if not os.path.isfile(str(path)):
        return None
    with gzip.open(str(path), "rt", encoding="utf-8") as handle:
        found = json.loads(handle.readline())
        translations = [json.loads(line) for line in handle]
    sources = list(dataset[source_column])
    header = dict(rows=len(sources), sources_sha256=_fingerprint(sources), **identity)
    changed = sorted(key for key in header if found.get(key) != header[key])
    if changed or len(translations) != len(sources):
        raise ValueError(f"{str(path)!r} holds translations of another teacher or data ({changed or ['rows']} differ "
                         f"from this run's); allowed: translate again with this teacher.")
    return _distilled(sources, translations, dataset, target_column)


def _distilled(sources, translations, dataset, target_column):
    """The KD dataset: "source", the teacher's "target" and, where ``dataset`` has ``target_column``, "reference"."""
    columns = {"source": sources, "target": translations}
    if target_column is not None and target_column in dataset.column_names:
        columns["reference"] = list(dataset[target_column])
    return datasets.Dataset.from_dict(columns)


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------
def add_distill_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--teacher", required=True, help="teacher folder or Hub id (AutoModelForSeq2SeqLM)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --teacher)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="folder with {split}.{src}[.gz] / {split}.{tgt}[.gz] line-aligned files")
    source.add_argument("--dataset", help="a datasets.save_to_disk folder with 'source' (and 'target') columns")
    parser.add_argument("--split", default="train", help="split of --data to translate (default train)")
    parser.add_argument("--src", default="en", help="source language suffix of the --data files (default en)")
    parser.add_argument("--tgt", default="de", help="target language suffix (kept as the reference; default de)")
    parser.add_argument("--out", required=True, help="output folder (shards, manifest, dataset/)")
    parser.add_argument("--num-beams", type=int, default=4, help="the teacher's beam size (default 4)")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per generate() call (default 64)")
    parser.add_argument("--shard-size", type=int, default=1000,
                        help="sentences per shard written (an interrupted run resumes at the first missing shard)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="output limit (default: 1.5 x the batch's source length + 10)")
    parser.add_argument("--max-examples", type=int, default=None, help="translate only the first N rows")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a teacher folder's own modeling code (not needed for hf_hardattn models)")


def run_distill(args):
    try:
        check_model_type(args.teacher, "--teacher")
        teacher = AutoModelForSeq2SeqLM.from_pretrained(args.teacher, trust_remote_code=args.trust_remote_code).eval()
    except (OSError, ValueError) as error:
        raise ValueError(f"--teacher={args.teacher!r} does not load as a seq2seq model (a saved folder, or a Hub id "
                         f"with HF_HUB_OFFLINE=0): {' '.join(str(error).split())[:200]}") from error
    if torch.cuda.is_available():
        teacher = teacher.cuda()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.teacher)
    if args.data:
        dataset = load_parallel(args.data, args.split, src=args.src, tgt=args.tgt)
    else:
        dataset = datasets.load_from_disk(args.dataset)
    if args.max_examples is not None:
        dataset = dataset.select(range(min(args.max_examples, len(dataset))))
    distilled = translate_dataset(teacher, tokenizer, dataset, args.out, num_beams=args.num_beams,
                                  batch_size=args.batch_size, shard_size=args.shard_size,
                                  max_new_tokens=args.max_new_tokens)
    print(f"distilled {len(distilled)} sentences -> {os.path.join(args.out, 'dataset')}", flush=True)
    return distilled


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_hardattn.tools.distill",
                                     description="Sequence-level KD: translate a dataset with a teacher model.")
    add_distill_arguments(parser)
    run_distill(parser.parse_args(argv))
    return 0


__all__ = ["KD_SCHEMES", "DEFAULT_KD_SCHEME", "check_kd_scheme", "check_compatible",
           "tokenize_kd_dataset", "DistillationTrainer", "train_kd_stage", "train_two_stage", "translate_dataset",
           "save_translations", "load_translations",
           "add_distill_arguments", "run_distill"]

if __name__ == "__main__":
    sys.exit(main())
