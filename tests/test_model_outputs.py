"""The model outputs of every type: attention weights and hidden states (``output_attentions`` /
``output_hidden_states``, by keyword or config, as a dict or a tuple), also per step through generate() and with
beam search's grouped memory.

References: the output layer applied to the last hidden state (beam-joint: the mixture rebuilt from the returned
weights, Eq. 5); transformers' MarianMTModel for the output order; the teacher-forced forward for each generate()
step; transformers' expanded beam path for the grouped one.
"""

import pytest
import torch
from transformers import MarianConfig, MarianMTModel

from common import CONTRACT_MODELS, PAD, as_float64, assert_nontrivial, contract_model, source_batch
from hf_hardattn.joint_kernel import joint_log_probs, select_candidates


DEC = torch.tensor([[1, 6, 9, 12, 15, 7], [1, 8, 10, 2, 0, 0]])  # teacher-forced decoder inputs


def expected_slots(model):
    """(encoder, decoder self, cross) -> list of bools: True where a layer has that sub-layer (False: kind "none")."""
    config = model.config
    encoder = [kind != "none" for kind in config.attention_kinds("encoder")]
    if hasattr(config, "rnn_attention"):  # the GRU decoder: no self-attention, its attention as one cross layer
        return encoder, [False] * config.decoder_layers, [True]
    return (encoder, [kind != "none" for kind in config.attention_kinds("decoder")],
            [kind != "none" for kind in config.attention_kinds("cross")])


def mixture_of(model, out):
    """The beam-joint logits rebuilt from the returned outputs: P_t(a) = the joint layer's weights averaged over heads,
    its top-K (renormalised), and the last hidden states (the candidates) through the tied output layer (Eq. 5)."""
    config = model.config
    layer = config.joint_layer_index() if hasattr(config, "joint_layer_index") else 0
    p = out.cross_attentions[layer].mean(1)
    log_w, _ = select_candidates(p.log(), config.joint_k, config.full_joint, config.renormalize_joint)
    return joint_log_probs(out.decoder_hidden_states[-1], log_w, model.lm_head.weight)


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_model_outputs_attentions_and_hidden_states(name):
    model = contract_model(name, fit=False).double()
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, use_cache=False)
    plain = model(**kwargs)
    out = model(**kwargs, output_attentions=True, output_hidden_states=True)
    torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=1e-10)

    encoder, decoder, cross = expected_slots(model)
    expanded = int(name.startswith("recurrent_expand"))  # the extra key-value pair of Eq. 5-8
    for weights, slots, queries, keys in ((out.encoder_attentions, encoder, 7, 7), (out.decoder_attentions, decoder, 6, 6),
                                          (out.cross_attentions, cross, 6, 7 + expanded)):
        assert [w is not None for w in weights] == slots
        for w in weights:
            if w is not None and not name.startswith("beam_joint"):
                assert w.shape[0] == 2 and w.shape[2:] == (queries, keys), w.shape
    assert len(out.encoder_hidden_states) == model.config.encoder_layers + 1
    torch.testing.assert_close(out.encoder_hidden_states[-1], out.encoder_last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(out.encoder_hidden_states[0], model.get_encoder()(ids, mask, output_hidden_states=True)
                               .hidden_states[0], rtol=0, atol=0)
    if name.startswith("beam_joint"):
        torch.testing.assert_close(mixture_of(model, out), out.logits, rtol=0, atol=1e-10)
    else:  # the last decoder hidden state is the output layer's input
        torch.testing.assert_close(model.lm_head(out.decoder_hidden_states[-1]), out.logits, rtol=0, atol=1e-10)
    if name.startswith(("hybrid", "beam_joint_rnn")):  # embeddings, each RNN layer's output, the readout
        assert len(out.decoder_hidden_states) == model.config.decoder_layers + 2
        hidden = model.config.rnn_hidden_size  # an LSTM layer's output h, not its [h; c] state
        assert [tuple(h.shape) for h in out.decoder_hidden_states[1:-1]] == [(2, 6, hidden)] * model.config.decoder_layers
    else:
        assert len(out.decoder_hidden_states) == model.config.decoder_layers + 1

    # the config's flags give the same outputs as the keywords; return_dict=False gives Seq2SeqLMOutput's order
    model.config.output_attentions = model.config.output_hidden_states = True
    try:
        by_config = model(**kwargs)
        as_tuple = model(**kwargs, return_dict=False)
    finally:
        model.config.output_attentions = model.config.output_hidden_states = False
    assert len(as_tuple) == len(out.to_tuple())
    for field in ("cross_attentions", "decoder_hidden_states", "encoder_attentions"):
        for a, b in zip(getattr(by_config, field), getattr(out, field)):
            assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(as_tuple, out.to_tuple()):
        assert type(a) is type(b)


def test_hybrid_and_beam_joint_weights_are_their_attention_distribution():
    """The GRU decoder's one cross layer is a_t per head (sums to 1, 0 on padding); beam-joint's P_t(a) is its mean."""
    for name in ("hybrid_multihead", "beam_joint_rnn", "beam_joint_transformer"):  # beam_joint_rnn: Luong-style
        model = contract_model(name, fit=False).double()
        ids, mask = source_batch()
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, output_attentions=True)
        layer = 0
        weights = out.cross_attentions[layer]
        assert weights.shape == (2, 4, 6, 7)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 6, dtype=torch.float64))
        assert weights[1, ..., 5:].abs().max() == 0
    hybrid = contract_model("hybrid_multihead", fit=False).double()
    decoded = hybrid.model.decoder_outputs(DEC, hybrid.get_encoder()(ids, mask).last_hidden_state, mask)
    torch.testing.assert_close(hybrid(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC,
                                      output_attentions=True).cross_attentions[0], decoded.attentions)


def test_output_order_follows_marian():
    """return_dict=False with both flags: the same sequence of fields and shapes as transformers' MarianMTModel of
    the same sizes (the cache field included)."""
    model = contract_model("soft", fit=False)
    marian = MarianMTModel(MarianConfig(vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, pad_token_id=PAD, decoder_start_token_id=1,
                                        attn_implementation="eager")).eval()
    ids, mask = source_batch()

    def shapes(m):
        out = m(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, labels=DEC, output_attentions=True,
                output_hidden_states=True, return_dict=False)
        return [tuple(x.shape) if torch.is_tensor(x) else [tuple(t.shape) for t in x] if isinstance(x, tuple)
                else "cache" for x in out]

    assert shapes(model) == shapes(marian)


# ----------------------------------------------------------------------------------------------------------------
# generate(): weights and states of every step
# ----------------------------------------------------------------------------------------------------------------
def assert_step_matches(step, full, t, causal):
    """A cached step's weights [B, H, 1 (or K), keys] equal row t of the teacher-forced ones [B, H, T, keys_full]."""
    rows = step.shape[2]
    row = full[:, :, t * rows : (t + 1) * rows]
    if causal:  # the step sees positions <= t; the full row gives the later ones 0
        assert (row[..., t + 1 :] == 0).all()
        row = row[..., : t + 1]
    torch.testing.assert_close(step, row, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", CONTRACT_MODELS)
@pytest.mark.numerics
def test_generate_returns_the_weights_and_states_of_every_step(name):
    """Each generate() step's weights and hidden states equal the teacher-forced forward's row of that step. Float64
    (see common.as_float64): the cached step and the full forward are two code paths whose scores differ by ~1e-15
    relative, so an argmax or top-K choice (hard retrieval, beam-joint) cannot flip between them as in fp32; weights
    in [0, 1] within 1e-12, hidden states within 1e-12 of their largest |value| (float64 sums of ~100 terms)."""
    model = as_float64(contract_model(name))
    ids, mask = source_batch()
    gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                         output_attentions=True, output_hidden_states=True, return_dict_in_generate=True)
    assert_nontrivial(gen.sequences)
    full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=gen.sequences[:, :-1], use_cache=False,
                 output_attentions=True, output_hidden_states=True)
    for a, b in zip(gen.encoder_attentions, full.encoder_attentions):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=0, atol=1e-12)
    assert len(gen.cross_attentions) == len(gen.decoder_attentions) == len(gen.decoder_hidden_states) == 6
    joint = name == "beam_joint_transformer"
    for t in range(6):
        for step, whole in zip(gen.cross_attentions[t], full.cross_attentions):
            assert (step is None) == (whole is None)
            if step is not None:
                assert_step_matches(step, whole, t, causal=False)
        for layer, (step, whole) in enumerate(zip(gen.decoder_attentions[t], full.decoder_attentions)):
            assert (step is None) == (whole is None)
            if step is not None and not (joint and layer > 0):  # (candidates' own column: a separate test)
                assert_step_matches(step, whole, t, causal=True)
        for step, whole in zip(gen.decoder_hidden_states[t], full.decoder_hidden_states):
            scale = max(float(whole.detach().abs().max()), 1.0)
            torch.testing.assert_close(step, whole[:, t : t + 1], rtol=0, atol=1e-12 * scale)


@pytest.mark.parametrize("name", ["soft", "hard_retrieval", "gaussian_sh_x", "hybrid_multihead"])
def test_beam_search_weights_with_grouped_memory_equal_the_expanded_ones(name):
    """Beams read one encoder row per sentence (grouped memory); the returned cross-attention weights are still one
    row per beam, equal to transformers' expanded path. Float64 (exact tokens between two code paths: see
    common.as_float64): the same tokens, the weights within 1e-12 (float64 rounding of values in [0, 1])."""
    model = as_float64(contract_model(name))
    assert model._memory_grouped_decoding()
    expanded = as_float64(model)
    expanded._memory_grouped_decoding = lambda: False
    ids, mask = source_batch()
    results = {grouped: m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, num_beams=3,
                                   output_attentions=True, return_dict_in_generate=True)
               for grouped, m in ((True, model), (False, expanded))}
    assert_nontrivial(results[True].sequences)
    assert torch.equal(results[True].sequences, results[False].sequences)
    for step_g, step_e in zip(results[True].cross_attentions, results[False].cross_attentions, strict=True):
        for a, b in zip(step_g, step_e, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape[0] == 6
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
