"""bfloat16 weights (``model.to(torch.bfloat16)``) for every model type: forward, greedy and beam-search decoding
follow the fp32 model within bf16's rounding.

References: the fp32 model, teacher-forced on the bf16 model's tokens; ``compute_transition_scores`` for the beam
scores.
"""

import copy

import pytest
import torch

from common import JOINT_TYPES, TYPE_MODELS, TYPE_NAMES, forward_logits, randomize, source_batch


def assert_close_in_bf16(got, expected, every_position):
    """Log-probabilities [B, T, V] of the bf16 model against the fp32 model's: bf16 (8 significant bits) moves them by
    about 0.01-0.06 here. Where a hard selection can flip at a near tie (hard retrieval's argmax, beam-joint's top K),
    a flipped position moves further, so for those kinds the bound holds for the median position."""
    error = (got.float() - expected).abs().amax(-1)  # per target position
    assert error.median() <= 0.1, error
    if every_position:
        assert error.max() <= 0.15, error


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_bfloat16_weights_forward_and_generate(name):
    """model.to(torch.bfloat16): every parameter and state in bf16 (beam-joint's mixture in fp32 by design), forward
    and decoding follow the fp32 model (decoding, greedy and beam search: the fp32 model teacher-forced on the bf16
    model's tokens); a beam hypothesis's score is the mean of its tokens' log-probabilities (length penalty 1), the
    hypotheses of a sentence best first."""
    model = randomize(TYPE_MODELS[name](), std=0.2)  # moderate weights: attention neither flat nor saturated
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    every_position = name in ("soft", "gaussian", "hybrid", "recurrent")  # no hard selection
    ids, mask = source_batch()
    out = forward_logits(bf16)
    assert out.dtype == (torch.float32 if name in JOINT_TYPES else torch.bfloat16)
    assert_close_in_bf16(out.float().log_softmax(-1), forward_logits(model).log_softmax(-1), every_position)
    greedy = bf16.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                           output_logits=True, return_dict_in_generate=True)
    steps = torch.stack(greedy.logits, 1).float().log_softmax(-1)
    teacher_forced = forward_logits(model, ids, mask, greedy.sequences[:, :-1]).log_softmax(-1)
    assert_close_in_bf16(steps, teacher_forced, every_position)
    beams = bf16.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, num_beams=4,
                          num_return_sequences=2, output_scores=True, return_dict_in_generate=True)
    assert beams.sequences.shape == (4, 9)
    tokens = bf16.compute_transition_scores(beams.sequences, beams.scores, beams.beam_indices)  # [4, 8] fp32
    sums = tokens.sum(-1)  # fp32 sums of 8 terms in another order than generate's: 8 eps * sum |term| apart at most
    assert ((beams.sequences_scores - sums / 8).abs() <= 8 * torch.finfo(torch.float32).eps * tokens.abs().sum(-1)).all()
    assert (beams.sequences_scores[0::2] >= beams.sequences_scores[1::2]).all()  # 2 per sentence, best first
    teacher_forced = forward_logits(model, ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), beams.sequences[:, :-1])
    expected = teacher_forced.log_softmax(-1).gather(-1, beams.sequences[:, 1:, None])
    assert_close_in_bf16(tokens[..., None], expected, every_position)
