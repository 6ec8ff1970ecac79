"""Hard retrieval attention (Xu et al.) against hand-written references of its equations."""

import math

import pytest
import torch

from common import fitted, run_generate, tiny_kwargs
from hf_hardattn import HardRetrievalConfig, HardRetrievalForConditionalGeneration
from hf_hardattn.hard_retrieval import (HardRetrieval, HardRetrievalAttention, gather_rows, inference_indices,
                                        sample_indices)

# chi-square critical values at p = 0.001 by degrees of freedom (a correct sampler fails 1 in 1000 runs; seeded here)
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}


def chi_square(counts, probs):
    """Pearson's statistic of ``counts`` [K] against the distribution ``probs`` [K] over its non-zero entries."""
    expected = probs.double() * counts.sum()
    visible = probs > 0
    return (((counts.double() - expected) ** 2)[visible] / expected[visible]).sum().item()


def _qkv(batch=2, heads=3, tq=4, tk=5, dim=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, t, dim, generator=g, dtype=torch.float64) for t in (tq, tk, tk)]


def test_forward_equals_hand_written_gather():
    _, _, v = _qkv()
    index = torch.randint(0, v.shape[2], (2, 3, 4), generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(torch.randn(2, 3, 4, 5, dtype=torch.float64), -1)
    out = HardRetrieval.apply(probs, v, index)
    expected = torch.empty(2, 3, 4, 6, dtype=torch.float64)
    for b in range(2):
        for h in range(3):
            for j in range(4):
                expected[b, h, j] = v[b, h, index[b, h, j]]  # Eq. 6
    assert torch.equal(out, expected)


def test_gradients_equal_eq9_eq10_computed_naively():
    _, _, v = _qkv(tq=7, tk=3)  # more queries than keys: several queries retrieve the same row
    probs = torch.softmax(torch.randn(2, 3, 7, 3, dtype=torch.float64), -1).requires_grad_()
    v = v.clone().requires_grad_()
    index = torch.randint(0, 3, (2, 3, 7), generator=torch.Generator().manual_seed(2))
    grad_out = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    HardRetrieval.apply(probs, v, index).backward(grad_out)
    grad_p = torch.zeros_like(probs)
    grad_v = torch.zeros_like(v)
    for b in range(2):
        for h in range(3):
            for j in range(7):
                for i in range(3):  # Eq. 9 (and Eq. 8: P^g = P_hard^g): element (j, i) = <A^g[j], V[i]>
                    grad_p[b, h, j, i] = (grad_out[b, h, j] * v[b, h, i]).sum()
                grad_v[b, h, index[b, h, j]] += grad_out[b, h, j]  # Eq. 10: sum over queries retrieving row i
    assert torch.allclose(probs.grad, grad_p)
    assert torch.allclose(v.grad, grad_v)


def test_sampling_never_hits_masked_positions_and_follows_probabilities():
    torch.manual_seed(0)
    probs = torch.tensor([0.1, 0.2, 0.0, 0.3, 0.4, 0.0])  # zeros = masked positions
    draws = sample_indices(probs.expand(10_000, 6))
    counts = torch.bincount(draws, minlength=6)
    assert counts[2] == 0 and counts[5] == 0
    chi2 = chi_square(counts, probs)
    assert chi2 < CHI2_999[3], chi2


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_training_draws_inside_attend_follow_the_scaled_softmax(dropout):
    """Many queries with the same scores, through the module's training path: the drawn keys follow
    P = softmax(q k^T / sqrt(d_k)) (Eq. 1-2, 4-5), written out here, with and without attention dropout (which acts
    after the draw). Scores chosen so that the sqrt(d_k) scale, a missing softmax or an argmax would each fail."""
    torch.manual_seed(0)
    attn = HardRetrievalAttention(HardRetrievalConfig(**tiny_kwargs(attention_dropout=dropout)), "cross", 0).train()
    d = attn.head_dim  # 8
    k = torch.zeros(1, 1, 5, d)
    k[0, 0, :, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    q = torch.zeros(20_000, 1, 1, d)
    q[..., 0] = 1.0
    v = torch.arange(5.0).view(1, 1, 5, 1).expand(1, 1, 5, d).clone() + 1  # value row i holds i + 1
    out = attn.attend(q, k.expand(20_000, 1, 5, d), v.expand(20_000, 1, 5, d), None, False)[:, 0, 0, 0]
    if dropout:
        kept = out != 0
        assert abs(kept.float().mean().item() - (1 - dropout)) < 0.02  # dropped rows are zero, kept ones scaled
        out = out[kept] * (1 - dropout)
    counts = torch.bincount(out.round().long() - 1, minlength=5)
    probs = torch.softmax(k[0, 0, :, 0] / math.sqrt(d), -1)
    chi2 = chi_square(counts, probs)
    assert chi2 < CHI2_999[4], (chi2, counts.tolist(), probs.tolist())


def test_training_path_with_heavy_dropout_never_samples_masked_positions():
    config = HardRetrievalConfig(**tiny_kwargs(attention_dropout=0.9))
    attn = HardRetrievalAttention(config, "decoder", 0).train()
    torch.manual_seed(0)
    q, k = (torch.randn(64, 4, 6, 8) for _ in range(2))
    v = torch.arange(1.0, 7.0).view(1, 1, 6, 1).expand(64, 4, 6, 8).clone()  # value row i holds i + 1
    key_padding = torch.ones(64, 1, 1, 6, dtype=torch.bool)
    key_padding[:, :, :, 4:] = False  # positions 4, 5 are padding
    for _ in range(20):
        out = attn.attend(q, k, v, key_padding, causal=True)[..., 0]
        kept = out != 0  # attention dropout zeroes a retrieved row (scaled by 10 otherwise)
        index = (out * 0.1).round().long() - 1
        query_pos = torch.arange(6).view(1, 1, 6).expand_as(index)
        assert (index[kept] <= query_pos[kept]).all(), "future position sampled"
        assert (index[kept] < 4).all(), "padding position sampled"


def test_inference_argmax_equals_training_probability_argmax():
    config = HardRetrievalConfig(**tiny_kwargs())
    attn = HardRetrievalAttention(config, "cross", 0)
    q, k, v = (t.float() for t in _qkv(tq=5, tk=7, dim=8, seed=3))
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[1, :, :, 5:] = False
    probs = attn.training_probabilities(q, k, mask, causal=False)  # Eq. 1-2 with scaling and softmax
    index = inference_indices(q, k, mask, causal=False)  # Eq. 11: raw scores, no softmax
    assert torch.equal(index, probs.argmax(-1))
    attn.eval()
    assert torch.equal(attn.attend(q, k, v, mask, False), gather_rows(v, probs.argmax(-1)))


def test_causal_inference_matches_explicit_mask():
    q, k, _ = _qkv(tq=5, tk=5, seed=4)
    causal = inference_indices(q, k, None, causal=True)
    scores = q @ k.transpose(-1, -2)
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
    assert torch.equal(causal, scores.argmax(-1))
    assert (causal <= torch.arange(5).view(1, 1, 5)).all()


def test_gradient_reaches_queries_keys_and_values_in_a_model():
    model = HardRetrievalForConditionalGeneration(HardRetrievalConfig(**tiny_kwargs())).train()
    ids = torch.tensor([[5, 6, 7, 2]])
    model(input_ids=ids, labels=torch.tensor([[8, 9, 2]])).loss.backward()
    for layer in model.model.decoder.layers:
        attention = layer.cross_attn.module
        assert attention.q_proj.weight.grad.abs().sum() > 0  # through the straight-through probabilities (Eq. 8-9)
        assert attention.kv_proj.weight.grad.abs().sum() > 0  # keys via P, values via Eq. 10


@pytest.fixture(scope="module")
def hard_trained():
    """A hard-retrieval model fitted on the reversal task, shared by the tests below (which copy it or read it)."""
    torch.manual_seed(0)  # module-scoped: built before the per-test seed (conftest), so seeded here
    return fitted(HardRetrievalForConditionalGeneration(HardRetrievalConfig(**tiny_kwargs())))


def test_decode_with_the_other_kind_shares_weights(hard_trained):
    """Table 4 of the paper: a hard-trained model decoded soft (and back) with the same parameters."""
    hard = hard_trained
    soft = hard.with_attention(decoder_attention="soft", cross_attention="soft")
    assert soft.config.attention_kinds("cross") == ["soft", "soft"]
    for (name, p), (name2, p2) in zip(hard.state_dict().items(), soft.state_dict().items()):
        assert name == name2 and torch.equal(p, p2)
    back = soft.with_attention(decoder_attention="hard_retrieval", cross_attention="hard_retrieval")
    assert torch.equal(run_generate(hard, "greedy", True), run_generate(back, "greedy", True))
    assert not torch.equal(run_generate(hard, "greedy", True), run_generate(soft, "greedy", True))
    with pytest.raises(ValueError, match="encoder_attention"):
        hard.with_attention(encoder_attention="bogus")
    with pytest.raises(ValueError, match="allowed"):
        hard.with_attention(self_attention="soft")


def test_load_with_a_kind_override(hard_trained, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    hard = hard_trained
    hard.save_pretrained(tmp_path)
    soft = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, cross_attention="soft", decoder_attention="soft").eval()
    reference = hard.with_attention(cross_attention="soft", decoder_attention="soft")
    assert torch.equal(run_generate(soft, "greedy", True), run_generate(reference, "greedy", True))
