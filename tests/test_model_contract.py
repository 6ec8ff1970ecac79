"""The HuggingFace model contract for every model type: attention weights and hidden states (output_attentions /
output_hidden_states, also through generate()), continuing generate() from a returned cache, loading a checkpoint
that lacks the tied embedding, left-padded sources, attn_implementation.

References: each attention kind's weights recompute its sub-layer's output from the values by hand (float64), and
equal the kind's formula (softmax by hand, the argmax of the raw scores, the Gaussian closed form); the cached decoding
path against a teacher-forced forward; transformers' own MarianMTModel for output order and loading; a sentence alone
against the same sentence in a left-padded batch.
"""

import contextlib
import math
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM, MarianConfig, MarianMTModel

from common import (CONTRACT_MODELS, PAD, as_float64, assert_nontrivial, assert_step_scores_close, contract_model,
                    randomize, source_batch, tiny_kwargs)
from hf_hardattn import GaussianConfig, RecurrentConfig, SoftTransformerConfig
from hf_hardattn.beam_joint import joint_log_probs, select_candidates
from hf_hardattn.gaussian import GaussianAttention
from hf_hardattn.hard_retrieval import HardRetrievalAttention
from hf_hardattn.caches import CACHE_FIELD, HardAttnCache
from hf_hardattn.layers import SoftAttention
from hf_hardattn.recurrent import RECURRENT_VARIANTS, RecurrentCrossAttention
from hf_hardattn.safe_io import CHECKSUM_FILE

DEC = torch.tensor([[1, 6, 9, 12, 15, 7], [1, 8, 10, 2, 0, 0]])  # teacher-forced decoder inputs
MEMORY_MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])


def heads(x, num_heads):
    """[B, T, d] -> [B, H, T, d / H]."""
    return x.view(x.shape[0], x.shape[1], num_heads, -1).transpose(1, 2)


def merged(module, per_head):
    """The output projection of [B, H, T, hd] heads, by hand."""
    batch, _, length, _ = per_head.shape
    return per_head.transpose(1, 2).reshape(batch, length, -1) @ module.out_proj.weight.T + module.out_proj.bias


def inputs64(seed=0, length=5):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, length, 32, generator=generator, dtype=torch.float64)
    memory = torch.randn(2, 7, 32, generator=generator, dtype=torch.float64)
    return hidden, memory, MEMORY_MASK.bool()[:, None, None, :]


def module64(cls, config, role, seed=0):
    torch.manual_seed(seed)
    module = cls(config, role, 0).double()
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    return module.eval()


# ----------------------------------------------------------------------------------------------------------------
# Each kind's weights, against its formula and its own output (float64)
# ----------------------------------------------------------------------------------------------------------------
def soft_qkv(module, hidden, memory):
    """Queries, keys, values [B, H, T, hd] from the module's projections, by hand."""
    d = hidden.shape[-1]
    if module.is_cross:
        q = hidden @ module.q_proj.weight.T + module.q_proj.bias
        kv = memory @ module.kv_proj.weight.T + module.kv_proj.bias
        k, v = kv[..., :d], kv[..., d:]
    else:
        qkv = hidden @ module.qkv_proj.weight.T + module.qkv_proj.bias
        q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]
    return (heads(t, module.num_heads) for t in (q, k, v))


def visible(module, mask, causal, tq, tk):
    """Bool [B or 1, 1, Tq, Tk]: the keys a query may see."""
    allowed = torch.ones(1, 1, tq, tk, dtype=torch.bool)
    if module.is_cross:
        allowed = allowed & mask
    elif module.role == "encoder":
        allowed = allowed & mask[..., :tk]
    if causal:
        allowed = allowed & torch.ones(tq, tk, dtype=torch.bool).tril()
    return allowed


ROLE_CASES = [("encoder", False), ("decoder", True), ("cross", False)]


@pytest.mark.parametrize("role,causal", ROLE_CASES)
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_soft_weights_are_the_softmax_and_recompute_the_output(role, causal, implementation):
    config = SoftTransformerConfig(**tiny_kwargs())
    config._attn_implementation = implementation
    module = module64(SoftAttention, config, role)
    hidden, memory, mask = inputs64(length=7 if role == "encoder" else 5)
    mask_in = mask if role != "decoder" else None
    plain = module(hidden, memory=memory, mask=mask_in, causal=causal)
    out, weights = module(hidden, memory=memory, mask=mask_in, causal=causal, output_attentions=True)
    q, k, v = soft_qkv(module, hidden, memory)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    allowed = visible(module, mask, causal, q.shape[2], k.shape[2])
    expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    assert weights.shape == (2, 4, q.shape[2], k.shape[2])
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, q.shape[2], dtype=torch.float64))
    torch.testing.assert_close(out, merged(module, weights @ v), rtol=0, atol=1e-10)
    torch.testing.assert_close(plain, out, rtol=0, atol=1e-10)  # the fused default path: the same output


@pytest.mark.parametrize("role,causal", ROLE_CASES)
def test_hard_retrieval_weights_are_the_one_hot_of_the_argmax_of_raw_scores(role, causal):
    module = module64(HardRetrievalAttention, SoftTransformerConfig(**tiny_kwargs()), role)
    hidden, memory, mask = inputs64(length=7 if role == "encoder" else 5)
    mask_in = mask if role != "decoder" else None
    plain = module(hidden, memory=memory, mask=mask_in, causal=causal)
    out, weights = module(hidden, memory=memory, mask=mask_in, causal=causal, output_attentions=True)
    q, k, v = soft_qkv(module, hidden, memory)
    raw = (q @ k.transpose(-1, -2)).masked_fill(~visible(module, mask, causal, q.shape[2], k.shape[2]),
                                                 float("-inf"))  # Eq. 11: no scaling, no softmax
    torch.testing.assert_close(weights, F.one_hot(raw.argmax(-1), k.shape[2]).double(), rtol=0, atol=0)
    torch.testing.assert_close(out, merged(module, weights @ v), rtol=0, atol=1e-10)
    torch.testing.assert_close(plain, out, rtol=0, atol=0)


def test_hard_retrieval_training_weights_are_the_sampled_index():
    """Training samples one index per query (Eq. 4-5); the returned one-hot is that sample (the same draw as without
    output_attentions), on a visible key, and recomputes the output."""
    module = module64(HardRetrievalAttention, SoftTransformerConfig(**tiny_kwargs()), "cross").train()
    hidden, memory, mask = inputs64()
    torch.manual_seed(5)
    plain = module(hidden, memory=memory, mask=mask)
    torch.manual_seed(5)
    out, weights = module(hidden, memory=memory, mask=mask, output_attentions=True)
    _, _, v = soft_qkv(module, hidden, memory)
    torch.testing.assert_close(plain, out, rtol=0, atol=0)
    torch.testing.assert_close(out, merged(module, weights @ v), rtol=0, atol=1e-10)
    assert set(weights.sum(-1).unique().tolist()) == {1.0} and weights[1, ..., 5:].abs().max() == 0
    q, k, _ = soft_qkv(module, hidden, memory)
    argmax = F.one_hot((q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")).argmax(-1), 7).double()
    assert not torch.equal(weights, argmax)  # sampled, not the argmax (the check above could fail)


def gaussian_closed_form(module, query_positions, key_positions, shift=None):
    """[B or 1, H, Tq, Tk] weights by the paper's formula: N(key - centre; 0, sigma^2) (Eq. 2), centre i + o (self)
    or floor(gamma * i + o) (cross; + the row's left padding), truncated to the window (conv) or a delta (index)."""
    out = torch.zeros(1 if shift is None else len(shift), len(module.offsets), len(query_positions),
                      len(key_positions), dtype=torch.float64)
    for b in range(out.shape[0]):
        for h, offset in enumerate(module.offsets):
            for i, qp in enumerate(query_positions):
                centre = math.floor(module.gamma * qp + offset) if module.is_cross else qp + offset
                centre += 0 if shift is None else int(shift[b])
                for j, kp in enumerate(key_positions):
                    d = kp - centre
                    value = math.exp(-d * d / 2) / math.sqrt(2 * math.pi)
                    if module.implementation == "conv" and abs(d) > 1:
                        value = 0.0
                    if module.implementation == "index":
                        value = float(d == 0)
                    if module.role == "decoder" and kp > qp:
                        value = 0.0
                    out[b, h, i, j] = value
    return out


@pytest.mark.parametrize("implementation", ["full", "conv", "index"])
@pytest.mark.parametrize("role,causal", ROLE_CASES)
def test_gaussian_weights_are_the_closed_form_and_recompute_the_output(role, causal, implementation):
    config = GaussianConfig(**tiny_kwargs(gaussian_implementation=implementation, length_ratio=1.3))
    module = module64(GaussianAttention, config, role)
    hidden, memory, mask = inputs64(length=7 if role == "encoder" else 5)
    mask_in = None if role == "decoder" else mask
    out, weights = module(hidden, memory=memory, mask=mask_in, causal=causal, output_attentions=True)
    keys = memory if role == "cross" else hidden
    values = heads(keys @ module.v_proj.weight.T + module.v_proj.bias, 4)
    expected = gaussian_closed_form(module, range(hidden.shape[1]), range(keys.shape[1]))
    if mask_in is not None:
        expected = expected * mask_in  # padded keys: 0, not renormalised (footnote 5)
    torch.testing.assert_close(weights, expected.expand_as(weights), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, merged(module, weights @ values), rtol=0, atol=1e-10)
    torch.testing.assert_close(module(hidden, memory=memory, mask=mask_in, causal=causal), out, rtol=0, atol=0)


@pytest.mark.parametrize("role", ["decoder", "cross"])
def test_gaussian_cached_weights_cover_every_key_and_equal_the_full_ones_within_reach(role):
    """Cached decoding reads only the keys within the heads' reach; its weights are returned over all keys (the
    earlier positions / the whole source), equal to the full computation there and 0 beyond (< 1e-6 of the peak)."""
    config = GaussianConfig(**tiny_kwargs(length_ratio=0.8, cross_attention="gaussian"))
    module = module64(GaussianAttention, config, role)
    hidden, memory, mask = inputs64(length=12)
    mask_in = mask if role == "cross" else None
    full_out, full = module(hidden, memory=memory, mask=mask_in, causal=role == "decoder", output_attentions=True)
    cache = HardAttnCache()
    for t in range(hidden.shape[1]):
        out, weights = module(hidden[:, t : t + 1], memory=memory, mask=mask_in, cache=cache, output_attentions=True)
        cache.seen_tokens += 1
        keys = memory.shape[1] if role == "cross" else t + 1
        assert weights.shape == (2, 4, 1, keys)
        row = full[:, :, t : t + 1, :keys]
        reached = weights != 0
        torch.testing.assert_close(weights[reached], row.expand_as(weights)[reached], rtol=0, atol=1e-12)
        skipped = row.expand_as(weights)[~reached]
        assert skipped.numel() == 0 or skipped.abs().max() < 1e-6 * 0.4
        torch.testing.assert_close(out, full_out[:, t : t + 1], rtol=0, atol=1e-6)
    assert role == "cross" or (full[..., -1, :5] > 0).any() and (weights[..., :5] == 0).all()  # the skipped keys


def recurrent_reference_output(module, weights, hidden, memory):
    """The recurrent layer's output rebuilt from its returned weights and its parameters, position by position: the
    context is sum_j w_j v_j, plus w_{J+1} g_v for the expand variants, g_v built from the previous step's context
    (Eq. 5: W_v c_{i-1}; Eq. 6: W_gv c_{i-1}; Eq. 7: W_gv^n c_{i-1}^{l,n}; Eq. 8: c_{i-1}^{l,n}), zeros before the
    first position."""
    d = hidden.shape[-1]
    kv = memory @ module.kv_proj.weight.T + module.kv_proj.bias
    v = heads(kv[..., d:], module.num_heads)  # [B, H, J, hd]
    variant, outputs = module.variant, []
    previous_full = torch.zeros(hidden.shape[0], d, dtype=torch.float64)
    previous_heads = torch.zeros_like(v[:, :, 0])
    for i in range(hidden.shape[1]):
        w = weights[:, :, i]
        context = (w[..., : v.shape[2], None] * v).sum(2)
        if variant in ("expand_1", "expand_2"):
            projection = module.kv_proj if variant == "expand_1" else module.g_proj
            gv = previous_full @ projection.weight.T
            if projection.bias is not None:
                gv = gv + projection.bias
            context = context + w[..., -1:] * heads(gv[:, None, d:], module.num_heads)[:, :, 0]
        elif variant == "expand_3":
            context = context + w[..., -1:] * torch.einsum("bhe,hde->bhd", previous_heads, module.g_value)
        elif variant == "expand_4":
            context = context + w[..., -1:] * previous_heads
        out = merged(module, context[:, :, None])[:, 0]
        previous_full, previous_heads = out, context
        outputs.append(out)
    return torch.stack(outputs, 1)


@pytest.mark.parametrize("variant", RECURRENT_VARIANTS)
def test_recurrent_weights_recompute_the_output_and_match_cached_decoding(variant):
    module = module64(RecurrentCrossAttention, RecurrentConfig(**tiny_kwargs(recurrent_variant=variant)), "cross")
    hidden, memory, mask = inputs64()
    out, weights = module(hidden, memory=memory, mask=mask, output_attentions=True)
    expand = variant.startswith("expand")
    assert weights.shape == (2, 4, 5, 7 + expand)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 5, dtype=torch.float64))
    assert weights[1, :, :, 5:7].abs().max() == 0  # padded source positions
    torch.testing.assert_close(out, recurrent_reference_output(module, weights, hidden, memory), rtol=0, atol=1e-10)
    torch.testing.assert_close(module(hidden, memory=memory, mask=mask), out, rtol=0, atol=0)
    cache, stepped = HardAttnCache(), []
    for t in range(hidden.shape[1]):
        stepped.append(module(hidden[:, t : t + 1], memory=memory, mask=mask, cache=cache, output_attentions=True)[1])
    torch.testing.assert_close(torch.cat(stepped, 2), weights, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# The model outputs of every type
# ----------------------------------------------------------------------------------------------------------------
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
    decoded = hybrid.decoder_outputs(DEC, hybrid.get_encoder()(ids, mask).last_hidden_state, mask)
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
    torch.testing.assert_close(step, row, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_generate_returns_the_weights_and_states_of_every_step(name):
    model = contract_model(name)
    ids, mask = source_batch()
    gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                         output_attentions=True, output_hidden_states=True, return_dict_in_generate=True)
    assert_nontrivial(gen.sequences)
    full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=gen.sequences[:, :-1], use_cache=False,
                 output_attentions=True, output_hidden_states=True)
    for a, b in zip(gen.encoder_attentions, full.encoder_attentions):
        assert (a is None and b is None) or torch.allclose(a, b, atol=1e-6)
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
            torch.testing.assert_close(step, whole[:, t : t + 1], rtol=0, atol=1e-5)


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


# ----------------------------------------------------------------------------------------------------------------
# Continuing generate() from a returned cache
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONTRACT_MODELS)
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_generate_continues_from_a_returned_cache(name, mode):
    """4 tokens, then 4 more from the returned cache (the sequence so far as decoder input, its mask covering it, as
    transformers asks of MarianMTModel too): the same tokens and scores (common.assert_step_scores_close) as 8 tokens
    in one call, in float64 (exact tokens between two code paths: see common.as_float64). The decoders that keep no
    key/value layers (Gaussian self-attention, GRU) used to feed the cached prefix again."""
    model = as_float64(contract_model(name))
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=mode == "sample", return_dict_in_generate=True,
                  output_scores=True)
    torch.manual_seed(7)
    whole = model.generate(**kwargs, max_new_tokens=8, min_new_tokens=8)
    torch.manual_seed(7)
    first = model.generate(**kwargs, max_new_tokens=4, min_new_tokens=4)
    cache = getattr(first, CACHE_FIELD)
    assert cache.get_seq_length() == 4
    second = model.generate(**kwargs, max_new_tokens=4, min_new_tokens=4, decoder_input_ids=first.sequences,
                            decoder_attention_mask=torch.ones_like(first.sequences), **{CACHE_FIELD: cache})
    assert_nontrivial(whole.sequences)
    assert torch.equal(second.sequences, whole.sequences)
    for t, (a, b) in enumerate(zip(second.scores, whole.scores[4:], strict=True)):
        assert_step_scores_close(a, b, f"step {4 + t}")
    assert cache.get_seq_length() == 8


# ----------------------------------------------------------------------------------------------------------------
# A checkpoint without the (tied) embedding
# ----------------------------------------------------------------------------------------------------------------
def drop_keys(folder, *keys):
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    for key in keys:
        state.pop(key)
    save_file(state, path, metadata={"format": "pt"})
    # replaced on purpose: the sha256 save_pretrained recorded no longer applies (from_pretrained would refuse the file)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, CHECKSUM_FILE))


TIED = {"model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
        "lm_head.weight"}


@pytest.mark.parametrize("name", ["soft", "hard_retrieval", "gaussian_sh_x", "hybrid_additive", "recurrent_expand_1",
                                  "beam_joint_transformer", "beam_joint_rnn"])  # the seven model types
def test_a_checkpoint_without_the_embedding_reports_it_missing_and_initialises_it(name, tmp_path):
    """As transformers does for MarianMTModel (checked here too): every tied key is reported missing, the embedding
    is materialised (not left on the meta device) with the model's init (N(0, embed_init_std or d^-1/2), pad row 0),
    the output layer stays tied to it, and the model runs. A missing untied weight is reported and initialised as well."""
    model = contract_model(name, fit=False)
    model.save_pretrained(tmp_path)
    layer_norm = "model.encoder.layers.0.ffn.norm.weight"
    drop_keys(tmp_path, "model.shared.weight", layer_norm)
    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == TIED | {layer_norm}
    weight = loaded.model.shared.weight
    assert weight.device.type == "cpu" and loaded.lm_head.weight is weight
    expected = loaded.config.embed_init_std or 32**-0.5  # the type's default embedding init (issue #53)
    assert abs(float(weight[1:].detach().std()) / expected - 1) < 0.2 and weight[PAD].abs().max() == 0
    assert torch.equal(loaded.get_parameter(layer_norm), torch.ones(32))
    other = {k: v for k, v in loaded.state_dict().items() if k not in TIED | {layer_norm}}
    for key, value in other.items():
        assert torch.equal(value, model.state_dict()[key]), key
    ids, mask = source_batch()
    assert torch.isfinite(loaded(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC).logits).all()

    marian_dir = tmp_path / "marian"
    MarianMTModel(MarianConfig(vocab_size=40, d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=64,
                               decoder_ffn_dim=64, pad_token_id=PAD)).save_pretrained(marian_dir)
    drop_keys(marian_dir, "model.shared.weight")
    _, marian_info = MarianMTModel.from_pretrained(marian_dir, output_loading_info=True)
    assert set(marian_info["missing_keys"]) == TIED  # the reference behaviour


# ----------------------------------------------------------------------------------------------------------------
# Left padding
# ----------------------------------------------------------------------------------------------------------------
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


def test_left_padded_labels_are_refused():
    """DataCollatorForSeq2Seq with a left-padding tokenizer pads the labels on the left; the shifted decoder input
    would then be [start, pad, ..., y1, ...] and train silently on it."""
    model = contract_model("soft", fit=False)
    ids, mask = source_batch()
    labels = torch.tensor([[5, 6, 7, 2], [-100, -100, 8, 2]])
    with pytest.raises(ValueError, match=r"`labels` row 1 .*-100.*padding_side='right'"):
        model(input_ids=ids, attention_mask=mask, labels=labels)
    model(input_ids=ids, attention_mask=mask, labels=torch.tensor([[5, 6, 7, 2], [8, 2, -100, -100]]))  # right: fine


# ----------------------------------------------------------------------------------------------------------------
# attn_implementation
# ----------------------------------------------------------------------------------------------------------------
def test_eager_attention_is_honoured_and_equals_sdpa(monkeypatch, tmp_path):
    model = contract_model("soft", fit=False).double()
    ids, mask = source_batch()
    reference = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC).logits
    model.set_attn_implementation("eager")

    def fused(*args, **kwargs):
        raise AssertionError("the fused kernel ran under attn_implementation='eager'")

    with monkeypatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", fused)
        eager = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC).logits
    torch.testing.assert_close(eager, reference, rtol=0, atol=1e-10)
    model.save_pretrained(tmp_path)
    assert AutoModelForSeq2SeqLM.from_pretrained(tmp_path, attn_implementation="eager").config._attn_implementation \
        == "eager"


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_set_attn_implementation_eager_is_honoured_by_every_model_type(name):
    """As on transformers' MarianMTModel, ``set_attn_implementation("eager")`` switches the model (issue #52: gaussian
    and hybrid stayed on "sdpa" with a logged warning only): the config says so, every soft attention module writes Eq. 1
    out (torch's fused kernel no longer runs) and the output is the "sdpa" model's."""
    marian = MarianMTModel(MarianConfig(**{k: v for k, v in tiny_kwargs().items() if k in MarianConfig().to_dict()}))
    marian.set_attn_implementation("eager")
    assert marian.config._attn_implementation == "eager"  # the reference
    model = contract_model(name, fit=False).double()
    assert model.config._attn_implementation == "sdpa"
    ids, mask = source_batch()
    soft = [module for module in model.modules()  # soft attention (hard retrieval, a subclass, has its own kernel)
            if getattr(type(module), "attend", None) is SoftAttention.attend]
    with mock.patch.object(F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention) as fused:
        reference = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC).logits
        calls = fused.call_count
        assert (calls > 0) == bool(soft)  # the default runs the fused kernel wherever there is soft attention
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC).logits
        assert fused.call_count == calls
    assert model.config._attn_implementation == "eager"
    assert all(module.eager for module in model.modules() if isinstance(module, SoftAttention))
    torch.testing.assert_close(eager, reference, rtol=0, atol=1e-10)


@pytest.mark.parametrize("value", ["flash_attention_2", "flex_attention", "paged|eager", "kernels-community/flash-attn"])
def test_other_attn_implementations_are_refused_naming_the_allowed_ones(value, tmp_path):
    model = contract_model("soft", fit=False)
    with pytest.raises(ValueError, match=r"`attn_implementation`=.*allowed: \['sdpa', 'eager'\]"):
        model.set_attn_implementation(value)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"allowed: \['sdpa', 'eager'\]"):
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path, attn_implementation=value)
