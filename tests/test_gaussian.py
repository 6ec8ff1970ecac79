"""Hard-coded Gaussian attention (You et al., 2020): weights against hand computations, the three implementations
(Sec. 6.3) against independent references, the presets, cached decoding, HF integration and bad input."""

import json
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from common import (check_cache_equivalence, check_padded_batch, check_remote_code, check_save_load, check_trainer,
                    collate, copy_task, decode_step_by_step, fitted, tiny_kwargs, toy_tokenizer)
from hf_hardattn import GaussianConfig, GaussianForConditionalGeneration, fit_length_ratio
from hf_hardattn.gaussian import GaussianAttention
from hf_hardattn.caches import HardAttnCache
from hf_hardattn.soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration


def pdf(d, sigma=1.0):  # hand-written N(d; 0, sigma^2)
    return math.exp(-d * d / (2 * sigma * sigma)) / (sigma * math.sqrt(2 * math.pi))


def identity_attention(role, **kw):
    """A Gaussian layer whose value/output projections are the identity, so its output is the weights applied to
    its input. d_model 96, 4 heads of 24 features: up to 24 keys per head can be read off."""
    config = GaussianConfig(**tiny_kwargs(**{"d_model": 96, **kw}))
    attention = GaussianAttention(config, role, 0).eval()
    with torch.no_grad():
        for linear in (attention.v_proj, attention.out_proj):
            linear.weight.copy_(torch.eye(config.d_model))
            linear.bias.zero_()
    return attention


def weight_matrix(attention, length, mask=None, memory_length=None):
    """[H, Tq, Tk]: the weights of every head, read off the layer's output on one-hot inputs (feature h * hd + j of
    key j is 1 for every head h, so head h's output features [h * hd, h * hd + Tk) are its weights)."""
    keys, heads, head_dim = memory_length or length, attention.num_heads, attention.head_dim
    assert keys <= head_dim
    eye = torch.zeros(1, keys, heads * head_dim)
    for h in range(heads):
        eye[0, :, h * head_dim:h * head_dim + keys] = torch.eye(keys)
    if attention.is_cross:
        out = attention(torch.zeros(1, length, heads * head_dim), memory=eye, mask=mask)
    else:
        out = attention(eye, mask=mask)
    return out[0].detach().view(length, heads, head_dim)[..., :keys].transpose(0, 1)


# -- the weights ---------------------------------------------------------------------------------------------------
def hand_weights(offsets, queries, keys, centre=lambda i, o: i + o, kernel=pdf, causal=False, real_keys=None):
    """[H, Tq, Tk] by hand: head h's weight of key j for query i is kernel(j - centre(i, offsets[h])), 0 after i
    when ``causal``, 0 on keys >= ``real_keys`` (padding)."""
    return torch.tensor([[[0.0 if (causal and j > i) or (real_keys is not None and j >= real_keys)
                           else kernel(j - centre(i, o)) for j in range(keys)] for i in range(queries)]
                         for o in offsets])


def window(radius):  # conv's kernel: the density inside the window, 0 outside
    return lambda d: pdf(d) if abs(d) <= radius else 0.0


def test_footnote_example_and_borders():
    """Footnote 1: a head centred on a token gives [0.054, 0.242, 0.399, 0.242, 0.054] over a 5-token window; rows
    at the borders are cut and NOT renormalised (footnote 5); every head."""
    attention = identity_attention("encoder", encoder_offsets=[0])
    w = weight_matrix(attention, 5)
    assert [round(float(x), 3) for x in w[3, 2]] == [0.054, 0.242, 0.399, 0.242, 0.054]
    torch.testing.assert_close(w, hand_weights([0] * 4, 5, 5), atol=1e-6, rtol=0)
    assert w[:, 0].sum(-1).max() < 0.95 and w[:, 4].sum(-1).max() < 0.95 and w[:, 1].sum(-1).max() < 0.99


@pytest.mark.parametrize("implementation,kernel", [("full", pdf), ("conv", window(1)),
                                                   ("index", lambda d: float(d == 0))])
def test_offsets_padding_and_causality_of_every_head(implementation, kernel):
    """Four heads with four different offsets, each checked: encoder heads centred at i + o; padded keys get weight 0
    (no renormalisation); decoder heads see nothing to their right."""
    enc = identity_attention("encoder", encoder_offsets=[-1, 1, 0, 2], gaussian_implementation=implementation)
    mask = torch.tensor([[True] * 4 + [False] * 2])[:, None, None, :]
    expected = hand_weights([-1, 1, 0, 2], 6, 6, kernel=kernel, real_keys=4)
    torch.testing.assert_close(weight_matrix(enc, 6, mask=mask), expected, atol=1e-6, rtol=0)
    dec = identity_attention("decoder", decoder_offsets=[0, -1, -2, 0], gaussian_implementation=implementation)
    expected = hand_weights([0, -1, -2, 0], 7, 7, kernel=kernel, causal=True)
    torch.testing.assert_close(weight_matrix(dec, 7), expected, atol=1e-6, rtol=0)
    assert enc.offsets == (-1, 1, 0, 2) and dec.offsets == (0, -1, -2, 0)


def test_default_offsets_are_duplicated_over_the_heads():
    """Footnote 12: the paper's (l, r) / (l, c) / (l, c, r) patterns repeated to fill 4 heads; every head checked."""
    enc, dec = identity_attention("encoder"), identity_attention("decoder")
    cross = identity_attention("cross", length_ratio=1.0)
    assert (enc.offsets, dec.offsets, cross.offsets) == ((-1, 1, -1, 1), (-1, 0, -1, 0), (-1, 0, 1, -1))
    torch.testing.assert_close(weight_matrix(enc, 6), hand_weights(enc.offsets, 6, 6), atol=1e-6, rtol=0)
    torch.testing.assert_close(weight_matrix(dec, 6), hand_weights(dec.offsets, 6, 6, causal=True), atol=1e-6, rtol=0)
    torch.testing.assert_close(weight_matrix(cross, 6, memory_length=8), hand_weights(cross.offsets, 6, 8), atol=1e-6,
                               rtol=0)


def test_per_layer_and_per_head_offsets():
    config = GaussianConfig(**tiny_kwargs(encoder_offsets=[[-2, 2], [0, 1, -1, 3]], decoder_offsets=[-3]))
    model = GaussianForConditionalGeneration(config)
    assert model.model.encoder.layers[0].self_attn.module.offsets == (-2, 2, -2, 2)
    assert model.model.encoder.layers[1].self_attn.module.offsets == (0, 1, -1, 3)
    assert model.model.decoder.layers[1].self_attn.module.offsets == (-3, -3, -3, -3)


def test_conv_window_gives_truncated_kernel():
    """Sec. 6.3: window 3 -> kernel [0.242, 0.399, 0.242] and nothing outside; window 5 adds the 0.054 taps; every
    head, window 7 and sigma 2 too."""
    w = weight_matrix(identity_attention("encoder", encoder_offsets=[0], gaussian_implementation="conv"), 7)
    assert [round(float(x), 3) for x in w[1, 3]] == [0, 0, 0.242, 0.399, 0.242, 0, 0]
    assert [round(float(x), 3) for x in w[2, 0]] == [0.399, 0.242, 0, 0, 0, 0, 0]
    w5 = weight_matrix(identity_attention("encoder", encoder_offsets=[1], gaussian_implementation="conv",
                                          gaussian_window=5), 7)
    assert [round(float(x), 3) for x in w5[3, 3]] == [0, 0, 0.054, 0.242, 0.399, 0.242, 0.054]
    torch.testing.assert_close(w5, hand_weights([1] * 4, 7, 7, kernel=window(2)), atol=1e-6, rtol=0)
    w7 = weight_matrix(identity_attention("encoder", encoder_offsets=[-2, 0, 1, 3], gaussian_implementation="conv",
                                          gaussian_window=7, gaussian_sigma=2.0), 9)
    expected = hand_weights([-2, 0, 1, 3], 9, 9, kernel=lambda d: pdf(d, 2.0) if abs(d) <= 3 else 0.0)
    torch.testing.assert_close(w7, expected, atol=1e-6, rtol=0)


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


@pytest.mark.parametrize("implementation,kernel", [("full", pdf), ("conv", window(1)),
                                                   ("index", lambda d: float(d == 0))])
def test_hc_all_centres_follow_gamma(implementation, kernel):
    """Sec. 3.2: cross heads centred at floor(gamma*i + o) of the source, o = -1, 0, 1, 2 on the four heads."""
    for gamma in (0.7, 1.0, 2.5):
        attention = identity_attention("cross", cross_offsets=[-1, 0, 1, 2], length_ratio=gamma,
                                       gaussian_implementation=implementation)
        w = weight_matrix(attention, 8, memory_length=20)
        expected = hand_weights([-1, 0, 1, 2], 8, 20, centre=lambda i, o: math.floor(gamma * i + o), kernel=kernel)
        torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
        if implementation == "full":
            centres = [[math.floor(gamma * i + o) for i in range(8)] for o in (-1, 0, 1, 2)]
            assert w.argmax(-1).tolist() == [[min(max(c, 0), 19) for c in row] for row in centres]


# -- conv and index: banded, against the dense computation ----------------------------------------------------------
SETTINGS = {  # name -> config fields; per-head offsets all different
    "full": dict(gaussian_implementation="full"),
    "conv3": dict(gaussian_implementation="conv"),
    "conv5_sigma1.5": dict(gaussian_implementation="conv", gaussian_window=5, gaussian_sigma=1.5),
    "index": dict(gaussian_implementation="index"),
}
OFFSETS = dict(encoder_offsets=[-2, 1, 0, -1], decoder_offsets=[0, -1, -3, -2], cross_offsets=[-1, 0, 2, 1])


def reference_kernel(fields):
    """The implementation's kernel written from the paper (Eq. 2, Sec. 6.3), from the config fields."""
    sigma, radius = fields.get("gaussian_sigma", 1.0), (fields.get("gaussian_window", 3) - 1) // 2
    implementation = fields["gaussian_implementation"]
    if implementation == "index":
        return lambda d: float(d == 0)
    if implementation == "conv":
        return lambda d: pdf(d, sigma) if abs(d) <= radius else 0.0
    return lambda d: pdf(d, sigma)


def reference(fields, attention, hidden, memory=None, mask=None, gamma=None):
    """The dense computation, by hand in float64: W[b, h, i, j] = kernel(j - centre), centre i + o (self) or
    floor(gamma * i + o) + the row's leading padding (cross), 0 after i (decoder) and where ``mask`` hides key j;
    output = out_proj(merge(W @ v_proj(keys))). Returns (output, W)."""
    kernel, offsets = reference_kernel(fields), OFFSETS[f"{attention.role}_offsets"]
    keys = memory if attention.is_cross else hidden
    (batch, queries, width), length = hidden.shape, keys.shape[1]
    heads = len(offsets)
    weights = torch.zeros(batch, heads, queries, length, dtype=torch.float64)
    for b in range(batch):
        shift = 0
        if attention.is_cross and mask is not None:
            while not bool(mask[b, 0, 0, shift]):
                shift += 1
        for h, o in enumerate(offsets):
            for i in range(queries):
                centre = math.floor(gamma * i + o) + shift if attention.is_cross else i + o
                for j in range(length):
                    hidden_key = mask is not None and not bool(mask.expand(batch, 1, queries, length)[b, 0, i, j])
                    if not hidden_key and not (attention.role == "decoder" and j > i):
                        weights[b, h, i, j] = kernel(j - centre)
    values = (keys @ attention.v_proj.weight.T + attention.v_proj.bias).view(batch, length, heads, -1).transpose(1, 2)
    out = (weights @ values).transpose(1, 2).reshape(batch, queries, width)
    return out @ attention.out_proj.weight.T + attention.out_proj.bias, weights


def random_module(role, fields, gamma=1.3, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    config = GaussianConfig(**tiny_kwargs(**OFFSETS, **fields, length_ratio=gamma, attention_dropout=dropout))
    attention = GaussianAttention(config, role, 0).double()
    with torch.no_grad():
        for param in attention.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    return attention.eval()


def role_inputs(case, seed=1):
    """(role, hidden, memory, mask, causal): right-padded keys for the encoder and cross-attention, a left-padded
    source for 'cross_left', a padded decoder (mask = causal & padding, as the decoder builds it) for 'decoder_pad'."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 9, 32, generator=generator, dtype=torch.float64)
    memory = torch.randn(2, 11, 32, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([[11, 8], [9, 6]])  # real keys of (memory, hidden) per row
    if case == "encoder":
        return "encoder", hidden, None, (torch.arange(9) < lengths[:, 1:2])[:, None, None, :], False
    if case == "decoder":
        return "decoder", hidden, None, None, True
    if case == "decoder_pad":
        pad = (torch.arange(9) < lengths[:, 1:2])[:, None, None, :]
        return "decoder", hidden, None, torch.ones(9, 9, dtype=torch.bool).tril() & pad, False
    real = torch.arange(11) < lengths[:, :1]
    if case == "cross_left":
        real = torch.stack([real[0], real[1].flip(0)])  # row 1: 3 padded positions first
    return "cross", hidden, memory, real[:, None, None, :], False


CASES = ["encoder", "decoder", "decoder_pad", "cross", "cross_left"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("setting", SETTINGS)
def test_output_equals_the_dense_computation_in_float64(setting, case):
    """conv and index (banded: gathered value rows, no [Tq, Tk] matrix) give exactly the dense computation's output
    (hand-built weights @ values) in every role, with per-head offsets, padding (right and left) and the causal cut;
    full likewise. The weights returned by output_attentions are the hand-built ones and the same output."""
    fields = SETTINGS[setting]
    for gamma in (1.3, 0.6):
        role, hidden, memory, mask, causal = role_inputs(case)
        attention = random_module(role, fields, gamma)
        expected, weights = reference(fields, attention, hidden, memory, mask, gamma)
        torch.testing.assert_close(attention(hidden, memory=memory, mask=mask, causal=causal), expected, rtol=0,
                                   atol=1e-12)
        out, returned = attention(hidden, memory=memory, mask=mask, causal=causal, output_attentions=True)
        torch.testing.assert_close(returned, weights, rtol=0, atol=1e-12)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        if role != "cross":
            break


@pytest.mark.parametrize("case", ["decoder", "cross", "cross_left"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_cached_steps_equal_the_dense_computation(setting, case):
    """Cached decoding (HardAttnCache, one query per call, then the rest in one call): each step reads only the keys
    within reach (the last `lookback` value rows; the source slice around floor(gamma * i + o)) and gives the dense
    computation's row: exactly for conv and index, within the 1e-6-of-the-peak cut for full. gamma 2.5 carries the
    reach past the end of the source (no key left: output = out_proj's bias)."""
    fields = SETTINGS[setting]
    tolerance = 1e-6 if fields["gaussian_implementation"] == "full" else 1e-12
    for gamma in (1.3, 2.5):
        role, hidden, memory, mask, _ = role_inputs(case)
        attention = random_module(role, fields, gamma)
        expected, _ = reference(fields, attention, hidden, memory, mask, gamma)
        cache, steps = HardAttnCache(), []
        for t in range(6):
            steps.append(attention(hidden[:, t:t + 1], memory=memory, mask=mask, cache=cache))
            cache.seen_tokens += 1
        if role == "cross":
            steps.append(attention(hidden[:, 6:], memory=memory, mask=mask, cache=cache))
        else:  # the decoder's mask for 3 queries after 6 cached positions
            steps.append(attention(hidden[:, 6:], cache=cache, mask=torch.ones(3, 9, dtype=torch.bool).tril(6)))
        torch.testing.assert_close(torch.cat(steps, 1), expected, rtol=0, atol=tolerance)
        if role == "decoder":
            assert cache.states["gaussian.0"].shape[2] == attention.lookback
            break


class LargestAllocation(TorchDispatchMode):
    """The largest storage (in elements) any operation returns while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("implementation", ["conv", "index", "full"])
@pytest.mark.parametrize("role", ["encoder", "decoder", "cross"])
def test_conv_and_index_build_no_query_by_key_tensor(role, implementation):
    """A training step (attention dropout on, padded keys) of conv / index allocates nothing of Tq x Tk elements,
    forward or backward; full does (its dense weights), which shows the test can fail. (A cached decoding step has
    one query: its reach, not a Tq x Tk matrix, is what test_cached_steps_equal_the_dense_computation checks.) Sizes: one sentence, d_model 8, so that W gathered rows per query stay well below Tq x Tk."""
    queries, keys = 61, 61 if role != "cross" else 67
    config = GaussianConfig(**tiny_kwargs(d_model=8, gaussian_implementation=implementation, gaussian_window=5,
                                          length_ratio=1.1, attention_dropout=0.1))
    attention = GaussianAttention(config, role, 0).train()
    hidden = torch.randn(1, queries, 8, requires_grad=True)
    memory = torch.randn(1, keys, 8, requires_grad=True) if role == "cross" else None
    mask = (torch.arange(keys) < keys - 3)[None, None, None, :] if role != "decoder" else None
    with LargestAllocation() as probe:
        attention(hidden, memory=memory, mask=mask, causal=role == "decoder").sum().backward()
    assert (probe.largest >= queries * keys) == (implementation == "full"), probe.largest


class LargestBytes(TorchDispatchMode):
    """The largest storage (in bytes) any operation returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def float64_weights(attention, query_start, query_length, key_start, key_length, dtype, shift=None):
    """The reference weights, built plainly: the [H, Tq, Tk] (or [B, H, Tq, Tk]) distance matrix in float64, the
    kernel and the causal cut on it in float64, cast to ``dtype`` at the end."""
    q_pos = torch.arange(query_start, query_start + query_length)
    k_pos = torch.arange(key_start, key_start + key_length)
    centres = attention.centres(q_pos)[:, :, None]
    if shift is not None:
        centres = centres[None] + shift.to(torch.float64)[:, None, None, None]
    weights = attention.kernel(k_pos.to(torch.float64) - centres)
    if attention.role == "decoder":
        weights = weights * (k_pos[None, :] <= q_pos[:, None])
    return weights.to(dtype)


@pytest.mark.parametrize("role", ["encoder", "decoder", "cross"])
def test_full_weights_equal_the_float64_computation_without_its_temporaries(role):
    """``full``'s [H, Tq, Tk] weights are gathered from per-head float64 tables of O(Tq + Tk) entries, cast once to
    the model's dtype: bit for bit the weights of the float64 [H, Tq, Tk] computation cast at the end (fp32, bf16,
    fp16, fp64; offsets per head; queries and keys starting anywhere, as in cached decoding; gamma < 1, > 1 and
    non-terminating; a left-padded source's shifted centres), while the largest tensor built is the result itself
    (the float64 path's temporaries are twice an fp32 result)."""
    for gamma, sigma in ((1.3, 1.0), (0.6, 1.7), (1 / 3, 1.0), (2.5, 0.5)):
        attention = random_module(role, dict(gaussian_implementation="full", gaussian_sigma=sigma), gamma)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for query_start, query_length, key_start, key_length in ((0, 9, 0, 9), (0, 7, 0, 11), (6, 3, 0, 9),
                                                                     (5, 1, 3, 3), (10, 5, 7, 8), (0, 1, 0, 1)):
                attention._weights.clear()
                got = attention.weights(query_start, query_length, key_start, key_length, "cpu", dtype)
                expected = float64_weights(attention, query_start, query_length, key_start, key_length, dtype)
                assert got.dtype == dtype and torch.equal(got, expected), (gamma, dtype, query_start, key_start)
            if role == "cross":
                for shift in (torch.tensor([0, 3]), torch.tensor([11, 0])):
                    got = attention.shifted_weights(2, 6, shift, 11, "cpu", dtype)
                    assert torch.equal(got, float64_weights(attention, 2, 6, 0, 11, dtype, shift)), (gamma, shift)
    attention = random_module(role, dict(gaussian_implementation="full"), 1.3)
    heads, queries, keys = attention.num_heads, 120, 130
    for dtype in (torch.float32, torch.bfloat16):
        attention._weights.clear()
        with LargestBytes() as probe:
            weights = attention.weights(0, queries, 0, keys, "cpu", dtype)
        result = heads * queries * keys * dtype.itemsize
        assert weights.untyped_storage().nbytes() == result and probe.largest == result, (probe.largest, result)


def test_memo_is_bounded_in_entries_and_bytes():
    """The memo of a module keeps at most MEMO_ENTRIES constants and MEMO_BYTES bytes, least recently used out first;
    a constant larger than MEMO_BYTES is computed (correctly) and not kept; a hit returns the kept tensor."""
    from hf_hardattn.gaussian import MEMO_BYTES, MEMO_ENTRIES

    assert MEMO_ENTRIES <= 8 and MEMO_BYTES <= 16 * 2**20  # a few entries, 16 MiB per module at most
    attention = random_module("encoder", dict(gaussian_implementation="full"))
    attention.float()

    def used():
        return sum(t.numel() * t.element_size() for t in attention._weights.values())

    kept = attention.weights(0, 5, 0, 5, "cpu", torch.float32)
    for length in range(6, 6 + 3 * MEMO_ENTRIES):
        attention.weights(0, 5, 0, 5, "cpu", torch.float32)  # used again: stays
        attention.weights(0, length, 0, length, "cpu", torch.float32)
        assert len(attention._weights) <= MEMO_ENTRIES and used() <= MEMO_BYTES
    assert attention.weights(0, 5, 0, 5, "cpu", torch.float32) is kept
    assert ("dense", 0, 6, 6, "cpu", torch.float32) not in attention._weights  # the least recently used left
    heads = attention.num_heads
    side = math.isqrt(MEMO_BYTES // (4 * heads)) + 1  # one [H, side, side] fp32 matrix is over MEMO_BYTES
    big = attention.weights(0, side, 0, side, "cpu", torch.float32)
    assert big.shape == (heads, side, side) and used() <= MEMO_BYTES
    assert all(value.shape[-1] != side for value in attention._weights.values())
    assert torch.equal(big[:, -3:, -5:], float64_weights(attention, side - 3, 3, side - 5, 5, torch.float32))
    torch.manual_seed(0)
    hidden = torch.randn(1, 40, 32)
    for implementation in ("conv", "index"):  # bands share the memo and its bounds
        banded = random_module("decoder", dict(gaussian_implementation=implementation)).float()
        for length in range(1, 41):
            banded(hidden[:, :length])
            assert 0 < len(banded._weights) <= MEMO_ENTRIES


def padded_decoder_batch(length):
    """A source batch and a right-padded decoder batch of ``length`` positions (row 2 ends 7 positions early)."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 40, (2, 6), generator=generator)
    dec = torch.randint(3, 40, (2, length), generator=generator)
    dec_mask = torch.ones(2, length, dtype=torch.long)
    dec_mask[1, length - 7:] = 0
    return ids, torch.ones(2, 6, dtype=torch.long), dec.masked_fill(dec_mask == 0, 0), dec_mask


@pytest.mark.parametrize("implementation", ["conv", "index", "full"])
def test_padded_decoder_gives_gaussian_self_attention_only_the_key_padding_mask(implementation, monkeypatch):
    """With a padded decoder batch, Gaussian decoder self-attention (its weights are 0 after the query by
    construction) gets the key padding mask [B, 1, 1, T], O(B T): no [B, 1, T, T] mask is built (the function that
    builds causal masks is never called) for a model whose decoder self-attention is all Gaussian, and the outputs
    are exactly those with the causal & padding mask; in a model mixing soft and Gaussian layers the soft layer
    still gets (and reads) the causal mask. conv / index: no tensor of B x T x T elements at all in the decoder."""
    from hf_hardattn import layers

    ids, mask, dec, dec_mask = padded_decoder_batch(150)
    model = make("hc-all", gaussian_implementation=implementation, max_position_embeddings=256, length_ratio=0.5)
    model = randomize_model(model).eval()
    calls, seen = [], []
    real_causal = layers.causal_mask
    monkeypatch.setattr(layers, "causal_mask", lambda *a: calls.append(a) or real_causal(*a))
    real_forward = GaussianAttention.forward

    def spy(self, hidden, memory=None, mask=None, causal=False, **kw):
        if self.role == "decoder":
            seen.append(None if mask is None else tuple(mask.shape))
        return real_forward(self, hidden, memory=memory, mask=mask, causal=causal, **kw)

    monkeypatch.setattr(GaussianAttention, "forward", spy)
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
    memory = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    with torch.no_grad():
        if implementation != "full":
            with LargestAllocation() as probe:
                model.model.decoder(input_ids=dec, encoder_hidden_states=memory, encoder_attention_mask=mask,
                                    attention_mask=dec_mask)
            assert probe.largest < 2 * 150 * 150, probe.largest
        logits = model(**inputs).logits
        assert not calls and seen and all(shape == (2, 1, 1, 150) for shape in seen), (calls, seen)
        decoder = model.model.decoder
        decoder.causal_built_in = [False] * len(decoder.layers)  # the path before: causal & padding for every layer
        torch.testing.assert_close(model(**inputs).logits, logits, rtol=0, atol=0)
        assert calls and seen[-1] == (2, 1, 150, 150)
    calls.clear()
    mixed = make("hc-all", gaussian_implementation=implementation, decoder_attention=["soft", "gaussian"],
                 max_position_embeddings=256, length_ratio=0.5)
    mixed = randomize_model(mixed).eval()
    soft_masks = []
    soft = mixed.model.decoder.layers[0].self_attn.module
    real_attend = type(soft).attend
    monkeypatch.setattr(soft, "attend", lambda q, k, v, m, c: soft_masks.append((tuple(m.shape), c))
                        or real_attend(soft, q, k, v, m, c))
    with torch.no_grad():
        mixed(**inputs)
    assert len(calls) == 1 and soft_masks == [((2, 1, 150, 150), False)] and seen[-1] == (2, 1, 1, 150)


def randomize_model(model, seed=0):
    """Random weights of a non-trivial size (the attention of padded positions would otherwise hide nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


@pytest.mark.parametrize("implementation", ["conv", "index", "full"])
def test_attention_dropout_drops_each_weight_independently(implementation):
    """Training: every non-zero weight is kept and scaled by 1 / (1 - p) or dropped, independently (two weights are
    both dropped with probability p^2), with probability p; weights off the band stay 0; the returned weights are
    the ones the output used. conv / index draw per tap: the distribution of dropout on the dense matrix."""
    p = 0.3
    fields = dict(gaussian_implementation=implementation)
    role, hidden, memory, mask, _ = role_inputs("cross")
    attention = random_module(role, fields, dropout=p)
    _, closed = reference(fields, attention, hidden, memory, mask, 1.3)
    attention.train()
    values = (memory @ attention.v_proj.weight.T + attention.v_proj.bias).view(2, 11, 4, 8).transpose(1, 2)
    support = closed > 1e-3  # (full: the tail's tiny weights are left out of the counts)
    kept = []
    for _ in range(300):
        out, weights = attention(hidden, memory=memory, mask=mask, output_attentions=True)
        expected = (weights @ values).transpose(1, 2).reshape(2, 9, 32)
        torch.testing.assert_close(out, expected @ attention.out_proj.weight.T + attention.out_proj.bias, rtol=0,
                                   atol=1e-12)
        assert (weights[closed == 0] == 0).all()
        ratio = weights[support] / closed[support]
        assert ((ratio == 0) | ((ratio - 1 / (1 - p)).abs() < 1e-12)).all()
        kept.append(ratio > 0)
    kept = torch.stack(kept).double()  # [draws, support]
    n = kept.numel()
    assert abs(1 - kept.mean().item() - p) < 4 * math.sqrt(p * (1 - p) / n)
    both_dropped = ((1 - kept[:, :-1]) * (1 - kept[:, 1:])).mean().item()  # neighbouring weights (same row mostly)
    assert abs(both_dropped - p * p) < 0.02, both_dropped


# -- the length ratio gamma ----------------------------------------------------------------------------------------
UNFITTED = r"`length_ratio` .*never set.*fit_length_ratio\(model, dataset, tokenizer\).*length_ratio=\.\.\."


def test_hc_all_refuses_an_unfitted_length_ratio(tmp_path):
    """hc-all without gamma (None = not fitted, the default) refuses training and generation, naming the field and
    the fix, also after save/load; fit_length_ratio (or a given number) makes it run. Self-attention-only presets
    never need gamma; a saved config holding a number (every checkpoint saved before) loads and runs as before."""
    ids, mask = torch.tensor([[5, 9, 13, 2], [7, 11, 2, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    model = GaussianForConditionalGeneration(GaussianConfig.preset("hc-all", **tiny_kwargs()))
    assert model.config.length_ratio is None
    with pytest.raises(ValueError, match=UNFITTED):
        model.train()(input_ids=ids, attention_mask=mask, labels=ids)
    with pytest.raises(ValueError, match=UNFITTED):
        model.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)
    model.save_pretrained(tmp_path / "unfitted")
    assert json.loads((tmp_path / "unfitted" / "config.json").read_text())["length_ratio"] is None
    reloaded = GaussianForConditionalGeneration.from_pretrained(tmp_path / "unfitted")
    with pytest.raises(ValueError, match=UNFITTED):
        reloaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)
    plain = SoftTransformerConfig(**tiny_kwargs(cross_attention="gaussian"))
    with pytest.raises(ValueError, match=UNFITTED):
        SoftTransformerForConditionalGeneration(plain)(input_ids=ids, attention_mask=mask, labels=ids)

    gamma = fit_length_ratio(model, {"source": ["t4 t5 t6", "t7"], "target": ["t4 t5", "t6 t7"]}, toy_tokenizer())
    assert gamma == 1.0 and model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3).shape == (2, 4)
    for preset in ("hc-sa", "sh-x"):
        other = GaussianForConditionalGeneration(GaussianConfig.preset(preset, **tiny_kwargs()))
        assert other.config.length_ratio is None
        other(input_ids=ids, attention_mask=mask, labels=ids)

    old = tmp_path / "saved_with_a_number"
    GaussianForConditionalGeneration(GaussianConfig.preset("hc-all", **tiny_kwargs())).save_pretrained(old)
    config = json.loads((old / "config.json").read_text())
    config["length_ratio"] = 1.0  # what every config saved before this change holds (the old default included)
    (old / "config.json").write_text(json.dumps(config))
    loaded = GaussianForConditionalGeneration.from_pretrained(old)
    assert loaded.model.decoder.layers[0].cross_attn.module.gamma == 1.0
    loaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)


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


@pytest.mark.parametrize("implementation", ["full", "index"])
def test_refitting_gamma_recomputes_the_weights(implementation):
    """A model that already ran (its weights and bands memoised for gamma 1) and is then fitted to another gamma
    gives the output of a model built with that gamma: nothing of the old centres is reused."""
    ids, mask = torch.tensor([[5, 9, 13, 2, 6, 8, 2]]), torch.ones(1, 7, dtype=torch.long)
    labels = torch.tensor([[7, 11, 2]])
    model = make("hc-all", gaussian_implementation=implementation).eval()
    before = model(input_ids=ids, attention_mask=mask, labels=labels).logits
    gamma = fit_length_ratio(model, {"source": ["t4 t5 t6 t7 t8 t9"], "target": ["t4 t5"]}, toy_tokenizer())
    assert gamma == 3.0
    fresh = make("hc-all", gaussian_implementation=implementation, length_ratio=3.0).eval()
    fresh.load_state_dict(model.state_dict())
    after = model(input_ids=ids, attention_mask=mask, labels=labels).logits
    torch.testing.assert_close(after, fresh(input_ids=ids, attention_mask=mask, labels=labels).logits, rtol=0, atol=0)
    assert (after - before).abs().max() > 1e-3


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
    config = SoftTransformerConfig(**tiny_kwargs(encoder_attention=["gaussian", "soft"], length_ratio=1.0,
                                                 decoder_attention=["soft", "gaussian"], cross_attention="gaussian"))
    model = fitted(SoftTransformerForConditionalGeneration(config), steps=100)
    check_cache_equivalence(model)


# -- HF integration for the paper's three configurations ------------------------------------------------------------
PRESET_KWARGS = {"hc-sa": {}, "hc-all": dict(length_ratio=1.0), "sh-x": {}}


def make(preset, **kw):
    return GaussianForConditionalGeneration(GaussianConfig.preset(preset, **tiny_kwargs(**{**PRESET_KWARGS[preset],
                                                                                           **kw})))


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
