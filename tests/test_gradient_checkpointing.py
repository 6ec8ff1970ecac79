"""Gradient checkpointing (``gradient_checkpointing_enable``) for every model type and the RNN decoder styles: the
recomputed units give the float64 loss and gradients of the model without checkpointing, under the RNG state of their
forward (dropout masks, hard retrieval's samples), and the cache is dropped in training only.

References: the same model without checkpointing (float64); the same recomputation without RNG preservation (the
negative control); plain generate() without checkpointing.
"""

import warnings

import pytest
import torch

from common import (DECODER_INPUTS as DEC, RNN_KW, TYPE_MODELS, collate, copy_task, randomize, source_batch,
                    tiny_kwargs, training_step)
from hf_hardattn import (BeamJointRNNConfig, BeamJointRNNForConditionalGeneration,
                         BeamJointTransformerForConditionalGeneration, HybridConfig, HybridForConditionalGeneration)
from hf_hardattn.caches import CACHE_FIELD
from hf_hardattn.hybrid import HybridDecoder


# TYPE_MODELS' beam_joint_rnn is the paper's Luong-style LSTM decoder (its defaults); these are the other styles
CHECKPOINTED = {
    **TYPE_MODELS,
    "hybrid_luong_lstm": lambda **kw: HybridForConditionalGeneration(HybridConfig(**tiny_kwargs(
        **RNN_KW, rnn_decoder_style="luong", rnn_cell="lstm", **kw))),
    "beam_joint_rnn_bahdanau": lambda **kw: BeamJointRNNForConditionalGeneration(BeamJointRNNConfig(**tiny_kwargs(
        **RNN_KW, joint_k=3, rnn_decoder_style="bahdanau", rnn_cell="gru", rnn_attention="additive", **kw))),
}


def enable_checkpointing(model, **kwargs):
    """``gradient_checkpointing_enable`` (transformers 5.24 deprecates the name for ``activation_checkpointing_enable``
    with a FutureWarning; both run the same code)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def checkpointed_modules(model):
    """(modules called inside a checkpointed unit, modules outside any): what gradient checkpointing recomputes in
    backward, for each type. Every encoder layer; every decoder layer, except in beam-joint Transformer the joint layer
    and the layers after it (``decode`` runs their sub-layers per candidate itself); the GRU decoder's step (its
    context projection runs once per step)."""
    inside = [layer.ffn for layer in model.model.encoder.layers]
    outside = []
    decoder = model.model.decoder
    if isinstance(decoder, HybridDecoder):
        inside.append(decoder.context_proj)
    else:
        joint = model.config.joint_layer_index() if isinstance(model, BeamJointTransformerForConditionalGeneration) \
            else len(decoder.layers)
        inside += [layer.ffn for layer in decoder.layers[:joint]]
        outside += [layer.ffn for layer in decoder.layers[joint:]]
    return inside, outside


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_gradient_checkpointing_gives_the_same_float64_gradients(name, reentrant):
    """With dropout everywhere (and hard retrieval sampling), the checkpointed units are recomputed in backward with the
    RNG state of their forward: loss and every gradient equal those without checkpointing (float64)."""
    model = CHECKPOINTED[name](dropout=0.1, attention_dropout=0.1, activation_dropout=0.1).double().train()
    batch = collate(copy_task(4, seed=3))
    loss, grads, calls = training_step(model, batch)
    assert len(grads) == len(list(model.parameters()))
    enable_checkpointing(model, use_reentrant=reentrant)
    checkpointed_loss, checkpointed_grads, checkpointed_calls = training_step(model, batch)
    inside, outside = checkpointed_modules(model)
    for module in inside:  # recomputed in backward: the checkpoint really happened
        assert checkpointed_calls[module] == 2 * calls[module]
    for module in outside:
        assert checkpointed_calls[module] == calls[module]
    assert torch.equal(checkpointed_loss, loss)
    assert checkpointed_grads.keys() == grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[key], grad, rtol=1e-12, atol=1e-14, msg=key)


def test_gradient_checkpointing_redraws_the_same_hard_retrieval_samples():
    """Sampling is the only randomness here (no dropout): gradients equal with the checkpoint's RNG preservation, and
    differ without it (the recomputation then retrieves other value rows), so the equality above is not luck."""
    model = TYPE_MODELS["hard_retrieval"]().double().train()
    batch = collate(copy_task(4, seed=3))
    _, grads, _ = training_step(model, batch)
    enable_checkpointing(model)
    _, preserved, _ = training_step(model, batch)
    enable_checkpointing(model, use_reentrant=False, preserve_rng_state=False)
    _, redrawn, _ = training_step(model, batch)
    assert all(torch.allclose(preserved[key], grad, rtol=1e-12, atol=1e-14) for key, grad in grads.items())
    assert not all(torch.allclose(redrawn[key], grad, rtol=1e-6, atol=1e-9) for key, grad in grads.items())


def test_gradient_checkpointing_turns_the_cache_off_only_in_training():
    """A checkpointed layer runs twice in training and would write its keys/values twice: forward drops the cache
    there (with transformers' warning); generate (no gradients) keeps it and decodes as without checkpointing."""
    model = randomize(TYPE_MODELS["soft"]())
    ids, mask = source_batch()
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, num_beams=2)
    enable_checkpointing(model)
    model.train()
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, use_cache=True)
    assert getattr(out, CACHE_FIELD) is None
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                      num_beams=2), plain)
