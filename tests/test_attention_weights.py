"""Each attention kind's returned weights (``output_attentions``), module by module, in float64: they equal the
kind's formula (softmax by hand, the one-hot of the argmax of the raw scores or of the training sample, the Gaussian
closed form, the recurrent layer's distribution) and recompute the sub-layer's output from its values by hand; cached
decoding returns the same rows.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from common import tiny_kwargs
from hf_hardattn import GaussianConfig, RecurrentConfig, SoftTransformerConfig
from hf_hardattn.caches import HardAttnCache
from hf_hardattn.gaussian import GaussianAttention
from hf_hardattn.hard_retrieval import HardRetrievalAttention
from hf_hardattn.layers import SoftAttention
from hf_hardattn.recurrent import RECURRENT_VARIANTS, RecurrentCrossAttention


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
