"""Hard-coded Gaussian attention (You et al., 2020): weights against hand computations, the three implementations
(Sec. 6.3) against independent references, the presets, cached decoding, HF integration and bad input."""

import math

import pytest
import torch

from common import (check_cache_equivalence, check_padded_batch, check_remote_code, check_save_load, check_trainer,
                    collate, copy_task, decode_step_by_step, fitted, tiny_kwargs, toy_tokenizer)
from hf_hardattn import GaussianConfig, GaussianForConditionalGeneration, fit_length_ratio
from hf_hardattn.gaussian import GaussianAttention
from hf_hardattn.soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration


def pdf(d, sigma=1.0):  # hand-written N(d; 0, sigma^2)
    return math.exp(-d * d / (2 * sigma * sigma)) / (sigma * math.sqrt(2 * math.pi))


def identity_attention(role, **kw):
    """A Gaussian layer whose value/output projections are the identity, so its output is the weights applied to
    its input."""
    config = GaussianConfig(**tiny_kwargs(**kw))
    attention = GaussianAttention(config, role, 0).eval()
    with torch.no_grad():
        for linear in (attention.v_proj, attention.out_proj):
            linear.weight.copy_(torch.eye(config.d_model))
            linear.bias.zero_()
    return attention


def weight_matrix(attention, length, mask=None, memory_length=None):
    """Row i = weights of head 0 for query i, read off the layer's output on one-hot inputs (feature j = key j)."""
    keys = memory_length or length
    eye = torch.zeros(1, keys, 32)
    eye[0, :, :keys] = torch.eye(keys)
    if attention.is_cross:
        out = attention(torch.zeros(1, length, 32), memory=eye, mask=mask)
    else:
        out = attention(eye, mask=mask)
    return out[0, :, :keys].detach()  # head 0 = features [0, head_dim)


# -- the weights ---------------------------------------------------------------------------------------------------
def test_footnote_example_and_borders():
    """Footnote 1: a head centred on a token gives [0.054, 0.242, 0.399, 0.242, 0.054] over a 5-token window; rows
    at the borders are cut and NOT renormalised (footnote 5)."""
    attention = identity_attention("encoder", encoder_offsets=[0])
    w = weight_matrix(attention, 5)
    assert [round(float(x), 3) for x in w[2]] == [0.054, 0.242, 0.399, 0.242, 0.054]
    expected = torch.tensor([[pdf(j - i) for j in range(5)] for i in range(5)])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    assert w[0].sum() < 0.95 and w[4].sum() < 0.95 and w[1].sum() < 0.99  # cut at the borders, not renormalised


def test_offsets_padding_and_causality():
    """Encoder heads (l, r) = i-1, i+1 are duplicated over 4 heads; padded keys get weight 0 (no renormalisation);
    decoder heads (l, c) see nothing to their right."""
    enc = identity_attention("encoder")
    assert enc.offsets == (-1, 1, -1, 1)
    mask = torch.tensor([[True] * 4 + [False] * 2])[:, None, None, :]
    w = weight_matrix(enc, 6, mask=mask)  # head 0: centred at i - 1
    expected = torch.tensor([[pdf(j - (i - 1)) if j < 4 else 0.0 for j in range(6)] for i in range(6)])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    dec = identity_attention("decoder", decoder_offsets=[0])
    assert dec.offsets == (0, 0, 0, 0)
    w = weight_matrix(dec, 5)
    expected = torch.tensor([[pdf(j - i) if j <= i else 0.0 for j in range(5)] for i in range(5)])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)


def test_per_layer_and_per_head_offsets():
    config = GaussianConfig(**tiny_kwargs(encoder_offsets=[[-2, 2], [0, 1, -1, 3]], decoder_offsets=[-3]))
    model = GaussianForConditionalGeneration(config)
    assert model.model.encoder.layers[0].self_attn.module.offsets == (-2, 2, -2, 2)
    assert model.model.encoder.layers[1].self_attn.module.offsets == (0, 1, -1, 3)
    assert model.model.decoder.layers[1].self_attn.module.offsets == (-3, -3, -3, -3)


def test_conv_window_gives_truncated_kernel():
    """Sec. 6.3: window 3 -> kernel [0.242, 0.399, 0.242] and nothing outside; window 5 adds the 0.054 taps."""
    w = weight_matrix(identity_attention("encoder", encoder_offsets=[0], gaussian_implementation="conv"), 7)
    assert [round(float(x), 3) for x in w[3]] == [0, 0, 0.242, 0.399, 0.242, 0, 0]
    assert [round(float(x), 3) for x in w[0]] == [0.399, 0.242, 0, 0, 0, 0, 0]
    w5 = weight_matrix(identity_attention("encoder", encoder_offsets=[1], gaussian_implementation="conv",
                                          gaussian_window=5), 7)
    assert [round(float(x), 3) for x in w5[3]] == [0, 0, 0.054, 0.242, 0.399, 0.242, 0.054]


@pytest.mark.parametrize("role", ["encoder", "decoder", "cross"])
def test_index_equals_gathering_shifted_values(role):
    """Sec. 6.3 'indexing': each head copies the value row at its centre (zero outside the sentence / in the
    future); reference built by explicit indexing, with random projections."""
    torch.manual_seed(0)
    offsets = {"encoder": dict(encoder_offsets=[-1, 1, 0, 2]), "decoder": dict(decoder_offsets=[-1, 0, -2, -1]),
               "cross": dict(cross_offsets=[-1, 0, 1, 2], length_ratio=1.5)}[role]
    attention = GaussianAttention(GaussianConfig(**tiny_kwargs(gaussian_implementation="index", **offsets)), role, 0)
    hidden, memory = torch.randn(2, 6, 32), torch.randn(2, 9, 32)
    out = attention(hidden, memory=memory if role == "cross" else None)
    values = attention.v_proj(memory if role == "cross" else hidden).view(2, -1, 4, 8)
    ref = torch.zeros(2, 6, 4, 8)
    for h, o in enumerate(attention.offsets):
        for i in range(6):
            c = math.floor(1.5 * i + o) if role == "cross" else i + o
            if 0 <= c < values.shape[1]:
                ref[:, i, h] = values[:, c, h]
    torch.testing.assert_close(out, attention.out_proj(ref.reshape(2, 6, 32)), atol=1e-6, rtol=1e-5)


def test_hc_all_centres_follow_gamma():
    """Sec. 3.2: cross heads centred at floor(gamma*i - 1), floor(gamma*i), floor(gamma*i + 1) of the source."""
    for gamma in (0.7, 1.0, 2.5):
        for offset in (-1, 0, 1):
            w = weight_matrix(identity_attention("cross", cross_offsets=[offset], length_ratio=gamma), 6,
                              memory_length=20)
            centres = [math.floor(gamma * i + offset) for i in range(6)]
            expected = torch.tensor([[pdf(j - c) for j in range(20)] for c in centres])
            torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
            assert [int(row.argmax()) for row in w] == [max(c, 0) for c in centres]


def test_fit_length_ratio_uses_tokenizer_and_updates_model():
    data = {"source": ["t4 t5 t6 t7", "t8 t9"], "target": ["t4 t5", "t6"]}
    tokenizer = toy_tokenizer()
    expected = (4 + 2) / (2 + 1)  # the toy tokenizer adds no special tokens
    model = GaussianForConditionalGeneration(GaussianConfig.preset("hc-all", **tiny_kwargs()))
    gamma = fit_length_ratio(model, data, tokenizer)
    assert gamma == pytest.approx(expected) and model.config.length_ratio == pytest.approx(expected)
    cross = model.model.decoder.layers[0].cross_attn.module
    assert cross.gamma == pytest.approx(expected)
    config = GaussianConfig.preset("hc-all", **tiny_kwargs())
    assert fit_length_ratio(config, data, tokenizer) == pytest.approx(expected) == config.length_ratio


def cross_parameter_count(layer):
    return sum(p.numel() for n, p in layer.named_parameters() if n.startswith("cross_attn."))


def test_sh_x_has_cross_attention_only_in_last_layer():
    config = GaussianConfig.preset("sh-x", **tiny_kwargs(decoder_layers=3))
    model = GaussianForConditionalGeneration(config)
    layers = model.model.decoder.layers
    assert [cross_parameter_count(layer) for layer in layers[:-1]] == [0, 0]
    assert all(layer.cross_attn is None for layer in layers[:-1])
    last = layers[-1].cross_attn.module
    assert (last.num_heads, last.head_dim) == (1, 32)  # one learned full-width head
    assert cross_parameter_count(layers[-1]) == 4 * 32 * 32 + 4 * 32 + 2 * 32  # q, kv, out + LayerNorm
    # no query/key projections in any hard-coded head
    names = [n for n, _ in model.named_parameters() if "self_attn.module" in n]
    assert names and all(".v_proj." in n or ".out_proj." in n for n in names)
    hc_sa = GaussianForConditionalGeneration(GaussianConfig.preset("hc-sa", **tiny_kwargs(decoder_layers=3)))
    assert all(cross_parameter_count(layer) > 0 for layer in hc_sa.model.decoder.layers)


# -- cached decoding -----------------------------------------------------------------------------------------------
def step_by_step(model, ids, mask, target):
    """Decoder states fed one token at a time through the cache, and all at once without it."""
    encoded = model.get_encoder()(ids, mask)
    full = model(encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=target, use_cache=False).logits
    return full, *decode_step_by_step(model, target, encoder_outputs=encoded, attention_mask=mask)


@pytest.mark.parametrize("implementation,sigma", [("full", 1.0), ("full", 2.0), ("conv", 1.0), ("index", 1.0)])
def test_cached_windowed_step_matches_full_sequence(implementation, sigma):
    """A cached step reads only the heads' reach (full: weights >= 1e-6 of the peak); on long sequences the output
    equals the whole-prefix computation within fp32 tolerance, and the kept value rows stay bounded."""
    torch.manual_seed(0)
    model = GaussianForConditionalGeneration(GaussianConfig.preset(
        "hc-all", **tiny_kwargs(gaussian_implementation=implementation, gaussian_sigma=sigma, length_ratio=1.3,
                                max_position_embeddings=128))).eval()
    ids = torch.randint(4, 40, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    target = torch.randint(4, 40, (2, 32))
    with torch.no_grad():
        full, cached, cache = step_by_step(model, ids, mask, target)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
    attention = model.model.decoder.layers[0].self_attn.module
    radius = {"full": math.floor(sigma * math.sqrt(2 * math.log(1e6))), "conv": 1, "index": 0}[implementation]
    assert attention.lookback == radius + 1  # offsets (l, c) = (-1, 0)
    assert cache.states["gaussian.0"].shape[2] == attention.lookback < target.shape[1]
    assert cache.self_attention_cache.get_seq_length() == 0  # no whole-prefix key/value cache


def test_kind_works_in_any_role_of_a_plain_config():
    """'gaussian' with the skeleton's own config (defaults sigma 1, full) in every role, mixed with soft layers."""
    config = SoftTransformerConfig(**tiny_kwargs(encoder_attention=["gaussian", "soft"],
                                                 decoder_attention=["soft", "gaussian"], cross_attention="gaussian"))
    model = fitted(SoftTransformerForConditionalGeneration(config), steps=100)
    check_cache_equivalence(model)


# -- HF integration for the paper's three configurations ------------------------------------------------------------
PRESET_KWARGS = {"hc-sa": {}, "hc-all": dict(length_ratio=1.0), "sh-x": {}}


def make(preset, **kw):
    return GaussianForConditionalGeneration(GaussianConfig.preset(preset, **tiny_kwargs(**PRESET_KWARGS[preset], **kw)))


@pytest.fixture(scope="module", params=[("hc-sa", "full"), ("hc-all", "conv"), ("sh-x", "full"), ("hc-sa", "index")],
                ids=lambda p: "-".join(p))
def trained(request):
    preset, implementation = request.param
    torch.manual_seed(0)  # module-scoped: built before the per-test seed (conftest), so seeded here
    return fitted(make(preset, gaussian_implementation=implementation))


def test_cache_equals_no_cache(trained):
    check_cache_equivalence(trained)


def test_padded_batch_equals_single(trained):
    check_padded_batch(trained)


def test_save_load(trained, tmp_path):
    reloaded = check_save_load(trained, tmp_path)
    for field in ("encoder_attention", "decoder_attention", "cross_attention", "gaussian_implementation",
                  "encoder_offsets", "decoder_offsets", "cross_offsets", "length_ratio", "cross_attention_heads"):
        assert getattr(reloaded.config, field) == getattr(trained.config, field) or list(
            getattr(reloaded.config, field)) == list(getattr(trained.config, field))


@pytest.mark.parametrize("preset", ["hc-all", "sh-x"])  # hc-sa's soft cross layers are the foundation's
def test_remote_code_fresh_process(preset, tmp_path):
    check_remote_code(fitted(make(preset)), tmp_path)


def test_trainer_lowers_loss(tmp_path):  # the foundation's tests already run the Trainer with soft cross-attention
    check_trainer(make("sh-x"), tmp_path)


def test_hc_all_learns_a_monotone_copy():
    """hc-all's cross-attention is a fixed diagonal (gamma = 1), so it cannot learn the reversal task of
    check_trainer; it must learn the monotone copy task (target = source)."""
    rows = [dict(r, labels=r["input_ids"]) for r in copy_task(60 * 16, seed=3)]
    model = make("hc-all").train()
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    losses = []
    for step in range(60):
        loss = model(**collate(rows[step * 16:(step + 1) * 16])).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    (dict(encoder_offsets=[[-1, 1]] * 3), "encoder_offsets"),  # 3 layer lists, 2 layers
    (dict(encoder_offsets=[-1, 1, 0, 2, 3]), "encoder_offsets"),  # 5 offsets, 4 heads
    (dict(encoder_offsets=[[-1, 1], []]), "encoder_offsets"),
    (dict(encoder_offsets="l,r"), "encoder_offsets"),
    (dict(encoder_offsets=[-1, 0.5]), "encoder_offsets"),
    (dict(decoder_offsets=[-1, 1]), "decoder_offsets"),  # causal: no positive offsets
    (dict(cross_attention="gaussian", cross_offsets=[[0], [0], [0]]), "cross_offsets"),
    (dict(gaussian_sigma=0), "gaussian_sigma"),
    (dict(gaussian_sigma=-1.0), "gaussian_sigma"),
    (dict(gaussian_window=4), "gaussian_window"),
    (dict(gaussian_window=0), "gaussian_window"),
    (dict(length_ratio=0.0), "length_ratio"),
    (dict(length_ratio=-2), "length_ratio"),
    (dict(gaussian_implementation="sparse"), "gaussian_implementation"),
    (dict(cross_attention_heads=3), "cross_attention_heads"),
])
def test_bad_input_raises_clear_error(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GaussianConfig(**tiny_kwargs(**kwargs))


def test_bad_preset_and_plain_config_errors():
    with pytest.raises(ValueError, match="name"):
        GaussianConfig.preset("hc-none")
    with pytest.raises(ValueError, match="gaussian_sigma"):
        GaussianAttention(SoftTransformerConfig(**tiny_kwargs(gaussian_sigma=-1)), "encoder", 0)
    with pytest.raises(ValueError, match="is empty"):
        fit_length_ratio(GaussianConfig(**tiny_kwargs()), {"source": [], "target": []}, toy_tokenizer())
    # sh-x cross_offsets are irrelevant for its soft cross layer: 3 offsets for 1 head is fine there
    assert GaussianConfig.preset("sh-x", **tiny_kwargs()).cross_attention_heads == 1
    with pytest.raises(ValueError, match="cross_offsets"):
        GaussianConfig.preset("sh-x", **tiny_kwargs(cross_attention="gaussian"))
