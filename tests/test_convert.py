"""hf_hardattn.tools.convert and `hf-hardattn convert`: pretrained Marian / BART / mBART / M2M100 models mapped into every
model type. The reference is the source transformers model itself, built tiny and briefly fitted here (no download):
the converted soft model must give its logits (fp32 and float64) and its greedy / beam-search tokens on a padded
batch; the other types must carry its shared weights, train and generate; every bad input is refused by name."""

import copy
import json
import math
import os

import pytest
import torch
from common import (EOS, PAD, VOCAB, assert_nontrivial, check_remote_code, check_save_load, collate, copy_task, fitted,
                    is_nontrivial, memorise, run_generate, source_batch, tiny_kwargs, toy_tokenizer)
from transformers import (BartConfig, BartForConditionalGeneration, BertConfig, M2M100Config,
                          M2M100ForConditionalGeneration, MarianConfig, MarianMTModel, MBartConfig,
                          MBartForConditionalGeneration)

import hf_hardattn
from hf_hardattn.tools.convert import ConversionReport
from hf_hardattn_cli.command import main as cli_main

SIZES = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
             dropout=0.0, pad_token_id=PAD, eos_token_id=EOS)


def marian(**overrides):  # opus-mt's settings: swish, scaled embeddings, decoding starts with the padding token
    config = dict(SIZES, decoder_start_token_id=PAD, activation_function="swish", scale_embedding=True)
    return MarianMTModel(MarianConfig(**{**config, **overrides}))


def bart(**overrides):  # bart-base's: gelu, unscaled embeddings, learned positions (+2), layernorm_embedding
    return BartForConditionalGeneration(BartConfig(**{**SIZES, "bos_token_id": 1, "decoder_start_token_id": EOS,
                                                      **overrides}))


def mbart(**overrides):  # pre-norm + final layer norms, layernorm_embedding, scaled embeddings
    return MBartForConditionalGeneration(MBartConfig(**{**SIZES, "bos_token_id": 1, "decoder_start_token_id": EOS,
                                                        "scale_embedding": True, **overrides}))


def m2m100(**overrides):  # pre-norm, fairseq sinusoidal positions from pad + 1, relu, layerdrop 0.05 (the default)
    return M2M100ForConditionalGeneration(M2M100Config(**{**SIZES, "bos_token_id": 1, "decoder_start_token_id": EOS,
                                                          **overrides}))


FAMILIES = {"marian": marian, "bart": bart, "mbart": mbart, "m2m_100": m2m100}
_FITTED = {}
MARGIN = 1.0  # logits: each memorised token wins by this much (two fp32 paths part by ~1e-4 x max|logit| at most)
EXACT_RTOL = 1e-10  # float64 logits of two paths, relative to max|logit|: see `assert_same_logits`
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]  # tiny models: faster on one thread, much faster on shared cores


def memorised_rows():
    """source_batch()'s two sources with their reversals as targets, and 6 reversal rows more (the training batch)."""
    ids, mask = source_batch()
    rows = [{"input_ids": row[m.bool()].tolist(), "attention_mask": [1] * int(m.sum()),
             "labels": row[m.bool()].tolist()[-2::-1] + [EOS]} for row, m in zip(ids, mask)]
    return rows + copy_task(6)


def memorised_margins(model):
    """Per target token of source_batch()'s rows (teacher-forced; the weights rounded to fp32, evaluated in float64):
    its logit minus the best other logit."""
    batch = collate(memorised_rows()[:2])
    with torch.no_grad():
        out = copy.deepcopy(model).float().double().eval()(**batch).logits
    labels = batch["labels"]
    target = out.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    other = out.scatter(-1, labels.clamp(min=0)[..., None], float("-inf")).amax(-1)
    return (target - other)[labels != -100]


def memorise_reversals(model, what):
    """``model`` (float64, trained in place) after float64 Adam on the reversals until each memorised token wins by
    MARGIN, which is asserted (the margins read with the weights rounded to fp32); returned in fp32, eval mode."""
    step = memorise(model, collate(memorised_rows()), memorised_margins, MARGIN, max_steps=300)
    model = model.float().eval()
    margins = memorised_margins(model)
    assert margins.min() >= MARGIN, (f"{what} did not memorise the reversals of source_batch() in {step} float64 Adam "
                                     f"steps (smallest margin {margins.min():.3g} < {MARGIN}): the token checks need "
                                     f"its varied, source-dependent output")
    return model


def source_model(family):
    """The family's tiny source with a random final_logits_bias where the family has one (a buffer that training
    leaves alone), drawn and fitted in float64 (the same weights on every CPU, to rounding) until it has memorised
    the reversals of source_batch() by MARGIN, which is asserted here: greedy decoding of that batch is varied and
    source-dependent by construction. Returned in fp32. Built once; deep-copy to edit."""
    if family not in _FITTED:
        torch.manual_seed(0)
        model = FAMILIES[family]().double()
        generator = torch.Generator().manual_seed(0)  # float64 draws: the same on every CPU (float32 ones are not)
        with torch.no_grad():  # N(0, 0.5) matrices: the tokens it does not memorise get logits far apart
            for param in model.parameters():
                if param.requires_grad and param.dim() >= 2:  # (Marian's sinusoidal table stays)
                    param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.5)
            if hasattr(model, "final_logits_bias"):
                model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=generator,
                                                          dtype=torch.float64) * 0.5)
        _FITTED[family] = memorise_reversals(model, f"the tiny {family} model")
    return _FITTED[family]


def decoder_inputs(model):
    """Teacher-forcing decoder inputs (no padding: fairseq positions give padded decoder positions their own value)."""
    start = model.config.decoder_start_token_id
    return torch.tensor([[start, 9, 14, 21, 33, 6], [start, 7, 7, 30, 12, 25]])


def float64(model):
    """A float64 copy: token comparisons run there, where the two code paths agree to ~1e-12 and no last-bit
    difference of fp32 GEMMs can flip an argmax (the source's weights are fitted so that its tokens are varied)."""
    return copy.deepcopy(model).double()


def logits(model, dtype=torch.float32):
    model = copy.deepcopy(model).to(dtype)
    ids, mask = source_batch()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_inputs(model)).logits


def assert_same_logits(expected, got):
    """The logits of two paths of one function, compared in float64 (the models cast with `logits(m, torch.float64)`):
    within EXACT_RTOL of each position's largest |logit|. In fp32 these N(0, 0.5) sources part from exact arithmetic by
    up to 1.2 x FP32_PATHS_RTOL / 2 (bart; `fp32_path_error`), beyond that bound's premise; in float64 the same errors
    scale by 2**-53 / 2**-24 = 1.9e-9 (the GEMMs' gamma_K and the layers' propagation are those of fp32 with the unit
    roundoff replaced), i.e. to ~4e-14 per path: 1e-10 leaves 1,000x room, and a wrong weight or op moves the
    logits by O(1)."""
    assert expected.dtype == got.dtype == torch.float64
    gap = ((got - expected).abs().amax(-1) / expected.abs().amax(-1)).max().item()
    assert gap <= EXACT_RTOL, f"logits differ by {gap:.3g} of max|logit|"


# ----------------------------------------------------------------------------------------------------------------
# soft_transformer: exact
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_soft_is_exact(family):
    """Same logits (float64, `assert_same_logits`; fp32 runs) on a right-padded source batch, and the same greedy and
    beam-4 tokens (padded batch, cached decoding, float64) as the source model; the source's greedy tokens are the
    reversals it memorised (varied by construction)."""
    source = source_model(family)
    model, report = hf_hardattn.convert(source, "soft_transformer", return_report=True)
    assert type(model) is hf_hardattn.SoftTransformerForConditionalGeneration
    assert not report.initialised, report
    assert not model.training
    assert logits(model).dtype == torch.float32
    assert_same_logits(logits(source, torch.float64), logits(model, torch.float64))
    theirs, ours = float64(source), float64(model)
    for mode in ("greedy", "beam"):
        expected = run_generate(theirs, mode, True)
        assert_nontrivial(expected)
        assert torch.equal(run_generate(ours, mode, True), expected), mode
        if mode == "greedy":
            assert expected[:, 1:5].tolist() == [[25, 21, 17, 13], [23, 19, 11, 7]]  # memorised: source-dependent


def fp32_loss_bound(logits, labels, eps):
    """Bound on how far our label-smoothed loss (hf_hardattn/loss.py: per token lse - (1 - eps) x_y - (eps / V) sum_v x_v
    in fp32 arithmetic, summed over the N target tokens and divided by N) may be from the same loss computed in float64
    on the float64 ``logits`` [B, T, V] (u = 2**-24, per token M = max_v |x_v|, first order):
    the cast to fp32 moves each x by u |x| <= u M: lse by u M, the two other terms by (1 - eps) u M + eps u M;
    logsumexp = m + log S, S = sum_v exp(x_v - m) in [1, V]: the shift by the maximum moves each exponent by <= 2 u M
    (lse by 2 u M), exp errs by <= 2 u relatively and the sum of V terms by (V - 1) u (S by (V + 1) u relatively, its
    log by that absolutely), the log's rounding 2 u log V, the last addition u |lse|; (1 - eps) x_y: u M; the sum of V
    logits (V - 1) u V M, times eps / V: eps (V - 1) u M, the product and the scale 2 eps u M; the two subtractions
    2 u |loss_i|. Per token err_i <= u ((5 + eps (V + 1)) M + V + 1 + 2 log V + |lse| + 2 |loss_i|). The fp32 sum
    of N token losses adds (N - 1) u sum loss_i, the division u L.
    Our logits themselves part from MarianMTModel's by at most EXACT_RTOL M (float64, `assert_same_logits`): 2 of
    that per token."""
    u = 2.0**-24
    valid = labels != -100
    x = logits[valid].double()
    vocab, n = x.shape[-1], x.shape[0]
    top, lse = x.abs().amax(-1), x.logsumexp(-1)
    token = lse - (1 - eps) * x.gather(-1, labels[valid][:, None])[:, 0] - (eps / vocab) * x.sum(-1)
    per_token = u * ((5 + eps * (vocab + 1)) * top + vocab + 1 + 2 * math.log(vocab) + lse.abs() + 2 * token.abs())
    per_token = per_token + 2 * EXACT_RTOL * top
    loss = token.mean().item()
    return (per_token.sum().item() + (n - 1) * u * token.abs().sum().item()) / n + u * abs(loss)


def test_soft_trains_as_marian_does():
    """The reproduce tables' `marian` reference row and `soft` are one model: a MarianMTModel with the
    recipe's settings (relu, scaled embeddings, shared and tied embeddings), converted to soft with label smoothing
    0.1, trained side by side on the same batches (float64, no dropout), has at every step the loss MarianMTModel's
    logits give under transformers' LabelSmoother (how the `marian` row trains), and the same logits after the steps.
    So what differs between those two rows is the initialisation and the random draw alone. (Our loss is computed in
    fp32 arithmetic whatever the logits' dtype: equal within the bound of that rounding, `fp32_loss_bound`. Plain SGD: Adam's first step, g / |g|, would
    turn that rounding of near-zero gradients into whole steps.)"""
    from transformers.trainer_pt_utils import LabelSmoother

    torch.manual_seed(0)
    theirs = marian(activation_function="relu", decoder_start_token_id=1, share_encoder_decoder_embeddings=True)
    theirs = theirs.double().train()
    ours = hf_hardattn.convert(theirs, "soft_transformer", label_smoothing=0.1, dropout=0.0).train()
    smoother = LabelSmoother(epsilon=0.1)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.5) for model in (theirs, ours)]
    rows = copy_task(64, seed=4)
    first = collate(rows[:16])
    for step in range(4):
        batch = collate(rows[16 * step : 16 * (step + 1)])
        out = theirs(**batch)
        expected = smoother(out, batch["labels"])
        loss = ours(**batch).loss
        bound = fp32_loss_bound(out.logits.detach(), batch["labels"], 0.1)
        assert abs(loss.item() - expected.item()) <= bound, (step, loss.item(), expected.item(), bound)
        if step == 0:
            start = expected.item()
        for optimizer, value in zip(optimizers, (expected, loss)):
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
    assert smoother(theirs(**first), first["labels"]).item() < 0.95 * start  # the steps changed the model
    theirs.eval(), ours.eval()
    expected = logits(theirs, torch.float64)
    assert (logits(ours, torch.float64) - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_m2m100_left_padding_is_exact():
    """fairseq positions count from each row's first real token, as ours do for a left-padded source: M2M100's logits
    are reproduced on a left-padded batch too (float64, `assert_same_logits`), and so are its beam-4 tokens
    (float64) (Marian and BART shift such a row's positions; ours do not)."""
    source = source_model("m2m_100")
    model = hf_hardattn.convert(source, "soft_transformer")
    ids, mask = source_batch()
    left = torch.stack([torch.cat([row[m.bool()], row[~m.bool()]]).roll(int((~m.bool()).sum())) for row, m
                        in zip(ids, mask)])
    assert left[1, 0] == PAD and left[1, -1] == EOS
    kwargs = dict(input_ids=left, attention_mask=(left != PAD).long(), decoder_input_ids=decoder_inputs(source))
    with torch.no_grad():
        assert_same_logits(float64(source)(**kwargs).logits, float64(model)(**kwargs).logits)
    generate = dict(input_ids=left, attention_mask=(left != PAD).long(), max_new_tokens=8, num_beams=4)
    expected = float64(source).generate(**generate)
    assert_nontrivial(expected)
    assert torch.equal(float64(model).generate(**generate), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_soft_config_fields(family):
    """The source's architecture lands in the documented config fields."""
    config = hf_hardattn.convert(source_model(family), "soft_transformer").config
    expected = {
        "marian": dict(position_embedding="sinusoidal", sinusoidal_layout="marian", position_offset=0,
                       layernorm_embedding=False, normalize_before=False, final_logits_bias=True,
                       activation_function="swish", scale_embedding=True),
        "bart": dict(position_embedding="learned", layernorm_embedding=True, normalize_before=False,
                     final_logits_bias=True, activation_function="gelu", scale_embedding=False),
        "mbart": dict(position_embedding="learned", layernorm_embedding=True, normalize_before=True,
                      final_logits_bias=True, scale_embedding=True),
        "m2m_100": dict(position_embedding="sinusoidal", sinusoidal_layout="fairseq", position_offset=PAD + 1,
                        layernorm_embedding=False, normalize_before=True, final_logits_bias=False,
                        activation_function="relu", scale_embedding=True),
    }[family]
    assert {key: getattr(config, key) for key in expected} == expected
    assert config.max_position_embeddings == 64 and config.pad_token_id == PAD and config.eos_token_id == EOS


def test_generation_config_is_copied():
    """generate() without arguments decodes with the source's generation config (bad_words_ids, num_beams, max_length,
    forced_eos_token_id): the tokens (float64) equal the source's, and differ from decoding with the default config
    (so the check can fail)."""
    source = float64(source_model("marian"))
    ids, mask = source_batch()
    plain = source.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8)
    banned = int(plain[0, 1])  # a token the source emits: banning it changes the output
    source.generation_config.update(bad_words_ids=[[banned]], num_beams=4, max_length=9, forced_eos_token_id=EOS)
    model = hf_hardattn.convert(source, "soft_transformer")
    expected = source.generate(input_ids=ids, attention_mask=mask)
    assert banned not in expected.tolist()[0] and expected.shape[1] <= 9
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask), expected)
    assert model.generation_config.bad_words_ids == [[banned]] and model.generation_config.num_beams == 4


def test_zero_final_logits_bias_is_not_kept():
    source = copy.deepcopy(source_model("bart"))
    source.final_logits_bias.zero_()
    model, report = hf_hardattn.convert(source, "soft_transformer", return_report=True)
    assert model.config.final_logits_bias is False and model.final_logits_bias is None
    assert any("all zeros" in note for note in report.notes)
    assert_same_logits(logits(source, torch.float64), logits(model, torch.float64))


def test_layerdrop_is_reported_as_dropped():
    """M2M100's default LayerDrop (0.05, training only) is not carried over: listed under `dropped`, outputs equal."""
    model, report = hf_hardattn.convert(source_model("m2m_100"), "soft_transformer", return_report=True)
    assert [item.split(" ")[0] for item in report.dropped] == ["encoder_layerdrop=0.05", "decoder_layerdrop=0.05"]
    assert not report.exact and "encoder_layerdrop" in str(report)


@pytest.mark.parametrize("family", ["marian", "bart", "mbart", "m2m_100"])
def test_save_and_reload(family, tmp_path):
    """safetensors + AutoModelForSeq2SeqLM reload decodes the same (greedy, beam); the logits still equal the source's."""
    model = hf_hardattn.convert(source_model(family), "soft_transformer")
    reloaded = check_save_load(model, tmp_path)
    assert_same_logits(logits(source_model(family), torch.float64), logits(reloaded, torch.float64))


def test_remote_code(tmp_path):
    """Loaded with trust_remote_code in a fresh process without hf_hardattn: the same greedy and beam tokens (Marian:
    its sinusoidal layout, computed with numpy there too, and the final_logits_bias buffer)."""
    check_remote_code(hf_hardattn.convert(source_model("marian"), "soft_transformer"), tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# The other model types
# ----------------------------------------------------------------------------------------------------------------
OTHER_TYPES = {  # model type -> (overrides, names that must appear among the initialised parameters)
    "hard_retrieval_transformer": ({}, []),
    "gaussian_transformer": ({}, []),
    "recurrent_transformer": ({}, []),
    "recurrent_concat_context": ({"recurrent_variant": "concat_context"}, ["context_query"]),
    "beam_joint_transformer": ({"joint_k": 3}, []),
}


def train_step(model):
    """One optimizer step on a reversal batch: the loss is finite and every trainable parameter that got a gradient
    changes."""
    model.train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model(**collate(copy_task(8))).loss
    assert torch.isfinite(loss)
    loss.backward()
    optimizer.step()
    changed = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert "model.shared.weight" in changed and len(changed) > len(before) // 2
    return model.eval()


U = 2.0**-24  # float32's unit roundoff


def check_generate_against_forward(model):
    """Greedy and beam-4 decoding (cached, float64, no forced tokens) against one full forward of what was decoded:
    each greedy token up to EOS is the argmax of the forward's logits at its step, and each returned beam's score is
    the forward's log-probability of its tokens up to EOS over their number (length_penalty 1). generate() casts each
    step's logits to float32 before its log_softmax and sums the scores in float32, so both checks allow for that
    (unit roundoff u = 2**-24, V the vocabulary, M a step's largest |logit|): greedy compares a sentence's tokens up
    to its first step whose top two logits are within 2 u M (the cast could swap them); a log-probability moves by at
    most u (4 M + |logsumexp| + |log p| + V + 8) (the cast, the shift by the maximum, exp and log within 4 ulp, a sum
    of V terms, the last subtraction), and the n + 1 float32 additions and the division add 2 (n + 1) u sum |log p|.
    The two float64 passes themselves agree to ~1e-15. Returns the greedy tokens."""
    model = float64(model).eval()
    ids, mask = source_batch()
    eos = model.config.eos_token_id
    model.generation_config.forced_eos_token_id = None  # (Marian's 0 would replace the last step's argmax)
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, length_penalty=1.0)
    greedy = model.generate(num_beams=1, **settings)
    beam = model.generate(num_beams=4, num_return_sequences=2, output_scores=True, return_dict_in_generate=True,
                          **settings)
    compared = 0
    for sequences, scores in ((greedy, None), (beam.sequences, beam.sequences_scores)):
        repeat = sequences.shape[0] // ids.shape[0]
        with torch.no_grad():
            logits = model(input_ids=ids.repeat_interleave(repeat, 0), attention_mask=mask.repeat_interleave(
                repeat, 0), decoder_input_ids=sequences[:, :-1]).logits
        log_probs, lse, top = logits.log_softmax(-1), logits.logsumexp(-1), logits.abs().amax(-1)
        for row, tokens in enumerate(sequences[:, 1:]):
            ends = (tokens == eos).nonzero()
            n = int(ends[0]) + 1 if len(ends) else len(tokens)
            if scores is None:
                best = logits[row, :n].topk(2, -1).values
                clear = int(((best[:, 0] - best[:, 1]) > 2 * U * top[row, :n]).cumprod(0).sum())
                assert log_probs[row, :clear].argmax(-1).tolist() == tokens[:clear].tolist(), (row, tokens.tolist())
                compared += clear
            else:
                chosen = log_probs[row, torch.arange(n), tokens[:n]]
                per_token = U * (4 * top[row, :n] + lse[row, :n].abs() + chosen.abs() + logits.shape[-1] + 8)
                bound = (per_token.sum().item() + 2 * (n + 1) * U * chosen.abs().sum().item()) / n
                assert abs(chosen.sum().item() / n - scores[row].item()) <= bound, (row, tokens.tolist(), bound)
    assert compared >= greedy.shape[0], f"only {compared} greedy tokens clear of the float32 cast"
    return greedy


def varied(model):
    """`model` itself when its greedy output on source_batch() is varied (at least MIN_DISTINCT_TOKENS tokens), else
    after memorising the reversals (float64 Adam, as `source_model`; asserted): a converted type that is not the
    source's function (beam-joint mixes K attentions and drops the bias; a training step in float32) may repeat one
    token, and which one the CPU's rounding decides. Guards the generate checks, which a repeated token could pass."""
    ids, mask = source_batch()
    model64 = float64(model).eval()
    with torch.no_grad():
        tokens = model64.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    if is_nontrivial(tokens):
        return model
    return memorise_reversals(model64, f"the converted {model.config.model_type} (it repeated one token: "
                                       f"{tokens.tolist()})")


@pytest.mark.parametrize("target", OTHER_TYPES)
def test_other_types(target, tmp_path):
    """Each Transformer type gets the source's shared weights, reports what it initialised or dropped, and generates
    (greedy and beam 4) as one full forward of its output scores it, varied tokens (fitted first where its output
    repeats one: `varied`), before and after one training step; the hard-retrieval one (Marian's positions and logits
    bias in another type) also saves and reloads."""
    source = source_model("marian")
    overrides, initialised = OTHER_TYPES[target]
    model_type = target if target.endswith("transformer") else "recurrent_transformer"
    model, report = hf_hardattn.convert(source, model_type, return_report=True, **overrides)
    assert model.config.model_type == model_type and isinstance(report, ConversionReport)
    assert report.model_type == model_type and str(report).startswith("converted MarianMTModel")
    encoder = model.model.encoder.layers[0].self_attn.module
    src_attn = source.model.encoder.layers[0].self_attn
    if target == "gaussian_transformer":  # hc-sa: Gaussian self-attention (v/out kept, q/k dropped), soft cross
        assert torch.equal(encoder.v_proj.weight, src_attn.v_proj.weight)
        dropped = [item for item in report.dropped if "Gaussian attention has no query/key" in item]
        assert len(dropped) == 4  # encoder and decoder self-attention, 2 layers each
        cross = model.model.decoder.layers[1].cross_attn.module
        src_cross = source.model.decoder.layers[1].encoder_attn
        assert torch.equal(cross.kv_proj.weight, torch.cat([src_cross.k_proj.weight, src_cross.v_proj.weight]))
    else:
        assert torch.equal(encoder.qkv_proj.weight, torch.cat([src_attn.q_proj.weight, src_attn.k_proj.weight,
                                                               src_attn.v_proj.weight]))
        if target == "beam_joint_transformer":  # no bias in the mixture: the source's nonzero one is dropped
            assert model.final_logits_bias is None and any("final_logits_bias" in d for d in report.dropped)
        else:
            assert torch.equal(model.final_logits_bias, source.final_logits_bias)
            if target != "recurrent_concat_context":  # the same computation as soft when every kind is soft
                soft = model.with_attention(**{f"{role}_attention": "soft" for role in ("encoder", "decoder")},
                                            cross_attention="soft")
                assert_same_logits(logits(source, torch.float64), logits(soft, torch.float64))
    names = " ".join(report.initialised)
    assert all(name in names for name in initialised)
    assert bool(report.initialised) == bool(initialised), report.initialised
    if target == "hard_retrieval_transformer":
        assert any("Table 4" in note for note in report.notes)
        assert report.exact
        check_save_load(model, tmp_path)
    model = varied(model)
    assert_nontrivial(check_generate_against_forward(model))
    model = varied(train_step(model))
    assert_nontrivial(check_generate_against_forward(model))


@pytest.mark.parametrize("family", ["bart", "m2m_100"])
def test_other_families_to_hard_retrieval(family):
    """The mapping is family-independent: hard retrieval from BART and M2M100 decodes like the source when switched
    back to soft, and trains."""
    source = source_model(family)
    model = hf_hardattn.convert(source, "hard_retrieval_transformer", cross_attention=["soft", "hard_retrieval"])
    assert model.config.cross_attention == ["soft", "hard_retrieval"]
    soft = model.with_attention(decoder_attention="soft", cross_attention="soft")
    assert_same_logits(logits(source, torch.float64), logits(soft, torch.float64))
    train_step(model)


def test_kind_none_drops_the_sub_layer():
    model, report = hf_hardattn.convert(source_model("marian"), "gaussian_transformer", return_report=True,
                                        cross_attention=["none", "soft"], cross_attention_heads=1)
    assert model.model.decoder.layers[0].cross_attn is None
    assert any(item.startswith("model.decoder.layers.0.encoder_attn and") for item in report.dropped)
    assert any("cross-attention heads: 1" in note for note in report.notes)


@pytest.mark.parametrize("model_type", ["hybrid_transformer", "beam_joint_rnn"])
def test_gru_decoder_types_point_to_distillation(model_type):
    with pytest.raises(ValueError, match="hf-hardattn distill --teacher") as error:
        hf_hardattn.convert(source_model("marian"), model_type)
    assert "GRU" in str(error.value) and "soft_transformer" in str(error.value)


# ----------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------
def test_unsupported_source_architectures():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    with pytest.raises(TypeError, match="`source` is a T5ForConditionalGeneration; supported sources: MarianMTModel"):
        hf_hardattn.convert(t5, "soft_transformer")
    with pytest.raises(TypeError, match="`source` must be a loaded .* got BertConfig"):
        hf_hardattn.convert(BertConfig(), "soft_transformer")
    ours = hf_hardattn.SoftTransformerForConditionalGeneration(hf_hardattn.SoftTransformerConfig(**tiny_kwargs()))
    with pytest.raises(TypeError, match="SoftTransformerForConditionalGeneration.*MarianMTModel.*with_attention"):
        hf_hardattn.convert(ours, "soft_transformer")

    class Patched(MarianMTModel):  # may compute anything: only transformers' own classes are trusted
        pass

    with pytest.raises(TypeError, match="Patched"):
        hf_hardattn.convert(Patched(copy.deepcopy(source_model("marian").config)), "soft_transformer")
    with pytest.raises(ValueError, match="`model_type` must be one of .*'xyz'"):
        hf_hardattn.convert(source_model("marian"), "xyz")


@pytest.mark.parametrize("build, field", [
    (lambda: marian(share_encoder_decoder_embeddings=False), "share_encoder_decoder_embeddings"),
    (lambda: marian(decoder_vocab_size=VOCAB + 8, share_encoder_decoder_embeddings=True), "decoder_vocab_size"),
    (lambda: bart(tie_word_embeddings=False), "tie_word_embeddings"),
    (lambda: m2m100(decoder_start_token_id=PAD), "decoder_start_token_id"),
])
def test_inexpressible_configs_name_the_field(build, field):
    with pytest.raises(ValueError, match=f"`{field}`="):
        hf_hardattn.convert(build(), "soft_transformer")


def test_inexpressible_weights_are_refused():
    source = copy.deepcopy(source_model("marian"))
    with torch.no_grad():
        source.model.encoder.embed_positions.weight[3, 0] += 0.5  # an edited sinusoidal table cannot be computed
    with pytest.raises(ValueError, match="embed_positions is not the 'marian' sinusoidal table"):
        hf_hardattn.convert(source, "soft_transformer")
    source = copy.deepcopy(source_model("bart"))
    source.model.decoder.layers[1].final_layer_norm.eps = 1e-6
    with pytest.raises(ValueError, match="`layer_norm_eps`="):
        hf_hardattn.convert(source, "soft_transformer")


def test_bad_overrides():
    source = source_model("marian")
    with pytest.raises(ValueError, match="`d_model`=64 cannot be overridden: the source fixes it to 32"):
        hf_hardattn.convert(source, "soft_transformer", d_model=64)
    with pytest.raises(ValueError, match="`joint_k` is not a field of SoftTransformerConfig"):
        hf_hardattn.convert(source, "soft_transformer", joint_k=3)
    with pytest.raises(ValueError, match="recurrent_variant"):  # the config's own check
        hf_hardattn.convert(source, "recurrent_transformer", recurrent_variant="nope")
    assert hf_hardattn.convert(source, "soft_transformer", d_model=32, dropout=0.3).config.dropout == 0.3


def test_bad_source_paths(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    bert = tmp_path / "bert"
    BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(bert)
    no_weights = tmp_path / "no_weights"
    source_model("bart").config.save_pretrained(no_weights)
    cases = [(tmp_path / "file.txt", "is a file, not a transformers seq2seq checkpoint"),
             (tmp_path / "empty", "is a folder without config.json"),
             (tmp_path / "missing", "holds no loadable transformers config"),
             (bert, "holds a 'bert' model; supported sources"),
             (no_weights, "has a bart config but its weights could not be loaded")]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            hf_hardattn.convert(str(path), "soft_transformer")
    with pytest.raises(TypeError, match="`source` must be a loaded"):
        hf_hardattn.convert(3, "soft_transformer")


def test_config_fields_are_validated():
    """The new fields refuse bad values by name; their defaults are the earlier behaviour."""
    config = hf_hardattn.SoftTransformerConfig(**tiny_kwargs())
    assert (config.sinusoidal_layout, config.position_offset, config.layernorm_embedding,
            config.final_logits_bias) == ("interleaved", 0, False, False)
    bad = [(dict(sinusoidal_layout="split"), "`sinusoidal_layout` must be one of"),
           (dict(position_offset=-1), "`position_offset` must be an integer >= 0"),
           (dict(position_offset=True), "`position_offset` must be an integer >= 0"),
           (dict(position_embedding="learned", sinusoidal_layout="marian"), "applies to position_embedding="),
           (dict(position_embedding="learned", position_offset=2), "`position_offset`=2 applies to"),
           (dict(sinusoidal_layout="fairseq", d_model=2, encoder_attention_heads=1, decoder_attention_heads=1),
            "`d_model` must be >= 4"),
           (dict(layernorm_embedding=1), "`layernorm_embedding` must be True or False"),
           (dict(final_logits_bias="yes"), "`final_logits_bias` must be True or False")]
    for overrides, message in bad:
        with pytest.raises(ValueError, match=message):
            hf_hardattn.SoftTransformerConfig(**tiny_kwargs(**overrides))
    with pytest.raises(ValueError, match="`final_logits_bias` must be False for beam-joint"):
        hf_hardattn.BeamJointTransformerConfig(**tiny_kwargs(final_logits_bias=True))


def test_earlier_checkpoints_still_load(tmp_path):
    """A config.json written before these fields existed loads with the old behaviour (interleaved sinusoids from 0,
    no embedding norm, no logits bias) and the same outputs."""
    model = fitted(hf_hardattn.SoftTransformerForConditionalGeneration(hf_hardattn.SoftTransformerConfig(
        **tiny_kwargs())), steps=20, max_rounds=1)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("sinusoidal_layout", "position_offset", "layernorm_embedding", "final_logits_bias"):
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    reloaded = hf_hardattn.SoftTransformerForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert reloaded.final_logits_bias is None and reloaded.model.encoder.layernorm_embedding is None
    assert reloaded.config.sinusoidal_layout == "interleaved" and reloaded.config.position_offset == 0
    position = torch.arange(64.0)[:, None]  # Vaswani et al. Sec. 3.5, written out: sin at even features, cos at odd
    angle = position / 10000 ** (torch.arange(0, 32, 2) / 32)
    table = reloaded.model.encoder.embed_positions.table
    torch.testing.assert_close(table[:, 0::2], torch.sin(angle), rtol=0, atol=1e-5)
    torch.testing.assert_close(table[:, 1::2], torch.cos(angle), rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)


def test_final_logits_bias_follows_resize():
    model = hf_hardattn.convert(source_model("marian"), "soft_transformer")
    bias = model.final_logits_bias.clone()
    model.resize_token_embeddings(VOCAB + 5)
    assert model.final_logits_bias.shape == (1, VOCAB + 5)
    assert torch.equal(model.final_logits_bias[:, :VOCAB], bias) and not model.final_logits_bias[:, VOCAB:].any()
    assert "final_logits_bias" in model.state_dict()


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------
def saved_source(family, folder):
    source_model(family).save_pretrained(folder)
    toy_tokenizer().save_pretrained(folder)
    return str(folder)


def test_cli_convert(tmp_path, capsys):
    """SRC folder -> OUT: weights, config (with the --set override), code, card and the source's tokenizer; the
    reloaded model gives the source's logits; the report is printed."""
    src, out = saved_source("marian", tmp_path / "src"), tmp_path / "out"
    assert cli_main(["convert", src, str(out), "--model-type", "soft_transformer", "--set", "label_smoothing=0.2",
                     "--set", 'cross_attention=["soft", "soft"]']) == 0
    printed = capsys.readouterr().out
    assert "converted MarianMTModel" in printed and f"saved soft_transformer to {out}" in printed
    files = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json", "generation_config.json",
            "modeling_hardattn.py", "configuration_hardattn.py"} <= files
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".convert-")]
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    reloaded = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert reloaded.config.label_smoothing == 0.2 and reloaded.config.cross_attention == ["soft", "soft"]
    assert_same_logits(logits(source_model("marian"), torch.float64), logits(reloaded, torch.float64))
    assert AutoTokenizer.from_pretrained(out).get_vocab() == toy_tokenizer().get_vocab()


def test_cli_reports_initialised_parameters(tmp_path, capsys):
    src = saved_source("bart", tmp_path / "src")
    cli_main(["convert", src, str(tmp_path / "out"), "--model-type", "recurrent_transformer", "--set",
              "recurrent_variant=concat_weight"])
    printed = capsys.readouterr().out
    assert "initialised (not in the source):" in printed and "weight_query" in printed


def test_cli_bad_input_writes_nothing(tmp_path, capsys):
    src = saved_source("marian", tmp_path / "src")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    cases = [
        ([src, "OUT", "--model-type", "hybrid_transformer"], "hf-hardattn distill"),
        ([src, "OUT", "--model-type", "xyz"], "`model_type` must be one of"),
        ([str(tmp_path / "nowhere"), "OUT", "--model-type", "soft_transformer"], "holds no loadable"),
        ([str(tmp_path / "full"), "OUT", "--model-type", "soft_transformer"], "folder without config.json"),
        ([src, "OUT", "--model-type", "soft_transformer", "--set", "d_model=64"], "`d_model`=64 cannot be"),
        ([src, "OUT", "--model-type", "soft_transformer", "--set", "dropout"], "--set takes KEY=VALUE"),
        ([src, "OUT", "--model-type", "soft_transformer", "--set", "dropout=2"], "`dropout` must be in"),
        ([src, str(tmp_path / "full"), "--model-type", "soft_transformer"], "exists and is not an empty folder"),
    ]
    before = sorted(os.listdir(tmp_path))
    for argv, message in cases:
        argv = [str(tmp_path / "out") if arg == "OUT" else arg for arg in argv]
        assert cli_main(["convert", *argv]) == 2
        text = capsys.readouterr().err.strip().splitlines()[-1]
        assert text.startswith("hf-hardattn convert: error:"), text
        assert message in text, text
        assert sorted(os.listdir(tmp_path)) == before  # no OUT, no staging folder
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
