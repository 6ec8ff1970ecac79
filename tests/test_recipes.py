"""The papers' recipes: the Lipschitz-constrained init of the hard-retrieval paper (config init_std="lipschitz"), the
placement of attention dropout on hard retrieval (config retrieval_dropout), checkpoint averaging, convergence by
patience and a stage that continues the previous one's optimizer (hf_hardattn.tools.training)."""

import itertools
import math
import os

import pytest
import torch
from torch import nn

from common import InterruptAt, Interrupted, Scripted

import hf_hardattn  # noqa: F401
from hf_hardattn import HardRetrievalConfig, HardRetrievalForConditionalGeneration
from hf_hardattn.hard_retrieval import HardRetrievalAttention, sampled_retrieval
from hf_hardattn.soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration
from hf_hardattn.tools import recipes

SIZES = dict(vocab_size=500, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256)


# ----------------------------------------------------------------------------------------------------------------
# init_std="lipschitz"
# ----------------------------------------------------------------------------------------------------------------
def uniform_bound_checks(weight: torch.Tensor, bound: float):
    """Every entry inside [-bound, bound], the largest near the bound and the std that of U(-bound, bound),
    bound / sqrt(3), within sampling error (float64)."""
    w = weight.detach().double().flatten()
    assert w.abs().max().item() <= bound * (1 + 1e-6)
    assert w.abs().max().item() > 0.97 * bound
    std = bound / math.sqrt(3)
    # the sample std of n uniform draws has a relative standard error of about sqrt(0.2 / n) (kurtosis 1.8)
    assert abs(w.std().item() - std) < 5 * std * math.sqrt(0.2 / w.numel()), (w.std().item(), std)
    assert abs(w.mean().item()) < 5 * std / math.sqrt(w.numel())


def test_lipschitz_init_is_the_authors_formula():
    """Xu et al. 2020a (hfxunlp/transformer init_model_params_lipschitz): every linear weight
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the embeddings U(-sqrt(2 / (V + d)), +), biases 0, norms 1 / 0, padding row 0;
    the tied output layer is the embedding."""
    torch.manual_seed(0)
    model = HardRetrievalForConditionalGeneration(HardRetrievalConfig(**SIZES, init_std="lipschitz",
                                                                      embed_init_std=None))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head]
    assert len(linears) == 11  # encoder 4, decoder 7
    for linear in linears:
        uniform_bound_checks(linear.weight, 1 / math.sqrt(linear.in_features))  # fc2: fan-in 256, the others 64
        if linear.bias is not None:
            assert not linear.bias.any()
    shared = model.get_input_embeddings()
    rows = torch.cat([shared.weight[: shared.padding_idx], shared.weight[shared.padding_idx + 1:]])
    uniform_bound_checks(rows, math.sqrt(2 / (500 + 64)))
    assert not shared.weight[shared.padding_idx].any()
    assert model.lm_head.weight is shared.weight
    for norm in (m for m in model.modules() if isinstance(m, nn.LayerNorm)):
        assert (norm.weight == 1).all() and not norm.bias.any()


def test_lipschitz_init_embeddings_follow_a_given_embed_std_and_the_value_round_trips(tmp_path):
    torch.manual_seed(0)
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**SIZES, init_std="lipschitz",
                                                                          embed_init_std=0.02))
    assert model.get_input_embeddings().weight.std().item() == pytest.approx(0.02, rel=0.05)  # N(0, 0.02)
    uniform_bound_checks(model.model.encoder.layers[0].ffn.module.fc2.weight, 1 / 16)
    model.save_pretrained(tmp_path)
    assert type(model).from_pretrained(tmp_path).config.init_std == "lipschitz"
    with pytest.raises(ValueError, match="`init_std`.*lipschitz.*got 'lipschits'"):
        SoftTransformerConfig(**SIZES, init_std="lipschits")


# ----------------------------------------------------------------------------------------------------------------
# retrieval_dropout
# ----------------------------------------------------------------------------------------------------------------
def before_draw_distribution(probs, p):
    """The distribution of the index drawn after dropout on ``probs`` (by hand): over every keep mask m (each key kept
    with probability 1 - p), m * P / sum(m * P); a mask that keeps no probability draws from P."""
    expected = torch.zeros_like(probs)
    for mask in itertools.product((0.0, 1.0), repeat=len(probs)):
        m = torch.tensor(mask, dtype=probs.dtype)
        chance = math.prod((1 - p) if kept else p for kept in mask)
        kept = m * probs
        expected += chance * (kept / kept.sum() if kept.sum() > 0 else probs)
    return expected


@pytest.mark.parametrize("placement", ["before_draw", "after_draw"])
def test_dropout_placement_sets_the_drawn_distribution(placement):
    """before_draw (the authors' code): the draw follows the renormalised dropped probabilities' expectation, not P;
    after_draw: P itself, with the retrieved row dropped (zero or scaled by 1 / (1 - p))."""
    torch.manual_seed(0)
    p, n = 0.5, 200_000
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0], dtype=torch.float64)  # the last key masked
    values = torch.eye(4, dtype=torch.float64).unsqueeze(0).unsqueeze(0)  # value row j = e_j: the output names j
    out, index = sampled_retrieval(probs.expand(1, 1, n, 4), values, dropout=p, placement=placement)
    frequencies = torch.bincount(index.flatten(), minlength=4).double() / n
    expected = before_draw_distribution(probs, p) if placement == "before_draw" else probs
    assert (expected - probs).abs().max() > 0.05 or placement == "after_draw"  # the two placements differ here
    tolerance = 5 * (expected * (1 - expected) / n).sqrt() + 1e-12
    assert ((frequencies - expected).abs() <= tolerance).all(), (frequencies, expected)
    assert frequencies[3] == 0
    rows = out[0, 0]
    scale = rows.gather(-1, index[0, 0].unsqueeze(-1)).squeeze(-1)
    if placement == "before_draw":  # the drawn row is returned as it is
        assert (scale == 1).all()
    else:  # kept (scaled by 2) about half the time, dropped the rest
        assert set(scale.unique().tolist()) == {0.0, 2.0}
        assert (scale == 0).double().mean().item() == pytest.approx(p, abs=5 * math.sqrt(p * (1 - p) / n))


def test_before_draw_gradient_reaches_the_kept_probabilities_only():
    """The straight-through gradient (Eq. 8-9) goes to the dropped probabilities, through the dropout mask: a dropped
    probability gets none, a kept one (A^g V^T) / (1 - p)."""
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(2, 3, 5, 7, dtype=torch.float64), -1).requires_grad_()
    values = torch.randn(2, 3, 7, 4, dtype=torch.float64)
    grad_out = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    state = torch.get_rng_state()
    out, _ = sampled_retrieval(probs, values, dropout=0.4, placement="before_draw")
    out.backward(grad_out)
    torch.set_rng_state(state)
    keep = torch.nn.functional.dropout(torch.ones_like(probs), 0.4, True) > 0  # the same mask (same RNG state)
    empty = ~keep.any(-1, keepdim=True)
    expected = (grad_out @ values.transpose(-1, -2)) * torch.where(empty, 1.0, keep / 0.6)
    torch.testing.assert_close(probs.grad, expected)


def test_retrieval_dropout_reaches_the_modules_and_bad_values_are_refused():
    config = HardRetrievalConfig(**SIZES, attention_dropout=0.1, retrieval_dropout="before_draw")
    model = HardRetrievalForConditionalGeneration(config)
    placements = {m.dropout_placement for m in model.modules() if isinstance(m, HardRetrievalAttention)}
    assert placements == {"before_draw"}
    assert HardRetrievalConfig(**SIZES).retrieval_dropout == "after_draw"  # the default is unchanged
    # a soft model with one hard role reads the kind's setting too
    soft = SoftTransformerForConditionalGeneration(SoftTransformerConfig(
        **SIZES, cross_attention="hard_retrieval", retrieval_dropout="before_draw"))
    assert {m.dropout_placement for m in soft.modules() if isinstance(m, HardRetrievalAttention)} == {"before_draw"}
    with pytest.raises(ValueError, match="`retrieval_dropout`.*after_draw.*got 'before'"):
        HardRetrievalConfig(**SIZES, retrieval_dropout="before")
    with pytest.raises(ValueError, match="`retrieval_dropout`.*'during'"):
        SoftTransformerForConditionalGeneration(SoftTransformerConfig(**SIZES, cross_attention="hard_retrieval",
                                                                      retrieval_dropout="during"))
    with pytest.raises(ValueError, match="`placement`"):
        sampled_retrieval(torch.ones(1, 2), torch.ones(2, 1), 0.1, "before")


# ----------------------------------------------------------------------------------------------------------------
# Convergence, continuation, checkpoint averaging (hf_hardattn.tools.training)
# ----------------------------------------------------------------------------------------------------------------
def test_convergence_stops_after_patience_evaluations_without_improvement():
    from hf_hardattn.tools.training import Convergence

    losses = iter([5.0, 4.0, 4.5, 3.9, 4.0, 3.9, 4.2, 1.0])  # 3.9 again is no improvement (strictly better only)
    callback = Convergence(lambda model: next(losses), every=10, patience=3)
    stops = [callback.observe(step, callback.evaluate(None)) for step in range(10, 80, 10)]
    assert stops == [False] * 6 + [True]
    record = callback.record()
    assert record["converged"] is True and record["best"] == 3.9 and record["best_step"] == 40
    assert record["curve"] == [[10, 5.0], [20, 4.0], [30, 4.5], [40, 3.9], [50, 4.0], [60, 3.9], [70, 4.2]]
    # BLEU: higher is better; min_steps holds the stop back
    bleu = Convergence(None, every=1, patience=1, metric="val_bleu", min_steps=3)
    assert [bleu.observe(step, value) for step, value in ((1, 10.0), (2, 9.0), (3, 11.0), (4, 11.0))] == \
        [False, False, False, True]
    assert bleu.record()["best_step"] == 3
    # as a Trainer callback: every `every` steps one evaluation, logged with the best so far; stop once patience is spent
    from types import SimpleNamespace

    losses = iter([3.0, 2.0, 2.5, 2.5])
    callback = Convergence(lambda model: next(losses), every=2, patience=2)
    state, control = SimpleNamespace(global_step=0, log_history=[{"loss": 9.0, "step": 1}]), SimpleNamespace(
        should_training_stop=False)
    for step in range(1, 9):
        state.global_step = step
        callback.on_step_end(None, state, control)
        assert control.should_training_stop is (step == 8)
    assert all(entry.pop("minutes") >= 0 for entry in state.log_history[1:])  # wall-clock, for a resumed run's total
    assert state.log_history == [{"loss": 9.0, "step": 1}] + [
        {"step": step, "val_loss": value, "best_val_loss": best, "best_step": at, "converged": step == 8}
        for step, value, best, at in ((2, 3.0, 3.0, 2), (4, 2.0, 2.0, 4), (6, 2.5, 2.0, 4), (8, 2.5, 2.0, 4))]
    never = Convergence(None, every=1, patience=2)
    assert not any(never.observe(step, 10.0 - step) for step in range(1, 6)) and never.record()["converged"] is False
    for kwargs, name in ((dict(every=0, patience=1), "every"), (dict(every=1, patience=1.5), "patience"),
                         (dict(every=1, patience=1, metric="bleu"), "metric"),
                         (dict(every=1, patience=1, min_steps=-1), "min_steps")):
        with pytest.raises(ValueError, match=f"`{name}`"):
            Convergence(None, **kwargs)


def toy_model(**extra):
    torch.manual_seed(0)
    config = SoftTransformerConfig(**{**dict(SIZES, vocab_size=TOKENIZER_VOCAB, dropout=0.0, attention_dropout=0.0,
                                             label_smoothing=0.0, pad_token_id=TOKENIZER.pad_token_id,
                                             bos_token_id=TOKENIZER.bos_token_id, eos_token_id=TOKENIZER.eos_token_id,
                                             decoder_start_token_id=TOKENIZER.bos_token_id), **extra})
    return SoftTransformerForConditionalGeneration(config)


def toy_data():
    import datasets

    from hf_hardattn.tools.training import tokenize_dataset

    pairs = [("a man rides a bike", "ein mann fährt rad"), ("two dogs play", "zwei hunde spielen"),
             ("a woman reads", "eine frau liest"), ("kids run on the beach", "kinder rennen am strand")]
    raw = datasets.Dataset.from_dict({"source": [s for s, _ in pairs], "target": [t for _, t in pairs]})
    return tokenize_dataset(raw, TOKENIZER, max_length=32)  # lengths 16-24: batches pad


def _tokenizer():
    from hf_hardattn.tools.tokenization import train_tokenizer

    text = ["a man rides a bike", "ein mann fährt rad", "two dogs play", "zwei hunde spielen", "a woman reads",
            "eine frau liest", "kids run on the beach", "kinder rennen am strand"]
    return train_tokenizer(text, kind="char", vocab_size=100, min_frequency=1)


TOKENIZER = _tokenizer()
TOKENIZER_VOCAB = len(TOKENIZER)


def test_validation_loss_is_the_token_mean_nll_of_the_references():
    """Against -log p(reference token) summed over one batch of every example, by hand (float64)."""
    from transformers import DataCollatorForSeq2Seq

    from hf_hardattn.tools.training import validation_loss

    model = toy_model().double().eval()
    data = toy_data()
    batch = DataCollatorForSeq2Seq(TOKENIZER, model=model, label_pad_token_id=-100)(
        [{k: row[k] for k in ("input_ids", "attention_mask", "labels")} for row in data])
    labels = batch.pop("labels")
    with torch.no_grad():
        log_probs = model(**batch).logits.log_softmax(-1)
    picked = [log_probs[b, t, labels[b, t]].item() for b in range(labels.shape[0]) for t in range(labels.shape[1])
              if labels[b, t] != -100]
    expected = -sum(picked) / len(picked)
    assert validation_loss(model, TOKENIZER, data, batch_size=3) == pytest.approx(expected, rel=1e-12)
    assert not model.training


def train(model, steps, tmp_path, name, **kwargs):
    from hf_hardattn.tools.training import train_seq2seq

    kwargs = dict(dict(batch_size=4, learning_rate=1e-2, warmup_steps=3, lr_scheduler="inverse_sqrt", progress=False),
                  **kwargs)
    return train_seq2seq(model, TOKENIZER, toy_data(), output_dir=str(tmp_path / name), max_steps=steps, **kwargs)


def test_a_carried_optimizer_continues_the_previous_stage(tmp_path):
    """2 + 2 steps with one OptimizerCarry = 4 steps in one run (every batch the whole toy set, no dropout: the same
    updates); 2 + 2 without it restarts Adam and the warm-up, and ends elsewhere."""
    from hf_hardattn.tools.training import OptimizerCarry

    whole = toy_model()
    train(whole, 4, tmp_path, "whole")
    carry, continued = OptimizerCarry(), toy_model()
    train(continued, 2, tmp_path, "first", carry=carry)
    optimizer = carry.optimizer
    train(continued, 2, tmp_path, "second", carry=carry)
    assert carry.optimizer is optimizer and carry.steps == 4 and carry.lr_scheduler.last_epoch == 4
    assert optimizer.state[next(continued.parameters())]["step"] == 4
    restarted = toy_model()
    train(restarted, 2, tmp_path, "first_again")
    train(restarted, 2, tmp_path, "second_again")
    for a, b, c in zip(whole.parameters(), continued.parameters(), restarted.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert max((a - c).abs().max().item() for a, c in zip(whole.parameters(), restarted.parameters())) > 1e-4
    with pytest.raises(ValueError, match="`carry`"):
        train(toy_model(), 1, tmp_path, "bad", carry=object())


# best 1.8 at step 12; 14 and 16 do not improve: patience 2 stops at 16. A rule that forgot the evaluations before a
# resume at 15 would take 16's 2.1 as its best and run on to the cap (20)
SCRIPT = {2: 3.0, 4: 2.0, 6: 2.5, 8: 1.9, 10: 2.2, 12: 1.8, 14: 2.0, 16: 2.1, 18: 2.2, 20: 2.3}


def scripted_run(tmp_path, name, interrupt=None, resume=False, dropout=0.1):
    from hf_hardattn.tools.training import Convergence

    script = Scripted(SCRIPT)
    rule = Convergence(script, every=2, patience=2)
    callbacks = [script, rule] + ([InterruptAt(interrupt)] if interrupt else [])
    model = toy_model(dropout=dropout)  # dropout: the resumed run must restore the RNG too
    trainer = train(model, 20, tmp_path, name, batch_size=1, save_steps=3, callbacks=callbacks,
                    resume_from_checkpoint=resume)
    return model, rule, trainer


def test_a_run_to_convergence_resumed_after_an_interruption_ends_as_the_uninterrupted_one(tmp_path):
    """Stopped by patience at step 16 (checkpoints every 3 steps, 4 examples one per batch: the resume skips into an
    epoch); the same run cut off after step 15 and resumed from its checkpoint takes the rule's state back from the
    checkpoint's log, stops at 16 too, with the same weights (bit for bit), curve and best; the stopping step is saved
    (16 is no multiple of 3), so the finished run says so on disk; a run cut off before is not finished."""
    from hf_hardattn.tools.checkpointing import checkpoints, finished_run

    whole, rule, trainer = scripted_run(tmp_path, "whole")
    assert trainer.state.global_step == 16 and rule.converged and rule.best_step == 12
    assert [step for step, _ in checkpoints(tmp_path / "whole")][-1] == 16  # saved at the stop
    ended = finished_run(str(tmp_path / "whole"))
    assert ended is not None and ended.state.global_step == 16 and ended.checkpoint.endswith("checkpoint-16")
    with pytest.raises(Interrupted):
        scripted_run(tmp_path, "cut", interrupt=15)
    assert finished_run(str(tmp_path / "cut")) is None
    resumed, resumed_rule, trainer = scripted_run(tmp_path, "cut", resume=True)
    assert trainer.state.global_step == 16 and resumed_rule.resumed_at == 15
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    record, expected = resumed_rule.record(), rule.record()
    assert record.pop("resumed_at") == 15 and expected.pop("resumed_at") is None
    assert record == expected and record["curve"] == [[step, SCRIPT[step]] for step in range(2, 17, 2)]
    assert resumed_rule.minutes() >= resumed_rule.minutes_before > 0  # the first run's minutes carried over
    # the control: a rule that forgot the evaluations before 15 would not have stopped at 16, but at the cap
    from hf_hardattn.tools.training import Convergence

    forgetful = Convergence(None, every=2, patience=2)
    assert [forgetful.observe(step, SCRIPT[step]) for step in (16, 18, 20)] == [False, False, True]


def test_resuming_needs_a_checkpoint_with_its_optimizer(tmp_path):
    train(toy_model(), 2, tmp_path, "model_only", save_steps=2, save_only_model=True)
    with pytest.raises(ValueError, match="`resume_from_checkpoint`.*no optimizer state.*save_only_model"):
        train(toy_model(), 4, tmp_path, "model_only", resume_from_checkpoint=True)


def test_averaged_checkpoints_are_the_hand_mean_of_the_last_saved_weights(tmp_path):
    """Checkpoints saved by the Trainer every step; the last 3 of 5, averaged, equal the mean of the weights that each
    of those checkpoints holds (read back one by one, summed in float64); the tied output layer follows."""
    from safetensors.torch import load_file

    from hf_hardattn.tools.checkpointing import average_checkpoints, last_checkpoints, load_average

    model = toy_model()
    train(model, 5, tmp_path, "run", save_steps=1)
    paths = last_checkpoints(tmp_path / "run", 3)
    assert [os.path.basename(p) for p in paths] == ["checkpoint-3", "checkpoint-4", "checkpoint-5"]
    saved = [load_file(os.path.join(p, "model.safetensors")) for p in paths]
    mean = {name: sum(s[name].double() for s in saved) / 3 for name in saved[0]}
    assert any((saved[0][n] != saved[2][n]).any() for n in mean)  # the checkpoints differ
    averaged = average_checkpoints(paths)
    for name, value in mean.items():
        torch.testing.assert_close(averaged[name].double(), value, rtol=0, atol=1e-7)
        assert averaged[name].dtype == saved[0][name].dtype
    load_average(model, paths)
    state = model.state_dict()
    for name, value in mean.items():
        torch.testing.assert_close(state[name].double(), value, rtol=0, atol=1e-7)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    with pytest.raises(ValueError, match="`paths`"):
        average_checkpoints([])
    with pytest.raises(ValueError, match="no model.safetensors"):
        average_checkpoints([tmp_path])


# ----------------------------------------------------------------------------------------------------------------
# reproduce --recipe PAPER (hf_hardattn.tools.reproduce), tiny rows
# ----------------------------------------------------------------------------------------------------------------
def tiny_argv(tmp_path, *extra):
    from test_reproduce import write_toy_multi30k

    data = tmp_path / "data"
    if not data.exists():
        write_toy_multi30k(tmp_path)
    return ["--task", "multi30k", "--preset", "tiny", "--data", str(data), "--quiet", *extra]


def assert_same_saved_model(row, first, second):
    """The model of ``row`` saved in two output folders: equal bit for bit, tensor by tensor."""
    from transformers import AutoModelForSeq2SeqLM

    models = [AutoModelForSeq2SeqLM.from_pretrained(folder / "models" / row) for folder in (first, second)]
    for (name, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        assert torch.equal(a, b), name


def stored(out, recipe):
    import json

    with open(os.path.join(out, f"reproduce_multi30k_tiny_{recipe}.json")) as handle:
        return json.load(handle)


def test_hard_retrieval_recipe_row_converges_by_patience_and_stores_every_field(tmp_path, monkeypatch):
    """A constant validation loss, evaluated every 2 steps: the best at step 2, then 2 evaluations without improvement
    (patience 2): the row stops at step 6 of its cap 10, converged, with its curve; its model is the mean of its
    checkpoints (one at every evaluation: steps 2, 4, 6); every recipe
    field is in the row's JSON and in the file's, and the model carries the paper's init and dropout placement;
    --export-fp16 keeps that averaged model in fp16 with its tokenizer and card."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSeq2SeqLM

    from hf_hardattn.tools import reproduce, training

    monkeypatch.setattr(training, "validation_loss", lambda *args, **kwargs: 1.0)
    out = tmp_path / "out"
    reproduce.main(tiny_argv(tmp_path, "--recipe", "hard_retrieval", "--rows", "hard_cross", "--output-dir", str(out),
                             "--export-fp16", str(tmp_path / "fp16"), "--eval-steps", "2", "--max-steps", "10"))
    payload = stored(out, "hard_retrieval")
    row = payload["rows"]["hard_cross"]
    assert row["converged"] is True and row["steps"] == 6 and row["convergence"]["steps_reached"] == 6
    assert row["convergence"]["curve"] == [[2, 1.0], [4, 1.0], [6, 1.0]] and row["convergence"]["metric"] == "val_loss"
    fields = {field.name for field in reproduce.dataclasses.fields(recipes.Recipe)}
    assert set(row["recipe"]) == set(payload["recipe"]) == fields
    assert row["recipe_name"] == payload["recipe_name"] == "hard_retrieval" and "--recipe hard_retrieval" in row["command"]
    for name, value in recipes.PAPER_RECIPES["hard_retrieval"]["fields"].items():
        assert row["recipe"][name] == value, name
    assert (row["recipe"]["patience"], row["recipe"]["max_steps"], row["recipe"]["eval_steps"]) == (2, 10, 2)
    assert row["recipe"]["lr_scheduler"] == "inverse_sqrt" and "--eval-steps 2 " in row["command"] + " "
    assert row["model_fields"]["init_std"] == "lipschitz" and row["model_fields"]["embed_init_std"] is None
    assert row["model_fields"]["retrieval_dropout"] == "before_draw" and row["model_fields"]["attention_dropout"] == 0.1
    assert row["averaged_checkpoints"] == [2, 4, 6] and row["checkpoint_steps"] == 2
    saved = [load_file(str(out / "trainer" / "hard_cross" / f"checkpoint-{step}" / "model.safetensors"))
             for step in (2, 4, 6)]
    model = AutoModelForSeq2SeqLM.from_pretrained(out / "models" / "hard_cross")
    assert model.config.init_std == "lipschitz" and model.config.retrieval_dropout == "before_draw"
    state = model.state_dict()
    for name in saved[0]:
        torch.testing.assert_close(state[name].double(), sum(s[name].double() for s in saved) / 3, rtol=0, atol=1e-7)
    half = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "fp16" / "hard_cross")
    assert load_file(str(tmp_path / "fp16" / "hard_cross" / "model.safetensors"))["model.shared.weight"].dtype == \
        torch.float16
    for name, value in half.state_dict().items():
        assert torch.equal(value, state[name].half()), name
    assert (tmp_path / "fp16" / "hard_cross" / "tokenizer.json").exists()
    assert "| hard_cross |" in (tmp_path / "fp16" / "hard_cross" / "README.md").read_text()


def test_an_interrupted_paper_recipe_row_resumes_where_it_stopped(tmp_path, monkeypatch, capsys):
    """hard_cross under the hard-retrieval recipe (a constant validation loss: it stops at step 6 of 10; checkpoints
    2, 4, 6 averaged) cut off after step 4, then the same command again: the row resumes from checkpoint-4 (stored as
    resumed_at), stops at 6 and stores the uninterrupted run's model (bit for bit), scores and curve. The finished
    row's checkpoints keep their weights, not the optimizer state; --force trains the row anew, and a --force rerun
    cut off part-way resumes with --force (the plain command meanwhile skips the row and says so)."""
    import json

    from hf_hardattn.tools import reproduce, training

    monkeypatch.setattr(training, "validation_loss", lambda *args, **kwargs: 1.0)

    def argv(out, *extra):
        return tiny_argv(tmp_path, "--recipe", "hard_retrieval", "--rows", "hard_cross", "--output-dir", str(out),
                         "--eval-steps", "2", "--max-steps", "10", *extra)

    reproduce.main(argv(tmp_path / "whole"))
    real, out = training.train_seq2seq, tmp_path / "cut"

    def cut_off(*args, **kwargs):
        return real(*args, **dict(kwargs, callbacks=list(kwargs.get("callbacks") or []) + [InterruptAt(4)]))

    monkeypatch.setattr(training, "train_seq2seq", cut_off)
    with pytest.raises(Interrupted):
        reproduce.main(argv(out))
    assert json.loads((out / "trainer" / "hard_cross" / "run.json").read_text())["row"] == "hard_cross"
    monkeypatch.setattr(training, "train_seq2seq", real)
    reproduce.main(argv(out))
    whole, row = (stored(folder, "hard_retrieval")["rows"]["hard_cross"] for folder in (tmp_path / "whole", out))
    assert row.pop("resumed_at") == {"train": 4} and "resumed_at" not in whole
    assert row["convergence"].pop("resumed_at") == 4 and whole["convergence"].pop("resumed_at") is None
    for result in (whole, row):
        assert result.pop("train_minutes") > 0
        for timing in ("command", "decode_seconds", "sentences_per_s", "finished"):  # the output folder; the clock
            result.pop(timing)
    assert row == whole and row["steps"] == 6 and row["averaged_checkpoints"] == [2, 4, 6]
    assert_same_saved_model("hard_cross", tmp_path / "whole", out)
    saved = sorted((out / "trainer" / "hard_cross").glob("checkpoint-*"))
    assert [p.name for p in saved] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert all((p / "model.safetensors").exists() and not (p / "optimizer.pt").exists() for p in saved)
    # --force: anew (nothing resumed)
    reproduce.main(argv(out, "--force"))
    assert "resumed_at" not in stored(out, "hard_retrieval")["rows"]["hard_cross"]
    # a --force rerun cut off after step 4: the plain command keeps the finished row and names the cut-off rerun;
    # --force again resumes that rerun from its checkpoint-4 and ends as the uninterrupted run; then --force is anew
    monkeypatch.setattr(training, "train_seq2seq", cut_off)
    with pytest.raises(Interrupted):
        reproduce.main(argv(out, "--force"))
    monkeypatch.setattr(training, "train_seq2seq", real)
    capsys.readouterr()
    reproduce.main(argv(out))
    assert "(skipped; a --force rerun was cut off part-way: --force resumes it)" in capsys.readouterr().out
    reproduce.main(argv(out, "--force"))
    row = stored(out, "hard_retrieval")["rows"]["hard_cross"]
    assert row["resumed_at"] == {"train": 4} and row["steps"] == 6
    assert_same_saved_model("hard_cross", tmp_path / "whole", out)
    reproduce.main(argv(out, "--force"))
    assert "resumed_at" not in stored(out, "hard_retrieval")["rows"]["hard_cross"]


def test_a_run_folder_resumes_only_the_run_it_records(tmp_path):
    """prepare_run_folder: the same identity with resume allowed keeps the folder (True); another identity, or resume
    not allowed, empties it and records the new identity (False); a redo empties a finished run's folder, and resumes
    only a redo that was cut off."""
    from hf_hardattn.tools.checkpointing import end_redo, prepare_run_folder, redo_begun

    folder = tmp_path / "run"
    assert prepare_run_folder(folder, dict(row="soft", seed=0), resume=True) is False  # nothing there yet
    (folder / "checkpoint-2").mkdir()
    assert prepare_run_folder(folder, dict(seed=0, row="soft"), resume=True) is True  # (key order does not matter)
    assert (folder / "checkpoint-2").is_dir()
    assert prepare_run_folder(folder, dict(row="soft", seed=1), resume=True) is False  # another run's folder
    assert sorted(p.name for p in folder.iterdir()) == ["run.json"]
    (folder / "checkpoint-2").mkdir()
    assert prepare_run_folder(folder, dict(row="soft", seed=1), resume=False) is False  # e.g. a recipe by minutes
    assert sorted(p.name for p in folder.iterdir()) == ["run.json"]
    # redo (--force): the run in the folder starts anew, unless it is a redo not yet ended (end_redo), which resumes
    (folder / "checkpoint-2").mkdir()
    assert prepare_run_folder(folder, dict(row="soft", seed=1), resume=True, redo=True) is False
    assert sorted(p.name for p in folder.iterdir()) == ["redo", "run.json"] and redo_begun(folder)
    (folder / "checkpoint-2").mkdir()
    assert prepare_run_folder(folder, dict(row="soft", seed=1), resume=True, redo=True) is True
    assert prepare_run_folder(folder, dict(row="soft", seed=1), resume=True) is True  # a plain resume keeps it too
    assert (folder / "checkpoint-2").is_dir() and redo_begun(folder)
    end_redo(folder)
    assert not redo_begun(folder) and (folder / "checkpoint-2").is_dir()
    assert prepare_run_folder(folder, dict(row="soft", seed=1), resume=True, redo=True) is False
    assert not (folder / "checkpoint-2").exists()


def test_hybrid_recipe_student_is_twice_as_wide_and_eq1_continues_the_hybrid_row(tmp_path, monkeypatch):
    """The hybrid paper's recipe: rnn_hidden_size 2 x d_model over d_model embeddings; the teacher's translations with
    beam 12; the MLE stage (mle_stage "row") is the hybrid_dot row itself, trained with at least the teacher's steps,
    and the Eq. 1 row continues it (its weights, and its Adam: the step count goes on, one optimizer through both)
    without training it again. Independent reference: mle_stage "teacher", where the Eq. 1 row trains its own MLE
    stage in one process and hands the optimizer over in memory: the same Eq. 1 model, bit for bit."""
    import json

    from hf_hardattn.tools import distill, reproduce, training

    calls, train_seq2seq = [], training.train_seq2seq

    def spy(*args, **kwargs):
        calls.append((os.path.relpath(kwargs["output_dir"], tmp_path), kwargs.get("carry")))
        return train_seq2seq(*args, **kwargs)

    monkeypatch.setattr(training, "train_seq2seq", spy)
    monkeypatch.setattr(distill, "train_seq2seq", spy)  # the stages' own import of it
    # a tiny model's BLEU is 0 at every step: scored by its chrF instead (a figure that moves), in both of the paths
    # compared below (the patience rule's evaluation and the row's scoring)
    real_scores = reproduce.row_scores

    def chrf_as_bleu(hypotheses, references):
        scores = real_scores(hypotheses, references)
        return dict(scores, bleu=scores["chrf"])

    monkeypatch.setattr(reproduce, "row_scores", chrf_as_bleu)
    out = tmp_path / "row"
    reproduce.main(tiny_argv(tmp_path, "--recipe", "hybrid", "--rows", "hybrid_dot_kd_eq1", "--max-steps", "3",
                             "--output-dir", str(out)))
    rows = stored(out, "hybrid")["rows"]
    row, mle_row, teacher = rows["hybrid_dot_kd_eq1"], rows["hybrid_dot"], rows["soft"]
    assert row["model_fields"]["rnn_hidden_size"] == 2 * row["model_fields"]["d_model"] == 64
    assert row["model_fields"]["rnn_embedding_size"] == 32
    assert json.loads((out / "kd_data" / "kd_manifest.json").read_text())["num_beams"] == 12 == row["distill_beams"]
    # trained: the teacher, the hybrid row (the MLE stage), then only Eq. 1
    trained = [os.path.join(*folder.split(os.sep)[2:]) for folder, _ in calls]
    assert trained == ["soft", "hybrid_dot", os.path.join("hybrid_dot_kd_eq1", "kd")]
    assert mle_row["convergence"]["min_steps"] == teacher["steps"] <= mle_row["steps"]
    assert row["mle_stage"] == "row" and row["mle_row"] == "hybrid_dot" and row["continued_optimizer"] is True
    assert row["stages"]["mle"] == mle_row["steps"] and row["stage_warmup_steps"] is None
    assert row["convergence"]["mle"] == mle_row["convergence"] and "resumed_at" not in row
    # the Eq. 1 stage stops on the validation BLEU (kd_patience_metric), the MLE stage on the validation loss; the
    # stage's last evaluation is the BLEU that the row's scoring gives its final model on the same split
    assert row["recipe"]["kd_patience_metric"] == "val_bleu" and mle_row["convergence"]["metric"] == "val_loss"
    assert row["convergence"]["kd"]["metric"] == "val_bleu"
    assert row["convergence"]["kd"]["curve"][-1] == [row["stages"]["kd"], row["scores"]["val"]] and row["scores"]["val"]
    # the hybrid row's run is recognised without the field it does not read; the Eq. 1 row's records it
    identities = {name: json.loads((out / "trainer" / name / "run.json").read_text())["recipe"]
                  for name in ("hybrid_dot", "hybrid_dot_kd_eq1")}
    assert "kd_patience_metric" not in identities["hybrid_dot"]
    assert identities["hybrid_dot_kd_eq1"]["kd_patience_metric"] == "val_bleu"
    kd = calls[-1][1]
    assert kd.steps == row["stages"]["kd"] and row["steps"] == sum(row["stages"].values())
    assert kd.optimizer.state[next(iter(kd.optimizer.state))]["step"] == row["steps"]  # Adam went on, not anew
    # the hybrid row keeps its optimizer for the Eq. 1 rows; the Eq. 1 row's copy of it goes when the row is done
    final = os.path.join(out, "trainer", "hybrid_dot", f"checkpoint-{mle_row['steps']}")
    assert os.path.isfile(os.path.join(final, "optimizer.pt"))
    assert not list((out / "trainer" / "hybrid_dot_kd_eq1").rglob("optimizer.pt"))

    fields = dict(recipes.PAPER_RECIPES["hybrid"]["fields"], mle_stage="teacher")
    monkeypatch.setitem(recipes.PAPER_RECIPES["hybrid"], "fields", fields)
    calls.clear()
    reference = tmp_path / "teacher"
    reproduce.main(tiny_argv(tmp_path, "--recipe", "hybrid", "--rows", "hybrid_dot_kd_eq1", "--max-steps", "3",
                             "--output-dir", str(reference)))
    assert [os.path.basename(folder) for folder, _ in calls] == ["soft", "mle", "kd"]
    expected = stored(reference, "hybrid")["rows"]["hybrid_dot_kd_eq1"]
    assert expected["stages"] == row["stages"] and expected["convergence"] == row["convergence"]
    assert_same_saved_model("hybrid_dot_kd_eq1", out, reference)


def test_an_eq1_row_refuses_a_hybrid_row_it_cannot_continue(tmp_path):
    """mle_stage "row": the Eq. 1 row continues the hybrid row's training only when that run finished with this seed,
    recipe and model and kept its optimizer; otherwise a clear error (never a silent fresh MLE stage). And a
    wall-clock budget, which keeps no final checkpoint to continue, is refused where the input enters."""
    from hf_hardattn.tools import reproduce

    out = tmp_path / "out"
    argv = tiny_argv(tmp_path, "--recipe", "hybrid", "--rows", "hybrid_dot_kd_eq1", "--max-steps", "3",
                     "--output-dir", str(out))
    with pytest.raises(ValueError, match="`--minutes` 1.0: the hybrid recipe's Eq. 1 rows continue"):
        reproduce.main([*argv, "--minutes", "1"])
    reproduce.main(tiny_argv(tmp_path, "--recipe", "hybrid", "--rows", "hybrid_dot", "--max-steps", "3",
                             "--output-dir", str(out)))
    for path in (out / "trainer" / "hybrid_dot").rglob("optimizer.pt"):
        path.unlink()
    with pytest.raises(ValueError, match="`hybrid_dot_kd_eq1` continues the training of `hybrid_dot`.*"
                                         "--rows hybrid_dot --force"):
        reproduce.main(argv)
    reproduce.main(tiny_argv(tmp_path, "--recipe", "hybrid", "--rows", "hybrid_dot", "--max-steps", "3", "--seed", "1",
                             "--force", "--output-dir", str(out)))  # another seed's hybrid row in the folder
    with pytest.raises(ValueError, match="holds no finished run of it with this seed, recipe and model"):
        reproduce.main(argv)


def test_an_interrupted_two_stage_row_resumes_its_second_stage(tmp_path, monkeypatch):
    """hybrid_dot_kd_eq1 under the hybrid recipe, cut off inside its Eq. 1 stage (after its checkpoint 1), then the
    same command again: neither the hybrid row (its MLE stage) nor the soft teacher is trained again, Eq. 1 resumes
    from its checkpoint, and the row's model, stages and curves equal an uninterrupted run's (bit for bit)."""
    from hf_hardattn.tools import distill, reproduce, training

    def argv(out):
        return tiny_argv(tmp_path, "--recipe", "hybrid", "--rows", "hybrid_dot_kd_eq1", "--max-steps", "3",
                         "--output-dir", str(out))

    reproduce.main(argv(tmp_path / "whole"))
    real, out, stages, cutting = training.train_seq2seq, tmp_path / "cut", [], [True]

    def cut_off(*args, **kwargs):
        stages.append(kwargs["output_dir"])
        if cutting[0] and kwargs["output_dir"].endswith(os.path.join("hybrid_dot_kd_eq1", "kd")):
            kwargs = dict(kwargs, callbacks=list(kwargs.get("callbacks") or []) + [InterruptAt(1)])
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "train_seq2seq", cut_off)
    monkeypatch.setattr(distill, "train_seq2seq", cut_off)  # the stages' own import of it
    with pytest.raises(Interrupted):
        reproduce.main(argv(out))
    stages.clear()
    cutting[0] = False
    reproduce.main(argv(out))  # (still counting the stages it trains)
    assert [os.path.basename(stage) for stage in stages] == ["kd"]
    whole, row = (stored(folder, "hybrid")["rows"]["hybrid_dot_kd_eq1"] for folder in (tmp_path / "whole", out))
    assert row["resumed_at"] == {"kd": 1} and row["stages"] == whole["stages"] and whole["stages"]["kd"] > 1
    assert row["convergence"]["mle"] == whole["convergence"]["mle"]
    assert dict(row["convergence"]["kd"], resumed_at=None) == whole["convergence"]["kd"]
    assert_same_saved_model("hybrid_dot_kd_eq1", tmp_path / "whole", out)


def test_a_fresh_machine_takes_the_teacher_from_the_results_folder(tmp_path, monkeypatch):
    """The soft teacher's row and translations kept in --results-dir: a later run in a fresh output folder (another
    machine, a later session) trains the hybrid and Eq. 1 rows without the teacher's model and without training it
    again, to the same Eq. 1 model as the run that trained the teacher (bit for bit on CPU). The stored translations
    are the teacher's own, and a file that does not match this run's teacher or data is refused by name."""
    import gzip
    import json

    import datasets

    from hf_hardattn.tools import distill, reproduce, training

    results = tmp_path / "results"

    def argv(out, *extra):
        return tiny_argv(tmp_path, "--recipe", "hybrid", "--rows", "hybrid_dot_kd_eq1", "--max-steps", "3",
                         "--output-dir", str(out), "--results-dir", str(results), *extra)

    reproduce.main(argv(tmp_path / "first"))
    path = results / "reproduce_multi30k_tiny_hybrid_kd_data.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        header, targets = json.loads(handle.readline()), [json.loads(line) for line in handle]
    made = datasets.load_from_disk(str(tmp_path / "first" / "kd_data" / "dataset"))
    teacher = stored(tmp_path / "first", "hybrid")["rows"]["soft"]
    assert targets == made["target"] and header["rows"] == len(made) and header["num_beams"] == 12
    assert header["teacher"]["steps"] == teacher["steps"] and header["teacher"]["score"] == teacher["score"]

    trained, real = [], training.train_seq2seq

    def spy(*args, **kwargs):
        trained.append(os.path.relpath(kwargs["output_dir"], tmp_path))
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "train_seq2seq", spy)
    monkeypatch.setattr(distill, "train_seq2seq", spy)  # the stages' own import of it
    second = tmp_path / "second"
    reproduce.main(argv(second, "--force"))
    assert trained == [os.path.join("second", "trainer", "hybrid_dot"),
                       os.path.join("second", "trainer", "hybrid_dot_kd_eq1", "kd")]
    assert not (second / "models" / "soft").exists()
    rows = [stored(folder, "hybrid")["rows"]["hybrid_dot_kd_eq1"] for folder in (tmp_path / "first", second)]
    assert rows[0]["stages"] == rows[1]["stages"] and rows[0]["scores"] == rows[1]["scores"]
    assert_same_saved_model("hybrid_dot_kd_eq1", tmp_path / "first", second)

    header["num_beams"] = 4  # another teacher setting's translations
    path.write_bytes(gzip.compress(("\n".join(json.dumps(x) for x in [header, *targets]) + "\n").encode()))
    with pytest.raises(ValueError, match="holds translations of another teacher or data \\(\\['num_beams'\\]"):
        reproduce.main(argv(tmp_path / "third", "--force"))


def test_paper_recipes_refuse_other_rows_and_patience_needs_its_interval(tmp_path):
    from hf_hardattn.tools import reproduce

    with pytest.raises(ValueError, match="`rows` \\['hc_sa'\\].*--recipe hard_retrieval; allowed: .*hard_cross"):
        reproduce.main(tiny_argv(tmp_path, "--recipe", "hard_retrieval", "--rows", "hc_sa"))
    with pytest.raises(ValueError, match="`--patience` 2 needs `--eval-steps`"):
        reproduce.main(tiny_argv(tmp_path, "--rows", "soft", "--patience", "2", "--output-dir", str(tmp_path / "o")))
    with pytest.raises(ValueError, match="`--patience` must be > 0"):
        reproduce.main(tiny_argv(tmp_path, "--rows", "soft", "--patience", "0", "--eval-steps", "1"))
    with pytest.raises(ValueError, match="`recipe`"):
        recipes.recipe_for("multi30k", "cpu", "hard")
    # today's recipe is the preset's, unchanged; a paper's keeps the preset's sizes
    assert recipes.recipe_for("multi30k", "cpu") == recipes.PRESETS["multi30k"]["cpu"]
    paper = recipes.recipe_for("multi30k", "cpu", "hybrid")
    assert paper.dims == recipes.PRESETS["multi30k"]["cpu"].dims and paper.rnn["rnn_hidden_size"] == 512
    assert (paper.minutes, paper.max_steps, paper.patience, paper.eval_steps) == (None, 12000, 5, 250)
