"""The training loss of the skeleton: per-token label-smoothed cross-entropy, computed in fp32 over row chunks of the
logits, and its mean over the target tokens.

Runtime code shipped with saved models (``trust_remote_code``): keep it flat, same-folder relative imports only.
"""

import torch

from .inputs import is_tracing


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-token label-smoothed cross-entropy, computed in fp32 over row chunks of the logits.

    loss_i = lse_i - (1 - eps) x_i[y_i] - (eps / V) sum_v x_i[v]       (= F.cross_entropy with label_smoothing=eps)
    d loss_i / d x_i = softmax(x_i) - eps / V - (1 - eps) onehot(y_i)

    Two passes over the [N, V] logits (forward: logsumexp + sum; backward: one fused softmax-gradient write) instead
    of the five or so of log_softmax + nll + smoothing + their backward, and no fp32 copy of bf16 logits: less memory
    traffic than F.cross_entropy, the more so with bf16 logits."""

    @staticmethod
    def forward(ctx, logits, labels, eps, chunk):
        rows, vocab = logits.shape
        valid = labels != -100
        safe = torch.where(valid, labels, 0)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, chunk):
            part = slice(start, start + chunk)
            x = logits[part].float()
            lse[part] = torch.logsumexp(x, -1)
            loss[part] = lse[part] - (1.0 - eps) * x.gather(1, safe[part, None]).squeeze(1)
            if eps:
                loss[part] -= (eps / vocab) * x.sum(-1)
        ctx.save_for_backward(logits, safe, valid, lse)
        ctx.eps, ctx.chunk = eps, chunk
        return loss.masked_fill_(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, safe, valid, lse = ctx.saved_tensors
        eps, chunk = ctx.eps, ctx.chunk
        scale = grad_loss.float() * valid
        grad = torch.empty_like(logits)
        target = torch.full((min(chunk, logits.shape[0]), 1), -(1.0 - eps), device=logits.device)
        for start in range(0, logits.shape[0], chunk):
            part = slice(start, start + chunk)
            p = torch.sub(logits[part].float(), lse[part, None]).exp_()  # softmax, a new tensor (never in place)
            if eps:
                p.sub_(eps / logits.shape[1])
            p.scatter_add_(1, safe[part, None], target[: p.shape[0]])
            grad[part] = p.mul_(scale[part, None])
        return grad, None, None, None


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0,
                           chunk: int = 256) -> torch.Tensor:
    """Per-token label-smoothed cross-entropy [N] of logits [N, V] (any float dtype; fp32 arithmetic) against labels
    [N]; tokens labelled -100 get 0 and no gradient. Equal to ``F.cross_entropy(logits.float(), labels,
    ignore_index=-100, label_smoothing=label_smoothing, reduction="none")``, faster and with memory bounded by
    ``chunk`` rows of fp32."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"`logits` must be [N, V] and `labels` [N], got {tuple(logits.shape)} and {tuple(labels.shape)}.")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"`label_smoothing` must be in [0, 1), got {label_smoothing!r}.")
    bad = (labels != -100) & ((labels < 0) | (labels >= logits.shape[1]))
    allowed = f"`labels` must be -100 (ignored) or in [0, {logits.shape[1]})"
    if is_tracing():  # a graph cannot branch on values: the same check, run by the graph
        torch._check_tensor_all_with(ValueError, ~bad, lambda: f"{allowed}.")
    elif bad.any():
        raise ValueError(f"{allowed}, got {labels[bad][0].item()}.")
    return _SmoothedCrossEntropy.apply(logits, labels, float(label_smoothing), chunk)


def token_mean(total: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """A summed token loss divided by ``num_items_in_batch`` (given by the Trainer under gradient accumulation, so
    accumulated micro-batches give exactly the loss of one large batch) or else by the non-ignored (-100) labels.
    A batch without any (every label -100) gives a loss of 0 and zero gradients, not 0 / 0 = NaN."""
    count = (labels != -100).sum() if num_items_in_batch is None else num_items_in_batch
    return total / (count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1))


__all__ = ["smoothed_cross_entropy", "token_mean"]
