"""Hard retrieval attention (Xu, Liu, van Genabith & Xiong, "Learning Hard Retrieval Decoder Attention for
Transformers", arXiv:2009.14658).

Every head of a hard-retrieval attention layer attends to exactly ONE key and returns its value row.

* Training (Sec. 3.1): P = softmax(QK^T / sqrt(d_k)) (Eq. 1-2); one index per query row is sampled from P
  (multinomial, Eq. 4-5) and the output is the value row at that index (Eq. 6; attention dropout, if any, drops that
  row after the draw, or, with ``retrieval_dropout="before_draw"`` as in the authors' code, drops probabilities
  before it, see :func:`sampled_retrieval`). The sampling
  is treated as noise (Eq. 7): the gradient of the one-hot P_hard is passed straight to P (Eq. 8), with
  P_hard^g = A^g V^T (Eq. 9) and V^g[i] = sum of A^g[j] over the queries j that retrieved i (Eq. 10), computed by
  indexing (scatter-add) rather than a one-hot matmul.
* Inference (Sec. 3.2): no scaling, no softmax, no P.V: index = argmax of the raw masked scores S = QK^T (Eq. 11),
  output = V[index] (Eq. 6).
* A query row with no visible key (only reachable by calling the module directly: the model refuses a fully padded
  row where the input enters) is drawn from all keys in training and takes the argmax of all its raw scores at
  inference, the same key set in both.

Runtime code shipped with saved models: flat, same-folder relative imports only.
"""

import torch
import torch.nn.functional as F
from transformers import GenerationMixin

from .configuration_hardattn import HardAttnConfig
from .layers import SoftAttention, full_mask
from .modeling_hardattn import HardAttnForConditionalGeneration, HardAttnModel
from .registry import KINDS

# Where attention dropout acts in training (config ``retrieval_dropout``, a setting of the kind, default in the registry)
DROPOUT_PLACEMENTS = ("after_draw", "before_draw")


def check_retrieval_dropout(config) -> str:
    """The config's ``retrieval_dropout`` (its kind default where the config lacks it); a ValueError for another."""
    placement = getattr(config, "retrieval_dropout", KINDS["hard_retrieval"].settings["retrieval_dropout"])
    if placement not in DROPOUT_PLACEMENTS:
        raise ValueError(f"`retrieval_dropout` must be one of {DROPOUT_PLACEMENTS} (where attention dropout acts on hard "
                         f"retrieval: on the retrieved row after the draw, or on the probabilities before it), got "
                         f"{placement!r}.")
    return placement


def gather_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [B, H, Tk, D], index [B, H, Tq] -> values[b, h, index[b, h, q]]: [B, H, Tq, D] (Eq. 6)."""
    return torch.gather(values, 2, index.unsqueeze(-1).expand(*index.shape, values.shape[-1]))


class HardRetrieval(torch.autograd.Function):
    """Forward: retrieve V[index] (Eq. 6). Backward: straight-through to the probabilities (Eq. 8-9) and a
    scatter-add into the retrieved value rows (Eq. 10)."""

    @staticmethod
    def forward(ctx, probs, values, index):
        ctx.save_for_backward(values, index)
        return gather_rows(values, index)

    @staticmethod
    def backward(ctx, grad_out):
        values, index = ctx.saved_tensors
        grad_probs = grad_values = None
        if ctx.needs_input_grad[0]:
            grad_probs = grad_out @ values.transpose(-1, -2)  # Eq. 8-9: P^g = P_hard^g = A^g V^T
        if ctx.needs_input_grad[1]:  # Eq. 10, by indexing
            expanded = index.unsqueeze(-1).expand_as(grad_out)
            grad_values = torch.zeros_like(values).scatter_add_(2, expanded, grad_out.to(values.dtype))
        return grad_probs, grad_values, None


def sample_indices(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs`` [..., Tk], drawn from P itself (Eq. 4-5): a masked (zero-probability) position
    is never drawn."""
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]).float(), 1).view(probs.shape[:-1])


def sampled_retrieval(probs: torch.Tensor, values: torch.Tensor, dropout: float = 0.0, placement: str = "after_draw"):
    """The training path (Sec. 3.1): one index per query sampled from P [..., Tq, Tk] (Eq. 4-5) and its value row
    retrieved with the straight-through gradient (Eq. 6-10). Returns (output [..., Tq, D], index [..., Tq]).

    Attention dropout (``dropout`` = p > 0; the paper does not discuss it) acts where ``placement`` says:

    * ``"after_draw"`` (default): the sampled distribution is P itself; the retrieved row is dropped as dropout drops a
      soft attention weight, i.e. kept and scaled by 1 / (1 - p) with probability 1 - p, zero otherwise (per query
      and head).
    * ``"before_draw"`` (the authors' code, hfxunlp/transformer ``modules/attn/retr.py``): dropout on P, then the draw
      from the kept probabilities renormalised, P' = m * P / sum(m * P) with m_j ~ Bernoulli(1 - p) per key; the
      straight-through gradient reaches P through the dropout mask. This changes what is sampled: P = [0.9, 0.1] at
      p = 0.5 draws index 1 with probability 0.3 rather than 0.1 (always when 0.9 is dropped and 0.1 kept, 0.25; with
      0.1 when both are kept or both dropped, 2 x 0.025). A row whose every probability is dropped draws from P (the
      authors add a small constant to key 0 instead)."""
    if placement not in DROPOUT_PLACEMENTS:
        raise ValueError(f"`placement` must be one of {DROPOUT_PLACEMENTS}, got {placement!r}.")
    if dropout > 0 and placement == "before_draw":
        dropped = F.dropout(probs, dropout, True)
        empty = (dropped.detach() == 0).all(-1, keepdim=True)  # every key dropped: draw from P
        dropped = torch.where(empty, probs, dropped)
        index = sample_indices(dropped.detach())  # multinomial renormalises the kept probabilities
        return HardRetrieval.apply(dropped, values, index), index
    index = sample_indices(probs.detach())
    out = HardRetrieval.apply(probs, values, index)
    if dropout > 0:
        out = out * F.dropout(out.new_ones(out.shape[:-1]), dropout, True).unsqueeze(-1)
    return out, index


def masked_scores(scores, mask, causal):
    """``scores`` [..., Tq, Tk] with the keys that ``mask`` / ``causal`` hide set to -inf; a query row with no visible
    key keeps all of its keys (training draws and inference argmaxes over the same key set, never over NaN)."""
    mask = full_mask(mask, causal, scores.shape[-2], scores.shape[-1], scores.device)
    if mask is None:
        return scores
    return scores.masked_fill(~(mask | ~mask.any(-1, keepdim=True)), float("-inf"))


def training_probabilities(q, k, mask, causal, scaling):
    """P = softmax(QK^T * scaling) (Eq. 1-2; scaling = d_k^-1/2 in the paper) over the visible keys, before attention
    dropout (a query row with no visible key: over all of its keys, see :func:`masked_scores`)."""
    return torch.softmax(masked_scores((q @ k.transpose(-1, -2)) * scaling, mask, causal), dim=-1)


def inference_indices(q, k, mask, causal):
    """Eq. 11: argmax over the raw masked scores S = QK^T, without scaling or softmax (a row with no visible key: over
    all of its keys, as in training)."""
    return masked_scores(q @ k.transpose(-1, -2), mask, causal).argmax(-1)


class HardRetrievalAttention(SoftAttention):
    """Multi-head attention whose heads each retrieve one value row (same parameters as soft attention, so a model
    can be decoded with the other kind than it was trained with; hard-retrieval paper, Table 4). Attention dropout acts
    where the config's ``retrieval_dropout`` says (:func:`sampled_retrieval`)."""

    reads_left_padding = True  # masked keys (padding) are never retrieved: -inf before the argmax or the draw

    def __init__(self, config: HardAttnConfig, role: str, layer_idx: int):
        super().__init__(config, role, layer_idx)
        self.dropout_placement = check_retrieval_dropout(config)

    def training_probabilities(self, q, k, mask, causal):
        """P = softmax(QK^T / sqrt(d_k)) (Eq. 1-2) over the visible keys, before attention dropout (a query row with no
        visible key, e.g. a direct call with a fully padded row, over all keys rather than NaN probabilities)."""
        return training_probabilities(q, k, mask, causal, self.head_dim**-0.5)

    def retrieve(self, q, k, v, mask, causal):
        """(output [B, H, Tq, head_dim], the retrieved index [B, H, Tq])."""
        if not self.training:
            index = inference_indices(q, k, mask, causal)  # Eq. 11
            return gather_rows(v, index), index  # Eq. 6
        return sampled_retrieval(self.training_probabilities(q, k, mask, causal), v, self.dropout,
                                 self.dropout_placement)  # Eq. 4-10

    def attend(self, q, k, v, mask, causal):
        return self.retrieve(q, k, v, mask, causal)[0]

    def attend_with_weights(self, q, k, v, mask, causal):
        """(output, weights [B, H, Tq, Tk]): the one-hot of the index each head retrieved (sampled in training, the
        argmax at inference), so that weights @ V is the output. The weights carry no gradient."""
        out, index = self.retrieve(q, k, v, mask, causal)
        return out, torch.nn.functional.one_hot(index, k.shape[-2]).to(v.dtype)


class HardRetrievalConfig(HardAttnConfig):
    """Hard retrieval in decoder self- and cross-attention, soft encoder (the paper's main setting). Any role can be
    set to "hard_retrieval" or "soft" (e.g. ``cross_attention="hard_retrieval", decoder_attention="soft"``).
    ``retrieval_dropout``: where ``attention_dropout`` acts on hard retrieval in training, ``"after_draw"`` (default:
    on the retrieved row; the draw is from P) or ``"before_draw"`` (on P before the draw, as the authors' code); see
    :func:`sampled_retrieval`. Any config with a hard-retrieval role reads it."""

    model_type = "hard_retrieval_transformer"
    decoder_attention: str | list[str] = "hard_retrieval"
    cross_attention: str | list[str] = "hard_retrieval"
    retrieval_dropout: str = KINDS["hard_retrieval"].settings["retrieval_dropout"]

    def check(self):
        super().check()
        check_retrieval_dropout(self)


class HardRetrievalModel(HardAttnModel):
    """The bare encoder-decoder (``AutoModel``): last_hidden_state = the decoder's last hidden state."""

    config_class = HardRetrievalConfig


class HardRetrievalForConditionalGeneration(HardAttnForConditionalGeneration, GenerationMixin):
    config_class = HardRetrievalConfig
    model_class = HardRetrievalModel
    card_title = "Transformer with hard retrieval decoder attention"
    card_description = (
        "Each head of a hard-retrieval attention layer attends to exactly one token. Training samples one index per "
        "query from the softmax attention probabilities and back-propagates straight through (Eqs. 7-10); inference "
        "takes the argmax of the raw scores and indexes the value rows (Eq. 11), with no softmax and no weighted sum. "
        "The default uses it in decoder self- and cross-attention with a soft encoder. Soft and hard attention share "
        "their parameters: `model.with_attention(cross_attention=\"soft\")` decodes with the other kind."
    )
    card_citation = (
        "Hongfei Xu, Qiuhui Liu, Josef van Genabith, Deyi Xiong. Learning Hard Retrieval Decoder Attention for "
        "Transformers. arXiv:2009.14658 (hard-retrieval-decoder-attention)."
    )


__all__ = [
    "HardRetrievalAttention",
    "HardRetrieval",
    "HardRetrievalConfig",
    "HardRetrievalForConditionalGeneration",
    "HardRetrievalModel",
    "gather_rows",
    "sample_indices",
    "sampled_retrieval",
    "DROPOUT_PLACEMENTS",
    "masked_scores",
    "training_probabilities",
    "inference_indices",
]
