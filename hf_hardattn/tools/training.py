"""Training and evaluation helpers for the hf_hardattn models (tooling, not runtime code).

* :func:`tokenize_dataset` - "source"/"target" strings -> input_ids / attention_mask / labels;
* :func:`train_seq2seq` - transformers' ``Seq2SeqTrainer`` + ``DataCollatorForSeq2Seq`` with the Transformer
  recipe (Adam betas (0.9, 0.98), warm-up then inverse-square-root decay, label smoothing from the model config),
  length-grouped batches (an approximation of token-based batching), an optional wall-clock budget in minutes
  and a tqdm progress bar;
* :class:`Convergence` - stop when a validation metric (:func:`validation_loss` or BLEU) has not improved for a
  number of evaluations, recording the curve; :class:`OptimizerCarry` - a later ``train_seq2seq`` call continues the
  optimizer and learning-rate schedule of an earlier one (checkpoints: complete or not, averaged, resumed:
  :mod:`hf_hardattn.tools.checkpointing`);
* :func:`translate`, :func:`bleu` (detokenised sacrebleu), :func:`accuracy` (exact match) - batched
  ``generate()`` over inputs sorted by length;
* :func:`translation_metrics` - the Trainer's ``compute_metrics`` (``predict_with_generate``): BLEU and chrF from the
  package's ``evaluate`` metric (:mod:`hf_hardattn.tools.metrics`, offline);
* :func:`decode_speed` - sentences per second of ``generate()`` with a fixed number of new tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging as stdlib_logging
import math
import os
import platform
import shutil
import statistics
import sys
import time

import sacrebleu
import torch
from tqdm.auto import tqdm
from transformers import (
    DataCollatorForSeq2Seq,
    PrinterCallback,
    ProgressCallback,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    TrainerCallback,
)
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from hf_hardattn_cli.scores import corpus_scores

from . import metrics
from .checkpointing import resolve_checkpoint
from .trainer_card import Seq2SeqCardTrainer

logger = logging.get_logger(__name__)

SCHEDULES = ("inverse_sqrt", "linear", "constant_with_warmup", "cosine")


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
def tokenize_dataset(ds, tokenizer, max_length: int = 128, source_column: str = "source",
                     target_column: str = "target", num_proc: int | None = None):
    """Map a Dataset (or DatasetDict) of strings to model inputs: ``source`` -> ``input_ids`` / ``attention_mask``,
    ``target`` -> ``labels`` (both end with ``</s>``, truncated to ``max_length`` tokens). The other columns are
    dropped."""
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"`max_length` must be an integer >= 2, got {max_length!r}.")
    columns = ds.column_names
    names = columns if isinstance(columns, list) else next(iter(columns.values()))
    for name, column in (("source_column", source_column), ("target_column", target_column)):
        if column not in names:
            raise ValueError(f"`{name}`={column!r} is not a column of the dataset; allowed: {names}.")

    def encode(batch):
        out = tokenizer(batch[source_column], max_length=max_length, truncation=True)
        out["labels"] = tokenizer(text_target=batch[target_column], max_length=max_length, truncation=True)["input_ids"]
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"], "labels": out["labels"]}

    return ds.map(encode, batched=True, remove_columns=names, num_proc=num_proc, desc="tokenize")


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------
class TimeBudget(TrainerCallback):
    """Stops training once ``minutes`` of wall-clock time have passed since training began (checked after every
    optimizer step, so the last step may overrun by one step)."""

    def __init__(self, minutes: float):
        self.seconds, self.start = 60.0 * minutes, None

    def elapsed(self) -> float:
        return 0.0 if self.start is None else time.perf_counter() - self.start

    def fraction(self) -> float:
        """Share of the budget spent (0 before training begins, may pass 1 by one step)."""
        return self.elapsed() / self.seconds

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.elapsed() >= self.seconds:
            control.should_training_stop = True


class ProgressBar(TrainerCallback):
    """One tqdm bar: over seconds when training has a time budget, else over optimizer steps; shows the step, the
    last logged loss and learning rate."""

    def __init__(self, budget: TimeBudget | None = None, desc: str = "train"):
        self.budget, self.desc, self.bar, self.postfix = budget, desc, None, {}

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.budget is not None:
            self.bar = tqdm(total=round(self.budget.seconds), desc=self.desc, unit="s", dynamic_ncols=True)
        else:
            self.bar = tqdm(total=state.max_steps, desc=self.desc, unit="step", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is None:
            return
        target = round(min(self.budget.elapsed(), self.budget.seconds)) if self.budget is not None else state.global_step
        self.bar.update(max(0, target - self.bar.n))
        if self.budget is not None:
            self.postfix["step"] = state.global_step
        self.bar.set_postfix(self.postfix, refresh=False)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs:
            if "loss" in logs:
                self.postfix["loss"] = f"{logs['loss']:.3f}"
            if "learning_rate" in logs:
                self.postfix["lr"] = f"{logs['learning_rate']:.2e}"
            if "eval_loss" in logs:
                self.postfix["eval_loss"] = f"{logs['eval_loss']:.3f}"

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            if self.budget is None:
                self.bar.update(max(0, state.global_step - self.bar.n))
            self.bar.set_postfix(self.postfix)
            self.bar.close()
            self.bar = None


PATIENCE_METRICS = {"val_loss": "min", "val_bleu": "max"}  # metric -> the direction that is an improvement


class Convergence(TrainerCallback):
    """Training to convergence: every ``every`` optimizer steps, ``evaluate(model)`` gives the validation metric
    (``metric``, a key of :data:`PATIENCE_METRICS`: "val_loss" lower is better, "val_bleu" higher); training stops
    once ``patience`` evaluations in a row have not improved on the best so far (strictly), but not before step
    ``min_steps``. The run's cap (``max_steps`` / minutes) may end it first: :meth:`record` then says
    ``converged`` False. :meth:`record` also holds the curve [[step, value], ...], the best value and its step; each
    evaluation is also appended to the Trainer's ``state.log_history`` (so to every checkpoint's trainer_state.json),
    with ``converged`` and the wall-clock ``minutes`` of training so far. A run resumed from a checkpoint
    (``resume_from_checkpoint``) takes the rule's state back from that log (:meth:`restore`), minutes included, so it
    stops where the uninterrupted run stops; the step that stops training is saved as a checkpoint too (when the run
    saves checkpoints by steps), so a finished run's last checkpoint says it finished."""

    def __init__(self, evaluate, every: int, patience: int, metric: str = "val_loss", min_steps: int = 0):
        for name, value in (("every", every), ("patience", patience)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if metric not in PATIENCE_METRICS:
            raise ValueError(f"`metric` must be one of {list(PATIENCE_METRICS)}, got {metric!r}.")
        if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 0:
            raise ValueError(f"`min_steps` must be an integer >= 0, got {min_steps!r}.")
        self.evaluate, self.every, self.patience, self.metric, self.min_steps = evaluate, every, patience, metric, min_steps
        self.curve, self.best, self.best_step, self.since_best, self.converged = [], None, None, 0, False
        self.last_step, self.minutes_before, self.start, self.resumed_at = 0, 0.0, None, None

    def observe(self, step: int, value: float) -> bool:
        """Record ``value`` at ``step``; True when training should stop (patience spent, ``min_steps`` reached)."""
        value = float(value)
        self.curve.append([step, value])
        better = self.best is None or (value < self.best if PATIENCE_METRICS[self.metric] == "min" else value > self.best)
        if better:
            self.best, self.best_step, self.since_best = value, step, 0
        else:
            self.since_best += 1
        self.converged = self.since_best >= self.patience and step >= self.min_steps
        return self.converged

    def restore(self, state) -> None:
        """The rule's state after the evaluations logged in ``state`` (a TrainerState, e.g. of the checkpoint a run
        resumes from): the logged values are observed again in order, so best, patience and ``converged`` are those
        of the run that logged them; ``resumed_at`` is that state's step."""
        self.curve, self.best, self.best_step, self.since_best, self.converged = [], None, None, 0, False
        self.minutes_before = 0.0
        for entry in state.log_history:
            if self.metric in entry and "best_step" in entry and entry["step"] <= state.global_step:
                self.observe(entry["step"], entry[self.metric])
                self.minutes_before = entry.get("minutes", self.minutes_before)
        self.last_step = self.resumed_at = state.global_step

    def minutes(self) -> float:
        """Wall-clock minutes of training so far, the runs this one resumed included (up to their last evaluation)."""
        return self.minutes_before + (0.0 if self.start is None else (time.perf_counter() - self.start) / 60)

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()
        if state.global_step > 0:  # resumed from a checkpoint: its log holds the evaluations so far
            self.restore(state)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.last_step = state.global_step
        if state.global_step % self.every == 0:
            stop = self.observe(state.global_step, self.evaluate(model))
            # the curve so far in the Trainer's log (each checkpoint's trainer_state.json): a long run can be watched,
            # and a resumed one takes the rule's state from it
            state.log_history.append({"step": state.global_step, self.metric: self.curve[-1][1],
                                      f"best_{self.metric}": self.best, "best_step": self.best_step,
                                      "converged": self.converged, "minutes": round(self.minutes(), 3)})
            control.should_training_stop |= stop
            if stop and _value(getattr(args, "save_strategy", None)) == "steps":  # the run's end, on disk
                control.should_save = True

    def record(self) -> dict:
        return dict(converged=self.converged, metric=self.metric, patience=self.patience, eval_steps=self.every,
                    min_steps=self.min_steps, steps_reached=self.last_step, best=self.best, best_step=self.best_step,
                    curve=self.curve, resumed_at=self.resumed_at)


class OptimizerCarry:
    """One optimizer and learning-rate schedule for successive :func:`train_seq2seq` calls on one model
    (``carry=``): the first call creates them as usual and leaves them here; every later call continues them (Adam's
    moments and the schedule's step where the previous call left them: no new warm-up) instead of starting anew, e.g.
    the hybrid's Eq. 1 stage as a continuation of its MLE stage. ``steps``: optimizer steps taken under it so far."""

    def __init__(self):
        self.optimizer, self.lr_scheduler, self.steps = None, None, 0

    def take(self, trainer):
        optimizer = trainer.optimizer
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> the torch optimizer
        self.lr_scheduler = trainer.lr_scheduler
        self.steps += trainer.state.global_step


class EpochLengthGroupedSampler(LengthGroupedSampler):
    """transformers' ``LengthGroupedSampler`` whose order depends on (seed, epoch) only (``set_epoch``, called by the
    Trainer every epoch), like accelerate's seedable random sampler: with the global RNG, a run resumed from a
    checkpoint would draw another order for the epoch it resumes in than the uninterrupted run drew."""

    def __init__(self, batch_size: int, lengths: list, seed: int):
        super().__init__(batch_size, lengths=lengths)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = int(epoch)

    def __iter__(self):
        self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return super().__iter__()


class Seq2SeqLengthTrainer(Seq2SeqCardTrainer):
    """``Seq2SeqTrainer`` (with the model's own card on ``push_to_hub``, :class:`Seq2SeqCardTrainer`) whose
    ``group_by_length`` batches group examples by max(source, target) length (the
    count of a token-based batch) instead of the source length alone: with source-only grouping a batch's targets
    vary in length and on Multi30k 39% of the padded target positions are padding (11% here)."""

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if (self.args.train_sampling_strategy != "group_by_length" or getattr(self, "example_lengths", None) is None
                or dataset is None or len(dataset) != len(self.example_lengths)):
            return super()._get_train_sampler(train_dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return EpochLengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps,
                                         lengths=self.example_lengths, seed=seed)

    def _save_checkpoint(self, model, trial):
        """transformers' checkpoint save, into a folder that does not exist yet: a run resumed from an earlier step
        rewrites the checkpoints after it, and writing into the old folder would mix its files (a complete-looking
        trainer_state.json) with a new save that a kill left half done. The old one is removed first; this run
        writes it again. (The Trainer writes trainer_state.json last, which
        :func:`~hf_hardattn.tools.checkpointing.checkpoint_problem` relies on.)"""
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):
            shutil.rmtree(folder)
        return super()._save_checkpoint(model, trial)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        """transformers' step, leaving the model's generation config as it was: with ``predict_with_generate`` it
        fills every unset field with transformers' default (``num_beams`` 1, ...), which each checkpoint would then
        save and the final model keep, so that a beam set later only where unset
        (``set_translation_generation_defaults``) would never be set."""
        kept = copy.deepcopy(self.model.generation_config)
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
        finally:
            self.model.generation_config = kept

    def create_scheduler(self, num_training_steps, optimizer=None):
        """With ``time_decay`` (a :func:`time_decay_schedule` factor) the learning rate follows wall-clock time
        instead of steps."""
        factor = getattr(self, "time_decay", None)
        if factor is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, factor)
        self._created_lr_scheduler = True
        return self.lr_scheduler


def time_decay_schedule(budget: "TimeBudget", warmup_steps: int, kind: str):
    """LR factor of step s: s / warmup_steps during the warm-up, then 1 - p ("linear") or (1 + cos(pi p)) / 2
    ("cosine"), where p is the fraction of the time left after the warm-up that has passed (0 -> 1 at the budget)."""
    if kind not in ("linear", "cosine"):
        raise ValueError(f"time-based decay needs `lr_scheduler` 'linear' or 'cosine', got {kind!r}.")
    warm_end = []  # budget fraction at the end of the warm-up

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        if not warm_end:
            warm_end.append(min(budget.fraction(), 0.999))
        progress = min(1.0, max(0.0, (budget.fraction() - warm_end[0]) / (1.0 - warm_end[0])))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def example_lengths(dataset):
    """max(len(input_ids), len(labels)) per example of a tokenized dataset (None if either column is missing)."""
    if not all(name in getattr(dataset, "column_names", ()) for name in ("input_ids", "labels")):
        return None
    return [max(len(a), len(b)) for a, b in zip(dataset["input_ids"], dataset["labels"])]


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU runs bf16 matrix products natively (oneDNN's bf16 kernels: AVX512 or AMX). Without them
    (e.g. AVX2-only CPUs) torch falls back to kernels ~100x slower than fp32 (measured: 0.6 vs 59 GFLOP/s)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def machine() -> dict:
    """Where a measurement ran (CPU, its torch capability, native bf16, threads, torch, GPU): minutes of training and
    sentences/s only compare between runs on the same machine."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    return dict(cpu=cpu, cpu_capability=torch.backends.cpu.get_cpu_capability(),
                cpu_bf16_matmul=cpu_has_bf16_matmul(), threads=torch.get_num_threads(), torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def check_bf16(bf16: bool, name: str = "bf16", fix: str = "Pass bf16=False (fp32)") -> None:
    """Refuse bf16 autocast training on a CPU without native bf16 matrix products (it would run ~100x slower than
    fp32, not faster); ``name`` and ``fix`` word the error for the caller's own parameter."""
    if bf16 and not torch.cuda.is_available() and not cpu_has_bf16_matmul():
        raise ValueError(
            f"`{name}` asks for bf16 autocast training, but this CPU (torch capability "
            f"{torch.backends.cpu.get_cpu_capability()}) has no native bf16 matrix products (oneDNN needs AVX512 or "
            f"AMX): its bf16 GEMMs run ~100x slower than fp32. {fix}.")


def check_fp16(fp16: bool, name: str = "fp16") -> None:
    """Refuse fp16 mixed-precision training without a GPU (train_seq2seq trains on CUDA where torch sees it, else on
    the CPU): accelerate runs fp16 autocast and its loss scaler on accelerators only and leaves both out on a CPU, so
    the run would silently train in fp32."""
    if fp16 and not torch.cuda.is_available():
        raise ValueError(
            f"`{name}` asks for fp16 mixed precision (autocast with a loss scaler), which accelerate runs on a GPU "
            f"only; torch sees no CUDA device here, and on the CPU the run would silently train in fp32. Train in "
            f"fp32, or in bf16 on a CPU with AVX512 or AMX.")


# Seq2SeqTrainingArguments fields that train_seq2seq sets from a parameter of its own (pass that one instead)
RENAMED_ARGUMENTS = {"per_device_train_batch_size": "batch_size", "lr_scheduler_type": "lr_scheduler",
                     "num_train_epochs": "epochs", "train_sampling_strategy": "group_by_length"}


def _value(option):
    return getattr(option, "value", option)  # transformers' enums (SaveStrategy.STEPS) or their strings


def training_arguments(output_dir, batch_size, eval_ds, eval_steps, fixed: dict, extra: dict):
    """``Seq2SeqTrainingArguments`` of :func:`train_seq2seq`: ``fixed`` (set from its parameters), then the recipe's
    defaults, each overridden by the caller's ``extra`` keywords (any other Seq2SeqTrainingArguments field)."""
    fields = {field.name for field in dataclasses.fields(Seq2SeqTrainingArguments) if field.init}
    for name in extra:
        if name in RENAMED_ARGUMENTS:
            raise ValueError(f"`{name}` is set by train_seq2seq's own `{RENAMED_ARGUMENTS[name]}`: pass "
                             f"{RENAMED_ARGUMENTS[name]}=... instead.")
        if name not in fields:
            close = difflib.get_close_matches(name, sorted(fields), n=3)
            raise ValueError(f"`{name}` is neither a parameter of train_seq2seq nor a Seq2SeqTrainingArguments field"
                             + (f"; did you mean {close}?" if close else "."))
    save_strategy = _value(extra.get("save_strategy", "steps" if "save_steps" in extra else "no"))
    if save_strategy == "no" and "save_steps" in extra:
        raise ValueError(f"`save_steps`={extra['save_steps']!r} asks for checkpoints, but `save_strategy`='no'; "
                         f"allowed: save_strategy 'steps' (the default when save_steps is given), 'epoch' or 'best'.")
    defaults = dict(
        per_device_eval_batch_size=batch_size, adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-9,
        eval_strategy="steps" if (eval_ds is not None and eval_steps) else "no", save_strategy=save_strategy,
        report_to=[], dataloader_num_workers=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
    )
    return Seq2SeqTrainingArguments(output_dir=str(output_dir), **fixed, **{**defaults, **extra})


WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")  # accelerate's


def check_processes_started(environ=None) -> None:
    """Refuse a run that ``accelerate launch`` started as one process although more were asked for.

    ``accelerate launch --cpu --num_processes 2`` (or ``--num_processes 2`` without ``--multi_gpu`` where no two GPUs
    are seen, or ``--num_machines 2`` without ``--multi_gpu``) goes through accelerate's simple launcher, which starts
    ONE process; for a count above 1 it exports ``MASTER_ADDR`` / ``MASTER_PORT`` but no world size
    (``accelerate/utils/launch.py``, ``prepare_simple_launcher_cmd_env``), and the run would train alone. That
    launcher is the one that sets ``ACCELERATE_USE_CPU``; the others (torchrun underneath ``--multi_gpu``, mpirun)
    set a world size (``WORLD_SIZE``, or MPI's, as accelerate reads them). A ValueError naming the commands that start
    the processes.
    """
    environ = os.environ if environ is None else environ
    if "ACCELERATE_USE_CPU" not in environ or "MASTER_ADDR" not in environ:
        return
    if any(name in environ for name in WORLD_SIZE_VARIABLES):
        return
    raise ValueError(
        "`accelerate launch` started this run as a single process although more processes were asked for "
        "(--num_processes or --num_machines above 1 without --multi_gpu, e.g. with --cpu: accelerate's simple "
        f"launcher starts one process, sets MASTER_ADDR={environ['MASTER_ADDR']} and no WORLD_SIZE). Start N "
        "processes with `accelerate launch --multi_gpu --num_processes N -m hf_hardattn train ...` (N gloo "
        "processes on a CPU-only machine) or `torchrun --nproc_per_node N -m hf_hardattn train ...`; for one process "
        "leave out --num_processes (or unset MASTER_ADDR if your shell exports it).")


def end_processes(status: int = 0) -> None:
    """End the process of a multi-process run here, with ``status`` (a no-op otherwise): every process waits at a
    barrier until process 0 has saved, flushes its output and leaves through ``os._exit``, without the interpreter's
    teardown. That teardown destroys the gloo process group (through DDP's reducer, when the Trainer is freed) while
    holding the GIL and joins the group's worker thread, which may still be releasing a finished collective's
    Python-owned tensors and waits for the GIL: a deadlock (1 of ~15 two-process runs of the tests on a 2-core AMD
    EPYC; the stacks: ``~ProcessGroupGloo`` -> ``std::thread::join`` in the main thread, ``decref_pyobject`` ->
    ``gil_scoped_acquire`` in ``ProcessGroupGloo::runLoop``). ``destroy_process_group()`` first does not help (DDP's
    reducer keeps the group), and left to interpreter exit a gloo process aborted at random ("terminate called
    without an active exception")."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        stdlib_logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def save_decoding_setting(model, args) -> None:
    """Write the decoding setting of the Trainer's evaluations (``generation_num_beams``, ``generation_max_length``,
    with ``predict_with_generate``) into ``model.generation_config``: every checkpoint and the final model then save
    the setting their BLEU was measured with, and ``generate()`` without arguments decodes so."""
    if not args.predict_with_generate:
        return
    generation = model.generation_config
    if args.generation_num_beams is not None:
        generation.num_beams = args.generation_num_beams
    if args.generation_max_length is not None:
        generation.max_length, generation.max_new_tokens = args.generation_max_length, None


def decoding_setting(model) -> str:
    """The decoding setting of ``model``'s generation config in words, e.g. "beam 4, at most 128 new tokens": what
    :func:`translate` and the Trainer's evaluations decode with when given no other, stated beside a score."""
    generation = model.generation_config
    length = (f"at most {generation.max_new_tokens} new tokens" if generation.max_new_tokens is not None
              else f"max_length {generation.max_length}")
    return f"beam {generation.num_beams or 1}, {length}"


def train_seq2seq(
    model,
    tokenizer,
    train_ds,
    eval_ds=None,
    output_dir: str = "outputs/train",
    max_steps: int | None = None,
    minutes: float | None = None,
    batch_size: int = 64,
    learning_rate: float = 5e-4,
    warmup_steps: int = 1000,
    seed: int = 0,
    lr_scheduler: str = "inverse_sqrt",
    epochs: float = 1.0,
    eval_steps: int | None = None,
    logging_steps: int = 50,
    group_by_length: bool = True,
    progress: bool = True,
    max_grad_norm: float = 1.0,
    weight_decay: float = 0.0,
    callbacks=None,
    compute_metrics=None,
    trainer_class=None,
    trainer_kwargs: dict | None = None,
    resume_from_checkpoint=None,
    carry: OptimizerCarry | None = None,
    **training_args,
) -> Seq2SeqTrainer:
    """Train ``model`` on ``train_ds`` (a tokenized Dataset, see :func:`tokenize_dataset`) and return the
    ``Seq2SeqTrainer`` (``trainer.state.log_history`` holds the losses). The model is left in eval mode.

    Length: ``max_steps`` optimizer steps, or ``minutes`` of wall-clock training (checked after every step), or
    both (whichever ends first), or neither (``epochs`` passes over the data). Optimizer: Adam(W) with betas
    (0.9, 0.98), eps 1e-9, ``weight_decay`` 0 by default (= Adam), gradient clipping ``max_grad_norm``.
    Schedule ``lr_scheduler``: "inverse_sqrt" (Vaswani et al. 2017: linear warm-up for ``warmup_steps``, then
    lr * sqrt(warmup / step)), "linear", "cosine" (these two decay to 0 at ``max_steps``; with only ``minutes``, at
    the end of the time budget, see :func:`time_decay_schedule`) or "constant_with_warmup". ``bf16=True`` (a
    ``Seq2SeqTrainingArguments`` field) trains under bf16 autocast, on CPU too (2x faster steps on CPUs with AMX; a
    ValueError on CPUs without native bf16 matrix products, see :func:`check_bf16`); ``fp16=True`` under fp16
    autocast with a loss scaler, on a GPU (a ValueError without one, see :func:`check_fp16`); the returned model runs
    in its own precision again.
    ``group_by_length`` batches sentences of similar max(source, target) length (little padding; an
    approximation of the papers' token-based batches, see :class:`Seq2SeqLengthTrainer`). ``compute_metrics`` goes to
    the Trainer (its evaluations). ``trainer_class`` (a :class:`Seq2SeqLengthTrainer` subclass, e.g.
    ``hf_hardattn.tools.distill.DistillationTrainer``) with its own ``trainer_kwargs`` replaces the plain trainer.

    Other keyword arguments are ``Seq2SeqTrainingArguments`` fields and override the recipe's defaults (e.g.
    ``save_strategy``, ``report_to``, ``adam_beta2``); the fields set from this function's own parameters
    (``per_device_train_batch_size`` = ``batch_size``, ``lr_scheduler_type``, ``num_train_epochs``,
    ``train_sampling_strategy``) are refused with the parameter to use. Checkpoints: none by default;
    ``save_steps=N`` saves one every N steps (``save_strategy`` "steps"). ``resume_from_checkpoint``: True resumes
    from the last *complete* checkpoint in ``output_dir`` (one that a kill left half written is skipped, see
    :func:`~hf_hardattn.tools.checkpointing.checkpoint_problem`), a path from that checkpoint (saved with its
    optimizer state, not ``save_only_model``); the run then ends with the weights an uninterrupted run would have (same data order and RNG
    states, a :class:`Convergence` rule's state from the checkpoint's log; with ``minutes``, the time budget starts
    again).
    ``carry`` (an :class:`OptimizerCarry`): the first call with it creates the optimizer and schedule as usual and
    leaves them there; a later call continues them (``learning_rate``, ``warmup_steps`` and ``lr_scheduler`` are then
    the first call's).
    """
    check_processes_started()
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"`max_steps` must be a positive integer or None, got {max_steps!r}.")
    if minutes is not None and not minutes > 0:
        raise ValueError(f"`minutes` must be > 0 or None, got {minutes!r}.")
    if lr_scheduler not in SCHEDULES:
        raise ValueError(f"`lr_scheduler` must be one of {SCHEDULES}, got {lr_scheduler!r}.")
    if lr_scheduler in ("linear", "cosine") and max_steps is None and minutes is None:
        raise ValueError(f"`lr_scheduler`={lr_scheduler!r} decays to 0 at `max_steps` (or, with only `minutes`, at the "
                         "end of the time budget), so it needs one of them.")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
    if trainer_class is not None and not (isinstance(trainer_class, type)
                                          and issubclass(trainer_class, Seq2SeqLengthTrainer)):
        raise ValueError(f"`trainer_class` must be a subclass of Seq2SeqLengthTrainer, got {trainer_class!r}.")
    check_bf16(training_args.get("bf16", False))
    check_fp16(training_args.get("fp16", False))
    for name, dataset in (("train_ds", train_ds), ("eval_ds", eval_ds)):
        if dataset is not None and hasattr(dataset, "__len__") and len(dataset) == 0:
            raise ValueError(f"`{name}` is empty (0 examples); allowed: a tokenized dataset with at least one example"
                             + (" (or eval_ds=None)." if name == "eval_ds" else "."))
    steps = max_steps if max_steps is not None else (10**9 if minutes is not None else -1)

    fixed = dict(per_device_train_batch_size=batch_size, learning_rate=learning_rate, weight_decay=weight_decay,
                 max_grad_norm=max_grad_norm, lr_scheduler_type=lr_scheduler, warmup_steps=warmup_steps,
                 max_steps=steps, num_train_epochs=epochs, seed=seed, logging_steps=logging_steps,
                 eval_steps=eval_steps, train_sampling_strategy="group_by_length" if group_by_length else "random")
    args = training_arguments(output_dir, batch_size, eval_ds, eval_steps, fixed, training_args)
    resume = resolve_checkpoint(resume_from_checkpoint, args.output_dir)
    save_decoding_setting(model, args)
    budget = TimeBudget(minutes) if minutes is not None else None
    if carry is not None and not isinstance(carry, OptimizerCarry):
        raise ValueError(f"`carry` must be an OptimizerCarry or None, got {type(carry).__name__}.")
    trainer_kwargs = dict(trainer_kwargs or {})
    if carry is not None and carry.optimizer is not None:
        if "optimizers" in trainer_kwargs:
            raise ValueError("`carry` already holds the optimizer: pass either carry or trainer_kwargs['optimizers'].")
        trainer_kwargs["optimizers"] = (carry.optimizer, carry.lr_scheduler)
    trainer = (trainer_class or Seq2SeqLengthTrainer)(
        model=model.train(),
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        callbacks=list(callbacks or []),
        compute_metrics=compute_metrics,
        **trainer_kwargs,
    )
    trainer.example_lengths = example_lengths(train_ds) if group_by_length else None
    if lr_scheduler in ("linear", "cosine") and max_steps is None:
        trainer.time_decay = time_decay_schedule(budget, warmup_steps, lr_scheduler)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if budget is not None:
        trainer.add_callback(budget)
    if progress:
        trainer.add_callback(ProgressBar(budget, desc=f"train {type(model).__name__}"))
    trainer.train(resume_from_checkpoint=resume)
    if carry is not None:
        carry.take(trainer)
    # accelerate runs bf16/fp16 training by wrapping model.forward in autocast and leaves the wrapper on the model:
    # without removing it, the trained model would go on decoding (and being scored) in bf16
    trainer.model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    trainer.model.eval()
    return trainer


# ----------------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------------
def length_sorted_batches(tokenizer, sources: list, batch_size: int, max_length: int = 128):
    """Yield (indices into ``sources``, tokenized padded batch), longest sources first: batches of similar length
    pad little. How :func:`translate` batches (benchmarks that time its decoding use it too)."""
    lengths = [len(ids) for ids in tokenizer(sources, max_length=max_length, truncation=True)["input_ids"]]
    order = sorted(range(len(sources)), key=lambda i: -lengths[i])
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        yield index, tokenizer([sources[i] for i in index], max_length=max_length, truncation=True, padding=True,
                               return_tensors="pt")


def default_max_new_tokens(input_ids: torch.Tensor) -> int:
    """:func:`translate`'s output limit for a batch: 1.5 x its (padded) source length + 10."""
    return int(1.5 * input_ids.shape[1]) + 10


def new_tokens_limit(model, new_tokens: int, generate_kwargs: dict) -> dict:
    """``generate()``'s keyword for at most ``new_tokens`` new tokens: ``max_length`` = ``new_tokens`` + 1 (the decoder
    start token; what ``max_new_tokens`` gives) for an encoder-decoder model decoding from its start token, so that a
    generation config that sets ``max_length`` (Marian's 512) does not make transformers log "Both `max_new_tokens`
    and `max_length` seem to have been set"; else (a saved ``max_new_tokens``, given decoder inputs) ``max_new_tokens``."""
    if (getattr(getattr(model, "config", None), "is_encoder_decoder", False)
            and "decoder_input_ids" not in generate_kwargs
            and getattr(getattr(model, "generation_config", None), "max_new_tokens", None) is None):
        return {"max_length": new_tokens + 1}
    return {"max_new_tokens": new_tokens}


@torch.no_grad()
def validation_loss(model, tokenizer, dataset, batch_size: int = 64) -> float:
    """The mean negative log-likelihood per target token (natural log, no label smoothing) of the references of a
    tokenized ``dataset`` (:func:`tokenize_dataset`) under ``model``, teacher-forced: the metric "val_loss" of
    :class:`Convergence`. Any seq2seq model (its logits, or log-probabilities, over the vocabulary)."""
    if len(dataset) == 0:
        raise ValueError("`dataset` is empty; the validation loss needs at least one example.")
    was_training = model.training
    model.eval()
    collate = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    total, tokens = 0.0, 0
    columns = ("input_ids", "attention_mask", "labels")
    rows = [{name: row[name] for name in columns} for row in dataset]
    rows.sort(key=lambda row: len(row["labels"]))  # little padding
    for start in range(0, len(rows), batch_size):
        batch = {k: v.to(model.device) for k, v in collate(rows[start : start + batch_size]).items()}
        labels = batch.pop("labels")  # the collator made decoder_input_ids of them; the model's own loss is not wanted
        logits = model(**batch, use_cache=False).logits
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 / fp16 logits: in fp32
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                   ignore_index=-100, reduction="sum").item()
        tokens += int((labels != -100).sum())
    model.train(was_training)
    return total / tokens


@torch.no_grad()
def translate(model, tokenizer, sources, num_beams: int = 4, batch_size: int = 64, max_new_tokens: int | None = None,
              max_length: int = 128, progress: bool = False, do_sample: bool = False, **generate_kwargs) -> list[str]:
    """Decoded outputs of ``model.generate`` for every string of ``sources`` (in order). The inputs are sorted by
    length and batched (little padding); ``max_new_tokens`` defaults to the model's generation config's
    ``max_new_tokens`` where it sets one (a model trained by ``hf-hardattn train``), else 1.5 x the batch's source
    length + 10. No sources give no outputs. ``do_sample=True`` samples (with ``num_beams`` > 1: beam sampling); other
    ``generate()`` keywords (``top_k``, ``top_p``, ``temperature``, ...) pass through."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"`num_beams` must be a positive integer, got {num_beams!r}.")
    sources = list(sources)
    wrong = next((source for source in sources if not isinstance(source, str)), None)
    if wrong is not None:
        raise ValueError(f"`sources` must be strings, got {type(wrong).__name__}.")
    if not sources:
        return []
    was_training = model.training
    model.eval()
    # a generation config's max_new_tokens (a trained model's, `hf-hardattn train`) is the model's own length rule
    saved_limit = getattr(getattr(model, "generation_config", None), "max_new_tokens", None)
    outputs = [None] * len(sources)
    for index, batch in tqdm(length_sorted_batches(tokenizer, sources, batch_size, max_length), desc="decode",
                             total=math.ceil(len(sources) / batch_size), disable=not progress):
        batch = batch.to(model.device)
        limit = max_new_tokens or saved_limit or default_max_new_tokens(batch["input_ids"])
        generated = model.generate(**batch, num_beams=num_beams, do_sample=do_sample,
                                   **new_tokens_limit(model, limit, generate_kwargs), **generate_kwargs)
        for i, text in zip(index, tokenizer.batch_decode(generated, skip_special_tokens=True)):
            outputs[i] = text.strip()
    model.train(was_training)
    return outputs


def bleu(model, tokenizer, sources, references, num_beams: int = 4, batch_size: int = 64,
         max_new_tokens: int | None = None, tokenize: str = "13a", **generate_kwargs) -> sacrebleu.metrics.BLEUScore:
    """Corpus BLEU (sacrebleu, on detokenised text, default 13a tokenisation) of the model's translations of
    ``sources`` against ``references`` (one reference per source). The hypotheses are kept in
    ``score.hypotheses``."""
    references = list(references)
    sources = list(sources)
    if len(sources) != len(references):
        raise ValueError(f"`sources` ({len(sources)}) and `references` ({len(references)}) must have the same length.")
    hypotheses = translate(model, tokenizer, sources, num_beams=num_beams, batch_size=batch_size,
                           max_new_tokens=max_new_tokens, **generate_kwargs)
    score, _ = corpus_scores(hypotheses, [references], metrics="bleu", tokenize=tokenize)["bleu"]
    score.hypotheses = hypotheses
    return score


def translation_metrics(tokenizer, metric=None, **options):
    """``compute_metrics`` for a ``Seq2SeqTrainer`` with ``predict_with_generate=True`` (``train_seq2seq(...,
    compute_metrics=translation_metrics(tokenizer))``): decodes the generated ids and the labels (-100 and special
    tokens dropped, text stripped) and returns ``{"bleu": ..., "chrf": ...}``, sacrebleu's corpus scores (one
    reference per example) from ``metric``, by default the package's ``evaluate`` metric
    (:func:`hf_hardattn.tools.metrics.load`, loaded once, offline). ``options`` go to ``metric.compute`` (e.g.
    ``tokenize="intl"``, ``lowercase=True``)."""
    metric = metric if metric is not None else metrics.load()

    def decode(ids):
        return [text.strip() for text in tokenizer.batch_decode([[t for t in row if t >= 0] for row in ids.tolist()],
                                                                skip_special_tokens=True)]

    def compute(prediction):
        generated = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        scores = metric.compute(predictions=decode(generated),
                                references=[[text] for text in decode(prediction.label_ids)], **options)
        return {"bleu": scores["bleu"], "chrf": scores["chrf"]}

    return compute


def accuracy(model, tokenizer, sources, references, num_beams: int = 1, batch_size: int = 256,
             max_new_tokens: int | None = None, return_predictions: bool = False, **generate_kwargs):
    """Exact-match accuracy in [0, 1] (whitespace-stripped strings) of the model's outputs for ``sources``,
    greedy by default; with ``return_predictions`` returns (accuracy, predictions)."""
    references = [r.strip() for r in references]
    sources = list(sources)
    if len(sources) != len(references):
        raise ValueError(f"`sources` ({len(sources)}) and `references` ({len(references)}) must have the same length.")
    if not sources:
        raise ValueError("`sources` is empty; exact-match accuracy needs at least one example.")
    predictions = translate(model, tokenizer, sources, num_beams=num_beams, batch_size=batch_size,
                            max_new_tokens=max_new_tokens, **generate_kwargs)
    value = sum(p == r for p, r in zip(predictions, references)) / len(references)
    return (value, predictions) if return_predictions else value


@torch.no_grad()
def decode_speed(model, input_ids, attention_mask=None, num_beams: int = 1, new_tokens: int = 30, repeats: int = 5,
                 warmup: int = 1, **generate_kwargs) -> float:
    """Sentences per second of ``model.generate`` on this batch, forced to produce exactly ``new_tokens`` tokens
    (min_new_tokens = max_new_tokens, so every model does the same number of steps): batch size / median time of
    ``repeats`` runs, after ``warmup`` untimed runs."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"`repeats` must be a positive integer, got {repeats!r}.")
    if not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"`new_tokens` must be a positive integer, got {new_tokens!r}.")
    was_training = model.training
    model.eval()
    input_ids = input_ids.to(model.device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask.to(model.device), num_beams=num_beams,
                  do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens, **generate_kwargs)
    for _ in range(warmup):
        model.generate(**kwargs)
    times = []
    for _ in range(repeats):
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(**kwargs)
        if input_ids.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    model.train(was_training)
    return input_ids.shape[0] / statistics.median(times)


__all__ = ["tokenize_dataset", "train_seq2seq", "translate", "bleu", "translation_metrics", "accuracy", "decode_speed",
           "TimeBudget", "ProgressBar", "Convergence", "OptimizerCarry", "validation_loss"]
