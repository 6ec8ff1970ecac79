"""Beam-joint / full-joint attention (Shankar et al., 2018, Eq. 4-5) in both settings: the Transformer decoder
(setting 2) and the attentional RNN decoder (setting 1: the paper's Luong-style LSTM decoder with input feeding, the
default, and the earlier Bahdanau-style GRU decoder).

References are independent code paths: a naive loop that runs the SOFT model once per (target position, source
position) with that layer's cross-attention of that position masked to the one source position (Transformer); for the
Luong RNN setting the decoder of tests/rnn_reference.py, written independently of HybridDecoder (torch's cells, the
attention per equation, each candidate tanh(W_c [s_t; x_a] + b) from its definition); for the Bahdanau RNN setting the
hybrid decoder's own soft outputs + ``decoder.readout`` on explicitly built hard contexts; all summed as
log sum_a P(a) P(y | x_a) in float64.
"""

import pytest
import torch
from torch import nn

from common import (check_cache_equivalence, check_padded_batch, check_remote_code, check_save_load,
                    check_trainer, fitted, randomize, source_batch, tiny_kwargs)
from hf_hardattn import (BeamJointRNNConfig, BeamJointRNNForConditionalGeneration, BeamJointTransformerConfig,
                         BeamJointTransformerForConditionalGeneration, HardAttnForConditionalGeneration,
                         HybridConfig, HybridForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration)
from hf_hardattn.joint_kernel import JointMixture, JointWorkspace
from rnn_reference import naive_rnn_decoder

DEC = torch.tensor([[1, 6, 9, 12, 15], [1, 8, 10, 2, 0]])  # decoder inputs (second row ends early)
RNN_KW = dict(decoder_layers=1, rnn_hidden_size=32)
BAHDANAU = dict(rnn_decoder_style="bahdanau", rnn_cell="gru")  # the earlier (not the paper's) RNN setting


def transformer(**kw):
    return BeamJointTransformerForConditionalGeneration(BeamJointTransformerConfig(**tiny_kwargs(**kw)))


def rnn(**kw):
    return BeamJointRNNForConditionalGeneration(BeamJointRNNConfig(**tiny_kwargs(**RNN_KW, **kw)))


def forward_log_probs(model, ids=None, mask=None, dec=DEC):
    if ids is None:
        ids, mask = source_batch()
    return model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec[: ids.shape[0]]).logits


# ------------------------------------------------------------------------------------------------------------
# Independent references
# ------------------------------------------------------------------------------------------------------------
class Probe(nn.Module):
    """Wraps a soft cross-attention module: records its inputs and can replace its mask."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.mask, self.seen = inner, None, None

    def forward(self, hidden, memory=None, mask=None, causal=False, cache=None):
        self.seen = (hidden, memory)
        return self.inner(hidden, memory=memory, mask=mask if self.mask is None else self.mask, cache=cache)


def transformer_reference(model, ids, mask, dec, layer):
    """(log P(a) [B, T, S] head-averaged, log P(y | x_a) [B, T, S, V]) from the soft model with the same weights,
    float64. P(y | x_a) at position t: layer `layer`'s cross-attention of position t masked to source position a."""
    config = model.config
    soft = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**{
        k: getattr(config, k) for k in tiny_kwargs()
    })).double()
    soft.load_state_dict(model.state_dict())
    soft.train(model.training)
    params = dict(soft.named_parameters())
    sub = soft.model.decoder.layers[layer].cross_attn
    probe = sub.module = Probe(sub.module)
    B, S = ids.shape
    T = dec.shape[1]
    soft(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    hidden, memory = probe.seen
    attn = probe.inner
    H, hd = attn.num_heads, attn.head_dim
    q = attn.q_proj(hidden).view(B, T, H, hd).transpose(1, 2)
    k = attn.kv_proj(memory)[..., : H * hd].view(B, S, H, hd).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / hd**0.5
    scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    log_p = scores.softmax(-1).mean(1).clamp_min(1e-300).log()  # head average (Eq. 1 per head); padded ~-690
    base = mask.bool()[:, None, None, :].expand(B, 1, T, S)
    rows = [[None] * S for _ in range(T)]
    for t in range(T):
        for a in range(S):
            one_hot = base.clone()
            one_hot[:, :, t, :] = False
            one_hot[:, :, t, a] = True
            probe.mask = one_hot
            rows[t][a] = soft(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits[:, t].log_softmax(-1)
    return log_p, torch.stack([torch.stack(row, 1) for row in rows], 1), params


def rnn_reference(model, ids, mask, dec):
    """(log P(a) [B, T, S], log P(y | x_a) [B, T, S, V], parameters). Luong: tests/rnn_reference.py's independent
    decoder on the model's own parameters. Bahdanau: the hybrid decoder's soft outputs and readout(s_t, x_a)."""
    config = model.config
    if config.rnn_decoder_style == "luong":
        ref = naive_rnn_decoder(model, ids, mask, dec)
        log_p = ref["probs"].clamp_min(1e-300).log()  # padding: ~-690 with a zero gradient
        return log_p, ref["candidate_log_probs"], dict(model.named_parameters())
    hybrid = HybridForConditionalGeneration(HybridConfig(**tiny_kwargs(
        **RNN_KW, rnn_attention=config.rnn_attention, rnn_decoder_style=config.rnn_decoder_style,
        rnn_cell=config.rnn_cell)))
    hybrid = hybrid.double()
    hybrid.load_state_dict(model.state_dict())
    hybrid.train(model.training)
    memory = hybrid.model.encoder(ids, mask).last_hidden_state
    out = hybrid.model.decoder_outputs(dec, memory, mask)
    hard = hybrid.model.decoder.hard_contexts(memory)  # [B, S, C]
    B, _, T, S = out.attentions.shape
    per_a = []
    for a in range(S):
        readout = hybrid.model.decoder.readout(out.states, hard[:, a : a + 1].expand(B, T, -1))
        per_a.append(hybrid.lm_head(readout).log_softmax(-1))
    log_p = out.attentions.mean(1).clamp_min(1e-300).log()  # head average; padding: ~-690 with a zero gradient
    return log_p, torch.stack(per_a, 2), dict(hybrid.named_parameters())


def mix(log_p, log_py, keep=None, renormalize=True):
    """log sum_{a in keep} w_a P(y | x_a); keep [B, T, S] bool (None = every position, Eq. 4)."""
    log_w = log_p if keep is None else log_p.masked_fill(~keep, float("-inf"))
    if keep is not None and renormalize:
        log_w = log_w - torch.logsumexp(log_w, -1, keepdim=True)
    return torch.logsumexp(log_w[..., None] + log_py, dim=2)


def top_k_mask(log_p, k):
    index = log_p.topk(min(k, log_p.shape[-1]), -1).indices
    return torch.zeros_like(log_p, dtype=torch.bool).scatter_(-1, index, True)


def reference(model, ids, mask, dec, with_params=False):
    if isinstance(model, BeamJointRNNForConditionalGeneration):
        log_p, log_py, params = rnn_reference(model, ids, mask, dec)
    else:
        layer = model.config.joint_layer % model.config.decoder_layers
        log_p, log_py, params = transformer_reference(model, ids, mask, dec, layer)
    return (log_p, log_py, params) if with_params else (log_p, log_py)


SETTINGS = {
    "transformer_last": lambda **kw: transformer(**kw),
    "transformer_layer0": lambda **kw: transformer(joint_layer=0, **kw),
    "rnn_luong": lambda **kw: rnn(**kw),  # the defaults: Luong-style LSTM decoder, dot attention (the paper's)
    "rnn_luong_gru_additive": lambda **kw: rnn(rnn_cell="gru", rnn_attention="additive", **kw),
    "rnn_bahdanau_additive": lambda **kw: rnn(rnn_attention="additive", **BAHDANAU, **kw),
    "rnn_bahdanau_multihead": lambda **kw: rnn(rnn_attention="multihead", **BAHDANAU, **kw),
}


# ------------------------------------------------------------------------------------------------------------
# The mixture
# ------------------------------------------------------------------------------------------------------------
def test_mixture_matches_naive_and_gradcheck():
    torch.manual_seed(0)
    hidden = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    log_w = torch.randn(5, 3, dtype=torch.float64).log_softmax(-1)
    log_w[1, 2] = float("-inf")  # an absent candidate (padding)
    log_w.requires_grad_(True)
    weight = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    out = JointMixture.apply(hidden, log_w, weight, 4)  # 4 rows = 1 token per chunk: 5 chunks
    naive = torch.log((log_w.exp()[..., None] * (hidden @ weight.t()).softmax(-1)).sum(1))
    torch.testing.assert_close(out.double(), naive)
    assert torch.autograd.gradcheck(lambda h, w, W: JointMixture.apply(h, w, W, 4), (hidden, log_w, weight))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_full_joint_equals_naive_loop_and_large_k(name):
    """Eq. 4 == naive loop over every (unpadded) source position; K >= source length == full-joint."""
    ids, mask = source_batch()
    full = randomize(SETTINGS[name](full_joint=True), std=0.3).double()
    got = forward_log_probs(full, ids, mask)
    log_p, log_py = reference(full, ids, mask, DEC)
    torch.testing.assert_close(got.double(), mix(log_p, log_py), rtol=1e-6, atol=1e-6)
    beam = SETTINGS[name](joint_k=ids.shape[1]).double().eval()
    beam.load_state_dict(full.state_dict())
    torch.testing.assert_close(forward_log_probs(beam, ids, mask), got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_k1_renormalised_is_hard_attention_on_argmax(name):
    ids, mask = source_batch()
    model = randomize(SETTINGS[name](joint_k=1), std=0.3).double()
    log_p, log_py = reference(model, ids, mask, DEC)
    argmax = log_p.argmax(-1)  # [B, T]
    expected = torch.gather(log_py, 2, argmax[..., None, None].expand(-1, -1, 1, log_py.shape[-1])).squeeze(2)
    torch.testing.assert_close(forward_log_probs(model, ids, mask).double(), expected, rtol=1e-6, atol=1e-6)
    # K=3 without renormalisation: the weights are the raw top-3 P(a)
    raw = SETTINGS[name](joint_k=3, renormalize_joint=False).double().eval()
    raw.load_state_dict(model.state_dict())
    expected = mix(log_p, log_py, top_k_mask(log_p, 3), renormalize=False)
    torch.testing.assert_close(forward_log_probs(raw, ids, mask).double(), expected, rtol=1e-6, atol=1e-6)
    assert bool((torch.logsumexp(expected, -1) < -1e-6).all())  # a sub-distribution


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_gradient_through_mixture_weights_not_selection(name):
    """Gradients of every parameter equal those of the naive mixture over the SAME (fixed, non-differentiable)
    top-K set; the attention's query parameters get a non-zero gradient."""
    ids, mask = source_batch()
    model = randomize(SETTINGS[name](joint_k=2), std=0.3).double().train()
    target = torch.tensor([[6, 9, 12, 15, 2], [8, 10, 2, 0, 0]])
    got = forward_log_probs(model, ids, mask).gather(-1, target[..., None]).sum()
    ours = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(got, list(model.parameters()))))
    log_p, log_py, ref_params = reference(model, ids, mask, DEC, with_params=True)
    ref = mix(log_p, log_py, top_k_mask(log_p.detach(), 2)).gather(-1, target[..., None]).sum()
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert ours.keys() == ref_params.keys()
    theirs = dict(zip(ref_params, torch.autograd.grad(ref, list(ref_params.values()), allow_unused=True)))
    for key, grad in ours.items():
        expected = theirs[key] if theirs[key] is not None else torch.zeros_like(grad)
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-8, msg=key)
    if name.startswith("transformer"):  # in the joint layer, q_proj reaches the output only through P_t(a)
        layer = model.config.joint_layer % model.config.decoder_layers
        query = [f"model.decoder.layers.{layer}.cross_attn.module.q_proj.weight"]
    else:
        query = [n for n in ours if n.startswith("model.decoder.attention.")]
    assert query and all(ours[n].abs().max() > 0 for n in query), "no gradient reached the attention scores"


def attention_query_names(model, name):
    """The parameters that reach the output only through P_t(a) (one-token target): in the joint layer of the
    Transformer, q_proj; in the RNN setting, the attention's own parameters."""
    if name.startswith("transformer"):
        layer = model.config.joint_layer % model.config.decoder_layers
        return [f"model.decoder.layers.{layer}.cross_attn.module.q_proj.weight"]
    return [n for n, _ in model.named_parameters() if n.startswith("model.decoder.attention.")]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_k1_training_keeps_the_papers_weight(name):
    """K=1 in training with the default renormalize_joint: the loss is the paper's beam-approximation at K=1, the
    attention weighted mixture of one component, log P_t(a_1) + log P_t(y_t | x_{a_1}), a_1 the argmax of P_t (not
    renormalised: one renormalised weight is exactly 1 and the attention got no gradient). Every parameter's
    gradient against that equation by hand in float64 (a naive loop over the attention positions picks a_1, on the
    independent references); for a one-token target the attention's parameters get a non-zero gradient (that of
    log P_t(a_1), where they reach the output only through P_t(a)), while the renormalised K=1 of eval mode gives
    them exactly 0."""
    ids, mask = source_batch()
    model = randomize(SETTINGS[name](joint_k=1), std=0.3).double().train()
    dec, target = DEC[:, :1], torch.tensor([[6], [8]])  # one target token: no later step reads the attention
    got = forward_log_probs(model, ids, mask, dec).gather(-1, target[..., None]).sum()
    names = [n for n, _ in model.named_parameters()]
    ours = dict(zip(names, torch.autograd.grad(got, list(model.parameters()))))
    log_p, log_py, ref_params = reference(model, ids, mask, dec, with_params=True)
    terms, attention_terms, chosen = [], [], log_p.detach()
    for b in range(ids.shape[0]):
        for t in range(dec.shape[1]):
            best = 0
            for a in range(ids.shape[1]):  # the top-1 position: pass-through, no gradient through the choice
                if float(chosen[b, t, a]) > float(chosen[b, t, best]):
                    best = a
            terms.append(log_p[b, t, best] + log_py[b, t, best, target[b, t]])  # log P_t(a_1) P_t(y_t | x_{a_1})
            attention_terms.append(log_p[b, t, best])
    ref = torch.stack(terms).sum()
    torch.testing.assert_close(got.double(), ref, rtol=1e-9, atol=1e-9)
    theirs = dict(zip(ref_params, torch.autograd.grad(ref, list(ref_params.values()), allow_unused=True,
                                                      retain_graph=True)))
    for key, grad in ours.items():
        expected = theirs[key] if theirs[key] is not None else torch.zeros_like(grad)
        torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-9, msg=key)
    query = attention_query_names(model, name)
    assert query and all(ours[n].abs().max() > 1e-6 for n in query), "no gradient reached the attention"
    if name.startswith("transformer") or "luong" in name:  # only through P_t(a): the gradient of log P_t(a_1)
        from_weight = torch.autograd.grad(torch.stack(attention_terms).sum(), [ref_params[n] for n in query])
        for n, grad in zip(query, from_weight):
            torch.testing.assert_close(ours[n], grad, rtol=1e-6, atol=1e-9, msg=n)
        model.eval()  # renormalised K=1 (decoding): hard attention on the argmax, no gradient to the attention
        hard = forward_log_probs(model, ids, mask, dec).gather(-1, target[..., None]).sum()
        torch.testing.assert_close(hard.double(), torch.stack([term - w for term, w in zip(terms, attention_terms)])
                                   .sum(), rtol=1e-9, atol=1e-9)
        params = dict(model.named_parameters())
        for n, grad in zip(query, torch.autograd.grad(hard, [params[n] for n in query], allow_unused=True)):
            assert grad is None or not bool(grad.any()), n


@pytest.mark.parametrize("name", ["transformer_last", "rnn_luong", "rnn_bahdanau_additive"])
def test_k_larger_than_sentence_uses_all_its_positions(name):
    """Row 2 has 5 real source positions in a batch padded to 7: K=6 mixes exactly its 5 unpadded positions (the
    padded one picked to fill K gets weight 0), i.e. its full-joint, in the batch and alone."""
    ids, mask = source_batch()
    model = randomize(SETTINGS[name](joint_k=6), std=0.3).double()
    batched = forward_log_probs(model, ids, mask)[1]
    length = int(mask[1].sum())
    alone = forward_log_probs(model, ids[1:, :length], mask[1:, :length], DEC[1:])[0]
    log_p, log_py = reference(model, ids[1:, :length], mask[1:, :length], DEC[1:])
    torch.testing.assert_close(batched, alone, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(alone.double(), mix(log_p, log_py)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["transformer_last", "rnn_luong", "rnn_bahdanau_additive"])
def test_log_probabilities_and_loss(name):
    """logits are log-probabilities (log_softmax is the identity); the loss equals the skeleton's cross-entropy;
    joint_inference_k applies in eval mode only."""
    ids, mask = source_batch()
    model = randomize(SETTINGS[name](joint_k=3, joint_inference_k=1, label_smoothing=0.1), std=0.3).train()
    logits = forward_log_probs(model, ids, mask)
    torch.testing.assert_close(logits.log_softmax(-1), logits, rtol=0, atol=2e-6)
    labels = torch.tensor([[6, 9, 12, 15, 2], [8, 10, 2, -100, -100]])
    ce = HardAttnForConditionalGeneration.compute_loss(model, logits, labels)
    torch.testing.assert_close(model.compute_loss(logits, labels), ce)
    torch.testing.assert_close(model.compute_loss(logits, labels, 7), HardAttnForConditionalGeneration.compute_loss(
        model, logits, labels, 7))
    k1 = SETTINGS[name](joint_k=1)
    k1.load_state_dict(model.state_dict())
    torch.testing.assert_close(forward_log_probs(model.eval(), ids, mask), forward_log_probs(k1.eval(), ids, mask))
    k3 = SETTINGS[name](joint_k=3)
    k3.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits, forward_log_probs(k3.train(), ids, mask))
    assert not torch.allclose(logits, forward_log_probs(k1.train(), ids, mask))


def test_chunked_mixture_equals_one_chunk():
    """joint_chunk_size bounds memory only: 5-row chunks (recomputed in backward) give the same loss and gradients."""
    ids, mask = source_batch()
    labels = torch.tensor([[6, 9, 12, 15, 2], [8, 10, 2, -100, -100]])
    grads = []
    for chunk in (5, 16384):
        model = randomize(transformer(joint_k=3, joint_chunk_size=chunk), std=0.3).double().train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        grads.append([loss] + list(torch.autograd.grad(loss, list(model.parameters()))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_mixture_under_bf16_autocast_equals_autograd():
    """bf16 training: the chunks recomputed in backward run under the forward's autocast state, so the gradients
    equal autograd's through the same bf16 logits (a recompute in fp32 would not match the forward's bf16 mixture)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(24, 3, 16, generator=generator).requires_grad_()
    log_w = torch.randn(24, 3, generator=generator).log_softmax(-1).requires_grad_()
    weight = (2 * torch.randn(50, 16, generator=generator)).requires_grad_()
    upstream = torch.randn(24, 50, generator=generator)
    results = []
    for fn in (lambda: JointMixture.apply(hidden, log_w, weight, 12),  # 4 tokens per chunk: recomputed
               lambda: torch.logsumexp((hidden @ weight.t()).float().log_softmax(-1) + log_w[..., None], dim=1)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn()
        results.append([out] + list(torch.autograd.grad((out * upstream).sum(), (hidden, log_w, weight))))
    for ours, reference in zip(*results):
        torch.testing.assert_close(ours.float(), reference.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results[0][2], results[1][2], rtol=1e-4, atol=1e-5)  # the mixture-weight gradient


def mixture_reference(hidden, log_w, weight):
    """Eq. 4-5 by autograd in float64, log space: logsumexp_k(log P(a_k) + log_softmax(z_k))."""
    z = hidden.double() @ weight.double().t()
    return torch.logsumexp(z.log_softmax(-1) + log_w.double()[..., None], dim=1)


def mixture_and_grads(fn, hidden, log_w, weight, upstream):
    hidden, log_w, weight = (x.detach().requires_grad_() for x in (hidden, log_w, weight))
    out = fn(hidden, log_w, weight)
    return [out] + list(torch.autograd.grad((out * upstream.to(out.dtype)).sum(), (hidden, log_w, weight)))


def test_mixture_exact_where_the_factored_sum_underflows():
    """The forward sums probabilities factored through each candidate's maximum; where a mixture probability falls
    below fp32's trusted range (log-probabilities of -300 here) that chunk is computed in log space instead, forward
    and backward. Chunks of 2 tokens: the first chunk underflows, the second does not; both equal the float64
    reference, and the factored sum really does underflow on the first (the case is exercised)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 3, 8, generator=generator)
    hidden[:2] *= 60  # huge logits: most tokens' probabilities ~exp(-300)
    log_w = torch.randn(4, 3, generator=generator).log_softmax(-1)
    log_w[3, 1] = float("-inf")
    weight = torch.randn(20, 8, generator=generator)
    upstream = torch.randn(4, 20, generator=generator)
    ours = mixture_and_grads(lambda h, w, W: JointMixture.apply(h, w, W, 6), hidden, log_w, weight, upstream)
    reference = mixture_and_grads(mixture_reference, hidden, log_w, weight, upstream)
    assert float(reference[0][:2].detach().min()) < -200 and float(reference[0][2:].detach().min()) > -60
    z = hidden @ weight.t()
    factored = (log_w[..., None].exp() * (z - z.amax(-1, keepdim=True)).exp()
                / (z - z.amax(-1, keepdim=True)).exp().sum(-1, keepdim=True)).sum(1)
    assert bool((factored[:2] == 0).any())  # the fp32 probability-space sum underflows there
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-4)


def test_mixture_workspace_reused_and_safe_to_share():
    """A JointWorkspace keeps its buffers between calls (same storage on the next call); a forward that claims it
    between another call's forward and backward makes that backward recompute in buffers of its own: the results
    equal separate workspaces (backwards in reverse order, as a teacher-student loss would run them)."""
    generator = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(6, 3, 8, generator=generator), torch.randn(6, 3, generator=generator).log_softmax(-1),
               torch.randn(20, 8, generator=generator), torch.randn(6, 20, generator=generator)) for _ in range(2)]
    separate = [mixture_and_grads(lambda h, w, W: JointMixture.apply(h, w, W, 9), *x) for x in inputs]
    workspace = JointWorkspace()
    leaves = [[t.detach().requires_grad_() for t in x[:3]] for x in inputs]
    outs = [JointMixture.apply(*leaf, 9, workspace) for leaf in leaves]  # 3 tokens per chunk: 2 chunks each
    storage = workspace.buffer("probs", (1,), torch.float32, "cpu").data_ptr()
    shared = [None, None]
    for i in (0, 1):  # call 0's buffers were claimed by call 1
        grads = torch.autograd.grad((outs[i] * inputs[i][3]).sum(), leaves[i])
        shared[i] = [outs[i]] + list(grads)
    for a, b in zip(separate, shared):
        for got, want in zip(a, b):
            torch.testing.assert_close(got, want)
    JointMixture.apply(*leaves[0], 9, workspace)
    assert workspace.buffer("probs", (1,), torch.float32, "cpu").data_ptr() == storage


@pytest.mark.parametrize("attention", ["additive", "dot", "multihead"])
def test_rnn_hard_contexts_and_fast_readout(attention):
    """hybrid's hard_contexts(j) == the attention's output with all weight on j; the split readout used per
    candidate == decoder.readout on explicitly built candidates."""
    ids, mask = source_batch()
    model = randomize(rnn(rnn_attention=attention), std=0.3).double()
    decoder = model.model.decoder
    memory = model.model.encoder(ids, mask).last_hidden_state
    keys, values = decoder.source(memory)
    hard = decoder.hard_contexts(memory)
    query = torch.randn(ids.shape[0], decoder.attention.query_size or decoder.hidden_size, dtype=torch.float64)
    for j in range(ids.shape[1]):
        one_hot = torch.zeros_like(mask, dtype=torch.bool)
        one_hot[:, j] = True
        context, _ = decoder.attention.attend(query, keys, values, one_hot)
        torch.testing.assert_close(context, hard[:, j])
    states = torch.randn(2, 3, 32, dtype=torch.float64)
    index = torch.tensor([[[0, 2], [1, 1], [6, 3]], [[4, 0], [2, 3], [1, 0]]])
    explicit = decoder.readout(states[:, :, None].expand(-1, -1, 2, -1),
                               torch.stack([hard[b, index[b]] for b in range(2)]))
    torch.testing.assert_close(model.model.candidate_readouts(states, hard, index), explicit)


def test_defaults_are_the_papers_and_a_config_from_before_the_fields_loads_as_trained(tmp_path):
    """beam_joint_rnn defaults to the paper's decoder (Luong-style LSTM, dot attention) and both beam-joint types to
    plain likelihood (label_smoothing 0: the loss is the mixture's NLL); a saved beam_joint_rnn config without
    `rnn_decoder_style` / `rnn_cell` (written before they existed) loads as the Bahdanau-style GRU it was trained
    with, through AutoConfig, AutoModelForSeq2SeqLM and the class, giving the same log-probabilities."""
    import json

    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    config = BeamJointRNNConfig(**tiny_kwargs(**RNN_KW))
    assert (config.rnn_decoder_style, config.rnn_cell, config.rnn_attention) == ("luong", "lstm", "dot")
    assert config.label_smoothing == 0 and BeamJointTransformerConfig(**tiny_kwargs()).label_smoothing == 0
    hybrid = HybridConfig(**tiny_kwargs(**RNN_KW))
    assert (hybrid.rnn_decoder_style, hybrid.rnn_cell, hybrid.label_smoothing) == ("bahdanau", "gru", 0.1)
    ids, mask = source_batch()
    model = randomize(rnn(), std=0.3).double()
    logits = forward_log_probs(model, ids, mask)
    labels = torch.tensor([[6, 9, 12, 15, 2], [8, 10, 2, -100, -100]])
    nll = -logits.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)[labels != -100].mean()
    torch.testing.assert_close(model.compute_loss(logits, labels).double(), nll, rtol=1e-6, atol=1e-7)  # fp32 loss

    old = randomize(rnn(rnn_attention="additive", **BAHDANAU), std=0.3)
    old.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    assert saved["rnn_decoder_style"] == "bahdanau"  # written since the field exists
    del saved["rnn_decoder_style"], saved["rnn_cell"]
    path.write_text(json.dumps(saved))
    assert (AutoConfig.from_pretrained(tmp_path).rnn_decoder_style, AutoConfig.from_pretrained(tmp_path).rnn_cell) \
        == ("bahdanau", "gru")
    expected = forward_log_probs(old, ids, mask)
    for loaded in (AutoModelForSeq2SeqLM.from_pretrained(tmp_path), BeamJointRNNForConditionalGeneration
                   .from_pretrained(tmp_path)):
        assert (loaded.config.rnn_decoder_style, loaded.config.rnn_cell) == ("bahdanau", "gru")
        torch.testing.assert_close(forward_log_probs(loaded.eval(), ids, mask), expected, rtol=0, atol=0)
    assert BeamJointRNNConfig.from_dict({**saved, "rnn_cell": "lstm"}).rnn_cell == "lstm"  # a present key wins


def test_bad_input():
    for kw, field in [(dict(joint_k=0), "joint_k"), (dict(joint_inference_k=0), "joint_inference_k"),
                      (dict(joint_layer=2), "joint_layer"), (dict(joint_layer=-3), "joint_layer"),
                      (dict(joint_chunk_size=0), "joint_chunk_size"), (dict(full_joint="yes"), "full_joint"),
                      (dict(cross_attention=["soft", "hard_retrieval"]), "cross_attention"),
                      (dict(joint_layer=0, cross_attention=["soft", "gaussian"]),
                       r"`cross_attention` of layer 1 \(after `joint_layer`=0\) must treat each query on its own .*"
                       r"allowed: \['hard_retrieval', 'none', 'soft'\], got 'gaussian'"),
                      (dict(joint_layer=0, cross_attention=["soft", "recurrent"]), r"got 'recurrent'")]:
        with pytest.raises(ValueError, match=field):
            transformer(**kw)
    with pytest.raises(ValueError, match="joint_k"):
        rnn(joint_k=0)
    ids, mask = source_batch()
    for model in (transformer(full_joint=True, full_joint_max_source_length=6),
                  rnn(full_joint=True, full_joint_max_source_length=6)):
        with pytest.raises(ValueError, match="full_joint_max_source_length"):
            forward_log_probs(model, ids, mask)
        forward_log_probs(model, ids[:, :6], mask[:, :6])  # at the limit: fine
    model = transformer()
    model.config.joint_k = 0  # edited after construction: refused at forward
    with pytest.raises(ValueError, match="joint_k"):
        forward_log_probs(model)


# ------------------------------------------------------------------------------------------------------------
# HF integration
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["transformer_last", "transformer_layer0", "rnn_luong",
                                                "rnn_bahdanau_multihead"])
def trained(request):
    torch.manual_seed(0)  # module-scoped: built before the per-test seed (conftest), so seeded here
    return request.param, fitted(SETTINGS[request.param](joint_k=3))


def test_cache_equals_no_cache(trained):
    check_cache_equivalence(trained[1])


def test_padded_batch_equals_single(trained):
    check_padded_batch(trained[1])


def test_save_load_and_card(trained, tmp_path):
    reloaded = check_save_load(trained[1], tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "log sum_k P_t(a_k)" in card and "renormalised" in card
    assert reloaded.config.joint_k == 3


@pytest.mark.parametrize("name", ["transformer_last", "rnn_luong"])
def test_remote_code_fresh_process(name, tmp_path):
    check_remote_code(fitted(SETTINGS[name](joint_k=3), steps=100), tmp_path)


@pytest.mark.parametrize("name", ["transformer_last", "rnn_luong"])
def test_trainer(name, tmp_path):
    check_trainer(SETTINGS[name](joint_k=3), tmp_path)


def test_model_keeps_mixture_buffers_between_steps_and_releases_them():
    """Training steps reuse the model's mixture buffers (same storage step after step, and the same loss as a model
    without kept buffers); release_joint_workspace() frees them."""
    ids, mask = source_batch()
    model = randomize(transformer(joint_k=3), std=0.3).train()
    torch.manual_seed(0)
    first = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, labels=DEC).loss
    first.backward()
    assert model._joint_workspace._buffers
    model.release_joint_workspace()
    assert model._joint_workspace._buffers == {}
    torch.manual_seed(0)
    again = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, labels=DEC).loss
    torch.testing.assert_close(again, first)
    torch.manual_seed(0)
    model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, labels=DEC).loss.backward()
    kept = model._joint_workspace.buffer("probs", (1,), torch.float32, "cpu").data_ptr()
    torch.manual_seed(0)
    model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, labels=DEC).loss.backward()
    assert model._joint_workspace.buffer("probs", (1,), torch.float32, "cpu").data_ptr() == kept


# ------------------------------------------------------------------------------------------------------------
# The skeleton decoder's public steps (what beam-joint's decode composes)
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pre_norm", [False, True])
def test_the_decoder_steps_composed_equal_run(pre_norm):
    """start, run_layers over any split of the layers, finish: exactly what HardAttnDecoder.run returns, outputs and
    cache alike, over a first call of three positions and a cached second call of one (padded decoder rows)."""
    from hf_hardattn.caches import HardAttnCache

    torch.manual_seed(0)
    model = randomize(SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs(
        decoder_layers=3, normalize_before=pre_norm)))).eval()
    decoder = model.model.decoder
    ids, mask = source_batch()
    memory = model.model.encoder(ids, mask).last_hidden_state
    dec_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]])  # (a padded key inside the second row)
    calls = [(DEC[:, :3], dec_mask[:, :3]), (DEC[:, 3:4], dec_mask)]
    with torch.no_grad():
        caches = {"run": HardAttnCache()}
        expected = [decoder.run(d, memory, mask, m, None, caches["run"], True, True) for d, m in calls]
        for splits in ([0, 3], [0, 1, 3], [0, 2, 3], [0, 1, 2, 3], [0, 0, 3, 3]):
            cache = HardAttnCache()
            for (d, m), want in zip(calls, expected):
                state = decoder.start(d, memory, mask, m, None, cache, True, True)
                for first, stop in zip(splits, splits[1:]):
                    decoder.run_layers(state, first, stop)
                got = decoder.finish(state)
                for name, value, other in zip(want._fields, want, got):
                    values = value if isinstance(value, tuple) else (value,)
                    others = other if isinstance(other, tuple) else (other,)
                    assert len(values) == len(others), name
                    assert all(torch.equal(a, b) for a, b in zip(values, others)), (splits, name)
            assert cache.get_seq_length() == caches["run"].get_seq_length() == 4
            assert torch.equal(cache.self_attention_cache.layers[2].keys, caches["run"].self_attention_cache.layers[2].keys)
