"""Knowledge distillation (hybrid paper, Sec. 2.2): every `kd_scheme`'s stage-2 loss against a hand computation on
tiny float64 models (Eq. 1 with the sequence-level KL: reference NLL + lambda * NLL of the teacher's output; with the
word-level KL: reference NLL + lambda * per-token KL), the two-stage schedule (MLE, then the scheme), the trainer
(frozen teacher, KL = 0 for student == teacher, clear errors), and resumable sequence-level KD translation."""

import copy
import json
import math

import pytest
import torch
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

from common import EOS, InterruptAt, Interrupted, Scripted, as_float64, collate, copy_task, fitted, tiny_kwargs, toy_tokenizer
from hf_hardattn import (HybridConfig, HybridForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration)
from hf_hardattn.hybrid import kd_loss, sequence_kd_loss
from hf_hardattn.tools import distill
from hf_hardattn.tools.distill import DistillationTrainer, tokenize_kd_dataset, train_two_stage, translate_dataset


def soft(**kw):
    return SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs(**kw)))


def hybrid(**kw):
    return HybridForConditionalGeneration(HybridConfig(**tiny_kwargs(decoder_layers=1, rnn_hidden_size=48, **kw)))


def test_kd_loss_equals_hand_computation():
    student = torch.tensor([[[1.0, 0.0, -1.0], [0.5, 2.0, 0.0], [3.0, 3.0, 3.0]]])
    teacher = torch.tensor([[[0.0, 1.0, 0.0], [2.0, 0.0, 1.0], [9.0, 0.0, 0.0]]])
    labels = torch.tensor([[0, 1, -100]])  # the last position is ignored
    lam = 0.7

    def probs(row):
        z = sum(math.exp(v) for v in row)
        return [math.exp(v) / z for v in row]

    total = 0.0
    for t in range(2):
        ps, pt = probs(student[0, t].tolist()), probs(teacher[0, t].tolist())
        nll = -math.log(ps[labels[0, t]])
        kl = sum(pt[v] * math.log(pt[v] / ps[v]) for v in range(3))
        total += nll + lam * kl
    loss, nll, kl = kd_loss(student, teacher, labels, kd_lambda=lam, return_parts=True)
    assert loss.item() == pytest.approx(total / 2, rel=1e-6)
    assert loss.item() == pytest.approx(nll.item() + lam * kl.item(), rel=1e-6) and kl.item() > 0.1
    # normalisation by num_items_in_batch (gradient accumulation) instead of the local token count
    assert kd_loss(student, teacher, labels, lam, num_items_in_batch=4).item() == pytest.approx(total / 4, rel=1e-6)
    # lambda = 0: plain NLL; teacher mass 0 on a token contributes 0 (no NaN)
    assert kd_loss(student, teacher, labels, 0.0).item() == pytest.approx(nll.item(), rel=1e-6)
    masked = teacher.clone()
    masked[..., 2] = float("-inf")
    assert torch.isfinite(kd_loss(student, masked, labels))


# ----------------------------------------------------------------------------------------------------------------
# kd_scheme: each stage-2 loss against a hand computation (float64 tiny models)
# ----------------------------------------------------------------------------------------------------------------
SOURCES = ["t5 t6 t7", "t9 t8 t11 t12", "t13 t14"]
REFERENCES = ["t7 t6 t5", "t12 t11 t8 t9", "t14 t13"]
TEACHER_OUT = ["t7 t6", "t12 t11 t8 t9 t10", "t14 t13 t15 t16"]  # other lengths than the references


def _distilled():
    import datasets

    return datasets.Dataset.from_dict({"source": SOURCES, "target": TEACHER_OUT, "reference": REFERENCES})


def _ids(text):
    return toy_tokenizer()(text_target=text)["input_ids"]


def _sentence_log_probs(model, source, target):
    """[log P(y_t | y_<t, x) as a list of rows of python floats] for one sentence, run alone (no padding), with the
    decoder input shifted right by hand."""
    x = torch.tensor([toy_tokenizer()(source)["input_ids"]])
    y = _ids(target)
    decoder_input = torch.tensor([[model.config.decoder_start_token_id] + y[:-1]])
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), decoder_input_ids=decoder_input).logits[0]
    rows = []
    for t in range(len(y)):
        row = logits[t].tolist()
        top = max(row)
        log_z = top + math.log(sum(math.exp(v - top) for v in row))
        rows.append([v - log_z for v in row])
    return y, rows


def _nll(model, source, target):
    y, rows = _sentence_log_probs(model, source, target)
    return -sum(rows[t][y[t]] for t in range(len(y)))


def _stage2_trainer(student, tmp_path, kd_scheme, **kw):
    tokenizer = toy_tokenizer()
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / kd_scheme), per_device_train_batch_size=4, max_steps=1,
                                    report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    return DistillationTrainer(model=student, args=args, processing_class=tokenizer, kd_scheme=kd_scheme,
                               train_dataset=tokenize_kd_dataset(_distilled(), tokenizer, kd_scheme),
                               data_collator=DataCollatorForSeq2Seq(tokenizer, model=student), **kw)


def _stage2_batch(trainer):
    """The three rows through the trainer's own collator (pads references and teacher outputs)."""
    return trainer.data_collator([trainer.train_dataset[i] for i in range(3)])


@pytest.mark.parametrize("kd_lambda", [None, 0.7])
def test_eq1_sequence_loss_is_reference_nll_plus_lambda_teacher_output_nll(tmp_path, kd_lambda):
    """Eq. 1 with the sequence-level KL (the default scheme): sum_n NLL(reference_n) + lambda * sum_n
    NLL(teacher output_n), over the number of reference tokens; lambda defaults to the paper's 1."""
    torch.manual_seed(0)
    student = hybrid().double().eval()
    kw = {} if kd_lambda is None else dict(kd_lambda=kd_lambda)
    trainer = _stage2_trainer(student, tmp_path, "eq1_sequence", **kw)
    assert trainer.kd_scheme == "eq1_sequence" == distill.DEFAULT_KD_SCHEME
    batch = _stage2_batch(trainer)
    assert batch["labels"].shape[1] == max(len(_ids(r)) for r in REFERENCES)
    assert batch["teacher_labels"].shape[1] == max(len(_ids(r)) for r in TEACHER_OUT)
    with torch.no_grad():
        loss = trainer.compute_loss(student, batch)
    lam = 1.0 if kd_lambda is None else kd_lambda
    reference = sum(_nll(student, x, y) for x, y in zip(SOURCES, REFERENCES))
    kd_term = sum(_nll(student, x, y) for x, y in zip(SOURCES, TEACHER_OUT))
    tokens = sum(len(_ids(y)) for y in REFERENCES)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx((reference + lam * kd_term) / tokens, rel=1e-10)
    assert trainer.kd_parts["nll"] == pytest.approx(reference / tokens, rel=1e-10)
    assert trainer.kd_parts["kd"] == pytest.approx(kd_term / tokens, rel=1e-10)


@pytest.mark.parametrize("kd_scheme", ["eq1_word", "sequence_word"])
def test_word_level_schemes_equal_the_hand_kl(tmp_path, kd_scheme):
    """eq1_word: NLL(reference) + lambda * sum_t KL(P_teacher(. | y_<t) || P_student(. | y_<t)) along the reference;
    sequence_word: the same along the teacher's output (no reference term)."""
    torch.manual_seed(0)
    student = hybrid().double().eval()
    teacher = fitted(soft(), steps=40).double().eval()
    trainer = _stage2_trainer(student, tmp_path, kd_scheme, teacher_model=teacher, kd_lambda=0.7)
    with torch.no_grad():
        loss = trainer.compute_loss(student, _stage2_batch(trainer))
    targets = REFERENCES if kd_scheme == "eq1_word" else TEACHER_OUT
    total, tokens = 0.0, 0
    for x, y_text in zip(SOURCES, targets):
        y, log_ps = _sentence_log_probs(student, x, y_text)
        _, log_pt = _sentence_log_probs(teacher, x, y_text)
        for t in range(len(y)):
            kl = sum(math.exp(log_pt[t][v]) * (log_pt[t][v] - log_ps[t][v]) for v in range(len(log_ps[t])))
            total += -log_ps[t][y[t]] + 0.7 * kl
            tokens += 1
    assert trainer.kd_parts["kd"] > 0.05  # the KL term is not vanishing
    assert loss.item() == pytest.approx(total / tokens, rel=1e-10)


def test_sequence_only_is_the_models_own_loss_on_the_teacher_outputs(tmp_path):
    torch.manual_seed(0)
    student = hybrid().double().eval()
    trainer = _stage2_trainer(student, tmp_path, "sequence_only")
    batch = _stage2_batch(trainer)
    assert "teacher_labels" not in batch
    assert [[i for i in row if i != -100] for row in batch["labels"].tolist()] == [_ids(y) for y in TEACHER_OUT]
    with torch.no_grad():
        loss = trainer.compute_loss(student, batch)
        own = student(**batch).loss  # label smoothing of the config included, as the old hybrid_*_kd rows
    assert student.config.label_smoothing > 0 and loss.item() == pytest.approx(own.item(), rel=1e-12)


def test_sequence_kd_loss_function_by_hand():
    ref = torch.tensor([[[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]]], dtype=torch.float64)
    out = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [1.0, 1.0, 0.0]]], dtype=torch.float64)
    labels, teacher_labels = torch.tensor([[0, 1]]), torch.tensor([[1, 0, -100]])

    def nll(row, i):
        return -(row[i] - math.log(sum(math.exp(v) for v in row)))

    reference = nll(ref[0, 0].tolist(), 0) + nll(ref[0, 1].tolist(), 1)
    kd_term = nll(out[0, 0].tolist(), 1) + nll(out[0, 1].tolist(), 0)
    loss = sequence_kd_loss(ref, labels, out, teacher_labels, kd_lambda=0.3)
    assert loss.item() == pytest.approx((reference + 0.3 * kd_term) / 2, rel=1e-12)
    assert sequence_kd_loss(ref, labels, out, teacher_labels, 0.3, num_items_in_batch=5).item() == pytest.approx(
        (reference + 0.3 * kd_term) / 5, rel=1e-12)
    assert sequence_kd_loss(ref, labels, out, teacher_labels).item() == pytest.approx(  # lambda = 1 (the paper)
        (reference + kd_term) / 2, rel=1e-12)


def test_two_stage_schedule_runs_mle_then_the_kd_scheme(tmp_path, monkeypatch):
    """Sec. 2.2: stage 1 is plain MLE on the references (the model's own loss), stage 2 fine-tunes the same student
    with Eq. 1 on references + teacher outputs; both stages move the weights."""
    seen = []
    real = distill.train_seq2seq

    def recording(model, tokenizer, data, **kw):
        before = [p.detach().clone() for p in model.parameters()]
        stage = "kd" if kw.get("trainer_class") is DistillationTrainer else "mle"
        trainer = real(model, tokenizer, data, **kw)
        moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        seen.append((stage, sorted(data.column_names), [list(r) for r in data["labels"]], moved, type(trainer)))
        return trainer

    monkeypatch.setattr(distill, "train_seq2seq", recording)
    student = hybrid()
    step = dict(max_steps=2, batch_size=3, learning_rate=1e-2, warmup_steps=0, progress=False)
    first, second = train_two_stage(student, toy_tokenizer(), _distilled(), mle=step, kd=step,
                                    output_dir=str(tmp_path / "two"))
    refs, outs = [_ids(y) for y in REFERENCES], [_ids(y) for y in TEACHER_OUT]
    assert [s[0] for s in seen] == ["mle", "kd"]
    assert seen[0][1] == ["attention_mask", "input_ids", "labels"] and seen[0][2] == refs
    assert seen[1][1] == ["attention_mask", "input_ids", "labels", "teacher_labels"] and seen[1][2] == refs
    assert seen[0][3] and seen[1][3]
    assert not isinstance(first, DistillationTrainer) and isinstance(second, DistillationTrainer)
    assert first.state.global_step == second.state.global_step == 2
    assert second.kd_scheme == "eq1_sequence" and second.kd_lambda == 1.0 and set(second.kd_parts) == {"nll", "kd"}
    assert list(second.train_dataset["teacher_labels"]) == outs
    # mle=False: stage 2 only, asked for (the old rows' sequence-level KD from scratch)
    seen.clear()
    none, only = train_two_stage(hybrid(), toy_tokenizer(), _distilled(), kd_scheme="sequence_only", mle=False,
                                 kd=step, output_dir=str(tmp_path / "one"))
    assert none is None and [s[0] for s in seen] == ["kd"] and seen[0][2] == outs


# stage 1: best 2.0 at step 4, stopped by patience 2 at 8 (no multiple of the checkpoint interval 3: saved as the stop);
# stage 2: best 1.5 at 4, stopped at 8
MLE_SCRIPT = {2: 3.0, 4: 2.0, 6: 2.5, 8: 2.6, 10: 1.0, 12: 1.0}
KD_SCRIPT = {2: 2.0, 4: 1.5, 6: 1.6, 8: 1.7, 10: 1.0, 12: 1.0}


def _two_stage_run(tmp_path, name, interrupt=None, resume=False, **changes):
    from hf_hardattn.tools.training import Convergence, OptimizerCarry

    carry, rules, args = OptimizerCarry(), {}, {}
    for stage, values in (("mle", MLE_SCRIPT), ("kd", KD_SCRIPT)):
        script = Scripted(values)
        rules[stage] = Convergence(script, every=2, patience=2)
        callbacks = [script, rules[stage]] + ([InterruptAt(interrupt[1])] if interrupt and interrupt[0] == stage else [])
        args[stage] = dict(dict(max_steps=12, batch_size=1, learning_rate=1e-2, warmup_steps=2, progress=False,
                                save_steps=3, save_total_limit=2, carry=carry, callbacks=callbacks),
                           **changes.get(stage, {}))
    torch.manual_seed(0)
    student = hybrid(dropout=0.1)  # dropout: the RNG of each stage must be the uninterrupted run's
    first, second = train_two_stage(student, toy_tokenizer(), _distilled(), mle=args["mle"], kd=args["kd"],
                                    output_dir=str(tmp_path / name), resume_from_checkpoint=resume)
    return student, first, second, rules


@pytest.mark.parametrize("interrupt", [("mle", 6), ("kd", 0), ("kd", 6)])
def test_two_stage_run_resumed_after_an_interruption_ends_as_the_uninterrupted_one(tmp_path, interrupt):
    """Stage 1 (MLE) then Eq. 1 continuing its optimizer (one OptimizerCarry), each stopped by its patience rule:
    cut off inside stage 1, between the stages (stage 1 finished, stage 2 saved nothing) or inside stage 2, then
    resumed with resume_from_checkpoint=True, the run ends with the uninterrupted run's weights (bit for bit), its
    stages' steps and its rules' curves; a stage 1 finished earlier comes back as a FinishedRun."""
    from hf_hardattn.tools.checkpointing import FinishedRun

    whole, first, second, rules = _two_stage_run(tmp_path, "whole")
    assert first.state.global_step == 8 and second.state.global_step == 8
    assert rules["mle"].converged and rules["kd"].converged
    with pytest.raises(Interrupted):
        _two_stage_run(tmp_path, "cut", interrupt=interrupt)
    resumed, again_first, again_second, again = _two_stage_run(tmp_path, "cut", resume=True)
    assert again_first.state.global_step == 8 and again_second.state.global_step == 8
    assert isinstance(again_first, FinishedRun) is (interrupt[0] == "kd")
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    resumed_at = {("mle", 6): {"mle": 6}, ("kd", 0): {"mle": 8}, ("kd", 6): {"mle": 8, "kd": 6}}[interrupt]
    for stage in ("mle", "kd"):
        record, expected = again[stage].record(), rules[stage].record()
        assert record.pop("resumed_at") == resumed_at.get(stage) and expected.pop("resumed_at") is None
        assert record == expected, stage
    assert not (tmp_path / "cut" / "kd" / "continuation").exists()  # stage 2's start from stage 1's end, removed


def test_two_stage_resume_refuses_what_cannot_continue(tmp_path):
    with pytest.raises(ValueError, match="`resume_from_checkpoint` must be True or False"):
        train_two_stage(hybrid(), toy_tokenizer(), _distilled(), output_dir=str(tmp_path), resume_from_checkpoint="x")
    with pytest.raises(Interrupted):
        _two_stage_run(tmp_path, "cut", interrupt=("kd", 3))
    # stage 2 continues stage 1's optimizer: a resumed stage 2 rebuilds the schedule from its own arguments
    with pytest.raises(ValueError, match=r"differ from stage 1's \{'warmup_steps': \(2, 5\)\}"):
        _two_stage_run(tmp_path, "cut", resume=True, kd=dict(warmup_steps=5))
    # stage-2 checkpoints beside a stage 1 that never finished: not one run's folder
    import shutil

    shutil.rmtree(tmp_path / "cut" / "mle")
    with pytest.raises(ValueError, match="holds stage-2 checkpoints but stage 1 .* did not finish"):
        _two_stage_run(tmp_path, "cut", resume=True)


def test_two_stage_default_is_the_papers_schedule(tmp_path, monkeypatch):
    """Eq. 1's schedule by default: without `mle`, stage 1 (MLE on the references, train_seq2seq's defaults) runs
    before stage 2, whatever the scheme; skipping it takes mle=False; mle=None (the old default, which skipped it)
    and other values are refused with the allowed ones."""
    seen = []

    def recording(model, tokenizer, data, **kw):
        seen.append(("kd" if kw.get("trainer_class") is DistillationTrainer else "mle",
                     [list(r) for r in data["labels"]], sorted(kw)))
        return "trainer"

    monkeypatch.setattr(distill, "train_seq2seq", recording)
    step = dict(max_steps=1)
    for scheme in ("eq1_sequence", "sequence_only"):
        seen.clear()
        first, second = train_two_stage(hybrid(), toy_tokenizer(), _distilled(), kd_scheme=scheme, kd=step,
                                        output_dir=str(tmp_path / scheme))
        assert [s[0] for s in seen] == ["mle", "kd"] and first == second == "trainer", scheme
        assert seen[0][1] == [_ids(y) for y in REFERENCES] and seen[0][2] == ["output_dir"]  # defaults: no budget
    seen.clear()
    assert train_two_stage(hybrid(), toy_tokenizer(), _distilled(), mle=False, kd=step)[0] is None
    assert [s[0] for s in seen] == ["kd"]
    for bad in (None, "no", 0, [1]):
        with pytest.raises(ValueError, match="mle=False"):
            train_two_stage(hybrid(), toy_tokenizer(), _distilled(), mle=bad, kd=step)
    no_reference = _distilled().remove_columns("reference")
    with pytest.raises(ValueError, match="'reference' column.*mle=False"):
        train_two_stage(hybrid(), toy_tokenizer(), no_reference, kd_scheme="sequence_only", kd=step)


def test_kd_scheme_errors(tmp_path):
    student = hybrid()
    with pytest.raises(ValueError, match=r"`kd_scheme` must be one of \['eq1_sequence', 'eq1_word', 'sequence_word', "
                                         r"'sequence_only'\], got 'eq1'"):
        _trainer(student, soft(), tmp_path, kd_scheme="eq1")
    with pytest.raises(ValueError, match="`kd_scheme`"):
        tokenize_kd_dataset(_distilled(), toy_tokenizer(), "word")
    with pytest.raises(ValueError, match="`kd_scheme`"):
        train_two_stage(student, toy_tokenizer(), _distilled(), kd_scheme="seq")
    with pytest.raises(ValueError, match="`teacher_model` is required"):
        _stage2_trainer(student, tmp_path, "eq1_word")
    with pytest.raises(ValueError, match="`teacher_model` is not used"):
        _stage2_trainer(student, tmp_path, "eq1_sequence", teacher_model=soft())
    with pytest.raises(ValueError, match="`kd_lambda` has no role"):
        _stage2_trainer(student, tmp_path, "sequence_only", kd_lambda=1.0)
    with pytest.raises(ValueError, match="reference"):
        tokenize_kd_dataset(_distilled().remove_columns(["reference"]), toy_tokenizer(), "eq1_sequence")


def _trainer(student, teacher, tmp_path, steps=0, kd_scheme="eq1_word", **kw):
    tokenizer = toy_tokenizer()
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / "kd"), per_device_train_batch_size=16, max_steps=steps,
                                    learning_rate=3e-3, logging_steps=2, save_strategy="no", report_to=[],
                                    use_cpu=True, disable_tqdm=True, seed=0)
    return DistillationTrainer(model=student, args=args, train_dataset=copy_task(256), processing_class=tokenizer,
                               data_collator=DataCollatorForSeq2Seq(tokenizer, model=student), teacher_model=teacher,
                               kd_scheme=kd_scheme, **kw)


def test_kl_is_zero_when_student_equals_teacher(tmp_path):
    student = fitted(soft(), steps=40)
    trainer = _trainer(student, copy.deepcopy(student), tmp_path)
    batch = collate(copy_task(8, seed=3))
    loss = trainer.compute_loss(student, batch)
    assert trainer.kd_parts["kd"] == pytest.approx(0.0, abs=1e-6)
    logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"]).logits
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    assert loss.item() == pytest.approx(nll.item(), rel=1e-5)


def test_trainer_student_learns_teacher_frozen(tmp_path):
    """Hybrid student, soft teacher: the teacher gets no gradient, stays in eval mode and unchanged; the student's
    loss is the Eq. 1 value of its logits and the teacher's, and it drops."""
    torch.manual_seed(0)
    teacher = fitted(soft(), steps=60)
    teacher.zero_grad(set_to_none=True)  # (fitting left Adam's gradients)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = hybrid()
    trainer = _trainer(student, teacher, tmp_path, steps=30, kd_lambda=0.5)
    batch = collate(copy_task(8, seed=3))
    loss = trainer.compute_loss(student.train(), batch)
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert any(p.grad is not None for p in student.parameters())
    student.zero_grad()
    with torch.no_grad():
        ids = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        expected = kd_loss(student(**ids).logits, teacher(**ids).logits, batch["labels"], 0.5)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)  # (dropout 0 in tiny configs)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < 0.9 * losses[0], losses
    assert not teacher.training
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())


def test_mismatched_teacher_raises(tmp_path):
    student = hybrid()
    with pytest.raises(ValueError, match="teacher_model"):
        _trainer(student, soft(vocab_size=41), tmp_path)
    with pytest.raises(ValueError, match="teacher_model"):
        _trainer(student, soft(eos_token_id=3), tmp_path)
    other = toy_tokenizer()
    other.add_tokens(["extra"])
    with pytest.raises(ValueError, match="teacher_tokenizer"):
        _trainer(student, soft(), tmp_path, teacher_tokenizer=other)
    with pytest.raises(ValueError, match="kd_lambda"):
        _trainer(student, soft(), tmp_path, kd_lambda=-1)


@pytest.mark.numerics
def test_sequence_level_kd_is_resumable(tmp_path, monkeypatch):
    import datasets

    from hf_hardattn.tools.training import translate

    tokenizer = toy_tokenizer()
    rows = copy_task(10, seed=5)
    texts = [" ".join(f"t{i}" for i in r["input_ids"] if i != EOS) for r in rows]
    refs = [" ".join(f"t{i}" for i in r["labels"] if i != EOS) for r in rows]
    # the teacher: the first fit (seeds 0, 1, 2) whose beam-3 translations of the 10 sources hold more than 3
    # distinct ones (how 60 steps round decides that), so the order checks below can fail; else a clear failure
    distinct = []
    for seed in range(3):
        # fitted in fp32, then float64: the shards' batches (4, 4, 2 sources) and the sorted batches of `expected`
        # are other code paths, compared by exact text, which fp32 rounding could flip at a near tie
        teacher = as_float64(fitted(soft(), steps=60, seed=seed))
        expected = translate(teacher, tokenizer, texts, num_beams=3, batch_size=4, max_new_tokens=12)
        distinct.append(len(set(expected)))
        if distinct[-1] > 3:
            break
    else:
        pytest.fail(f"no teacher of seeds 0-2 translates the 10 sources into more than 3 distinct targets "
                    f"(distinct per seed: {distinct}); the KD data checks would compare too little")
    data = datasets.Dataset.from_dict({"source": texts, "target": refs})
    out = tmp_path / "distilled"
    first = translate_dataset(teacher, tokenizer, data, out, num_beams=3, batch_size=4, shard_size=4,
                              max_new_tokens=12, progress=False)
    assert first["target"] == expected and first["source"] == texts and first["reference"] == refs
    assert len(list((out / "shards").glob("shard-*.jsonl"))) == 3
    assert datasets.load_from_disk(str(out / "dataset"))["target"] == expected

    # interruption: the last shard never got written; a rerun translates only that shard
    (out / "shards" / "shard-000001.jsonl").unlink()
    calls = []

    def counting_translate(model, tok, sources, **kw):
        calls.append(len(sources))
        return translate(model, tok, sources, **kw)

    monkeypatch.setattr("hf_hardattn.tools.training.translate", counting_translate)
    again = translate_dataset(teacher, tokenizer, data, out, num_beams=3, batch_size=4, shard_size=4,
                              max_new_tokens=12, progress=False)
    assert calls == [4] and again["target"] == expected
    with pytest.raises(ValueError, match="output_dir"):  # other settings never mix with finished shards
        translate_dataset(teacher, tokenizer, data, out, num_beams=2, shard_size=4, max_new_tokens=12,
                          progress=False)

    # the teacher is known by its weights: the same teacher loaded from another folder resumes (nothing translated),
    # one weight changed is another teacher
    teacher.save_pretrained(tmp_path / "moved")
    moved = type(teacher).from_pretrained(tmp_path / "moved")
    calls.clear()
    assert translate_dataset(moved, tokenizer, data, out, num_beams=3, batch_size=4, shard_size=4,
                             max_new_tokens=12, progress=False)["target"] == expected and calls == []
    # a manifest of the earlier format (the teacher by the folder it was loaded from) resumes for that folder's
    # teacher, and its manifest is upgraded; for a teacher from another folder it is refused
    manifest = out / "kd_manifest.json"
    old = json.loads(manifest.read_text())
    old["teacher"] = str(tmp_path / "moved")
    del old["teacher_sha256"]
    manifest.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="teacher_sha256"):
        translate_dataset(teacher, tokenizer, data, out, num_beams=3, batch_size=4, shard_size=4, max_new_tokens=12,
                          progress=False)
    assert translate_dataset(moved, tokenizer, data, out, num_beams=3, batch_size=4, shard_size=4,
                             max_new_tokens=12, progress=False)["target"] == expected and calls == []
    assert "teacher" not in json.loads(manifest.read_text())
    with torch.no_grad():
        next(moved.parameters())[0, 0] += 1e-3
    with pytest.raises(ValueError, match="teacher_sha256"):
        translate_dataset(moved, tokenizer, data, out, num_beams=3, batch_size=4, shard_size=4, max_new_tokens=12,
                          progress=False)


def test_cli_distill(tmp_path):
    import datasets

    from hf_hardattn_cli.command import main

    teacher = fitted(soft(), steps=20)
    teacher.save_pretrained(tmp_path / "teacher")
    toy_tokenizer().save_pretrained(tmp_path / "teacher")
    datasets.Dataset.from_dict({"source": ["t5 t6 t7", "t9 t8"], "target": ["t7 t6 t5", "t8 t9"]}).save_to_disk(
        str(tmp_path / "data"))
    assert main(["distill", "--teacher", str(tmp_path / "teacher"), "--dataset", str(tmp_path / "data"),
                 "--out", str(tmp_path / "out"), "--num-beams", "2", "--max-new-tokens", "6"]) == 0
    result = datasets.load_from_disk(str(tmp_path / "out" / "dataset"))
    assert result["source"] == ["t5 t6 t7", "t9 t8"] and len(result["target"]) == 2
    assert distill.MANIFEST in [p.name for p in (tmp_path / "out").iterdir()]


def test_saved_translations_load_back_for_the_same_sources_and_identity_only(tmp_path):
    """save_translations / load_translations: the file gives back translate_dataset's columns (source, the teacher's
    target, the reference) for the same sources and identity; other sources or another identity are refused by name,
    and no file is None."""
    import datasets

    data = datasets.Dataset.from_dict(dict(source=["a b", "c", "dé f"], target=["x", "y", "z"]))
    distilled = datasets.Dataset.from_dict(dict(source=data["source"], target=["T1", "T 2", "Tü3"],
                                                reference=data["target"]))
    path = tmp_path / "kd.jsonl.gz"
    assert distill.load_translations(path, data, num_beams=12) is None
    distill.save_translations(path, distilled, num_beams=12, teacher=dict(steps=5))
    loaded = distill.load_translations(path, data, num_beams=12, teacher=dict(steps=5))
    assert loaded.column_names == distilled.column_names and loaded.to_dict() == distilled.to_dict()
    with pytest.raises(ValueError, match=r"another teacher or data \(\['num_beams', 'teacher'\]"):
        distill.load_translations(path, data, num_beams=4, teacher=dict(steps=6))
    other = datasets.Dataset.from_dict(dict(source=["a b", "c", "d f"], target=["x", "y", "z"]))
    with pytest.raises(ValueError, match=r"\(\['sources_sha256'\] differ"):
        distill.load_translations(path, other, num_beams=12, teacher=dict(steps=5))
