"""Knowledge distillation from a Transformer teacher into a (hybrid) student (hybrid paper, Sec. 2.2).

* Sequence-level KD (Kim & Rush, 2016): :func:`translate_dataset` translates the source side of a dataset with any
  teacher ``AutoModelForSeq2SeqLM`` (beam search, batched, tqdm progress bar) and writes a distilled dataset whose
  "target" is the teacher's output (the original target is kept as "reference"). Work is written shard by shard
  (atomic renames), so an interrupted run resumes without redoing finished shards.
  CLI: ``hf-hardattn distill --teacher DIR --data FOLDER --split train --out DIR`` (or ``python -m
  hf_hardattn.distill ...``).
* Word-level KD, the paper's Eq. 1: :class:`DistillationTrainer`, a ``Seq2SeqTrainer`` whose loss per target token is
  NLL(y_t) + lambda * KL(P_teacher(. | y_<t, x) || P_student(. | y_<t, x)) (lambda = 1 in the paper; Eq. 1 maximises
  log-likelihood minus lambda * KL, we minimise the negation), normalised by the number of target tokens. The
  teacher is frozen (eval mode, ``requires_grad=False``, run under ``torch.no_grad``). Student and teacher must share
  the tokenizer (same vocabulary and special token ids); anything else raises a ValueError.

Tooling (not runtime code): may import datasets / tqdm.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
from transformers import Seq2SeqTrainer

from .safe_io import write_json_atomic

MANIFEST = "kd_manifest.json"


# ----------------------------------------------------------------------------------------------------------------
# Eq. 1 loss
# ----------------------------------------------------------------------------------------------------------------
def kd_loss(student_logits, teacher_logits, labels, kd_lambda: float = 1.0, num_items_in_batch=None,
            return_parts: bool = False):
    """Eq. 1, negated and per token: sum over target tokens (labels != -100) of
    -log P_s(y_t) + kd_lambda * KL(P_t || P_s), divided by ``num_items_in_batch`` (or the number of target tokens).

    KL(P_t || P_s) = sum_v P_t(v) (log P_t(v) - log P_s(v)); terms with P_t(v) = 0 count 0. With ``return_parts``
    also returns the (normalised) NLL and KL sums."""
    if not kd_lambda >= 0:
        raise ValueError(f"`kd_lambda` must be >= 0, got {kd_lambda!r}.")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ: "
            "`teacher_model` must share the student's tokenizer/vocabulary (same vocabulary size)."
        )
    mask = labels != -100
    log_student = torch.log_softmax(student_logits.float(), dim=-1)
    log_teacher = torch.log_softmax(teacher_logits.float(), dim=-1)
    nll = -log_student.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    p_teacher = log_teacher.exp()
    kl = torch.where(p_teacher > 0, p_teacher * (log_teacher - log_student), 0.0).sum(-1)
    denominator = mask.sum() if num_items_in_batch is None else num_items_in_batch
    # an all-ignored batch (every label -100) gives 0, not 0 / 0 = NaN
    denominator = denominator.clamp(min=1) if isinstance(denominator, torch.Tensor) else max(denominator, 1)
    nll_sum, kl_sum = nll[mask].sum() / denominator, kl[mask].sum() / denominator
    loss = nll_sum + kd_lambda * kl_sum
    return (loss, nll_sum, kl_sum) if return_parts else loss


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


class DistillationTrainer(Seq2SeqTrainer):
    """``Seq2SeqTrainer`` with the hybrid paper's Eq. 1 objective: NLL + ``kd_lambda`` * KL(teacher || student) per
    target token. Extra arguments: ``teacher_model`` (required; frozen here), ``kd_lambda`` (default 1.0),
    ``teacher_tokenizer`` (optional; compared with ``processing_class``). Use it like ``Seq2SeqTrainer`` (the data
    collator may or may not build ``decoder_input_ids``; both models get the same ones). The last training step's
    loss parts are in ``trainer.kd_parts`` ({"nll", "kl"})."""

    def __init__(self, *args, teacher_model=None, kd_lambda: float = 1.0, teacher_tokenizer=None, **kwargs):
        if teacher_model is None:
            raise ValueError("`teacher_model` is required (a seq2seq model sharing the student's tokenizer).")
        if not (isinstance(kd_lambda, (int, float)) and kd_lambda >= 0):
            raise ValueError(f"`kd_lambda` must be a number >= 0, got {kd_lambda!r}.")
        super().__init__(*args, **kwargs)
        check_compatible(self.model, teacher_model, self.processing_class, teacher_tokenizer)
        self.kd_lambda = float(kd_lambda)
        self.teacher_model = teacher_model.to(self.args.device).eval()
        self.teacher_model.requires_grad_(False)
        self.kd_parts = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if "labels" not in inputs:
            raise ValueError("DistillationTrainer needs `labels` in every batch (the data targets of Eq. 1).")
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        if inputs.get("decoder_input_ids") is None:
            inputs["decoder_input_ids"] = self.accelerator.unwrap_model(model).prepare_decoder_input_ids_from_labels(
                labels)
        outputs = model(**inputs, use_cache=False)
        self.teacher_model.eval()  # stays frozen even if someone called .train() on it
        with torch.no_grad():
            teacher_logits = self.teacher_model(**inputs, use_cache=False).logits
        # The Trainer divides by the accumulation steps itself unless the model takes loss kwargs (then
        # num_items_in_batch is the token count of the whole accumulated batch): normalise to match.
        scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        loss, nll, kl = kd_loss(outputs.logits, teacher_logits.to(outputs.logits.device), labels, self.kd_lambda,
                                num_items_in_batch if scaled else None, return_parts=True)
        if scaled and self.args.average_tokens_across_devices:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        self.kd_parts = {"nll": nll.detach().item(), "kl": kl.detach().item()}
        outputs["loss"] = loss
        return (loss, outputs) if return_outputs else loss


# ----------------------------------------------------------------------------------------------------------------
# Sequence-level KD
# ----------------------------------------------------------------------------------------------------------------
def _fingerprint(sources) -> str:
    digest = hashlib.sha256()
    for text in sources:
        digest.update(text.encode("utf-8") + b"\0")
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
    with the same sources and settings skips finished shards. Rerunning with other sources/settings in the same
    ``output_dir`` raises a ValueError (the shards would mix)."""
    import datasets
    from tqdm.auto import tqdm

    from .training import translate

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
                    teacher=str(getattr(teacher.config, "_name_or_path", "")) or teacher.config.model_type,
                    generate_kwargs={k: repr(v) for k, v in sorted(generate_kwargs.items())})
    manifest_path = os.path.join(str(output_dir), MANIFEST)
    if os.path.exists(manifest_path):
        with open(manifest_path) as handle:
            previous = json.load(handle)
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
        outputs = translate(teacher, tokenizer, chunk, num_beams=num_beams, batch_size=batch_size,
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
    columns = {"source": sources, "target": translations}
    if target_column is not None and target_column in dataset.column_names:
        columns["reference"] = list(dataset[target_column])
    distilled = datasets.Dataset.from_dict(columns)
    distilled.save_to_disk(os.path.join(str(output_dir), "dataset"))
    return distilled


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------
def add_distill_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--teacher", required=True, help="teacher folder or Hub id (AutoModelForSeq2SeqLM)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --teacher)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="folder with {split}.{src}[.gz] / {split}.{tgt}[.gz] line-aligned files")
    source.add_argument("--dataset", help="a datasets.save_to_disk folder with 'source' (and 'target') columns")
    parser.add_argument("--split", default="train")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--out", required=True, help="output folder (shards, manifest, dataset/)")
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--max-examples", type=int, default=None, help="translate only the first N rows")
    parser.add_argument("--trust-remote-code", action="store_true")


def run_distill(args):
    import datasets
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from . import MODEL_CLASSES  # noqa: F401  (registers the hf_hardattn model types)
    from .data import load_parallel

    teacher = AutoModelForSeq2SeqLM.from_pretrained(args.teacher, trust_remote_code=args.trust_remote_code).eval()
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
    parser = argparse.ArgumentParser(prog="python -m hf_hardattn.distill",
                                     description="Sequence-level KD: translate a dataset with a teacher model.")
    add_distill_arguments(parser)
    run_distill(parser.parse_args(argv))
    return 0


__all__ = ["kd_loss", "check_compatible", "DistillationTrainer", "translate_dataset", "add_distill_arguments",
           "run_distill"]

if __name__ == "__main__":
    sys.exit(main())
