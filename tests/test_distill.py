"""Knowledge distillation (hybrid paper, Sec. 2.2): the Eq. 1 loss against a hand computation, its trainer (frozen
teacher, KL = 0 for student == teacher, clear errors), and resumable sequence-level KD translation."""

import copy
import math

import pytest
import torch
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

from common import EOS, collate, copy_task, fitted, tiny_kwargs, toy_tokenizer
from hf_hardattn import (HybridConfig, HybridForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration)
from hf_hardattn import distill
from hf_hardattn.distill import DistillationTrainer, kd_loss, translate_dataset


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


def _trainer(student, teacher, tmp_path, steps=0, **kw):
    tokenizer = toy_tokenizer()
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / "kd"), per_device_train_batch_size=16, max_steps=steps,
                                    learning_rate=3e-3, logging_steps=2, save_strategy="no", report_to=[],
                                    use_cpu=True, disable_tqdm=True, seed=0)
    return DistillationTrainer(model=student, args=args, train_dataset=copy_task(256), processing_class=tokenizer,
                               data_collator=DataCollatorForSeq2Seq(tokenizer, model=student), teacher_model=teacher,
                               **kw)


def test_kl_is_zero_when_student_equals_teacher(tmp_path):
    student = fitted(soft(), steps=40)
    trainer = _trainer(student, copy.deepcopy(student), tmp_path)
    batch = collate(copy_task(8, seed=3))
    loss = trainer.compute_loss(student, batch)
    assert trainer.kd_parts["kl"] == pytest.approx(0.0, abs=1e-6)
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


def test_sequence_level_kd_is_resumable(tmp_path, monkeypatch):
    import datasets

    from hf_hardattn.training import translate

    teacher = fitted(soft(), steps=60)
    tokenizer = toy_tokenizer()
    rows = copy_task(10, seed=5)
    texts = [" ".join(f"t{i}" for i in r["input_ids"] if i != EOS) for r in rows]
    refs = [" ".join(f"t{i}" for i in r["labels"] if i != EOS) for r in rows]
    data = datasets.Dataset.from_dict({"source": texts, "target": refs})
    out = tmp_path / "distilled"
    first = translate_dataset(teacher, tokenizer, data, out, num_beams=3, batch_size=4, shard_size=4,
                              max_new_tokens=12, progress=False)
    expected = translate(teacher, tokenizer, texts, num_beams=3, batch_size=4, max_new_tokens=12)
    assert first["target"] == expected and first["source"] == texts and first["reference"] == refs
    assert len(set(expected)) > 3  # not degenerate
    assert len(list((out / "shards").glob("shard-*.jsonl"))) == 3
    assert datasets.load_from_disk(str(out / "dataset"))["target"] == expected

    # interruption: the last shard never got written; a rerun translates only that shard
    (out / "shards" / "shard-000001.jsonl").unlink()
    calls = []

    def counting_translate(model, tok, sources, **kw):
        calls.append(len(sources))
        return translate(model, tok, sources, **kw)

    monkeypatch.setattr("hf_hardattn.training.translate", counting_translate)
    again = translate_dataset(teacher, tokenizer, data, out, num_beams=3, batch_size=4, shard_size=4,
                              max_new_tokens=12, progress=False)
    assert calls == [4] and again["target"] == expected
    with pytest.raises(ValueError, match="output_dir"):  # other settings never mix with finished shards
        translate_dataset(teacher, tokenizer, data, out, num_beams=2, shard_size=4, max_new_tokens=12,
                          progress=False)


def test_cli_distill(tmp_path):
    import datasets

    from hf_hardattn.cli import main

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
