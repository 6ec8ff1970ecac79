"""Half-precision weights (``model.to(torch.bfloat16)``, ``model.half()``) for every model type: forward, greedy and
beam-search decoding follow the fp32 model within the format's rounding.

References: the fp32 model, teacher-forced on the half model's tokens; ``compute_transition_scores`` for the beam
scores.
"""

import copy
import functools

import pytest
import torch

from common import JOINT_TYPES, TYPE_MODELS, forward_logits, randomize, source_batch


def assert_close_in_half(got, expected, every_position, dtype):
    """Log-probabilities [B, T, V] of the half-precision model against the fp32 model's. Each rounding to ``dtype``
    moves a value by up to half its eps (bf16 2^-7, fp16 2^-10), relative; through weights, activations and the
    layers the log-probabilities here move by 1.5-4 eps at the median position and up to 7 eps at the worst
    (measured on every type in both formats), so the bounds are 12.8 and 19.2 eps (0.1 and 0.15 in bf16). Where a hard selection can flip
    at a near tie (hard retrieval's argmax, beam-joint's top K), a flipped position moves further, so for those kinds
    the bound holds for the median position."""
    eps = torch.finfo(dtype).eps
    error = (got.float() - expected).abs().amax(-1)  # per target position
    assert error.median() <= 12.8 * eps, error
    if every_position:
        assert error.max() <= 19.2 * eps, error


BUILDERS = dict(TYPE_MODELS, beam_joint_transformer_joint_layer_0=functools.partial(  # candidates pass a later layer
    TYPE_MODELS["beam_joint_transformer"], joint_layer=0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_half_precision_weights_forward_and_generate(name, dtype):
    """model.to(dtype): every parameter and state in bf16 / fp16 (beam-joint's mixture in fp32 by design; its masks
    within the format's range), forward and decoding follow the fp32 model (decoding, greedy and beam search: the fp32
    model teacher-forced on the half model's tokens); a beam hypothesis's score is the mean of its tokens'
    log-probabilities (length penalty 1), the hypotheses of a sentence best first."""
    model = randomize(BUILDERS[name](), std=0.2)  # moderate weights: attention neither flat nor saturated
    half = copy.deepcopy(model).to(dtype)
    assert {p.dtype for p in half.parameters()} == {dtype}
    every_position = name in ("soft", "gaussian", "hybrid", "recurrent")  # no hard selection
    ids, mask = source_batch()
    out = forward_logits(half)
    assert out.dtype == (torch.float32 if name.startswith(JOINT_TYPES) else dtype)
    assert_close_in_half(out.float().log_softmax(-1), forward_logits(model).log_softmax(-1), every_position, dtype)
    greedy = half.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                           output_logits=True, return_dict_in_generate=True)
    steps = torch.stack(greedy.logits, 1).float().log_softmax(-1)
    teacher_forced = forward_logits(model, ids, mask, greedy.sequences[:, :-1]).log_softmax(-1)
    assert_close_in_half(steps, teacher_forced, every_position, dtype)
    beams = half.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, num_beams=4,
                          num_return_sequences=2, output_scores=True, return_dict_in_generate=True)
    assert beams.sequences.shape == (4, 9)
    tokens = half.compute_transition_scores(beams.sequences, beams.scores, beams.beam_indices)  # [4, 8] fp32
    sums = tokens.sum(-1)  # fp32 sums of 8 terms in another order than generate's: 8 eps * sum |term| apart at most
    assert ((beams.sequences_scores - sums / 8).abs() <= 8 * torch.finfo(torch.float32).eps * tokens.abs().sum(-1)).all()
    assert (beams.sequences_scores[0::2] >= beams.sequences_scores[1::2]).all()  # 2 per sentence, best first
    teacher_forced = forward_logits(model, ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), beams.sequences[:, :-1])
    expected = teacher_forced.log_softmax(-1).gather(-1, beams.sequences[:, 1:, None])
    assert_close_in_half(tokens[..., None], expected, every_position, dtype)
