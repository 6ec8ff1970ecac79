"""Left-padded sources (a tokenizer with ``padding_side="left"``) for every contract model: positions (sinusoidal or
learned, the Gaussian cross-attention centres) count from each row's first real token.

References: each sentence alone, in float64.
"""

import pytest
import torch

from common import (CONTRACT_MODELS, PAD, as_float64, assert_nontrivial, assert_step_scores_close, contract_model,
                    source_batch)


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
