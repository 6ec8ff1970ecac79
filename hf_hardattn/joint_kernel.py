r"""The beam-joint mixture's kernel (Shankar, Garg & Sarawagi 2018, Eq. 4-5 in log space): the K x vocabulary output
distributions of the attention beam's candidates mixed chunk by chunk (:class:`JointMixture`, a custom autograd
function that recomputes each chunk in backward), the buffers it reuses between calls (:class:`JointWorkspace`), and
the selection of the attention beam (:func:`select_candidates`). ``beam_joint.py`` builds the candidates; this file
mixes them.

Runtime code shipped with saved models: flat, same-folder relative imports only.
"""

import math

import torch

from .inputs import is_tracing


def at_least_fp32(x):
    """``x`` in fp32, or in its own dtype where that is wider (fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class JointMixture(torch.autograd.Function):
    """out[n, v] = logsumexp_k( log_weights[n, k] + log_softmax(hidden[n, k] @ weight^T)[v] )   (Eq. 4-5, log space)

    hidden [N, K, d] (one output-layer input per candidate), log_weights [N, K] (fp32; -inf = absent candidate),
    weight [V, d] (the tied vocabulary projection). Rows are processed ``chunk_rows // K`` tokens at a time; backward
    recomputes each chunk's logits instead of storing N x K x V values (the candidates' log-normalisers [N, K] are
    kept, and so is the last chunk, so a batch of at most ``chunk_rows`` candidate rows is never recomputed).

    The logsumexp over k is factored through each candidate's own maximum m_k = max_v z_k[v]: with
    e_k = exp(z_k - m_k) and s_k = sum_v e_k, out = log sum_k (w_k / s_k) e_k, a [1, K] x [K, V] product per token
    (fp32). It equals the log-space form unless a mixture value underflows; a chunk with any value below
    ``_floor`` (fp32: log-probability below about -70) is recomputed in the plain log-space form (``_exact_*``),
    forward and backward, so the result is exact either way. With G = dL/dout, a = G / exp(out), p_k = softmax(z_k):
        dL/dlw_k = sum_v G[v] r_k[v] = w_k sum_v p_k[v] a[v]   (r_k = w_k p_k / mix, the posterior of candidate k),
        dL/dz_k[u] = p_k[u] (w_k a[u] - dL/dlw_k).
    On a CPU the [n, K, V] elementwise work, not the GEMMs, is most of a step, and a fresh tensor of that size costs
    about as much again in page faults: every [n, K, V] tensor is one of three buffers of a :class:`JointWorkspace`
    (logits in the GEMM's dtype, fp32 probabilities, fp32 scratch), every operation on them is in place or writes
    into them. Under autocast the GEMMs run in its dtype (bf16) as a plain ``matmul`` would; all else is fp32.
    """

    @staticmethod
    def forward(ctx, hidden, log_weights, weight, chunk_rows, workspace=None):
        n_tokens, k, _ = hidden.shape
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.workspace = workspace if workspace is not None else JointWorkspace()
        ctx.token = ctx.workspace.claim()
        with torch.autocast(device, enabled=False):
            return JointMixture._forward(ctx, hidden, log_weights, weight, max(1, chunk_rows // k))

    @staticmethod
    def _gemm_dtype(ctx, hidden):
        _, enabled, dtype = ctx.autocast
        return dtype if enabled and hidden.dtype == torch.float32 else hidden.dtype

    @staticmethod
    def _forward(ctx, hidden, log_weights, weight, step):
        n_tokens, k, _ = hidden.shape
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 stays fp64)
        gemm = JointMixture._gemm_dtype(ctx, hidden)
        h_all, w = hidden.to(gemm), weight.to(gemm)
        out = torch.empty(n_tokens, weight.shape[0], dtype=acc, device=hidden.device)
        lse = torch.empty(n_tokens, k, dtype=acc, device=hidden.device)  # log-normaliser of every candidate
        ctx.shape = (min(step, n_tokens), k, weight.shape[0])  # of the [rows, K, V] buffers
        probs, logits = JointMixture._buffers(ctx.workspace, ctx.shape, acc, gemm, hidden.device)
        one = logits is probs  # one buffer when the GEMMs run in the accumulation dtype
        floor, exact, last = _floor(acc), set(), None
        for start in range(0, n_tokens, step):
            chunk = slice(start, start + step)
            n = min(step, n_tokens - start)
            e = probs[:n]
            z = e if one else logits[:n]
            torch.matmul(h_all[chunk], w.t(), out=z)
            if not one:  # (copy, then fp32 in place: a mixed-dtype op is slower on a CPU)
                e.copy_(z)
            top = e.amax(-1, keepdim=True)
            log_s = e.sub_(top).exp_().sum(-1, keepdim=True).log_()  # e = exp(z - m), log s  [n, K, 1]
            lse[chunk] = (top + log_s).squeeze(-1)
            lw = log_weights[chunk].to(acc)[..., None]
            coef = (lw - log_s).exp()  # w_k / s_k  [n, K, 1]
            mix = torch.bmm(coef.transpose(1, 2), e).squeeze(1)  # sum_k w_k p_k[v]  [n, V]
            if bool((mix < floor).any()):  # an underflow: this chunk in plain log space
                exact.add(start)
                if one:  # the logits were overwritten in place (a separate GEMM-dtype buffer still holds them)
                    torch.matmul(h_all[chunk], w.t(), out=z)
                out[chunk] = torch.logsumexp(JointMixture._exact_log_joint(z, lw, lse[chunk], acc), dim=1)
                last = None
            else:
                out[chunk] = mix.log_()
                last = (start, e, coef, log_s)
        ctx.save_for_backward(hidden, log_weights, weight, out, lse)
        ctx.step, ctx.exact = step, exact
        ctx.last = last if any(ctx.needs_input_grad[:3]) else None  # kept: no recompute for it
        return out

    @staticmethod
    def _buffers(workspace, shape, acc, gemm, device):
        probs = workspace.buffer("probs", shape, acc, device)
        return probs, probs if gemm == acc else workspace.buffer("logits", shape, gemm, device)

    @staticmethod
    def _exact_log_joint(z, lw, lse, acc):
        """log P(a_k) + log_softmax(z_k)  [n, K, V], fp32: the plain log-space form (a fresh tensor)."""
        return z.to(acc) - (lse[..., None] - lw)

    @staticmethod
    def backward(ctx, grad_out):
        device, _, _ = ctx.autocast
        with torch.autocast(device, enabled=False):
            return JointMixture._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        hidden, log_weights, weight, out, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_lw = torch.empty_like(log_weights) if ctx.needs_input_grad[1] else None
        acc = out.dtype
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[2] else None
        gemm = JointMixture._gemm_dtype(ctx, hidden)
        h_all, w = hidden.to(gemm), weight.to(gemm)
        grad_out = grad_out.to(acc)
        workspace = ctx.workspace
        if workspace.owner is not ctx.token:  # a later forward took the buffers over: recompute in buffers of our own
            workspace, ctx.last = JointWorkspace(), None
        probs, logits = JointMixture._buffers(workspace, ctx.shape, acc, gemm, hidden.device)
        one = logits is probs
        scratch = workspace.buffer("scratch", probs.shape, acc, hidden.device)
        for start in reversed(range(0, hidden.shape[0], ctx.step)):
            chunk = slice(start, start + ctx.step)
            n = min(ctx.step, hidden.shape[0] - start)
            e, t = probs[:n], scratch[:n]
            z = e if one else logits[:n]
            lw = log_weights[chunk].to(acc)[..., None]
            if start in ctx.exact:
                torch.matmul(h_all[chunk], w.t(), out=z)
                g_lw = JointMixture._exact_grads(z, lw, lse[chunk], out[chunk], grad_out[chunk], acc, e)
                g_z = e if one else z.copy_(e)
            else:
                if ctx.last is not None and ctx.last[0] == start:
                    _, e, coef, log_s = ctx.last  # the forward's e = exp(z - m) and w_k / s_k
                    ctx.last = None
                else:
                    torch.matmul(h_all[chunk], w.t(), out=z)
                    if not one:
                        e.copy_(z)
                    e.sub_(lse[chunk][..., None]).exp_()  # p_k = softmax(z_k): s = 1
                    coef, log_s = lw.exp(), None
                a = grad_out[chunk] * torch.exp(-out[chunk])  # G / mix  [n, V]
                g_lw = coef.squeeze(-1) * torch.bmm(e, a[:, :, None]).squeeze(-1)  # w_k sum_v p_k a  [n, K]
                # dL/dz_k = e_k (coef_k a - dL/dlw_k / s_k), written in the GEMMs' dtype
                shift = -g_lw[..., None] if log_s is None else -g_lw[..., None] * (-log_s).exp()
                torch.addcmul(shift, a[:, None, :], coef, out=t)
                g_z = e.mul_(t) if one else z.copy_(e.mul_(t))
            if grad_lw is not None:
                grad_lw[chunk] = g_lw.to(grad_lw.dtype)
            if grad_hidden is not None:
                grad_hidden[chunk] = (g_z @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (g_z.reshape(-1, g_z.shape[-1]).t() @ h_all[chunk].reshape(-1, hidden.shape[-1])).to(acc)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_lw, grad_weight, None, None

    @staticmethod
    def _exact_grads(z, lw, lse, out, grad_out, acc, result):
        """The log-space backward of one chunk (used where the forward underflowed): writes dL/dz into ``result``
        and returns dL/dlw. r_k = exp(joint_k - out) is the posterior of candidate k given v."""
        joint = JointMixture._exact_log_joint(z, lw, lse, acc)
        weighted = torch.sub(joint, out[:, None, :]).exp_().mul_(grad_out[:, None, :])  # G r_k
        g_lw = weighted.sum(-1)
        softmax = joint.sub_(lw.clamp(min=torch.finfo(acc).min)).exp_()  # an absent candidate: r_k = 0
        torch.addcmul(weighted, softmax, g_lw[..., None], value=-1.0, out=result)
        return g_lw


class JointWorkspace:
    """The mixture's [rows, K, V] buffers, kept between calls by the model that owns them (``JointOutputMixin``):
    a fresh tensor of that size costs about as much in page faults as the work done on it. Each forward claims them
    until its backward; a backward that finds them claimed by a later forward (e.g. a second model's forward in
    between) recomputes in buffers of its own, so sharing never changes a result. They grow to the largest call
    seen (at most ``joint_chunk_size`` rows) and are freed with the model or by ``release`` (the model's
    ``release_joint_workspace()``)."""

    def __init__(self):
        self.owner, self._buffers = None, {}

    def claim(self):
        self.owner = object()
        return self.owner

    def buffer(self, name, shape, dtype, device):
        size = math.prod(shape)
        key = (name, dtype, torch.device(device))
        flat = self._buffers.get(key)
        if flat is None or flat.numel() < size:
            flat = self._buffers[key] = torch.empty(size, dtype=dtype, device=device)
        return flat[:size].view(shape)

    def release(self):
        self.owner, self._buffers = None, {}


def _floor(dtype):
    """The smallest mixture probability the factored forward trusts (fp32: ~1.6e-31, log -70): at least one term of
    the sum is then far above the subnormal range, so the sum has full relative precision."""
    return torch.finfo(dtype).tiny ** 0.8


def joint_mixture(logits, log_weights):
    """The plain log-space form of Eq. 4-5: logits [..., K, V] of every candidate, log_weights [..., K] -> mixture
    log-probabilities [..., V] in fp32 (fp64 for fp64 logits), all K x V values at once (no chunks, no buffers)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    return torch.logsumexp(log_weights.to(acc)[..., None] + logits.to(acc).log_softmax(-1), dim=-2)


def joint_log_probs(hidden, log_weights, weight, chunk_rows=16384, workspace=None):
    """hidden [..., K, d], log_weights [..., K] -> mixture log-probabilities [..., V] in fp32 (fp64 for fp64
    inputs) (Eq. 4-5). ``workspace``: a :class:`JointWorkspace` reused between calls (None = buffers of this call)."""
    lead = hidden.shape[:-2]
    if is_tracing():  # a traced graph (compile, export): the plain log-space form, no buffers or branch on values
        return joint_mixture(torch.matmul(hidden, weight.t()), log_weights)
    out = JointMixture.apply(hidden.reshape(-1, *hidden.shape[-2:]), log_weights.reshape(-1, log_weights.shape[-1]),
                             weight, chunk_rows, workspace)
    return out.view(*lead, weight.shape[0])


def select_candidates(log_p, k, full_joint, renormalize):
    """The attention beam: log_p [..., S] (log P_t(a), padded positions ~ -3e38) -> (log weights [..., K'], indices
    [..., K']). Full-joint keeps every position (Eq. 4); beam-joint the top-K (Eq. 5; K' = min(K, S): a K larger than
    a sentence's length keeps all its unpadded positions, the padded ones selected to fill K' get weight exactly 0).
    Renormalisation divides the top-K weights by their sum. TopK is pass-through: the indices carry no gradient."""
    if full_joint:
        index = torch.arange(log_p.shape[-1], device=log_p.device).expand_as(log_p)
        return log_p, index
    log_w, index = log_p.topk(min(k, log_p.shape[-1]), dim=-1)
    if renormalize:
        log_w = log_w - torch.logsumexp(log_w, dim=-1, keepdim=True)
    return log_w, index


__all__ = ["JointMixture", "JointWorkspace", "at_least_fp32", "joint_log_probs", "joint_mixture", "select_candidates"]
