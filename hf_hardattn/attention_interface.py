"""Hard retrieval as an attention implementation of stock transformers models (MarianMTModel, BART, ...).

``import hf_hardattn`` registers these names with ``transformers.AttentionInterface`` (and, for the masks they
receive, ``transformers.masking_utils.AttentionMaskInterface``)::

    model = MarianMTModel.from_pretrained(path, attn_implementation="hard_retrieval")   # or
    model.set_attn_implementation("hard_retrieval")

======================== ================================================ =========================================
name                     hard retrieval in                                the paper's Table 3 row
======================== ================================================ =========================================
``hard_retrieval``       decoder self- and cross-attention (encoder soft) Dec Cross- and Self-Attn (main setting)
``hard_retrieval_cross`` cross-attention only                             Dec Cross-Attn
``hard_retrieval_all``   encoder self-, decoder self- and cross-attention Enc Self- and Dec Cross- and Self-Attn
======================== ================================================ =========================================

They correspond to a ``hard_retrieval_transformer`` with ``decoder_attention`` / ``cross_attention`` /
``encoder_attention`` set to ``"hard_retrieval"`` for the same roles. :func:`register` adds another combination.

Role rule. The attention function gets the attention module and reads its two flags, which Marian, BART and the
models copied from them set at construction: ``module.is_causal`` True -> decoder self-attention; else
``module.is_decoder`` True -> cross-attention (the decoder's ``encoder_attn``); else encoder self-attention. A module
with neither attribute is refused (its role cannot be told).

Hard roles (``hard_retrieval.py``, Sec. 3 of the paper): in training (``module.training``) P = softmax(QK^T * scaling)
over the visible keys, one key per query sampled from P and the value row retrieved with straight-through gradients,
attention dropout (the ``dropout`` transformers passes) dropping that row after the draw (``sampled_retrieval``,
Eq. 4-10); in eval mode the argmax of the raw masked scores QK^T, no scaling, no softmax (``inference_indices``,
Eq. 11), and the value row (``gather_rows``, Eq. 6). The returned weights are None unless ``output_attentions`` is
asked for, then the one-hot of the retrieved index. Soft roles run transformers' own ``sdpa_attention_forward``, or,
when ``output_attentions`` is asked for, the model's own ``eager_attention_forward`` (softmax weights returned).

Masks. For a name transformers does not know, ``create_causal_mask`` / ``create_bidirectional_mask`` return None
(padding silently dropped, transformers 5.10.1 to 5.24 at least), so each name is also registered with the
``AttentionMaskInterface``: ``sdpa_mask`` with the causal shortcut off, i.e. a bool [B, 1, Tq, Tk] mask (True = may
attend) for decoder self-attention, always materialised (no upper-left-aligned ``is_causal`` shortcut to
reinterpret), and for encoder self- and cross-attention a bool mask, or None when nothing is padded. The function
also accepts what a caller may pass as a ready 4D mask: bool, or additive float (entries at or below half the
dtype's minimum, -inf included, are hidden, everything else visible; additive biases are not applied to the hard
argmax), and None for decoder self-attention (then causal, aligned to the last key as in cached decoding). A query
row with no visible key (only padding rows) reads all of its keys, as ``inference_indices`` and ``sampled_retrieval``
define it: the argmax of all raw scores at inference, a draw over all keys in training.
"""

import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .hard_retrieval import gather_rows, inference_indices, sampled_retrieval, training_probabilities
from .layers import full_mask
from .registry import ROLES as ROLE_ENTRIES

ROLES = tuple(ROLE_ENTRIES)  # the role names: encoder, decoder, cross

VARIANTS = {
    "hard_retrieval": ("decoder", "cross"),
    "hard_retrieval_cross": ("cross",),
    "hard_retrieval_all": ROLES,
}


def attention_role(module) -> str:
    """"encoder" (encoder self-attention), "decoder" (decoder self-attention) or "cross", from the module's flags."""
    is_causal, is_decoder = getattr(module, "is_causal", None), getattr(module, "is_decoder", None)
    if is_causal is None and is_decoder is None:
        raise ValueError(f"{type(module).__name__} has neither `is_causal` nor `is_decoder`: hard retrieval cannot "
                         "tell whether it is encoder self-, decoder self- or cross-attention.")
    if is_causal:
        return "decoder"
    return "cross" if is_decoder else "encoder"


def visible_mask(attention_mask):
    """The bool mask (True = may attend) of what a transformers attention function receives, or None."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_floating_point():  # additive: 0 (or any bias) visible, dtype minimum / -inf hidden
        return attention_mask > torch.finfo(attention_mask.dtype).min / 2
    return attention_mask != 0


def hard_retrieval_mask(*args, **kwargs):
    """The mask builder registered for every hard-retrieval name: ``sdpa_mask`` (bool, True = may attend) that always
    materialises causal masks (no None standing for sdpa's ``is_causal``); bidirectional masks may still be None when
    nothing is padded."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _repeat_heads(key, value, heads):
    """Grouped-query attention: the key/value heads repeated to the query's head count (transformers' ``repeat_kv``)."""
    if key.shape[1] == heads:
        return key, value
    groups = heads // key.shape[1]
    return key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)


def hard_retrieve(module, query, key, value, mask, scaling, dropout, output_attentions=False):
    """Hard retrieval of [B, H, Tq, D] queries over [B, H, Tk, D] keys/values with a bool ``mask`` (None = all
    visible): (output [B, H, Tq, D], one-hot weights [B, H, Tq, Tk] or None)."""
    key, value = _repeat_heads(key, value, query.shape[1])
    if not module.training:
        index = inference_indices(query, key, mask, False)  # Eq. 11: argmax of the raw masked scores
        out = gather_rows(value, index)  # Eq. 6
    else:  # Eq. 1-2 with the module's scaling (a row with no visible key samples over all keys), then Eq. 4-10
        out, index = sampled_retrieval(training_probabilities(query, key, mask, False, scaling), value, dropout)
    weights = torch.nn.functional.one_hot(index, key.shape[-2]).to(value.dtype) if output_attentions else None
    return out, weights


def _eager_function(module):
    """The model's own ``eager_attention_forward`` (what ``attn_implementation="eager"`` runs for it), else BART's."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        from transformers.models.bart.modeling_bart import eager_attention_forward as eager
    return eager


def soft_attention(module, query, key, value, mask, scaling, dropout, **kwargs):
    """transformers' soft attention for the roles left soft: sdpa, or the model's eager function when
    ``output_attentions`` asks for the softmax weights. ``mask``: bool or None."""
    if kwargs.get("output_attentions", False):
        if mask is not None:
            hidden = torch.finfo(query.dtype).min
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(~mask, hidden)
        return _eager_function(module)(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)


def make_attention_function(hard_roles):
    """The transformers attention function with hard retrieval in ``hard_roles`` (a subset of ROLES), soft elsewhere.
    Signature and return value are transformers': ``(module, query, key, value, attention_mask, scaling=None,
    dropout=0.0, **kwargs) -> (attn_output [B, Tq, H, D], attn_weights [B, H, Tq, Tk] or None)``."""
    hard_roles = frozenset(hard_roles)
    unknown = hard_roles - set(ROLES)
    if unknown:
        raise ValueError(f"unknown attention roles {sorted(unknown)}; allowed: {list(ROLES)}")

    def hard_retrieval_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        role = attention_role(module)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        mask = visible_mask(attention_mask)
        # Decoder self-attention without a mask (a caller's own None; the registered mask builder always gives one):
        # causal, the Tq queries being the last Tq of the Tk positions.
        mask = full_mask(mask, role == "decoder" and mask is None and query.shape[-2] > 1,
                         query.shape[-2], key.shape[-2], query.device)
        if role not in hard_roles:
            return soft_attention(module, query, key, value, mask, scaling, dropout, **kwargs)
        out, weights = hard_retrieve(module, query, key, value, mask, scaling, dropout,
                                     output_attentions=kwargs.get("output_attentions", False))
        return out.transpose(1, 2).contiguous(), weights

    hard_retrieval_attention.hard_roles = hard_roles
    return hard_retrieval_attention


def register(name: str | None = None, hard_roles=None) -> None:
    """Register ``name`` (hard retrieval in ``hard_roles``) with transformers' attention and mask interfaces; without
    arguments, every name of VARIANTS. ``import hf_hardattn`` calls this."""
    variants = VARIANTS if name is None else {name: VARIANTS[name] if hard_roles is None else tuple(hard_roles)}
    for variant, roles in variants.items():
        AttentionInterface.register(variant, make_attention_function(roles))
        AttentionMaskInterface.register(variant, hard_retrieval_mask)


__all__ = ["ROLES", "VARIANTS", "attention_role", "hard_retrieval_mask", "hard_retrieve", "make_attention_function",
           "register", "soft_attention", "visible_mask"]
