"""Left-padded sources (a tokenizer with ``padding_side="left"``) for every contract model: positions (sinusoidal or
learned, the Gaussian cross-attention centres) count from each row's first real token. Left-padded decoder prompts
(``decoder_input_ids`` + ``decoder_attention_mask``, as decoder-only models take a batch of prompts): the same for the
types whose decoder reads them, a clear refusal from the others.

References: each sentence (and prompt) alone, unpadded, in float64.
"""

import pytest
import torch

from common import (BOS, CONTRACT_MODELS, ONE_PER_TYPE, PAD, TYPE_MODELS, as_float64, assert_nontrivial,
                    assert_step_scores_close, contract_model, source_batch)
from hf_hardattn.caches import CACHE_FIELD, StaticHardAttnCache
from hf_hardattn.layers import SoftAttention
from hf_hardattn.modeling_hardattn import HardAttnModel
from hf_hardattn.gaussian import (FULL_CUTOFF, GaussianAttention, GaussianConfig, GaussianForConditionalGeneration,
                                  cutoff_radius, gaussian_density)
from test_static_gaussian_beam_joint import GAUSSIAN, config_model


def left_padded():
    """source_batch() with the second sentence padded on the left."""
    ids, mask = source_batch()
    length = int(mask[1].sum())
    ids[1] = torch.cat([torch.full((ids.shape[1] - length,), PAD), ids[1, :length]])
    return ids, (ids != PAD).long()


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_left_padded_source_gives_the_same_output_as_the_sentence_alone(name):
    """Positions (sinusoidal or learned, the Gaussian cross-attention centres) count from each row's first real token,
    so a left-padded sentence decodes as it does alone (greedy and beam search, tokens and scores as
    common.assert_step_scores_close), in float64 (exact tokens between two code paths: see common.as_float64)."""
    model = as_float64(contract_model(name))
    ids, mask = left_padded()
    for beams in (1, 3):
        kwargs = dict(max_new_tokens=8, min_new_tokens=8, num_beams=beams, return_dict_in_generate=True,
                      output_scores=True)
        batch = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        assert_nontrivial(batch.sequences)
        for row in range(2):
            real = mask[row].bool()
            alone = model.generate(input_ids=ids[row : row + 1, real], **kwargs)
            assert torch.equal(alone.sequences[0], batch.sequences[row]), (row, beams)
            for t, (a, b) in enumerate(zip(alone.scores, batch.scores, strict=True)):  # [beams, V] per step
                assert_step_scores_close(a, b[row * beams : (row + 1) * beams], f"row {row}, {beams} beams, step {t}")


def test_left_padded_source_encodes_its_tokens_as_alone():
    """The encoder output of the real tokens of a left-padded row equals the sentence's alone, for sinusoidal and
    learned positions (float64)."""
    ids, mask = left_padded()
    for name in ("soft", "soft_prenorm", "gaussian_hc_all"):
        encoder = contract_model(name, fit=False).double().get_encoder()
        batch = encoder(ids, mask).last_hidden_state
        alone = encoder(ids[1:, mask[1].bool()]).last_hidden_state
        torch.testing.assert_close(batch[1, mask[1].bool()], alone[0], rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------------------------------------------
# Left-padded decoder prompts: positions counted from each row's first real token, as decoder-only models do
# ----------------------------------------------------------------------------------------------------------------
# the model types whose decoder reads a left-padded prompt (HardAttnModel.left_padding_refusal is None): contract
# models (fitted: varied tokens; soft_prenorm: pre-norm with learned positions), every Gaussian configuration and
# implementation (test_static_gaussian_beam_joint.config_model: hc-all full / conv / index, whose cross-attention
# centres count from each row's first real token, with a gamma of 1.3 here, sh-x, hc-sa) and beam_joint_transformer
# with its joint layer first (a later layer runs per candidate) and last
LEFT_PADDED_PROMPT_TYPES = ("soft", "soft_prenorm", "hard_retrieval") + GAUSSIAN + ("joint_first", "joint_last")
# (recurrent_transformer, hybrid_transformer and beam_joint_rnn read it too: tests/test_left_padding_states.py)
GAMMA = 1.3  # hc-all's length ratio here: floor(gamma * (i - padding)) is no shift of floor(gamma * i)
_MODELS = {}


def prompt_model(name):
    """The float64 model of a name of LEFT_PADDED_PROMPT_TYPES (built once; do not modify it)."""
    if name not in _MODELS:
        if name.startswith("hc_all"):  # hc-all's weights with gamma = GAMMA
            model = config_model(name)
            config = GaussianConfig.from_dict({**model.config.to_dict(), "length_ratio": GAMMA})
            _MODELS[name] = GaussianForConditionalGeneration(config).double().eval()
            _MODELS[name].load_state_dict(model.state_dict())
        elif name in GAUSSIAN or name.startswith("joint"):
            _MODELS[name] = config_model(name)
        else:
            _MODELS[name] = as_float64(contract_model(name))
    return _MODELS[name]


def cached_tolerance(model):
    """How far a cached forward's logits may lie from an uncached one's: rounding (1e-10) and, for Gaussian ``full``
    heads, the keys a cached step skips (beyond cutoff_radius: those under FULL_CUTOFF of the peak, see gaussian.py),
    at most the tail mass 2 sum_{d > r} N(d) of a head's weights per decoder sub-layer (self- and cross-attention),
    moving the logits by at most about that mass times their scale (< 10 here) each."""
    def tail(sigma):
        radius = cutoff_radius(sigma, FULL_CUTOFF)
        return 2 * float(gaussian_density(torch.arange(radius + 1, radius + 60, dtype=torch.float64), sigma).sum())

    return 1e-10 + 10 * sum(tail(module.sigma) for module in model.modules()
                            if isinstance(module, GaussianAttention) and module.implementation == "full"
                            and module.role != "encoder")
PROMPTS = ([BOS, 9, 13, 6], [BOS], [BOS, 17])  # decoder prompts of 4, 1 and 2 tokens, each from the start token


def left_padded_prompts(prompts=PROMPTS):
    """(decoder ids [3, 4], decoder mask): ``prompts`` padded on the left (PAD, mask 0)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def prompt_sources():
    """Three sources (source_batch() and a third, right-padded), one per prompt."""
    ids, mask = source_batch()
    ids = torch.cat([ids, torch.tensor([[13, 9, 5, 2, PAD, PAD, PAD]])])
    return ids, (ids != PAD).long()


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("name", LEFT_PADDED_PROMPT_TYPES)
def test_left_padded_decoder_prompts_decode_as_each_prompt_alone(name, cache):
    """generate() with a batch of decoder prompts padded on the left (``decoder_input_ids`` and
    ``decoder_attention_mask``, as decoder-only models take them), greedy and beam 4, with the dynamic and the static cache: each row's tokens and
    step scores (common.assert_step_scores_close) are those of its prompt decoded alone, unpadded (float64)."""
    model = prompt_model(name)
    ids, mask = prompt_sources()
    decoder_ids, decoder_mask = left_padded_prompts()
    width = decoder_ids.shape[1]
    for beams in (1, 4):
        kwargs = dict(max_new_tokens=6, min_new_tokens=6, num_beams=beams, return_dict_in_generate=True,
                      output_scores=True, cache_implementation=cache)
        batch = model.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                               decoder_attention_mask=decoder_mask, **kwargs)
        assert_nontrivial(batch.sequences)
        for row, prompt in enumerate(PROMPTS):
            alone = model.generate(input_ids=ids[row : row + 1, mask[row].bool()],
                                   decoder_input_ids=torch.tensor([prompt]), **kwargs)
            assert torch.equal(batch.sequences[row, width - len(prompt):], alone.sequences[0]), (row, beams)
            assert (batch.sequences[row, : width - len(prompt)] == PAD).all()
            for t, (a, b) in enumerate(zip(alone.scores, batch.scores, strict=True)):  # [beams, V] per step
                assert_step_scores_close(a, b[row * beams : (row + 1) * beams], f"row {row}, {beams} beams, step {t}")


def teacher_forced_alone(model, ids, mask, decoder_ids, decoder_mask):
    """Per row: the logits [T_real, V] of its real decoder tokens decoded alone, unpadded, without a cache."""
    return [model(input_ids=ids[row : row + 1, mask[row].bool()], decoder_input_ids=decoder_ids[row : row + 1, real],
                  use_cache=False).logits[0]
            for row, real in enumerate(decoder_mask.bool())]


def stepped_alone(model, ids, mask, decoder_ids, decoder_mask, prompt):
    """Per row: the logits [T_real, V] of its real decoder tokens decoded alone, unpadded, through the dynamic cache:
    its real tokens among the first ``prompt`` columns in one call, then one position a call (the calls of the padded
    batch in the test below: the same queries per call, so a cached Gaussian ``full`` step reads the same keys)."""
    logits = []
    for row, real in enumerate(decoder_mask.bool()):
        tokens = decoder_ids[row : row + 1, real]
        first = int(real[:prompt].sum())
        cache, steps = None, []
        for start, stop in [(0, first)] + [(t, t + 1) for t in range(first, tokens.shape[1])]:
            out = model(input_ids=ids[row : row + 1, mask[row].bool()], decoder_input_ids=tokens[:, start:stop],
                        cache=cache, use_cache=True)
            cache = getattr(out, CACHE_FIELD)
            steps.append(out.logits[0])
        logits.append(torch.cat(steps))
    return logits


def assert_real_positions(logits, alone, decoder_mask, what, atol=1e-10):
    for row, real in enumerate(decoder_mask.bool()):
        torch.testing.assert_close(logits[row, real], alone[row][: int(real.sum())], rtol=0, atol=atol,
                                   msg=f"{what}, row {row}")


@pytest.mark.parametrize("name", LEFT_PADDED_PROMPT_TYPES)
def test_left_padded_decoder_inputs_in_forward_equal_each_row_alone(name):
    """forward() with left-padded decoder inputs (a prompt and 3 more tokens): in one call without a cache, in one call
    into a cache, and through the dynamic and the static cache: the prompts in one call, then position by position
    (the mask growing with the positions, as generate() passes it); then 2 more positions with no mask at all, and
    (dynamic cache) 1 with the mask of its own position only: the cache keeps each row's padding. The logits of every
    real position equal those of the row alone, unpadded: without a cache (float64; a cached Gaussian ``full`` step
    skips the keys beyond its cutoff: :func:`cached_tolerance`), and step by step, those of the row alone through the
    dynamic cache in the same calls (the same keys read: 1e-10); the padding's own are finite."""
    model = prompt_model(name)
    atol = cached_tolerance(model)
    ids, mask = prompt_sources()
    decoder_ids, decoder_mask = left_padded_prompts([p + [5, 7, 11] for p in PROMPTS])
    more = torch.tensor([[8, 3], [12, 4], [6, 10]])
    full_ids = torch.cat([decoder_ids, more, torch.tensor([[9], [9], [9]])], 1)
    full_mask = torch.cat([decoder_mask, torch.ones(3, 3, dtype=torch.long)], 1)
    alone = teacher_forced_alone(model, ids, mask, full_ids, full_mask)
    width, prompt = decoder_ids.shape[1], max(map(len, PROMPTS))
    alone_steps = stepped_alone(model, ids, mask, full_ids, full_mask, prompt)
    inputs = dict(input_ids=ids, attention_mask=mask)
    whole = model(**inputs, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask, use_cache=False).logits
    assert whole.isfinite().all()
    assert_real_positions(whole, alone, decoder_mask, "one call")
    for cache in (None, StaticHardAttnCache(model.config.decoder_layers, 12, 3)):
        logits = []
        for start, stop in [(0, prompt)] + [(t, t + 1) for t in range(prompt, width)]:
            out = model(**inputs, decoder_input_ids=decoder_ids[:, start:stop],
                        decoder_attention_mask=decoder_mask[:, :stop], cache=cache, use_cache=True)
            cache = getattr(out, CACHE_FIELD)
            logits.append(out.logits)
        for t in range(2):  # no mask: the cache's count of each row's padding hides it and places the positions
            out = model(**inputs, decoder_input_ids=more[:, t : t + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
        if not isinstance(cache, StaticHardAttnCache):  # the mask of the new position only
            out = model(**inputs, decoder_input_ids=full_ids[:, -1:], decoder_attention_mask=full_mask[:, -1:],
                        cache=cache, use_cache=True)
            logits.append(out.logits)
        steps = torch.cat(logits, 1)
        assert steps.isfinite().all()
        what = f"step by step, {type(cache).__name__}"
        assert_real_positions(steps, alone, full_mask[:, : steps.shape[1]], what, atol)
        assert_real_positions(steps, alone_steps, full_mask[:, : steps.shape[1]], f"{what}, against alone step by step")
    cached = model(**inputs, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask, use_cache=True).logits
    assert_real_positions(cached, alone, decoder_mask, "one call into a cache", atol)


def test_right_padded_decoder_inputs_are_unchanged():
    """Teacher forcing with right-padded decoder inputs (labels padded with -100) reads no left padding: its positions
    are 0, 1, ... and its loss and real positions' logits are the rows' alone (float64), the padding's own finite."""
    model = as_float64(contract_model("soft"))
    ids, mask = prompt_sources()
    labels = torch.tensor([[5, 9, 13, 2], [7, 2, -100, -100], [6, 8, 2, -100]])
    decoder_ids = model.prepare_decoder_input_ids_from_labels(labels)
    decoder_mask = (labels != -100).long()
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask,
                labels=labels)
    assert out.logits.isfinite().all()
    alone = teacher_forced_alone(model, ids, mask, decoder_ids, decoder_mask)
    assert_real_positions(out.logits, alone, decoder_mask, "right-padded")
    smoothing = model.config.label_smoothing
    expected = torch.nn.functional.cross_entropy(torch.cat(alone), labels[labels != -100], label_smoothing=smoothing)
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-6, atol=0)  # (the loss is summed in fp32)


@pytest.mark.parametrize("name", [name for name in LEFT_PADDED_PROMPT_TYPES if not name.startswith("joint")])
def test_no_real_query_sees_a_padded_key(name):
    """output_attentions: every real query's decoder self-attention weights are 0 on the padding before its prompt (for
    hard retrieval: its one-hot never picks a padded key; Gaussian: its padded keys are 0), and the padding's queries
    see padding only (Gaussian's: nothing)."""
    model = prompt_model(name)
    ids, mask = prompt_sources()
    decoder_ids, decoder_mask = left_padded_prompts()
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask,
                output_attentions=True)
    pad = ~decoder_mask.bool()
    for weights in out.decoder_attentions:  # [B, H, Tq, Tk]
        real_query_on_pad = weights * (~pad)[:, None, :, None] * pad[:, None, None, :]
        assert real_query_on_pad.abs().max() == 0
        pad_query_on_real = weights * pad[:, None, :, None] * (~pad)[:, None, None, :]
        assert pad_query_on_real.abs().max() == 0
        assert weights.isfinite().all()


@pytest.mark.parametrize("part", ["decode", "kind"])
def test_left_padded_decoder_prompt_refused_where_reading_it_is_not_declared(part, monkeypatch):
    """Every model type reads a left-padded decoder prompt, declared beside the code that does it
    (``decode_reads_left_padding`` beside a ``decode``, ``reads_left_padding`` on a kind's class): where the model's
    ``decode`` or one of its decoder's attention kinds does not declare it, such a mask is refused where it enters
    (forward and generate()), naming the model type, what does not read it and what is allowed."""
    model = TYPE_MODELS["soft"]().eval()  # (a fresh model: the answer is found once per model)
    if part == "decode":
        monkeypatch.setattr(HardAttnModel, "decode_reads_left_padding", False)
        what = r"HardAttnModel.decode counts decoder positions from the first column"
    else:
        monkeypatch.setattr(SoftAttention, "reads_left_padding", False)
        what = r"its attention kind\(s\) \['soft \(cross\)', 'soft \(decoder\)'\] read positions from the first "
        what += "column"
    ids, mask = prompt_sources()
    decoder_ids, decoder_mask = left_padded_prompts()
    pattern = (rf"`decoder_attention_mask` row 1 has padding before a token: \[0, 0, 0, 1\]; decoder inputs must be "
               rf"padded on the right for model_type 'soft_transformer' \({what}\); allowed for it: padding after "
               rf"each row's last token only")
    with pytest.raises(ValueError, match=pattern):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask)
    with pytest.raises(ValueError, match=pattern):
        model.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                       decoder_attention_mask=decoder_mask, max_new_tokens=3)


@pytest.mark.parametrize("name", ONE_PER_TYPE)
def test_decoder_padding_between_tokens_is_refused(name):
    """Padding between two tokens (a hole), or a mask of the new positions only whose padding follows the cached
    tokens, is refused on every type: only padding before a row's first token or after its last is a layout."""
    model = contract_model(name, fit=False)
    ids, mask = prompt_sources()
    decoder_ids = torch.tensor([[1, 6, 9, 12], [1, 8, 10, 2], [1, 5, 5, 5]])
    hole = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 0]])
    with pytest.raises(ValueError, match=r"`decoder_attention_mask` row 1 has padding between two tokens: "
                                         r"\[1, 0, 1, 1\]; allowed: padding before a row's first token \(left\) or "
                                         r"after its last"):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, decoder_attention_mask=hole)
    cache = getattr(model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids[:, :2], use_cache=True),
                    CACHE_FIELD)
    with pytest.raises(ValueError, match=r"`decoder_attention_mask` row 2 has padding before a token: \[0, 1\]"):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids[:, 2:], cache=cache, use_cache=True,
              decoder_attention_mask=torch.tensor([[1, 1], [1, 1], [0, 1]]))


@pytest.mark.parametrize("name", ["soft", "hc_all_full", "joint_first"])
def test_left_padded_decoder_prompts_through_compiled_static_steps(name):
    """generate() with compiled decoding steps over the static cache (fullgraph: a graph break raises; backend
    "eager", dynamo alone) decodes left-padded prompts with the eager dynamic cache's tokens and scores, greedy
    (float64); the mask, one column wider each step, costs at most one more graph than a call without it. Soft,
    Gaussian hc-all (self- and cross-attention from the position tensor and each row's padding) and beam-joint (the
    candidates of a later layer read the soft history through the same mask)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from transformers import CompileConfig

    class Counter(CompileCounterWithBackend):
        def __deepcopy__(self, memo):  # kept itself when generate() deep-copies its compile config
            return self

    torch._dynamo.reset()
    model = prompt_model(name)
    ids, mask = prompt_sources()
    decoder_ids, decoder_mask = left_padded_prompts()
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                  decoder_attention_mask=decoder_mask, max_new_tokens=6, min_new_tokens=6,
                  return_dict_in_generate=True, output_scores=True)
    reference = model.generate(**kwargs)
    counter = Counter("eager")
    config = CompileConfig(fullgraph=True, dynamic=True, backend=counter, mode=None)
    config._compile_all_devices = True  # (generate() compiles on a CPU only when asked)
    compiled = model.generate(**kwargs, cache_implementation="static", compile_config=config)
    assert torch.equal(compiled.sequences, reference.sequences)
    for step, (got, expected) in enumerate(zip(compiled.scores, reference.scores, strict=True)):
        assert_step_scores_close(got, expected, f"step {step}")
    assert 1 <= counter.frame_count <= 2, counter.frame_count
    torch._dynamo.reset()
