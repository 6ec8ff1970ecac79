"""Checkpoints of :func:`~hf_hardattn.tools.training.train_seq2seq` runs (tooling, not runtime code): whether a
``checkpoint-N`` folder is complete (:func:`checkpoint_problem`; a kill can leave one half written), the last complete
one, the mean of the last N (:func:`average_checkpoints`, the hard-retrieval paper's evaluation), the folder a run
resumes from (:func:`resolve_checkpoint`), whether a saved run had finished (:func:`finished_run`), a checkpoint that
starts a run where a finished one ended (:func:`continuation_checkpoint`), and the folder of a run that resumes only
itself (:func:`prepare_run_folder`)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file
from transformers import TrainerControl, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ..safe_io import CorruptFileError, verify_folder, write_json_atomic

logger = logging.get_logger(__name__)

OPTIMIZER_FILE = "optimizer.pt"  # transformers.trainer.OPTIMIZER_NAME: a checkpoint saved with its optimizer state
TRAINER_STATE = "trainer_state.json"  # written last by transformers' Trainer._save_checkpoint (5.10 - 5.24)
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def checkpoint_problem(path) -> str | None:
    """Why the Trainer checkpoint folder ``path`` cannot be resumed from, or None when it is complete. The Trainer
    writes the weights, then optimizer, scheduler and RNG states, then ``trainer_state.json``: a save killed before
    the end has no (or a truncated) trainer_state.json. Weights that fail their safetensors header or the sha256
    ``save_pretrained`` recorded count as incomplete too."""
    path = os.fspath(path)
    state_path = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(state_path):
        return f"no {TRAINER_STATE} (the Trainer writes it last: the save was interrupted)"
    try:
        with open(state_path, encoding="utf-8") as handle:
            step = json.load(handle)["global_step"]
    except (ValueError, KeyError, TypeError) as error:
        return f"{TRAINER_STATE} is truncated or malformed ({type(error).__name__}: {error})"
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    if match and int(match.group(1)) != step:
        return f"{TRAINER_STATE} is for step {step}, not {match.group(1)}"
    # (training_args.bin is the Trainer's, not weights)
    if not any(name.endswith(".safetensors") or (name.startswith("pytorch_model") and name.endswith(".bin"))
               for name in os.listdir(path)):
        return "no model weights"
    try:
        verify_folder(path)
    except CorruptFileError as error:
        return str(error)
    return None


def checkpoints(output_dir) -> list:
    """(step, path) of every ``checkpoint-N`` folder in ``output_dir``, by step."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in os.listdir(output_dir)
             if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))]
    return sorted(found)


def last_complete_checkpoint(output_dir) -> str | None:
    """The complete checkpoint (see :func:`checkpoint_problem`) of ``output_dir`` with the highest step, or None.
    Unlike transformers' ``get_last_checkpoint``, which returns the highest ``checkpoint-N`` even when a kill left it
    half written."""
    for _, path in reversed(checkpoints(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        logger.warning(f"Skipping checkpoint {path}: {problem}.")
    return None


def last_checkpoints(output_dir, n: int) -> list:
    """The ``n`` complete checkpoint folders of ``output_dir`` with the highest steps (fewer if fewer were saved), by
    step."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"`n` must be a positive integer, got {n!r}.")
    complete = [path for _, path in checkpoints(output_dir) if checkpoint_problem(path) is None]
    return complete[-n:]


WEIGHTS_FILE = "model.safetensors"


def average_checkpoints(paths) -> dict:
    """The element-wise mean of the weights saved in the checkpoint folders ``paths`` (each one's
    ``model.safetensors``): summed in float64, then cast to each tensor's own dtype. Tensors that are not floating
    point (integer buffers) must be equal in every checkpoint and are kept. As the hard-retrieval paper evaluates
    (the average of the last 5 checkpoints)."""
    paths = [os.fspath(path) for path in paths]
    if not paths:
        raise ValueError("`paths` is empty: averaging needs at least one checkpoint folder.")
    total, dtypes, names = {}, {}, None
    for path in paths:
        file = os.path.join(path, WEIGHTS_FILE)
        if not os.path.isfile(file):
            raise ValueError(f"`paths` entry {path!r} has no {WEIGHTS_FILE}; allowed: checkpoint folders saved with "
                             "safetensors weights.")
        weights = load_file(file)
        if names is None:
            names = set(weights)
        elif set(weights) != names:
            raise ValueError(f"checkpoint {path!r} holds other tensors than {paths[0]!r}: "
                             f"{sorted(set(weights) ^ names)[:5]}; allowed: checkpoints of one model.")
        for name, tensor in weights.items():
            if tensor.is_floating_point():
                total[name] = total.get(name, 0) + tensor.double()
                dtypes[name] = tensor.dtype
            elif name not in total:
                total[name] = tensor
            elif not torch.equal(total[name], tensor):
                raise ValueError(f"the integer tensor {name!r} differs between the checkpoints; it cannot be averaged.")
    return {name: (value / len(paths)).to(dtypes[name]) if name in dtypes else value for name, value in total.items()}


def missing_untied(model, missing_keys) -> list:
    """The names of ``missing_keys`` (``load_state_dict``'s) that no loaded name holds: a checkpoint stores a tied
    parameter once (``model.shared.weight``), so its other names (the embeddings, ``lm_head.weight``) come back missing
    although the tensor they name was loaded; they are left out, and so is nothing else."""
    missing = set(missing_keys)
    names_of = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    loaded_ties = {name for names in names_of.values() if len(names) > 1 and not missing.issuperset(names)
                   for name in names}
    return [key for key in missing_keys if key not in loaded_ties]


def load_average(model, paths):
    """``model`` (in place, returned) with the mean of the checkpoints ``paths`` (:func:`average_checkpoints`). Only
    tied weights (saved once) may be missing from the checkpoints."""
    averaged = average_checkpoints(paths)
    target = model.state_dict()
    averaged = {name: value.to(target[name].device) for name, value in averaged.items() if name in target}
    missing, unexpected = model.load_state_dict(averaged, strict=False)
    missing = missing_untied(model, missing)
    if missing or unexpected:
        raise ValueError(f"the checkpoints do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def resolve_checkpoint(resume_from_checkpoint, output_dir) -> str | None:
    """The checkpoint folder ``train_seq2seq(resume_from_checkpoint=...)`` resumes from: None/False none, True the
    last complete one in ``output_dir``, a path that folder (it must be complete). Interrupted checkpoints after the
    one resumed from are removed (transformers' rotation would otherwise keep them as the newest and delete
    complete ones); this run writes them again."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        path = last_complete_checkpoint(output_dir)
        if path is None:
            found = [os.path.basename(p) for _, p in checkpoints(output_dir)]
            raise ValueError(f"`resume_from_checkpoint`=True: no complete checkpoint in `output_dir` {output_dir!r} "
                             f"(checkpoint folders: {found or 'none'}); allowed: True with a complete checkpoint there, "
                             f"a checkpoint path, or False.")
    elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
        path = os.fspath(resume_from_checkpoint)
        if not os.path.isdir(path):
            raise ValueError(f"`resume_from_checkpoint`={path!r} is not a folder; allowed: a checkpoint folder "
                             f"(checkpoint-N), True (the last complete one in `output_dir`) or False.")
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(f"`resume_from_checkpoint`={path!r} is not a complete checkpoint: {problem}. Pass True to "
                             f"resume from the last complete one in `output_dir`.")
    else:
        raise ValueError(f"`resume_from_checkpoint` must be True, False, None or a checkpoint path, got "
                         f"{resume_from_checkpoint!r}.")
    if not os.path.isfile(os.path.join(path, OPTIMIZER_FILE)):
        raise ValueError(f"`resume_from_checkpoint`: the checkpoint {path!r} holds no optimizer state ({OPTIMIZER_FILE}; "
                         f"saved with save_only_model=True), so a resumed run would start Adam and the schedule "
                         f"anew; allowed: a checkpoint saved with its optimizer (save_only_model=False), or False.")
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    if match and os.path.isdir(output_dir) and os.path.samefile(os.path.dirname(os.path.abspath(path)), output_dir):
        for step, other in checkpoints(output_dir):
            if step > int(match.group(1)) and checkpoint_problem(other) is not None:
                logger.warning(f"Removing the interrupted checkpoint {other} (resuming from {path}).")
                shutil.rmtree(other)
    return path


@dataclasses.dataclass
class FinishedRun:
    """A :func:`train_seq2seq` run that ended in an earlier process, known by its last checkpoint (:func:`finished_run`):
    ``state`` is that checkpoint's ``TrainerState`` (``global_step``, ``log_history``) and ``checkpoint`` its folder.
    It stands in for the run's Trainer where only ``.state`` is read (``distill.train_two_stage``'s first stage when
    a resumed run finds it finished)."""

    state: TrainerState
    checkpoint: str


def finished_run(output_dir) -> FinishedRun | None:
    """The run saved in ``output_dir`` if its last complete checkpoint is the run's end, else None: the checkpoint of
    the step that reached the run's ``max_steps``, or of the step where a :class:`Convergence` rule stopped it (its log
    entry at that step says ``converged``; the rule saves that step)."""
    path = last_complete_checkpoint(output_dir)
    if path is None:
        return None
    state = TrainerState.load_from_json(os.path.join(path, TRAINER_STATE))
    converged = any(entry.get("converged") is True and entry.get("step") == state.global_step
                    for entry in state.log_history)
    if converged or (state.max_steps and state.global_step >= state.max_steps):
        return FinishedRun(state, path)
    return None


def continuation_checkpoint(finished: FinishedRun, folder) -> str:
    """A checkpoint folder from which a new :func:`train_seq2seq` run (``resume_from_checkpoint=folder``) starts at
    its step 0 with ``finished``'s weights, optimizer state and learning-rate schedule: what an
    :class:`OptimizerCarry` hands from one call to the next in one process (e.g. the hybrid's Eq. 1 stage continuing its
    MLE stage), rebuilt from disk after an interruption between the two. ``finished``'s files are copied but for its
    TrainerState (a fresh one, step 0) and RNG states (none: the new run keeps its own seed's, as the uninterrupted
    one does, since each Trainer seeds anew). Written to a temporary folder and renamed, so it is whole or absent."""
    folder = os.fspath(folder)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    partial = f"{folder}.partial"
    if os.path.isdir(partial):
        shutil.rmtree(partial)
    os.makedirs(partial)
    for name in os.listdir(finished.checkpoint):
        if name == TRAINER_STATE or name.startswith("rng_state"):
            continue
        source = os.path.join(finished.checkpoint, name)
        (shutil.copytree if os.path.isdir(source) else shutil.copy2)(source, os.path.join(partial, name))
    # step 0, no log; the batch and intervals as the finished run recorded them (transformers compares them)
    TrainerState(stateful_callbacks=[TrainerControl()],
                 **{name: getattr(finished.state, name) for name in
                    ("train_batch_size", "logging_steps", "eval_steps", "save_steps")}).save_to_json(
        os.path.join(partial, TRAINER_STATE))
    os.rename(partial, folder)
    return folder


REDO_FILE = "redo"  # in a run folder: a rerun asked for over a finished run began there and has not finished


def prepare_run_folder(folder, identity: dict, resume: bool, redo: bool = False) -> bool:
    """True when ``folder`` holds an interrupted run with this ``identity`` (a JSON-able dict of what the run depends
    on, kept in ``folder/run.json``) and ``resume`` allows continuing it. Otherwise the folder is emptied (checkpoints
    of another run must be neither resumed nor averaged), this ``identity`` written, and False returned. ``redo`` (a
    finished run asked for again, e.g. ``reproduce --force``) starts the run anew, unless the folder holds such a redo
    begun earlier and cut off (marked by :data:`REDO_FILE` until :func:`end_redo`): that one resumes."""
    folder = os.fspath(folder)
    identity = json.loads(json.dumps(identity, default=str, sort_keys=True))
    path = os.path.join(folder, "run.json")
    if resume and os.path.isfile(path) and (not redo or redo_begun(folder)):
        with open(path, encoding="utf-8") as handle:
            if json.load(handle) == identity:
                return True
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    write_json_atomic(path, identity)
    if redo:
        write_json_atomic(os.path.join(folder, REDO_FILE), True)
    return False


def redo_begun(folder) -> bool:
    """Whether ``folder`` holds a redo (:func:`prepare_run_folder`'s ``redo``) that has not finished."""
    return os.path.isfile(os.path.join(os.fspath(folder), REDO_FILE))


def end_redo(folder) -> None:
    """The run in ``folder`` finished: a later redo starts it anew."""
    if redo_begun(folder):
        os.remove(os.path.join(os.fspath(folder), REDO_FILE))


def drop_optimizer_states(*folders) -> None:
    """Remove the optimizer state (needed only to resume) from every checkpoint in ``folders``; weights stay."""
    for folder in folders:
        for _, path in checkpoints(folder):
            if os.path.isfile(os.path.join(path, OPTIMIZER_FILE)):
                os.remove(os.path.join(path, OPTIMIZER_FILE))
