"""Recurrent cross-attention (Rosendahl et al., "Recurrent Attention for the Transformer"): the nine variants against
a naive per-position reference written from the paper's equations, and the HF integration contract."""

import math

import pytest
import torch

import hf_hardattn.modeling_hardattn as skeleton
from common import (as_float64, assert_nontrivial, beam_result, check_cache_equivalence, check_padded_batch,
                    check_remote_code, check_save_load, check_trainer, decode_step_by_step, fitted, randomize,
                    run_generate, source_batch, tiny_kwargs)
from hf_hardattn import RecurrentConfig, RecurrentForConditionalGeneration
from hf_hardattn.recurrent import RECURRENT_VARIANTS, RecurrentCrossAttention

VARIANTS = list(RECURRENT_VARIANTS)


def make(variant, **kw):
    return RecurrentForConditionalGeneration(RecurrentConfig(**tiny_kwargs(recurrent_variant=variant, **kw)))


_FITTED = {}


def fitted_model(variant):
    """One briefly fitted model per variant, shared by the integration tests of this file."""
    if variant not in _FITTED:
        torch.manual_seed(0)  # the same initial weights whichever test asks first
        _FITTED[variant] = fitted(make(variant))
    return _FITTED[variant]


# ------------------------------------------------------------------------------------------------------------------
# Naive reference, written directly from the paper (float64, one batch row, head, target and source position at a
# time, only the real source positions of each row, every "previous" quantity zero at i = 1).
# ------------------------------------------------------------------------------------------------------------------
def layer_norm(x, eps=1e-5):
    """Parameter-free layer norm by hand: (x - mean) / sqrt(biased variance + eps)."""
    centred = x - sum(x) / len(x)
    return centred / math.sqrt(float(sum(centred * centred)) / len(x) + eps)


def reference(attn, hidden, memory, lengths, window=5, lam_continuity=0.5, lam_coverage=0.5, drop=None):
    """``drop``: attention dropout as a multiplier per key index j (the extra pair of Eq. 5-8 has index J_padded, the
    padded source length); the contexts use the dropped weights, the weight states (Eq. 3, 4, 10) the weights before
    dropout."""
    variant, heads, dk = attn.variant, attn.num_heads, attn.head_dim
    d = heads * dk
    Wq, bq = attn.q_proj.weight, attn.q_proj.bias
    Wk, Wv = attn.kv_proj.weight[:d], attn.kv_proj.weight[d:]
    bk, bv = attn.kv_proj.bias[:d], attn.kv_proj.bias[d:]
    Wo, bo = attn.out_proj.weight, attn.out_proj.bias
    batch, length, _ = hidden.shape
    out = torch.zeros(batch, length, d, dtype=hidden.dtype)
    for b in range(batch):
        J = lengths[b]
        h = memory[b, :J]  # padding never takes part
        prev_head = [torch.zeros(dk, dtype=h.dtype) for _ in range(heads)]  # c_{i-1}^{l,n}
        prev_full = torch.zeros(d, dtype=h.dtype)  # c_{i-1}^l
        prev_alpha = [[0.0] * J for _ in range(heads)]  # alpha_{i-1,j}
        accumulated = [[0.0] * J for _ in range(heads)]  # sum_{i' < i} alpha_{i',j}
        prev_rescaled = [[0.0] * J for _ in range(heads)]  # ring-alpha_{i-1,j}
        for i in range(length):
            s = hidden[b, i]
            contexts = []
            for n in range(heads):
                rows = slice(n * dk, (n + 1) * dk)
                keys = [Wk[rows] @ h[j] + bk[rows] for j in range(J)]
                values = [Wv[rows] @ h[j] + bv[rows] for j in range(J)]
                query = Wq[rows] @ s + bq[rows]
                if variant == "concat_context":  # Eq. 2: W_q' (s_i; c_{i-1}^{l,n})
                    query = query + attn.context_query[n] @ prev_head[n]
                energies = []
                for j in range(J):
                    query_j = query
                    if variant == "concat_weight":  # Eq. 3: W_q' (s_i; alpha_{i-1,j}), one query per j
                        query_j = query + attn.weight_query[n] * prev_alpha[n][j]
                    if variant == "concat_accumulated":  # Eq. 4
                        query_j = query + attn.weight_query[n] * accumulated[n][j]
                    energies.append(float(keys[j] @ query_j) / math.sqrt(dk))
                if variant.startswith("expand"):
                    full_in, head_in = prev_full, prev_head[n]
                    if getattr(attn, "context_norm", False):  # recurrent_context_norm: LN(c_{i-1}) instead of c_{i-1}
                        full_in, head_in = layer_norm(prev_full), layer_norm(prev_head[n])
                    if variant == "expand_1":  # Eq. 5
                        g_k, g_v = Wk[rows] @ full_in + bk[rows], Wv[rows] @ full_in + bv[rows]
                    elif variant == "expand_2":  # Eq. 6
                        Wg = attn.g_proj.weight
                        g_k, g_v = Wg[:d][rows] @ full_in, Wg[d:][rows] @ full_in
                    elif variant == "expand_3":  # Eq. 7
                        g_k, g_v = attn.g_key[n] @ head_in, attn.g_value[n] @ head_in
                    else:  # Eq. 8
                        g_k, g_v = attn.g_key[n] @ prev_head[n], prev_head[n]
                    keys, values = keys + [g_k], values + [g_v]
                    energies.append(float(g_k @ query) / math.sqrt(dk))
                if variant == "continuity":  # Eq. 9
                    energies = [
                        lam_continuity * energies[j] + (1 - lam_continuity) / (2 * window + 1)
                        * sum(prev_rescaled[n][jp] for jp in range(j - window, j + window + 1) if 0 <= jp < J)
                        for j in range(J)
                    ]
                    prev_rescaled[n] = energies
                if variant == "coverage":  # Eq. 10
                    energies = [energies[j] - lam_coverage / math.sqrt(dk) * accumulated[n][j] for j in range(J)]
                top = max(energies)
                exp = [math.exp(e - top) for e in energies]
                alpha = [e / sum(exp) for e in exp]  # Eq. 1 / Eq. 11
                used = alpha if drop is None else [a * drop(j if j < J else memory.shape[1]) for j, a in enumerate(alpha)]
                contexts.append(sum(a * value for a, value in zip(used, values)))
                prev_alpha[n] = alpha[:J]
                accumulated[n] = [accumulated[n][j] + alpha[j] for j in range(J)]
            full = Wo @ torch.cat(contexts) + bo  # heads concatenated + linear transformation
            prev_head, prev_full = contexts, full
            out[b, i] = full
    return out


def random_attention(seed, **settings):
    """A float64 RecurrentCrossAttention (d 8, 2 heads) with N(0, 0.7^2) parameters, and the generator that drew
    them (for the inputs)."""
    config = RecurrentConfig(**tiny_kwargs(d_model=8, decoder_attention_heads=2, **settings))
    attn = RecurrentCrossAttention(config, "cross", 0).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in attn.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.7)
    return attn, generator


@pytest.mark.parametrize("variant, window, norm", [(v, 5, False) for v in VARIANTS] + [("continuity", 0, False),
                                                  ("continuity", 1, False)] + [(f"expand_{i}", 5, True) for i in (1, 2, 3)])
def test_parallel_forward_equals_naive_reference(variant, window, norm):
    attn, generator = random_attention(0, recurrent_variant=variant, continuity_window=window, continuity_lambda=0.3,
                                       coverage_lambda=0.7, recurrent_context_norm=norm)
    hidden = torch.randn(2, 6, 8, generator=generator, dtype=torch.float64)
    memory = torch.randn(2, 7, 8, generator=generator, dtype=torch.float64)
    lengths = [7, 4]
    memory[1, 4:] = 100.0  # padding holds garbage that must not leak in
    mask = (torch.arange(7)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    with torch.no_grad():
        got = attn(hidden, memory=memory, mask=mask)
        want = reference(attn, hidden, memory, lengths, window, 0.3, 0.7)
        # the recurrence matters: plain soft attention with the same projections differs
        soft = skeleton.SoftAttention.forward(attn, hidden, memory=memory, mask=mask)
    assert torch.allclose(got, want, atol=1e-10, rtol=1e-8), (got - want).abs().max()
    assert not torch.allclose(got, soft, atol=1e-3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_steps_equal_full_forward_logits(variant):
    """Teacher-forced logits of the parallel path == logits decoded one position at a time through the cache; the
    state is stored per layer and per head."""
    model = randomize(make(variant), std=0.3)
    ids, mask = source_batch()
    decoder_ids = torch.tensor([[1, 5, 9, 7, 30, 12], [1, 8, 8, 22, 4, 6]])
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, use_cache=False).logits
        steps, cache = decode_step_by_step(model, decoder_ids, input_ids=ids, attention_mask=mask)
    assert torch.allclose(full, steps, atol=1e-4), (full - steps).abs().max()
    keys = sorted(cache.states)
    assert {k.split(".")[1] for k in keys} == {"0", "1"}, keys  # one state per layer
    for key in keys:
        state = cache.states[key]
        assert state.shape[0] == 2
        if state.dim() == 3:
            assert state.shape[1] == 4  # per head


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_padding_save_load(variant, tmp_path):
    model = fitted_model(variant)
    check_cache_equivalence(model)  # greedy, beam 4, sampling: cache == no cache, non-trivial output
    check_padded_batch(model)
    check_save_load(model, tmp_path)


@pytest.mark.numerics
def test_beam_search_needs_the_state_reordered(monkeypatch):
    """Negative control: if reorder_cache skipped the recurrent state, beam outputs would change. Float64 (cached and
    uncached beam search are two code paths: see common.as_float64), so their exact tokens cannot part by rounding."""
    model = as_float64(fitted_model("coverage"))
    expected = run_generate(model, "beam", True)
    assert_nontrivial(expected)
    assert torch.equal(expected, run_generate(model, "beam", False))
    _, scores = beam_result(model)

    def reorder_without_states(self, beam_idx):
        self.self_attention_cache.reorder_cache(beam_idx)

    monkeypatch.setattr(skeleton.HardAttnCache, "reorder_cache", reorder_without_states)
    _, broken_scores = beam_result(model)
    assert not torch.allclose(scores, broken_scores, atol=1e-4), (scores, broken_scores)


def test_remote_code_fresh_process(tmp_path):
    check_remote_code(fitted_model("expand_3"), tmp_path)


@pytest.mark.parametrize("variant", ["expand_1", "coverage"])
def test_trainer_lowers_loss(variant, tmp_path):
    check_trainer(make(variant), tmp_path)


def test_per_layer_selection_and_init():
    model = make("concat_context", cross_attention=["soft", "recurrent"])
    layers = model.model.decoder.layers
    assert type(layers[0].cross_attn.module) is skeleton.SoftAttention
    assert isinstance(layers[1].cross_attn.module, RecurrentCrossAttention)
    extra = layers[1].cross_attn.module.context_query
    assert torch.isfinite(extra).all() and extra.abs().max() > 0  # _init_weights covers the added parameters
    assert model.config.recurrent_variant == "concat_context" and model.config.continuity_window == 5


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(recurrent_variant="expand_5"), r"`recurrent_variant` must be one of \('concat_context'"),
        (dict(continuity_window=-1), r"`continuity_window` \(k of Eq. 9\) must be an integer >= 0, got -1"),
        (dict(continuity_window=2.5), r"`continuity_window`.*integer >= 0"),
        (dict(continuity_lambda=0.0), r"`continuity_lambda` \(lambda of Eq. 9\) must be in \(0, 1\], got 0.0"),
        (dict(continuity_lambda=1.5), r"`continuity_lambda`.*\(0, 1\]"),
        (dict(coverage_lambda=-0.1), r"`coverage_lambda` \(lambda of Eq. 10\) must be a finite number >= 0"),
        (dict(coverage_lambda=float("inf")), r"`coverage_lambda`.*finite"),
        (dict(decoder_attention="recurrent"), r"`decoder_attention` entry 'recurrent' is not a known attention kind"),
    ],
)
def test_bad_config_raises(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        RecurrentConfig(**tiny_kwargs(**kwargs))


def test_recurrent_kind_refuses_other_roles():
    with pytest.raises(ValueError, match=r"role 'cross' only"):
        RecurrentCrossAttention(RecurrentConfig(**tiny_kwargs()), "decoder", 0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_dropout_forms_contexts_from_dropped_weights_and_states_from_the_others(variant, monkeypatch):
    """attention_dropout > 0 in training, against the naive reference: dropout replaced by a fixed mask (every third key
    dropped, the rest scaled by 1 / (1 - p)), so both paths drop the same weights. The contexts (and so the context
    states of Eq. 2, 5-8) are built from the dropped weights, the weight states of Eq. 3, 4 and 10 from the weights
    before dropout; the module must call dropout with the configured p in training."""
    p = 0.3

    def multiplier(j):
        return 0.0 if j % 3 == 1 else 1 / (1 - p)

    calls = []

    def fixed_dropout(x, rate, training=True, inplace=False):
        calls.append((rate, training))
        keep = (torch.arange(x.shape[-1]) % 3 != 1).to(x.dtype)
        return x * keep / (1 - rate)

    attn, generator = random_attention(1, recurrent_variant=variant, attention_dropout=p, continuity_window=1,
                                       continuity_lambda=0.3, coverage_lambda=0.7)
    attn.train()
    hidden = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64)
    memory = torch.randn(2, 6, 8, generator=generator, dtype=torch.float64)
    lengths = [6, 4]
    mask = (torch.arange(6)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    monkeypatch.setattr(torch.nn.functional, "dropout", fixed_dropout)
    with torch.no_grad():
        got = attn(hidden, memory=memory, mask=mask)
    monkeypatch.undo()
    assert calls and all(call == (p, True) for call in calls), calls
    want = reference(attn, hidden, memory, lengths, 1, 0.3, 0.7, drop=multiplier)
    assert torch.allclose(got, want, atol=1e-10, rtol=1e-8), (got - want).abs().max()
    undropped = reference(attn, hidden, memory, lengths, 1, 0.3, 0.7)
    assert not torch.allclose(got, undropped, atol=1e-3)  # the mask matters at these sizes
