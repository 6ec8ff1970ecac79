"""Hybrid model (self-attention encoder + RNN decoder): attention functions against naive references, the GRU
against torch.nn.GRUCell, both decoder styles (bahdanau / luong with input feeding) and both cells (GRU / LSTM) against
the independent decoder of tests/rnn_reference.py (float64), step loop == teacher forcing, the cache's per-step
states, and the HF-integration contract of tests/common.py."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM

from common import (GROUPED_MODES, beam_result, check_cache_equivalence, check_grouped_memory, check_padded_batch,
                    check_remote_code, check_save_load, check_trainer, fitted, source_batch, tiny_kwargs)
from hf_hardattn import HardAttnCache, HybridConfig, HybridForConditionalGeneration
from hf_hardattn.registry import model_classes
from rnn_reference import naive_rnn_decoder

KINDS = ("additive", "dot", "multihead")
LUONG = dict(rnn_decoder_style="luong", rnn_cell="lstm")  # the beam-joint paper's decoder


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
    still asserts non-degenerate outputs). ``"luong"``: the Luong-style 2-layer LSTM decoder with dot attention."""
    if kind not in _FITTED:
        torch.manual_seed(0)  # the same initial weights whichever test asks first
        kw = dict(rnn_attention="dot", decoder_layers=2, **LUONG) if kind == "luong" else dict(rnn_attention=kind)
        _FITTED[kind] = fitted(make(encoder_layers=1, **kw), steps=100)
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


STEP_CASES = [("additive", 1, "bahdanau", "gru"), ("dot", 2, "bahdanau", "gru"), ("multihead", 3, "bahdanau", "gru"),
              ("dot", 2, "luong", "lstm"), ("multihead", 2, "luong", "gru"), ("additive", 1, "luong", "lstm"),
              ("additive", 2, "bahdanau", "lstm")]


@pytest.mark.parametrize("kind,layers,style,cell", STEP_CASES)
def test_step_loop_equals_teacher_forcing(kind, layers, style, cell):
    model = randomized(make(rnn_attention=kind, decoder_layers=layers, rnn_decoder_style=style, rnn_cell=cell))
    ids, mask = source_batch()
    targets = torch.tensor([[1, 5, 9, 4, 7, 30, 2], [1, 8, 6, 12, 2, 0, 0]])
    with torch.no_grad():
        memory = model.model.encoder(ids, mask).last_hidden_state
        full = model.model.decoder_outputs(targets, memory, mask)
        cache, steps = HardAttnCache(), []
        for t in range(targets.shape[1]):
            steps.append(model.model.decoder_outputs(targets[:, t : t + 1], memory, mask, cache=cache))
    gates = (4 if cell == "lstm" else 3) * 48
    expected = {f"{cell}.{l}": (2, 96 if cell == "lstm" else 48) for l in range(layers)}  # LSTM: [h; c]
    if style == "luong":
        expected.update({"luong.feed": (2, 32), "luong.gates": (2, gates)})  # h~_{t-1}, W_h s_{t-1} + b of the top
    assert cache.get_seq_length() == targets.shape[1]
    assert {name: tuple(state.shape) for name, state in cache.states.items()} == expected
    for field in ("readout", "states", "contexts", "attentions"):
        stepped = torch.cat([getattr(s, field) for s in steps], 2 if field == "attentions" else 1)
        torch.testing.assert_close(stepped, getattr(full, field), rtol=1e-5, atol=1e-5)
    heads = 4 if kind == "multihead" else 1
    assert full.attentions.shape == (2, heads, 7, 7) and full.attentions[1, ..., 5:].abs().max() == 0
    torch.testing.assert_close(full.attentions.sum(-1), torch.ones(2, heads, 7))
    # the logits really differ by position and row (the comparison could fail)
    assert full.readout.std(1).mean() > 0.05


REFERENCE_CASES = [("luong", "lstm", "dot", 2), ("luong", "gru", "additive", 1), ("bahdanau", "lstm", "dot", 2),
                   ("bahdanau", "gru", "additive", 1)]


@pytest.mark.parametrize("style,cell,kind,layers", REFERENCE_CASES)
def test_decoder_equals_independent_reference(style, cell, kind, layers):
    """Every output of the decoder (readout, top states, contexts, attention, log-probabilities) and the per-step
    states kept in the cache equal tests/rnn_reference.py's decoder (torch's own cells, the attention per equation,
    no fused or carried projections), float64. Luong: the attention is queried with s_t and h~_t is fed to the next
    step; bahdanau: queried with s_{t-1}, c_t fed into s_t."""
    model = randomized(make(rnn_attention=kind, decoder_layers=layers, rnn_decoder_style=style, rnn_cell=cell,
                            rnn_hidden_size=24)).double()
    ids, mask = source_batch()
    targets = torch.tensor([[1, 5, 9, 4, 7], [1, 8, 6, 2, 0]])
    with torch.no_grad():
        ref = naive_rnn_decoder(model, ids, mask, targets)
        memory = model.model.encoder(ids, mask).last_hidden_state
        cache = HardAttnCache()
        out = model.model.decoder_outputs(targets, memory, mask, cache=cache)
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=targets).logits
    for field in ("readout", "states", "contexts"):
        torch.testing.assert_close(getattr(out, field), ref[field], rtol=1e-10, atol=1e-12, msg=field)
    torch.testing.assert_close(out.attentions[:, 0], ref["probs"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(logits.log_softmax(-1), ref["log_probs"], rtol=1e-10, atol=1e-12)
    for l in range(layers):  # the last step's state of every layer; an LSTM keeps [h; c]
        state = cache.states[f"{cell}.{l}"]
        if l == layers - 1:
            torch.testing.assert_close(state[:, :24], ref["states"][:, -1], rtol=1e-10, atol=1e-12)
        if cell == "lstm":
            torch.testing.assert_close(state[:, 24:], ref["cells"][:, -1, l], rtol=1e-10, atol=1e-12)
            assert ref["cells"][:, -1, l].abs().max() > 0.05
    if style == "luong":
        torch.testing.assert_close(cache.states["luong.feed"], ref["readout"][:, -1], rtol=1e-10, atol=1e-12)
    assert ref["probs"].std() > 0.05 and out.readout.std(1).mean() > 0.05  # the comparison could fail


def test_luong_and_bahdanau_differ_on_the_same_weights():
    """The style is not a no-op: the same parameters give other attention weights (queried with s_t vs s_{t-1})."""
    ids, mask = source_batch()
    models = [randomized(make(rnn_attention="dot", rnn_decoder_style=style)) for style in ("luong", "bahdanau")]
    weights = [m(input_ids=ids, attention_mask=mask, decoder_input_ids=ids, output_attentions=True).cross_attentions[0]
               for m in models]
    assert not torch.allclose(weights[0], weights[1], atol=1e-3)


# ---- HF integration (tests/common.py) -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS + ("luong",))
def test_cache_equals_no_cache(kind):
    check_cache_equivalence(fitted_model(kind))


@pytest.mark.parametrize("kind", KINDS + ("luong",))
def test_padded_batch_equals_single(kind):
    check_padded_batch(fitted_model(kind))


@pytest.mark.parametrize("mode", sorted(GROUPED_MODES))
@pytest.mark.parametrize("kind", KINDS + ("luong",))
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


@pytest.mark.parametrize("skipped", ["lstm.0", "lstm.1", "luong.feed", "luong.gates"])
def test_luong_beam_search_reorders_every_state(monkeypatch, skipped):
    """Negative control per state of the Luong LSTM decoder: beam search reorders both layers' [h; c], the fed h~_{t-1}
    and the carried gate projections; leaving any one of them unreordered changes the beam scores."""
    model = fitted_model("luong")
    _, scores = beam_result(model)
    original = HardAttnCache.reorder_cache

    def reorder_all_but_one(self, beam_idx):
        kept = self.states.pop(skipped)
        original(self, beam_idx)
        self.states[skipped] = kept

    monkeypatch.setattr(HardAttnCache, "reorder_cache", reorder_all_but_one)
    _, broken_scores = beam_result(model)
    assert not torch.allclose(scores, broken_scores, atol=1e-4), (skipped, scores, broken_scores)


def test_save_load(tmp_path):
    reloaded = check_save_load(fitted_model("multihead"), tmp_path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.shared.weight.data_ptr()


def test_save_load_luong_and_a_config_from_before_the_fields(tmp_path):
    """The Luong LSTM model reloads with its style and cell; a saved config without `rnn_decoder_style` / `rnn_cell`
    (written before they existed) loads as the GRU Bahdanau-style decoder it was trained with."""
    reloaded = check_save_load(fitted_model("luong"), tmp_path / "luong")
    assert (reloaded.config.rnn_decoder_style, reloaded.config.rnn_cell) == ("luong", "lstm")
    old = fitted_model("additive")
    old.save_pretrained(tmp_path / "old")
    path = tmp_path / "old" / "config.json"
    config = json.loads(path.read_text())
    del config["rnn_decoder_style"], config["rnn_cell"]
    path.write_text(json.dumps(config))
    loaded = HybridForConditionalGeneration.from_pretrained(tmp_path / "old").eval()
    assert (loaded.config.rnn_decoder_style, loaded.config.rnn_cell) == ("bahdanau", "gru")
    ids, mask = source_batch()
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits,
                               old(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits)


def test_remote_code_fresh_process(tmp_path):
    check_remote_code(fitted_model("additive"), tmp_path)


def test_trainer(tmp_path):
    check_trainer(make(rnn_attention="dot", encoder_layers=1), tmp_path)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_init_weights_covers_the_rnn_on_meta_device(tmp_path, cell):
    """from_pretrained builds on the meta device; weights missing from the checkpoint are made by _init_weights: the
    RNN's recurrent gate blocks must come out orthogonal (3 GRU, 4 LSTM), an LSTM's forget-gate bias 1 (the others
    0), the other matrices finite and non-zero."""
    model = make(rnn_attention="multihead", rnn_cell=cell)
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
    gates = 4 if cell == "lstm" else 3
    for gate in range(gates):
        block = weight[gate * 48 : (gate + 1) * 48]
        torch.testing.assert_close(block @ block.T, torch.eye(48), atol=1e-4, rtol=0)
    bias = reloaded.model.decoder.hidden_projs[0].bias[: gates * 48].view(gates, 48)
    expected = torch.zeros(gates, 48)
    if cell == "lstm":
        expected[1] = 1.0  # [i, f, g, o]: forget_bias 1
    torch.testing.assert_close(bias, expected, rtol=0, atol=0)


def test_embedding_size_other_than_d_model_stays_tied():
    model = make(rnn_embedding_size=24)
    assert model.model.decoder.embed_in.weight.shape == (24, 32)
    assert model.lm_head.weight.data_ptr() == model.model.shared.weight.data_ptr()
    assert model.model.decoder.embed_tokens.weight.data_ptr() == model.model.shared.weight.data_ptr()
    ids, mask = source_batch()
    assert model(input_ids=ids, attention_mask=mask, labels=ids).logits.shape == (2, 7, 40)


@pytest.mark.parametrize("model_type, gates", [("hybrid_transformer", 3), ("beam_joint_rnn", 4)])  # GRU / LSTM
def test_rnn_hidden_size_defaults_to_twice_d_model(model_type, gates, tmp_path):
    """The hybrid paper's decoder state is 1024 for d_model 512; the default follows d_model at that ratio (it was
    1024 whatever d_model: 9.8M parameters for a d_model 32 hybrid against 44k for a soft Transformer of that size).
    The saved config.json holds the number (transformers writes every field that PreTrainedConfig lacks)."""
    config_class, model_class = model_classes(model_type)
    assert config_class(**tiny_kwargs(d_model=512)).rnn_hidden_size == 1024  # the paper's setting
    assert config_class(**tiny_kwargs(d_model=48, encoder_attention_heads=4)).rnn_hidden_size == 96
    config = config_class(**tiny_kwargs(decoder_layers=1))  # d_model 32
    assert config.rnn_hidden_size == 64
    decoder = model_class(config).model.decoder
    assert decoder.input_projs[0].weight.shape == (gates * 64, 32)  # one block of H rows per gate
    assert decoder.init_proj.weight.shape == (64, 32) and decoder.readout_proj.weight.shape == (32, 64 + 32)
    assert config_class(**tiny_kwargs(rnn_hidden_size=24)).rnn_hidden_size == 24  # an explicit size is kept
    model_class(config).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rnn_hidden_size"] == 64


@pytest.mark.parametrize("model_type", ["hybrid_transformer", "beam_joint_rnn"])
def test_a_saved_rnn_hidden_size_loads_as_saved_whatever_d_model(model_type, tmp_path):
    """A model saved under the old default (1024 at d_model 32, written to its config.json) loads as it was saved:
    the number in config.json wins over the default derived from d_model (tests/test_old_checkpoints.py: 8 at
    d_model 8)."""
    config_class, model_class = model_classes(model_type)
    torch.manual_seed(0)
    old = model_class(config_class(**tiny_kwargs(decoder_layers=1, rnn_hidden_size=1024))).eval()
    old.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rnn_hidden_size"] == 1024
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert loaded.config.rnn_hidden_size == 1024 and loaded.model.decoder.hidden_size == 1024
    ids, mask = source_batch()
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits,
                               old(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [dict(rnn_attention="bilinear"), dict(cross_attention="soft"),
                                 dict(rnn_hidden_size=0), dict(rnn_hidden_size=True), dict(rnn_hidden_size=32.0), dict(decoder_attention=["soft"]),
                                 dict(rnn_decoder_style="luong_feed"), dict(rnn_cell="rnn")])
def test_bad_config_raises(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        HybridConfig(**tiny_kwargs(decoder_layers=1, **bad))
