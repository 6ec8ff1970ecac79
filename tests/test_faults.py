"""Faults and numerical robustness: a process killed during a checkpoint or model save, corrupted weight
files, diverging recurrent cross-attention, NaN scores in generate(), all-ignored batches, train_seq2seq's arguments.

References: an uninterrupted training run's weights (a run killed while saving a checkpoint and resumed must end
bit-identical to it); the old or the new model, exactly (a killed save_pretrained); the parallel forward (cached
decoding with the normalised recurrent context). Kills are real SIGKILLs of forked child processes, at points inside
the save reached through monkeypatched writers (a partial file is written first where the point is "mid-write").
"""

import io
import json
import multiprocessing
import os
import random
import shutil
import signal

import pytest
import torch
from safetensors.torch import save as safetensors_bytes
from transformers import AutoModelForSeq2SeqLM, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

import hf_hardattn.saving as saving
from common import (BOS, CONTRACT_MODELS, EOS, PAD, VOCAB, contract_model, fitted, generate_kwargs, randomize,
                    source_batch, tiny_kwargs, toy_tokenizer)
from hf_hardattn import (RecurrentConfig, RecurrentForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration)
from hf_hardattn import safe_io
from hf_hardattn.safe_io import CHECKSUM_FILE, CorruptFileError
from hf_hardattn.tools.checkpointing import checkpoint_problem, last_complete_checkpoint, resolve_checkpoint
from hf_hardattn.tools.training import train_seq2seq

FORK = multiprocessing.get_context("fork")


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def run_killed(target, *args):
    """Run ``target(*args)`` in a forked child that must die by SIGKILL (the kill point was reached)."""
    process = FORK.Process(target=target, args=args)
    process.start()
    process.join(120)
    assert process.exitcode == -signal.SIGKILL, f"the child was not killed at its point (exit code {process.exitcode})"


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ----------------------------------------------------------------------------------------------------------------
# train_seq2seq: a run killed while writing a checkpoint resumes from the last complete one, to the same weights
# ----------------------------------------------------------------------------------------------------------------
RUN = dict(max_steps=12, save_steps=4, batch_size=8, learning_rate=3e-3, warmup_steps=3, logging_steps=1,
           progress=False)  # 5 steps per epoch: checkpoints 4 and 8 fall mid-epoch (the data skip on resume matters)


def toy_data(n=40):
    import datasets

    rng = random.Random(0)
    rows = []
    for _ in range(n):
        src = [rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 8))]
        rows.append({"input_ids": src + [EOS], "attention_mask": [1] * (len(src) + 1), "labels": src[::-1] + [EOS]})
    return datasets.Dataset.from_list(rows)


def new_model():
    torch.manual_seed(0)  # dropout 0.1: the resumed run must restore the RNG states too
    return SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs(dropout=0.1)))


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """(tokenizer, data, weights of the uninterrupted 12-step run)."""
    torch.set_num_threads(1)
    tokenizer, data = toy_tokenizer(), toy_data()
    out = tmp_path_factory.mktemp("uninterrupted")
    trainer = train_seq2seq(new_model(), tokenizer, data, output_dir=out, **RUN)
    assert sorted(os.listdir(out)) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]  # save_steps works
    return tokenizer, data, trainer.model


def _partial(path, data: bytes):
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 2])
    kill_self()


def _train_and_die(point, out, tokenizer, data):
    """The child: train, SIGKILLed at ``point`` of the save of checkpoint-8."""
    import transformers.modeling_utils
    from transformers.trainer_callback import TrainerState

    from hf_hardattn.tools.training import Seq2SeqLengthTrainer

    torch.set_num_threads(1)

    def at_8(path):
        return f"checkpoint-8{os.sep}" in os.fspath(path) or ".checkpoint-8.saving" in os.fspath(path)

    callbacks = []
    if point == "model_written_halfway":  # inside the model's safetensors write
        real = transformers.modeling_utils.safe_save_file

        def save_file(tensors, filename, metadata=None):
            if at_8(filename):
                _partial(filename, safetensors_bytes(tensors, metadata))
            return real(tensors, filename, metadata=metadata)

        transformers.modeling_utils.safe_save_file = save_file
    elif point == "before_optimizer":  # the model is written, nothing else
        real_optimizer = Seq2SeqLengthTrainer._save_optimizer_and_scheduler

        def save_optimizer(self, output_dir):
            if at_8(output_dir + os.sep):
                kill_self()
            return real_optimizer(self, output_dir)

        Seq2SeqLengthTrainer._save_optimizer_and_scheduler = save_optimizer
    elif point == "optimizer_written_halfway":
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)) and at_8(f) and os.fspath(f).endswith("optimizer.pt"):
                buffer = io.BytesIO()
                real_save(obj, buffer)
                _partial(f, buffer.getvalue())
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
    elif point == "state_written_halfway":  # trainer_state.json, the Trainer's last file, cut in half
        real_json = TrainerState.save_to_json

        def save_to_json(self, json_path):
            if at_8(json_path):
                _partial(json_path, (json.dumps(self.__dict__, indent=2, sort_keys=True) + "\n").encode())
            return real_json(self, json_path)

        TrainerState.save_to_json = save_to_json
    elif point == "after_save":  # the checkpoint is complete

        class Kill(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                if state.global_step == 8:
                    kill_self()

        callbacks.append(Kill())
    train_seq2seq(new_model(), tokenizer, data, output_dir=out, callbacks=callbacks, **RUN)


class StepRecorder(TrainerCallback):
    def __init__(self):
        self.done = []

    def on_step_end(self, args, state, control, **kwargs):
        self.done.append(state.global_step)


@pytest.mark.parametrize("point, resumed_from", [("model_written_halfway", 4), ("before_optimizer", 4),
                                                 ("optimizer_written_halfway", 4), ("state_written_halfway", 4),
                                                 ("after_save", 8)])
def test_checkpoint_save_killed_then_resumed_equals_uninterrupted_run(training, tmp_path, point, resumed_from):
    tokenizer, data, reference = training
    out = tmp_path / "run"
    run_killed(_train_and_die, point, str(out), tokenizer, data)
    names = sorted(os.listdir(out))
    if point == "model_written_halfway":  # the model save is atomic: checkpoint-8 (made by the Trainer) stays empty
        assert os.listdir(out / "checkpoint-8") == []
        assert [n for n in names if n.startswith(".checkpoint-8.saving-")], names
    if point != "after_save":  # a partial checkpoint-8, which transformers' own lookup would resume from
        assert [n for n in names if not n.startswith(".")] == ["checkpoint-4", "checkpoint-8"]
        assert get_last_checkpoint(str(out)) == str(out / "checkpoint-8")
        assert checkpoint_problem(out / "checkpoint-8") is not None
    assert last_complete_checkpoint(str(out)) == str(out / f"checkpoint-{resumed_from}")

    steps = StepRecorder()
    trainer = train_seq2seq(new_model(), tokenizer, data, output_dir=out, resume_from_checkpoint=True,
                            callbacks=[steps], **RUN)
    assert steps.done == list(range(resumed_from + 1, 13))  # resumed, not restarted
    assert same_weights(trainer.model, reference)
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == ["checkpoint-12", "checkpoint-4",
                                                                             "checkpoint-8"]
    assert all(checkpoint_problem(out / f"checkpoint-{n}") is None for n in (4, 8, 12))
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # the next save removed the leftover


def _resume_from_4_and_die(out, tokenizer, data):
    from hf_hardattn.tools.training import Seq2SeqLengthTrainer

    torch.set_num_threads(1)
    real = Seq2SeqLengthTrainer._save_optimizer_and_scheduler

    def save_optimizer(self, output_dir):
        if output_dir.endswith("checkpoint-8"):
            kill_self()
        return real(self, output_dir)

    Seq2SeqLengthTrainer._save_optimizer_and_scheduler = save_optimizer
    train_seq2seq(new_model(), tokenizer, data, output_dir=out, resume_from_checkpoint=os.path.join(out, "checkpoint-4"),
                  **dict(RUN, learning_rate=1e-3))


def test_resaving_a_complete_checkpoint_never_mixes_old_and_new_files(training, tmp_path):
    """Resumed from checkpoint-4 with another learning rate while the first run's checkpoint-8 exists, and killed while
    re-saving checkpoint-8 (new weights written, optimizer not yet): the old trainer_state.json must not make the
    half-rewritten folder look complete."""
    tokenizer, data, _ = training
    out = tmp_path / "run"
    train_seq2seq(new_model(), tokenizer, data, output_dir=out, **dict(RUN, max_steps=8))
    run_killed(_resume_from_4_and_die, str(out), tokenizer, data)
    assert checkpoint_problem(out / "checkpoint-8") is not None
    assert last_complete_checkpoint(str(out)) == str(out / "checkpoint-4")


def test_resume_argument_checks(training, tmp_path):
    tokenizer, data, _ = training
    model = new_model()
    with pytest.raises(ValueError, match=r"`resume_from_checkpoint`=True: no complete checkpoint in `output_dir`"):
        train_seq2seq(model, tokenizer, data, output_dir=tmp_path / "none", resume_from_checkpoint=True, **RUN)
    with pytest.raises(ValueError, match=r"`resume_from_checkpoint`=.*missing.*is not a folder"):
        train_seq2seq(model, tokenizer, data, output_dir=tmp_path / "x", resume_from_checkpoint=str(tmp_path / "missing"),
                      **RUN)
    with pytest.raises(ValueError, match=r"`resume_from_checkpoint` must be True, False, None or a checkpoint path"):
        train_seq2seq(model, tokenizer, data, output_dir=tmp_path / "x", resume_from_checkpoint=3, **RUN)
    # a checkpoint whose weights were corrupted after the save is not resumed from: True skips it, a path is refused
    out = tmp_path / "run"
    train_seq2seq(new_model(), tokenizer, data, output_dir=out, **dict(RUN, max_steps=8))
    flip_byte(out / "checkpoint-8" / "model.safetensors")
    assert "model.safetensors is corrupt" in checkpoint_problem(out / "checkpoint-8")
    assert last_complete_checkpoint(str(out)) == str(out / "checkpoint-4")
    with pytest.raises(ValueError, match=r"not a complete checkpoint: .*checkpoint-8.model\.safetensors is corrupt"):
        train_seq2seq(new_model(), tokenizer, data, output_dir=out, resume_from_checkpoint=str(out / "checkpoint-8"),
                      **RUN)
    weightless = tmp_path / "checkpoint-4"  # a trainer_state.json without weights (deleted by hand)
    shutil.copytree(out / "checkpoint-4", weightless)
    (weightless / "model.safetensors").unlink()
    assert checkpoint_problem(weightless) == "no model weights"
    # resuming removes the unusable checkpoints after the one it resumes from (with save_total_limit, transformers'
    # rotation would keep such a folder as the newest and delete complete ones); the run writes them again
    assert resolve_checkpoint(True, str(out)) == str(out / "checkpoint-4")
    assert sorted(os.listdir(out)) == ["checkpoint-4"]


def test_train_seq2seq_training_arguments(training, tmp_path):
    """Transformers' own arguments: a caller's value wins over the recipe's default, the fields set from the function's
    parameters are refused with the parameter to use, unknown names and contradictions are refused; no dataset is
    empty."""
    tokenizer, data, _ = training
    model = new_model()
    trainer = train_seq2seq(model, tokenizer, data, output_dir=tmp_path / "a", max_steps=2, batch_size=8,
                            progress=False, save_strategy="steps", save_steps=1, report_to="none", adam_beta2=0.99,
                            per_device_eval_batch_size=3, save_total_limit=1)
    args = trainer.args
    assert (args.report_to, args.adam_beta2, args.per_device_eval_batch_size) == ([], 0.99, 3)
    assert sorted(os.listdir(tmp_path / "a")) == ["checkpoint-2"]  # save_steps=1 and save_total_limit=1 took effect
    trainer = train_seq2seq(model, tokenizer, data, output_dir=tmp_path / "b", max_steps=2, batch_size=8,
                            progress=False, save_strategy="epoch")
    assert trainer.args.save_strategy == "epoch" and os.listdir(tmp_path / "b") == ["checkpoint-2"]
    with pytest.raises(ValueError, match=r"`per_device_train_batch_size` is set by train_seq2seq's own `batch_size`"):
        train_seq2seq(model, tokenizer, data, output_dir=tmp_path / "c", max_steps=2, per_device_train_batch_size=4)
    with pytest.raises(ValueError, match=r"`lr_scheduler_type` is set by train_seq2seq's own `lr_scheduler`"):
        train_seq2seq(model, tokenizer, data, output_dir=tmp_path / "c", max_steps=2, lr_scheduler_type="linear")
    with pytest.raises(ValueError, match=r"`save_step` is neither .* did you mean \['save_steps'"):
        train_seq2seq(model, tokenizer, data, output_dir=tmp_path / "c", max_steps=2, save_step=5)
    with pytest.raises(ValueError, match=r"`save_steps`=5 asks for checkpoints, but `save_strategy`='no'"):
        train_seq2seq(model, tokenizer, data, output_dir=tmp_path / "c", max_steps=2, save_steps=5, save_strategy="no")
    with pytest.raises(ValueError, match=r"`train_ds` is empty \(0 examples\)"):
        train_seq2seq(model, tokenizer, data.select([]), output_dir=tmp_path / "c", max_steps=2)
    with pytest.raises(ValueError, match=r"`eval_ds` is empty \(0 examples\)"):
        train_seq2seq(model, tokenizer, data, data.select([]), output_dir=tmp_path / "c", max_steps=2, eval_steps=1)
    assert not (tmp_path / "c").exists()


# ----------------------------------------------------------------------------------------------------------------
# save_pretrained into an existing folder: a kill leaves the old or the new complete model
# ----------------------------------------------------------------------------------------------------------------
def tiny(seed):
    return randomize(SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs())), seed=seed)


def _save_and_die(point, folder, model, tokenizer):
    import transformers.modeling_utils

    if point == "weights_written_halfway":
        def save_file(tensors, filename, metadata=None):
            _partial(filename, safetensors_bytes(tensors, metadata))

        transformers.modeling_utils.safe_save_file = save_file
    elif point == "before_card":
        saving.write_model_card = lambda *args, **kwargs: kill_self()
    elif point == "before_tokenizer":
        tokenizer.save_pretrained = lambda *args, **kwargs: kill_self()
    elif point == "before_swap":
        safe_io._exchange = lambda a, b: kill_self()
    elif point == "after_swap":  # exchanged, the old folder not yet deleted
        real = safe_io._exchange

        def exchange(a, b):
            assert real(a, b)
            kill_self()

        safe_io._exchange = exchange
    elif point == "between_fallback_renames":  # a system without renameat2: two renames
        safe_io._exchange = lambda a, b: False
        real_rename, calls = os.rename, []

        def rename(a, b):
            calls.append(a)
            if len(calls) == 2:
                kill_self()
            return real_rename(a, b)

        safe_io.os.rename = rename
    model.save_pretrained(folder, tokenizer=tokenizer)


@pytest.mark.parametrize("point, survivor", [("weights_written_halfway", "old"), ("before_card", "old"),
                                             ("before_tokenizer", "old"), ("before_swap", "old"),
                                             ("after_swap", "new"), ("between_fallback_renames", "old")])
def test_save_pretrained_killed_leaves_old_or_new_complete_model(tmp_path, point, survivor):
    old, new, tokenizer = tiny(0), tiny(1), toy_tokenizer()
    folder = tmp_path / "my-model"
    old.save_pretrained(folder)
    (folder / "notes.txt").write_text("the user's own file")
    run_killed(_save_and_die, point, str(folder), new, tokenizer)
    if point == "between_fallback_renames":  # the folder is missing for an instant; the next save restores it
        assert not folder.exists()
        safe_io.remove_leftovers(str(tmp_path), "my-model")
    loaded = AutoModelForSeq2SeqLM.from_pretrained(folder)  # also checks the stored sha256
    assert same_weights(loaded, {"old": old, "new": new}[survivor])
    assert (folder / "notes.txt").read_text() == "the user's own file"
    assert (folder / "tokenizer.json").exists() == (survivor == "new")
    # the next save completes, keeps the user's file and removes what the killed one left
    new.save_pretrained(folder, tokenizer=tokenizer)
    assert same_weights(AutoModelForSeq2SeqLM.from_pretrained(folder), new)
    assert (folder / "notes.txt").exists() and (folder / "tokenizer.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["my-model"]


def test_save_replaces_stale_weight_files_and_keeps_the_rest(tmp_path):
    """A sharded save replaced by a single-file one (and back): no shard, index or single file of the other save
    remains (transformers keeps an old single file, which from_pretrained would load instead of new shards)."""
    small, other = tiny(0), tiny(1)
    folder = tmp_path / "m"
    small.save_pretrained(folder, max_shard_size="100KB")
    shards = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").exists()
    other.save_pretrained(folder)
    assert sorted(n for n in os.listdir(folder) if "safetensors" in n) == ["model.safetensors"]
    small.save_pretrained(folder, max_shard_size="100KB")
    assert not (folder / "model.safetensors").exists()
    assert same_weights(AutoModelForSeq2SeqLM.from_pretrained(folder), small)
    assert set(json.loads((folder / CHECKSUM_FILE).read_text())["files"]) == set(shards)
    with pytest.raises(NotADirectoryError, match=r"`save_directory` .* is a file"):
        small.save_pretrained(folder / "config.json")


# ----------------------------------------------------------------------------------------------------------------
# corrupt weight files: the error names the file; flipped bytes fail the stored sha256
# ----------------------------------------------------------------------------------------------------------------
def flip_byte(path, offset=-16):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_corrupt_weights_are_reported_by_name(tmp_path):
    model = tiny(0)
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    stored = json.loads((folder / CHECKSUM_FILE).read_text())
    assert stored == {"algorithm": "sha256", "files": {"model.safetensors": safe_io.sha256_file(str(weights))}}
    flip_byte(weights)  # in the data: safetensors itself would load it
    with pytest.raises(CorruptFileError, match=rf"{weights}.* is corrupt: its sha256 .* differs"):
        AutoModelForSeq2SeqLM.from_pretrained(folder)
    assert not same_weights(AutoModelForSeq2SeqLM.from_pretrained(folder, verify_checksums=False), model)
    weights.write_bytes(good[:-100])  # truncated: named with or without the checksum file
    for _ in range(2):
        with pytest.raises(CorruptFileError, match=rf"{weights}.* is corrupt: it has \d+ bytes but its header describes"):
            AutoModelForSeq2SeqLM.from_pretrained(folder)
        (folder / CHECKSUM_FILE).unlink(missing_ok=True)
    weights.write_bytes(good[:8] + b"{not json" + good[17:])
    with pytest.raises(CorruptFileError, match=rf"{weights}.* header is not valid safetensors JSON"):
        AutoModelForSeq2SeqLM.from_pretrained(folder)
    weights.write_bytes(good)
    assert same_weights(AutoModelForSeq2SeqLM.from_pretrained(folder), model)  # no checksum file: loads as before


# ----------------------------------------------------------------------------------------------------------------
# numerical robustness
# ----------------------------------------------------------------------------------------------------------------
def recurrent(variant, std, **kw):
    torch.manual_seed(0)
    config = RecurrentConfig(**tiny_kwargs(recurrent_variant=variant, **kw))
    return randomize(RecurrentForConditionalGeneration(config), std=std)


DEC = torch.tensor([[1, 5, 9, 7, 30, 12, 8, 8, 22, 4, 6, 17], [1, 8, 8, 22, 4, 6, 11, 5, 9, 7, 30, 12]])


@pytest.mark.parametrize("variant", ["expand_1", "expand_2"])
def test_diverging_recurrent_context_raises_naming_the_variant(variant):
    """Weights of std 1 make Eq. 5/6's unnormalised recursion grow past 1e16 in 12 steps: the training forward, the
    eval forward and every decoding mode raise, naming the variant and the fix; the recursion stays bounded with
    `recurrent_context_norm`, and models with ordinary weights pass."""
    model = recurrent(variant, std=1.0)
    ids, mask = source_batch()
    pattern = rf"recurrent_variant='{variant}'.*recurrent_context_norm=True"
    with pytest.raises(FloatingPointError, match=pattern):
        model.train()(input_ids=ids, attention_mask=mask, labels=DEC)
    model.eval()
    for mode in ("greedy", "beam", "sample"):
        with pytest.raises(FloatingPointError, match=pattern):
            model.generate(input_ids=ids, attention_mask=mask, **generate_kwargs(mode))
    normalised = recurrent(variant, std=1.0, recurrent_context_norm=True)
    assert torch.isfinite(normalised(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC).logits).all()
    ordinary = recurrent(variant, std=0.3)
    with torch.no_grad():
        ordinary(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC)
        ordinary.generate(input_ids=ids, attention_mask=mask, **generate_kwargs("beam"))


@pytest.mark.parametrize("variant, std", [("expand_1", 3.0), ("expand_2", 3.0), ("expand_3", 1.0)])
def test_normalised_context_cached_decoding_equals_parallel_forward(variant, std):
    """With large weights (std 3: Eq. 5/6's recursion overflows fp32 and the guard stops it), the normalised context
    stays bounded and cached decoding equals the parallel forward. (Eq. 7 normalises per head, over d_k = 8 values:
    at std 3 that random model is so ill-conditioned that fp32 rounding moves logits by 0.3, float64 by 4e-10.)"""
    from common import decode_step_by_step

    model = recurrent(variant, std=std, recurrent_context_norm=True)
    ids, mask = source_batch()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, use_cache=False).logits
        steps, cache = decode_step_by_step(model, DEC, input_ids=ids, attention_mask=mask)
    assert torch.isfinite(full).all()
    assert torch.allclose(full, steps, atol=1e-3, rtol=1e-5), (full - steps).abs().max()
    assert max(state.abs().max() for state in cache.states.values()) < 1e4


def test_context_norm_setting_checked():
    with pytest.raises(ValueError, match=r"`recurrent_context_norm`=True .* allowed with `recurrent_variant` in"):
        RecurrentConfig(**tiny_kwargs(recurrent_variant="coverage", recurrent_context_norm=True))
    with pytest.raises(ValueError, match=r"`recurrent_context_norm` must be True or False, got 'yes'"):
        RecurrentConfig(**tiny_kwargs(recurrent_context_norm="yes"))


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_generate_never_emits_after_nan_scores(name):
    """One NaN row of the output projection makes that token's score NaN: without the check greedy and beam search
    emit tokens from NaN scores and sampling fails inside torch.multinomial; every mode raises a clear error."""
    model = contract_model(name, fit=False)
    with torch.no_grad():
        model.get_output_embeddings().weight[VOCAB - 1] = float("nan")  # (tied: a token no source holds)
    ids, mask = source_batch()
    for mode in ("greedy", "beam", "sample"):
        with pytest.raises(FloatingPointError, match=r"computed NaN or \+inf scores at inference"):
            model.generate(input_ids=ids, attention_mask=mask, **generate_kwargs(mode))


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_all_ignored_batch_gives_zero_loss_and_zero_gradients(name):
    """Every label -100 (an all-padding micro-batch): loss 0 and zero gradients, not 0 / 0 = NaN, with and without
    the Trainer's num_items_in_batch (0 for such a batch)."""
    model = contract_model(name, fit=False).train()
    ids, mask = source_batch()
    labels = torch.full((2, 5), -100)
    for count in (None, 0, torch.tensor(0)):
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=count).loss
        loss.backward()
        assert loss.item() == 0.0
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_kd_loss_of_an_all_ignored_batch_is_zero():
    from hf_hardattn.hybrid import kd_loss

    student = torch.randn(2, 5, VOCAB, requires_grad=True)
    loss = kd_loss(student, torch.randn(2, 5, VOCAB), torch.full((2, 5), -100), 1.0)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(student.grad, torch.zeros_like(student.grad))
