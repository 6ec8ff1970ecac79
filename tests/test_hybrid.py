"""Hybrid model (self-attention encoder + GRU decoder): attention functions against naive references, the GRU
against torch.nn.GRUCell, step loop == teacher forcing, and the HF-integration contract of tests/common.py."""

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from common import (GROUPED_MODES, beam_result, check_cache_equivalence, check_grouped_memory, check_padded_batch,
                    check_remote_code, check_save_load, check_trainer, fitted, source_batch, tiny_kwargs)
from hf_hardattn import HardAttnCache, HybridConfig, HybridForConditionalGeneration

KINDS = ("additive", "dot", "multihead")


def make(**kw):
    kw = {"decoder_layers": 1, "rnn_hidden_size": 48, **kw}
    return HybridForConditionalGeneration(HybridConfig(**tiny_kwargs(**kw)))


def randomized(model, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()


_FITTED = {}


def fitted_model(kind):
    """Fitted once per kind and shared by the tests (a 1-layer encoder and 100 steps keep the file fast; every check
    still asserts non-degenerate outputs)."""
    if kind not in _FITTED:
        torch.manual_seed(0)  # the same initial weights whichever test asks first
        _FITTED[kind] = fitted(make(rnn_attention=kind, encoder_layers=1), steps=100)
    return _FITTED[kind]


# ---- attention functions vs naive per-element references ------------------------------------------------------------
def naive_attention(attention, kind, query_state, memory, mask, fused_query):
    """Loops over batch rows and source positions, from the raw parameters: contexts [B, d], probabilities of every
    head [B, heads, S]."""
    batch, length, d = memory.shape
    contexts, all_probs = [], []
    for b in range(batch):
        visible = [j for j in range(length) if mask[b, j]]
        if kind == "additive":
            v = attention.score.weight[0]
            scores = [v @ torch.tanh(fused_query[b] + attention.key_proj.weight @ memory[b, j]) for j in visible]
        elif kind == "dot":
            scores = [query_state[b] @ (attention.key_proj.weight @ memory[b, j]) / math.sqrt(query_state.shape[-1])
                      for j in visible]
        if kind in ("additive", "dot"):
            weights = torch.softmax(torch.stack(scores), 0)
            context = sum(w * memory[b, j] for w, j in zip(weights, visible))
            probs = torch.zeros(1, length)
            probs[0, visible] = weights
        else:
            heads, hd = attention.num_heads, attention.head_dim
            kv = [attention.kv_proj.weight @ memory[b, j] + attention.kv_proj.bias for j in range(length)]
            outs, probs = [], torch.zeros(heads, length)
            for h in range(heads):
                q = fused_query[b, h * hd : (h + 1) * hd]
                scores = torch.stack([q @ kv[j][h * hd : (h + 1) * hd] / math.sqrt(hd) for j in visible])
                weights = torch.softmax(scores, 0)
                outs.append(sum(w * kv[j][d + h * hd : d + (h + 1) * hd] for w, j in zip(weights, visible)))
                probs[h, visible] = weights
            context = attention.out_proj.weight @ torch.cat(outs) + attention.out_proj.bias
        contexts.append(context)
        all_probs.append(probs)
    return torch.stack(contexts), torch.stack(all_probs)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_equals_naive_reference(kind):
    torch.manual_seed(0)
    decoder = randomized(make(rnn_attention=kind)).model.decoder
    memory = torch.randn(2, 5, 32)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()
    state = torch.randn(2, 48)
    hidden = decoder.hidden_size
    fused_query = decoder.hidden_projs[-1](state)[:, 3 * hidden :]  # the query rows of the fused projection
    keys, values = decoder.attention.source(memory)
    query = fused_query if decoder.attention.query_size else state
    with torch.no_grad():
        context, probs = decoder.attention.attend(query, keys, values, mask)
        ref_context, ref_probs = naive_attention(decoder.attention, kind, state, memory, mask, fused_query)
    torch.testing.assert_close(context, ref_context, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-6)
    assert probs[1, :, 3:].abs().max() == 0  # padding gets no weight
    assert probs.std() > 0.05  # far from uniform: the comparison could fail


@pytest.mark.parametrize("kind", KINDS)
def test_hard_contexts_equal_attention_on_one_position(kind):
    """Masking all but source position j makes the attention one-hot on j; its context must be hard_contexts[:, j]."""
    decoder = randomized(make(rnn_attention=kind)).model.decoder
    memory, state = torch.randn(2, 4, 32), torch.randn(2, 48)
    keys, values = decoder.attention.source(memory)
    fused = decoder.hidden_projs[-1](state)[:, 3 * decoder.hidden_size :]
    query = fused if decoder.attention.query_size else state
    with torch.no_grad():
        hard = decoder.hard_contexts(memory)
        for j in range(4):
            mask = torch.zeros(2, 4, dtype=torch.bool)
            mask[:, j] = True
            context, _ = decoder.attention.attend(query, keys, values, mask)
            torch.testing.assert_close(hard[:, j], context, rtol=1e-5, atol=1e-6)


def test_gru_equals_torch_gru_cell():
    """The fused step equals torch.nn.GRUCell with W_ih = [W_e | W_c] and W_hh = the gate rows of the fused matrix."""
    decoder = randomized(make()).model.decoder
    hidden = decoder.hidden_size
    cell = torch.nn.GRUCell(32 + 32, hidden)
    with torch.no_grad():
        cell.weight_ih.copy_(torch.cat([decoder.input_projs[0].weight, decoder.context_proj.weight], 1))
        cell.bias_ih.copy_(decoder.input_projs[0].bias)
        cell.weight_hh.copy_(decoder.hidden_projs[0].weight[: 3 * hidden])
        cell.bias_hh.copy_(decoder.hidden_projs[0].bias[: 3 * hidden])
        memory, state, embedding = torch.randn(2, 5, 32), torch.randn(2, hidden), torch.randn(2, 32)
        keys, values = decoder.attention.source(memory)
        (new,), context, _ = decoder.step(decoder.input_projs[0](embedding), [state], keys, values)
        torch.testing.assert_close(new, cell(torch.cat([embedding, context], 1), state), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(new, state, atol=1e-2)


@pytest.mark.parametrize("kind,layers", [("additive", 1), ("dot", 2), ("multihead", 3)])
def test_step_loop_equals_teacher_forcing(kind, layers):
    model = randomized(make(rnn_attention=kind, decoder_layers=layers))
    ids, mask = source_batch()
    targets = torch.tensor([[1, 5, 9, 4, 7, 30, 2], [1, 8, 6, 12, 2, 0, 0]])
    with torch.no_grad():
        memory = model.model.encoder(ids, mask).last_hidden_state
        full = model.decoder_outputs(targets, memory, mask)
        cache, steps = HardAttnCache(), []
        for t in range(targets.shape[1]):
            steps.append(model.decoder_outputs(targets[:, t : t + 1], memory, mask, cache=cache))
    assert cache.get_seq_length() == targets.shape[1] and set(cache.states) == {f"gru.{l}" for l in range(layers)}
    for field in ("readout", "states", "contexts", "attentions"):
        stepped = torch.cat([getattr(s, field) for s in steps], 2 if field == "attentions" else 1)
        torch.testing.assert_close(stepped, getattr(full, field), rtol=1e-5, atol=1e-5)
    heads = 4 if kind == "multihead" else 1
    assert full.attentions.shape == (2, heads, 7, 7) and full.attentions[1, ..., 5:].abs().max() == 0
    torch.testing.assert_close(full.attentions.sum(-1), torch.ones(2, heads, 7))
    # the logits really differ by position and row (the comparison could fail)
    assert full.readout.std(1).mean() > 0.05


# ---- HF integration (tests/common.py) -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_cache_equals_no_cache(kind):
    check_cache_equivalence(fitted_model(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_padded_batch_equals_single(kind):
    check_padded_batch(fitted_model(kind))


@pytest.mark.parametrize("mode", sorted(GROUPED_MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_grouped_memory_equals_the_expanded_memory(kind, mode):
    """Beams of a sentence read its one row of source keys/values and initial state (HybridDecoder.forward)."""
    check_grouped_memory(fitted_model(kind), mode)


def test_beam_search_needs_state_reordering(monkeypatch):
    """Negative control: if reorder_cache skips the GRU states, beam search outputs change."""
    model = fitted_model("additive")
    _, scores = beam_result(model)

    def reorder_keys_only(self, beam_idx):
        self.self_attention_cache.reorder_cache(beam_idx)

    monkeypatch.setattr(HardAttnCache, "reorder_cache", reorder_keys_only)
    _, broken_scores = beam_result(model)
    assert not torch.allclose(scores, broken_scores, atol=1e-4), (scores, broken_scores)


def test_save_load(tmp_path):
    reloaded = check_save_load(fitted_model("multihead"), tmp_path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.shared.weight.data_ptr()


def test_remote_code_fresh_process(tmp_path):
    check_remote_code(fitted_model("additive"), tmp_path)


def test_trainer(tmp_path):
    check_trainer(make(rnn_attention="dot", encoder_layers=1), tmp_path)


def test_init_weights_covers_gru_on_meta_device(tmp_path):
    """from_pretrained builds on the meta device; weights missing from the checkpoint are made by _init_weights: the
    GRU's recurrent gate blocks must come out orthogonal, the other matrices finite and non-zero."""
    model = make(rnn_attention="multihead")
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    dropped = [k for k in state if "model.decoder." in k and "embed_tokens" not in k]
    save_file({k: v for k, v in state.items() if k not in dropped}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    # (the file was replaced on purpose: its recorded sha256 no longer applies)
    reloaded = HybridForConditionalGeneration.from_pretrained(tmp_path, verify_checksums=False)
    params = dict(reloaded.named_parameters())
    for name in dropped:
        assert torch.isfinite(params[name]).all(), name
        if params[name].dim() == 2:  # biases start at zero
            assert params[name].abs().sum() > 0, name
    weight = reloaded.model.decoder.hidden_projs[0].weight
    for gate in range(3):
        block = weight[gate * 48 : (gate + 1) * 48]
        torch.testing.assert_close(block @ block.T, torch.eye(48), atol=1e-4, rtol=0)


def test_embedding_size_other_than_d_model_stays_tied():
    model = make(rnn_embedding_size=24)
    assert model.model.decoder.embed_in.weight.shape == (24, 32)
    assert model.lm_head.weight.data_ptr() == model.model.shared.weight.data_ptr()
    assert model.model.decoder.embed_tokens.weight.data_ptr() == model.model.shared.weight.data_ptr()
    ids, mask = source_batch()
    assert model(input_ids=ids, attention_mask=mask, labels=ids).logits.shape == (2, 7, 40)


@pytest.mark.parametrize("bad", [dict(rnn_attention="bilinear"), dict(cross_attention="soft"),
                                 dict(rnn_hidden_size=0), dict(decoder_attention=["soft"])])
def test_bad_config_raises(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        HybridConfig(**tiny_kwargs(decoder_layers=1, **bad))
