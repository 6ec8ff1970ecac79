"""The papers' recipes: the Lipschitz-constrained init of the hard-retrieval paper (config init_std="lipschitz"), the
placement of attention dropout on hard retrieval (config retrieval_dropout), checkpoint averaging, convergence by
patience and a stage that continues the previous one's optimizer (hf_hardattn.tools.training)."""

import itertools
import math

import pytest
import torch
from torch import nn

import hf_hardattn  # noqa: F401
from hf_hardattn import HardRetrievalConfig, HardRetrievalForConditionalGeneration
from hf_hardattn.hard_retrieval import HardRetrievalAttention, sampled_retrieval
from hf_hardattn.soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration

SIZES = dict(vocab_size=500, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256)


# ----------------------------------------------------------------------------------------------------------------
# init_std="lipschitz"
# ----------------------------------------------------------------------------------------------------------------
def uniform_bound_checks(weight: torch.Tensor, bound: float):
    """Every entry inside [-bound, bound], the largest near the bound and the std that of U(-bound, bound),
    bound / sqrt(3), within sampling error (float64)."""
    w = weight.detach().double().flatten()
    assert w.abs().max().item() <= bound * (1 + 1e-6)
    assert w.abs().max().item() > 0.97 * bound
    std = bound / math.sqrt(3)
    # the sample std of n uniform draws has a relative standard error of about sqrt(0.2 / n) (kurtosis 1.8)
    assert abs(w.std().item() - std) < 5 * std * math.sqrt(0.2 / w.numel()), (w.std().item(), std)
    assert abs(w.mean().item()) < 5 * std / math.sqrt(w.numel())


def test_lipschitz_init_is_the_authors_formula():
    """Xu et al. 2020a (hfxunlp/transformer init_model_params_lipschitz): every linear weight
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the embeddings U(-sqrt(2 / (V + d)), +), biases 0, norms 1 / 0, padding row 0;
    the tied output layer is the embedding."""
    torch.manual_seed(0)
    model = HardRetrievalForConditionalGeneration(HardRetrievalConfig(**SIZES, init_std="lipschitz",
                                                                      embed_init_std=None))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not model.lm_head]
    assert len(linears) == 11  # encoder 4, decoder 7
    for linear in linears:
        uniform_bound_checks(linear.weight, 1 / math.sqrt(linear.in_features))  # fc2: fan-in 256, the others 64
        if linear.bias is not None:
            assert not linear.bias.any()
    shared = model.get_input_embeddings()
    rows = torch.cat([shared.weight[: shared.padding_idx], shared.weight[shared.padding_idx + 1:]])
    uniform_bound_checks(rows, math.sqrt(2 / (500 + 64)))
    assert not shared.weight[shared.padding_idx].any()
    assert model.lm_head.weight is shared.weight
    for norm in (m for m in model.modules() if isinstance(m, nn.LayerNorm)):
        assert (norm.weight == 1).all() and not norm.bias.any()


def test_lipschitz_init_embeddings_follow_a_given_embed_std_and_the_value_round_trips(tmp_path):
    torch.manual_seed(0)
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**SIZES, init_std="lipschitz",
                                                                          embed_init_std=0.02))
    assert model.get_input_embeddings().weight.std().item() == pytest.approx(0.02, rel=0.05)  # N(0, 0.02)
    uniform_bound_checks(model.model.encoder.layers[0].ffn.module.fc2.weight, 1 / 16)
    model.save_pretrained(tmp_path)
    assert type(model).from_pretrained(tmp_path).config.init_std == "lipschitz"
    with pytest.raises(ValueError, match="`init_std`.*lipschitz.*got 'lipschits'"):
        SoftTransformerConfig(**SIZES, init_std="lipschits")


# ----------------------------------------------------------------------------------------------------------------
# retrieval_dropout
# ----------------------------------------------------------------------------------------------------------------
def before_draw_distribution(probs, p):
    """The distribution of the index drawn after dropout on ``probs`` (by hand): over every keep mask m (each key kept
    with probability 1 - p), m * P / sum(m * P); a mask that keeps no probability draws from P."""
    expected = torch.zeros_like(probs)
    for mask in itertools.product((0.0, 1.0), repeat=len(probs)):
        m = torch.tensor(mask, dtype=probs.dtype)
        chance = math.prod((1 - p) if kept else p for kept in mask)
        kept = m * probs
        expected += chance * (kept / kept.sum() if kept.sum() > 0 else probs)
    return expected


@pytest.mark.parametrize("placement", ["before_draw", "after_draw"])
def test_dropout_placement_sets_the_drawn_distribution(placement):
    """before_draw (the authors' code): the draw follows the renormalised dropped probabilities' expectation, not P;
    after_draw: P itself, with the retrieved row dropped (zero or scaled by 1 / (1 - p))."""
    torch.manual_seed(0)
    p, n = 0.5, 200_000
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0], dtype=torch.float64)  # the last key masked
    values = torch.eye(4, dtype=torch.float64).unsqueeze(0).unsqueeze(0)  # value row j = e_j: the output names j
    out, index = sampled_retrieval(probs.expand(1, 1, n, 4), values, dropout=p, placement=placement)
    frequencies = torch.bincount(index.flatten(), minlength=4).double() / n
    expected = before_draw_distribution(probs, p) if placement == "before_draw" else probs
    assert (expected - probs).abs().max() > 0.05 or placement == "after_draw"  # the two placements differ here
    tolerance = 5 * (expected * (1 - expected) / n).sqrt() + 1e-12
    assert ((frequencies - expected).abs() <= tolerance).all(), (frequencies, expected)
    assert frequencies[3] == 0
    rows = out[0, 0]
    scale = rows.gather(-1, index[0, 0].unsqueeze(-1)).squeeze(-1)
    if placement == "before_draw":  # the drawn row is returned as it is
        assert (scale == 1).all()
    else:  # kept (scaled by 2) about half the time, dropped the rest
        assert set(scale.unique().tolist()) == {0.0, 2.0}
        assert (scale == 0).double().mean().item() == pytest.approx(p, abs=5 * math.sqrt(p * (1 - p) / n))


def test_before_draw_gradient_reaches_the_kept_probabilities_only():
    """The straight-through gradient (Eq. 8-9) goes to the dropped probabilities, through the dropout mask: a dropped
    probability gets none, a kept one (A^g V^T) / (1 - p)."""
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(2, 3, 5, 7, dtype=torch.float64), -1).requires_grad_()
    values = torch.randn(2, 3, 7, 4, dtype=torch.float64)
    grad_out = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    state = torch.get_rng_state()
    out, _ = sampled_retrieval(probs, values, dropout=0.4, placement="before_draw")
    out.backward(grad_out)
    torch.set_rng_state(state)
    keep = torch.nn.functional.dropout(torch.ones_like(probs), 0.4, True) > 0  # the same mask (same RNG state)
    empty = ~keep.any(-1, keepdim=True)
    expected = (grad_out @ values.transpose(-1, -2)) * torch.where(empty, 1.0, keep / 0.6)
    torch.testing.assert_close(probs.grad, expected)


def test_retrieval_dropout_reaches_the_modules_and_bad_values_are_refused():
    config = HardRetrievalConfig(**SIZES, attention_dropout=0.1, retrieval_dropout="before_draw")
    model = HardRetrievalForConditionalGeneration(config)
    placements = {m.dropout_placement for m in model.modules() if isinstance(m, HardRetrievalAttention)}
    assert placements == {"before_draw"}
    assert HardRetrievalConfig(**SIZES).retrieval_dropout == "after_draw"  # the default is unchanged
    # a soft model with one hard role reads the kind's setting too
    soft = SoftTransformerForConditionalGeneration(SoftTransformerConfig(
        **SIZES, cross_attention="hard_retrieval", retrieval_dropout="before_draw"))
    assert {m.dropout_placement for m in soft.modules() if isinstance(m, HardRetrievalAttention)} == {"before_draw"}
    with pytest.raises(ValueError, match="`retrieval_dropout`.*after_draw.*got 'before'"):
        HardRetrievalConfig(**SIZES, retrieval_dropout="before")
    with pytest.raises(ValueError, match="`retrieval_dropout`.*'during'"):
        SoftTransformerForConditionalGeneration(SoftTransformerConfig(**SIZES, cross_attention="hard_retrieval",
                                                                      retrieval_dropout="during"))
    with pytest.raises(ValueError, match="`placement`"):
        sampled_retrieval(torch.ones(1, 2), torch.ones(2, 1), 0.1, "before")
