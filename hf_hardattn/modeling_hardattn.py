"""The shared encoder-decoder skeleton of hf_hardattn (Vaswani et al., 2017).

Written once; every variant plugs into it:

* an attention *kind* per role (encoder self-attention, decoder self-attention, cross-attention), looked up in
  :func:`attention_classes`; every kind implements the small interface of :class:`SoftAttention`
  (``forward(hidden, memory=None, mask=None, causal=False, cache=None)``), usually by overriding ``attend``;
* :class:`HardAttnCache`, an ``EncoderDecoderCache`` that also carries per-step recurrent state
  (``cache.states``) and reorders it for beam search;
* :class:`HardAttnForConditionalGeneration`, the ``PreTrainedModel`` + ``GenerationMixin`` that every variant
  subclasses with its own config class.

Runtime code shipped with saved models (``trust_remote_code``): keep it flat, same-folder relative imports only.
"""

import contextlib
import copy
import inspect
import math
import os
import shutil
import tempfile
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from huggingface_hub import ModelCard
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPastAndCrossAttentions, Seq2SeqLMOutput
from transformers.utils import is_tracing as hf_is_tracing
from transformers.utils import logging
from transformers.utils.hub import hf_api

from .configuration_hardattn import ROLES, HardAttnConfig
from .model_card import RESULTS_FILE, write_model_card
from .packed_linear import DEFAULT_MAX_ROWS, Int8Linear, pack_linears, unpack_linears
from .safe_io import atomic_folder, stale_weights, target_folder, verify_folder, write_checksums

# transformers 5.24 renamed the decoding cache from `past_key_values` to `cache`: generate() passes `cache=` and model
# outputs carry `.cache`; earlier 5.x releases use `past_key_values` for both. forward() accepts either name, and
# outputs use the installed release's field (read a cache from an output as `getattr(output, CACHE_FIELD)`).
CACHE_FIELD = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"

logger = logging.get_logger(__name__)

# transformers changed the meaning of a cache's `crop(n)` within 5.x: it was the length to keep (n >= 0) or minus the
# positions to remove (n < 0), and is now only the latter (n <= 0; 5.24 passes `crop(0)` as "remove nothing"). The
# caches here follow the installed release, whose assisted decoding calls it (`assistant_model`, prompt lookup).
CROP_KEEPS_LENGTH = "tokens_to_remove" not in inspect.signature(DynamicLayer.crop).parameters


def cropped_length(length: int, n: int) -> int:
    """The length of a cache of ``length`` positions after ``crop(n)`` in the installed transformers' convention."""
    if n < 0:
        return max(0, length + n)
    if CROP_KEEPS_LENGTH:
        return min(length, n)
    if n > 0:
        raise ValueError(f"`crop` takes minus the number of positions to remove (<= 0), got {n}.")
    return length


# ----------------------------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------------------------
class BufferedLayer(DynamicLayer):
    """A self-attention cache layer whose keys/values live in a preallocated, time-major buffer [T_max, B, H, D]
    that doubles when full. ``keys``/``values`` are [B, H, T, D] views of its filled part.

    ``DynamicLayer`` copies the whole cache at every step (``torch.cat``) and again at every beam reorder
    (``index_select``); here a step writes one time slot, and a reorder gathers the filled part into a second
    buffer in one pass (``index_select(out=...)``) and swaps the two. Other batch edits (repeat, select, crop) are
    rare and rebuild the buffer from the current keys/values. While autograd tracks the cache (a loss over
    step-by-step decoding), steps and reorders go out of place instead, as in ``DynamicLayer``: an in-place write
    would change keys that earlier steps saved for backward, and ``out=`` records no gradient."""

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length, self._k, self._v, self._spare = 0, None, None, None
        self.is_initialized = True

    def _tracked(self, *tensors) -> bool:
        """Whether autograd tracks the cache's buffers or the given new keys/values (then: no in-place writes)."""
        return any(t is not None and t.requires_grad for t in (self._k, self._v, *tensors))

    def _views(self):
        self.keys = self._k[: self.length].permute(1, 2, 0, 3)
        self.values = self._v[: self.length].permute(1, 2, 0, 3)

    def _reserve(self, key_states, value_states, needed):
        if self._k is not None and needed <= self._k.shape[0] and key_states.shape[0] == self._k.shape[1]:
            return
        capacity = max(needed, 32, 2 * (self._k.shape[0] if self._k is not None else 0))
        k = key_states.new_empty((capacity, *key_states.permute(2, 0, 1, 3).shape[1:]))
        v = value_states.new_empty((capacity, *value_states.permute(2, 0, 1, 3).shape[1:]))
        if self.length:
            k[: self.length] = self._k[: self.length]
            v[: self.length] = self._v[: self.length]
        self._k, self._v, self._spare = k, v, None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        steps = key_states.shape[-2]
        new_k, new_v = key_states.permute(2, 0, 1, 3), value_states.permute(2, 0, 1, 3)
        if self._tracked(key_states, value_states):
            if self.length:
                new_k, new_v = torch.cat([self._k[: self.length], new_k]), torch.cat([self._v[: self.length], new_v])
            self._k, self._v, self._spare = new_k, new_v, None
        else:
            self._reserve(key_states, value_states, self.length + steps)
            self._k[self.length : self.length + steps] = new_k
            self._v[self.length : self.length + steps] = new_v
        self.length += steps
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reorder_cache(self, beam_idx):
        if not self.get_seq_length():
            return
        beam_idx = beam_idx.to(self.device)
        keys, values = self._k[: self.length], self._v[: self.length]
        if self._tracked():
            self._k, self._v, self._spare = keys.index_select(1, beam_idx), values.index_select(1, beam_idx), None
        else:
            if self._spare is None:
                self._spare = (torch.empty_like(self._k), torch.empty_like(self._v))
            spare_k, spare_v = self._spare
            torch.index_select(keys, 1, beam_idx, out=spare_k[: self.length])
            torch.index_select(values, 1, beam_idx, out=spare_v[: self.length])
            self._spare, self._k, self._v = (self._k, self._v), spare_k, spare_v
        self._views()

    def _rebuild(self, keys, values):
        self.length, self._k, self._v, self._spare = 0, None, None, None
        if keys.shape[-2]:
            self.update(keys, values)
        else:
            self.keys, self.values = keys, values

    def batch_repeat_interleave(self, repeats: int):
        if self.get_seq_length():
            self._rebuild(self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        if self.get_seq_length():
            self._rebuild(self.keys[indices], self.values[indices])

    def crop(self, n: int):
        """Keep the first positions: see :func:`cropped_length` for ``n``."""
        length = cropped_length(self.get_seq_length(), n)
        if length < self.get_seq_length():
            self.length = length
            self._views()

    def reset(self):
        self.keys = self.values = None
        self.length, self._k, self._v, self._spare = 0, None, None, None
        self.is_initialized = False


class BufferedCache(DynamicCache):
    """A ``DynamicCache`` made of :class:`BufferedLayer` s (the decoder self-attention cache of hf_hardattn)."""

    def __init__(self):
        super().__init__()
        self.layer_class_to_replicate = BufferedLayer


class HardAttnCache(EncoderDecoderCache):
    """``EncoderDecoderCache`` plus the state that a decoder carries from one step to the next.

    * self-attention keys/values are appended per step (``self_attention_cache``), cross-attention keys/values are
      computed once per sentence (``cross_attention_cache`` + ``is_updated``), exactly as in transformers;
    * ``states`` maps a name (e.g. ``"gru.0"`` or ``"prev_context.3"``) to a tensor whose first dimension is the
      batch; :meth:`reorder_cache` reorders them together with the keys/values, so beam search never mixes beams;
    * ``sentence_states``: the same for tensors that are constant over a sentence's decoding (computed from the
      encoder output once); like the cross-attention keys/values, beam reordering leaves them alone;
    * ``seen_tokens`` counts the target positions processed, so that decoders without a self-attention cache
      (an RNN decoder) still report the right ``get_seq_length()`` to ``generate()``.

    Beam search only ever reorders beams *within* a sentence, and every beam of a sentence has the same
    cross-attention keys/values, so :meth:`reorder_cache` leaves the cross-attention cache alone (it is the same
    tensor after reordering). Use :meth:`batch_select_indices` for an arbitrary selection. Under ``generate()`` with
    beams or several returned sequences the cross-attention cache may hold one row per sentence, not per beam
    (grouped memory, see :class:`SoftAttention`).
    """

    def __init__(self, self_attention_cache=None, cross_attention_cache=None):
        super().__init__(
            self_attention_cache if self_attention_cache is not None else BufferedCache(),
            cross_attention_cache if cross_attention_cache is not None else DynamicCache(),
        )
        self.states: dict[str, torch.Tensor] = {}
        self.sentence_states: dict[str, torch.Tensor] = {}
        self.seen_tokens = 0

    @classmethod
    def from_cache(cls, cache):
        """Our cache for ``cache`` (None, a plain ``EncoderDecoderCache`` made by ``generate()``, or ours)."""
        if cache is None:
            return cls()
        if isinstance(cache, cls):
            return cache
        if isinstance(cache, EncoderDecoderCache):
            for part in (cache.self_attention_cache, cache.cross_attention_cache):
                if not isinstance(part, DynamicCache):  # a StaticCache has fixed-length slots that need a mask
                    raise ValueError(
                        f"hf_hardattn models decode with growing (DynamicCache) caches; got a {type(part).__name__} "
                        f"(generate's `cache_implementation`); allowed `cache_implementation`: None or 'dynamic'.")
            self_cache = cache.self_attention_cache
            if type(self_cache) is DynamicCache and self_cache.get_seq_length() == 0:  # generate()'s fresh cache
                self_cache = BufferedCache()
            new = cls(self_cache, cache.cross_attention_cache)
            new.is_updated = dict(cache.is_updated)
            new.seen_tokens = cache.get_seq_length()
            return new
        raise TypeError(
            f"`cache` (`past_key_values`) must be None or an EncoderDecoderCache (e.g. HardAttnCache), got "
            f"{type(cache).__name__}."
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    @property
    def is_linear(self) -> list[bool]:
        """No layer is a linear-attention (state-space) layer. generate() (transformers >= 5.24) cuts an already cached
        decoder prefix only when some layer is not linear, and a decoder that keeps no key/value layers (Gaussian
        self-attention, the hybrid's GRU) would otherwise report an empty list, i.e. "all linear"."""
        return [False] * max(1, len(self.self_attention_cache.layers))

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self.self_attention_cache.reorder_cache(beam_idx)
        for name, state in self.states.items():
            self.states[name] = state.index_select(0, beam_idx.to(state.device))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        for states in (self.states, self.sentence_states):
            for name, state in states.items():
                states[name] = state.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor):
        # A grouped memory's keys/values (one row per sentence, see SoftAttention) are first repeated to one row per
        # decoder row, so that `indices` select decoder rows.
        rows = next((layer.keys.shape[0] for layer in self.self_attention_cache.layers if layer.get_seq_length()),
                    next((state.shape[0] for state in self.states.values()), 0))  # decoder rows
        for layer in self.cross_attention_cache.layers:
            if layer.is_initialized and rows and layer.keys.shape[0] != rows:
                groups = rows // layer.keys.shape[0]
                layer.keys, layer.values = (t.repeat_interleave(groups, dim=0) for t in (layer.keys, layer.values))
        super().batch_select_indices(indices)
        for states in (self.states, self.sentence_states):
            for name, state in states.items():
                states[name] = state[indices]

    def reset(self):
        super().reset()
        self.states.clear()
        self.sentence_states.clear()
        self.seen_tokens = 0

    @property
    def is_croppable(self) -> bool:
        """Read by transformers' assisted decoding (5.24: refused when False, after the first forward)."""
        return not self.states and getattr(self.self_attention_cache, "is_croppable", True)

    def crop(self, n: int) -> None:
        """Remove the last positions (assisted decoding: rejected draft tokens); ``n`` as in :func:`cropped_length`."""
        if self.states and (n < 0 or (CROP_KEEPS_LENGTH and n < self.seen_tokens)):
            raise NotImplementedError(
                f"`crop` (assisted decoding: `assistant_model`, `prompt_lookup_num_tokens`) is not possible for a "
                f"decoder that carries state from step to step ({', '.join(sorted(self.states))}): it cannot be rolled "
                f"back. Allowed: models whose decoder keeps only keys/values (e.g. soft, hard_retrieval, "
                f"beam_joint_transformer)."
            )
        super().crop(n)
        self.seen_tokens = cropped_length(self.seen_tokens, n)


# ----------------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------------
def sinusoidal_table(num_positions: int, dim: int, offset: int = 0, layout: str = "interleaved") -> torch.Tensor:
    """Rows ``offset`` ... ``offset + num_positions - 1`` of a sinusoidal position table [num_positions, dim], fp32.

    * ``"interleaved"``, Vaswani et al. (2017), Sec. 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)),
      PE(pos, 2i+1) = cos(...);
    * ``"marian"``: the same frequencies, the sines in the first half of the features and the cosines in the second
      (transformers' ``MarianSinusoidalPositionalEmbedding``, computed as it does: float64 numpy, rounded to fp32);
    * ``"fairseq"``: sines then cosines with frequencies exp(-i log(10000) / (d/2 - 1)) (fairseq / tensor2tensor,
      transformers' ``M2M100SinusoidalPositionalEmbedding``, computed as it does in fp32), a zero feature for odd d.
    Each row depends only on its position, so any range equals the same rows of a table started at 0."""
    if layout == "marian":
        return _marian_table(num_positions, dim, offset)
    if layout == "fairseq":
        half = dim // 2
        freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
        angle = torch.arange(offset, offset + num_positions, dtype=torch.int64).float()[:, None] * freq[None]
        table = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)
        return torch.cat([table, torch.zeros(num_positions, 1)], dim=1) if dim % 2 else table
    position = torch.arange(offset, offset + num_positions, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(num_positions, dim)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: dim // 2])
    return table


def _marian_table(num_positions: int, dim: int, offset: int) -> torch.Tensor:
    """The "marian" layout, by the operations of transformers' ``MarianSinusoidalPositionalEmbedding.create_weight``
    (float64 numpy; the frequencies by the same scalar ``np.power`` calls) so that its fp32 table is bit-identical."""
    import numpy as np

    inv = np.array([np.power(10000, 2 * (j // 2) / dim) for j in range(dim)])
    angle = np.arange(offset, offset + num_positions, dtype=np.float64)[:, None] / inv[None, :]
    table = torch.empty(num_positions, dim, dtype=torch.float32)
    sentinel = dim // 2 if dim % 2 == 0 else dim // 2 + 1
    table[:, :sentinel] = torch.from_numpy(np.sin(angle[:, 0::2])).float()
    table[:, sentinel:] = torch.from_numpy(np.cos(angle[:, 1::2])).float()
    return table


class PositionEmbedding(nn.Module):
    """Sinusoidal (default) or learned absolute positions: of consecutive positions (``forward``), or of one position
    per token (``at``: a left-padded source, whose positions count from each row's first real token)."""

    def __init__(self, config: HardAttnConfig):
        super().__init__()
        self.kind, self.limit, self.dim = config.position_embedding, config.max_position_embeddings, config.d_model
        self.layout, self.offset = config.sinusoidal_layout, config.position_offset  # (sinusoidal only)
        if self.kind == "learned":
            self.embed = nn.Embedding(self.limit, self.dim)
        else:
            self.register_buffer("table", self.sinusoids(self.limit), persistent=False)

    def sinusoids(self, length: int, start: int = 0) -> torch.Tensor:
        """[length, d] fp32: the sinusoidal embeddings of positions start, ..., start + length - 1."""
        return sinusoidal_table(length, self.dim, offset=start + self.offset, layout=self.layout)

    def check_length(self, end: int):
        if self.kind == "learned" and end > self.limit:
            raise ValueError(
                f"Sequence of {end} positions exceeds `max_position_embeddings`={self.limit} with "
                f"`position_embedding`='learned'; allowed: at most {self.limit} positions (truncate the input, "
                f"or use position_embedding='sinusoidal', which extends beyond the table)."
            )

    def forward(self, start: int, length: int) -> torch.Tensor:
        """[length, d]: positions start, ..., start + length - 1."""
        end = start + length
        self.check_length(end)
        if self.kind == "learned":
            return self.embed.weight[start:end]
        if end > self.limit:  # sinusoidal positions extend beyond the table
            return self.sinusoids(length, start).to(self.table)
        return self.table[start:end]

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, S, d]: the embedding of every position in ``positions`` [B, S] (each < S)."""
        length = positions.shape[-1]
        self.check_length(length)
        if self.kind == "learned":
            return self.embed(positions)
        return (self.table if length <= self.limit else self.sinusoids(length).to(self.table))[positions]


def token_positions(attention_mask):
    """Per-token positions [B, S] counted from each row's first real token (0 on the padding before it), or None when
    every row starts with a real token (right padding or none): positions 0, 1, ..., which the computed ones equal
    then (a data-dependent check, so while tracing, torch.compile / export, they are always computed)."""
    if attention_mask is None or (not is_tracing() and bool(attention_mask[:, 0].all())):
        return None
    leading = (attention_mask.cumsum(-1) == 0).sum(-1, keepdim=True)  # padding before the first real token
    return (torch.arange(attention_mask.shape[-1], device=attention_mask.device) - leading).clamp(min=0)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, activation: str, activation_dropout: float):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, ffn_dim), nn.Linear(ffn_dim, d_model)
        self.act, self.activation_dropout = ACT2FN[activation], activation_dropout

    def forward(self, x):
        return self.fc2(F.dropout(self.act(self.fc1(x)), self.activation_dropout, self.training))


def causal_mask(query_length: int, key_length: int, device) -> torch.Tensor:
    """Boolean [Tq, Tk] mask, True where query i (the last Tq of Tk positions) may attend to key j."""
    return torch.ones(query_length, key_length, dtype=torch.bool, device=device).tril(key_length - query_length)


def full_mask(mask, causal, query_length, key_length, device):
    """The bool mask (True = may attend) implied by ``mask`` / ``causal``, or None when everything is visible."""
    if causal:
        tri = causal_mask(query_length, key_length, device)
        return tri if mask is None else mask & tri
    return mask


def ungroup_weights(weights: torch.Tensor, rows: int) -> torch.Tensor:
    """Attention weights of a grouped memory, [sources, H, g * Tq, Tk] (the g decoder rows of a sentence as one query
    sequence, see SoftAttention), as one row per decoder row: [rows = sources * g, H, Tq, Tk]."""
    sources, heads, queries, keys = weights.shape
    if sources == rows:
        return weights
    groups = rows // sources
    return weights.view(sources, heads, groups, queries // groups, keys).transpose(1, 2).reshape(rows, heads, -1, keys)


def is_tracing() -> bool:
    """Whether a graph is being traced (torch.compile / dynamo, torch.export, torch.jit.trace, CUDA graph capture),
    where a branch on a tensor's value (``bool(tensor...)``) cannot be taken: callers then take their general path
    (e.g. an explicit padding mask even when nothing is padded), which gives the same outputs."""
    return hf_is_tracing()


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-token label-smoothed cross-entropy, computed in fp32 over row chunks of the logits.

    loss_i = lse_i - (1 - eps) x_i[y_i] - (eps / V) sum_v x_i[v]       (= F.cross_entropy with label_smoothing=eps)
    d loss_i / d x_i = softmax(x_i) - eps / V - (1 - eps) onehot(y_i)

    Two passes over the [N, V] logits (forward: logsumexp + sum; backward: one fused softmax-gradient write) instead
    of the five or so of log_softmax + nll + smoothing + their backward, and no fp32 copy of bf16 logits: 1.8x faster
    than F.cross_entropy in fp32 and 4x with bf16 logits (vocab 8000, 3840 tokens, 2 CPU threads)."""

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


def check_finite_logits(logits: torch.Tensor, model) -> None:
    """FloatingPointError if inference ``logits`` hold NaN or +inf (-inf is a legitimate log-probability): generate()
    would otherwise go on emitting tokens chosen from NaN scores (greedy and beam search pick pad with a NaN score,
    sampling stops in torch.multinomial). One reduction over the logits (amax propagates NaN) and one sync per
    forward, a cost far below the output projection's."""
    if not bool(logits.detach().amax() < math.inf):
        raise FloatingPointError(
            f"{type(model).__name__} ({model.config.model_type}) computed NaN or +inf scores at inference: its weights "
            f"or activations have overflowed, so no token it would emit means anything. Check the weights for NaN/inf "
            f"(a diverged training run: lower the learning rate, keep gradient clipping, train in fp32 or bf16 rather "
            f"than fp16) and the inputs (`inputs_embeds`).")


# a CPU decoding step with up to WRITTEN_OUT_QUERIES queries per row and at least WRITTEN_OUT_MIN_QUERIES in all
# computes attention written out rather than by the fused kernel (faster there; see SoftAttention.attend)
WRITTEN_OUT_QUERIES, WRITTEN_OUT_MIN_QUERIES = 8, 16


class SoftAttention(nn.Module):
    """Multi-head scaled dot-product attention, softmax(QK^T / sqrt(d_k)) V (Vaswani et al., 2017, Eq. 1).

    The interface every attention kind implements:

    ``forward(hidden, memory=None, mask=None, causal=False, cache=None) -> [B, Tq, d_model]``

    * ``hidden``: the queries' layer input [B, Tq, d]; ``memory``: the encoder output [B, S, d] (cross-attention);
    * ``mask``: bool, broadcastable to [B, heads, Tq, Tk], True = may attend, or None;
    * ``causal``: the decoder's causal mask when ``mask`` is None and Tq == Tk (training, no cache);
    * ``cache``: a :class:`HardAttnCache` during cached decoding;
    * ``output_attentions``: also return the attention weights the kind used, ``(output, weights)`` with weights
      [B, heads, Tq, Tk] (transformers' layout; computed only when asked, the fused kernel stays the default).

    Kinds that keep the projections and change only how the weights are formed override :meth:`attend` and
    :meth:`attend_with_weights`.

    As cross-attention it also reads a *grouped* memory: ``memory`` with B rows for ``hidden`` with B x g rows, row r
    of ``hidden`` attending to row r // g of ``memory`` (g beams or returned sequences per sentence; see
    :meth:`HardAttnForConditionalGeneration._expand_inputs_for_generation`). Kinds whose ``forward`` or ``attend``
    treats a query by its position rather than on its own set ``reads_memory_grouped = False``.
    """

    reads_memory_grouped = True

    def __init__(self, config: HardAttnConfig, role: str, layer_idx: int):
        super().__init__()
        # "eager" (attn_implementation) writes Eq. 1 out; kept in step by HardAttnPreTrainedModel.set_attn_implementation
        self.eager = config._attn_implementation == "eager"
        self.role, self.layer_idx, self.is_cross = role, layer_idx, role == "cross"
        d_model = config.d_model
        self.num_heads = config.encoder_attention_heads if role == "encoder" else config.decoder_attention_heads
        if self.is_cross and getattr(config, "cross_attention_heads", None):  # per-role head count (Gaussian sh-x)
            self.num_heads = config.cross_attention_heads
        self.head_dim = d_model // self.num_heads
        self.dropout = config.attention_dropout
        if self.is_cross:  # queries from the decoder; keys and values (fused) from the encoder output, once
            self.q_proj, self.kv_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * d_model)
        else:  # fused query/key/value projection
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _split(self, x: torch.Tensor, parts: int):
        """[B, T, parts * d] -> `parts` tensors [B, H, T, head_dim]."""
        batch, length, _ = x.shape
        return x.view(batch, length, parts, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def project(self, hidden, memory, cache):
        """Queries, keys and values [B, H, T, head_dim], with the keys/values of earlier steps from the cache."""
        if not self.is_cross:
            q, k, v = self._split(self.qkv_proj(hidden), 3)
            if cache is not None:
                k, v = cache.self_attention_cache.update(k, v, self.layer_idx)
            return q, k, v
        (q,) = self._split(self.q_proj(hidden), 1)
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            return q, layer.keys, layer.values
        k, v = self._split(self.kv_proj(memory), 2)
        if cache is not None:
            k, v = cache.cross_attention_cache.update(k, v, self.layer_idx)
            cache.is_updated[self.layer_idx] = True
        return q, k, v

    def attend(self, q, k, v, mask, causal):
        """Eq. 1 of Vaswani et al.: [B, H, Tq, head_dim], by torch's fused kernel (``attn_implementation="sdpa"``, the
        default) or written out (``"eager"``). Under CPU autocast (bf16 training on CPU) the fused kernel runs in fp32:
        the CPU flash kernel's bf16 backward is several times slower than its fp32 one (measured: 21 ms vs 4 ms per
        call at d 256, 128 x 30 tokens), and attention is a small share of the GEMM work bf16 speeds up. A batched
        decoding step on CPU (no gradient, at most ``WRITTEN_OUT_QUERIES`` queries per row: one, or one per beam of a
        grouped memory; at least ``WRITTEN_OUT_MIN_QUERIES`` in all) takes the written-out path too, where the fused
        kernel costs more (AVX512 EPYC, 2 threads: 254 vs 200 us for [128, 8, 1, 15] keys, 413 vs 100 us for a grouped
        memory's [32, 8, 4, 24]; but 9 vs 18 us for [1, 8, 1, 15])."""
        queries, rows = q.shape[-2], q.shape[0]
        concrete = type(queries) is int and type(rows) is int  # (traced with symbolic shapes: one path for every shape)
        if self.eager or (concrete and queries <= WRITTEN_OUT_QUERIES and rows * queries >= WRITTEN_OUT_MIN_QUERIES
                          and not self.training and not torch.is_grad_enabled() and q.device.type == "cpu"):
            return self.attend_with_weights(q, k, v, mask, causal)[0]
        fp32 = q.requires_grad and q.device.type == "cpu" and torch.is_autocast_enabled("cpu")  # (never when decoding)
        with torch.autocast("cpu", enabled=False) if fp32 else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                *((t.float() for t in (q, k, v)) if fp32 else (q, k, v)), attn_mask=mask,
                dropout_p=self.dropout if self.training else 0.0, is_causal=causal)
        return out.to(q.dtype) if fp32 else out

    def attend_with_weights(self, q, k, v, mask, causal):
        """Eq. 1 written out: (output [B, H, Tq, head_dim], weights [B, H, Tq, Tk] = softmax(QK^T / sqrt(d_k)) over
        the visible keys, after attention dropout, as transformers' eager attention returns them)."""
        scores = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5
        mask = full_mask(mask, causal, q.shape[-2], k.shape[-2], q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = F.dropout(torch.softmax(scores, dim=-1), self.dropout, self.training)
        return weights @ v, weights

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        """[B, H, Tq, head_dim] heads -> output projection [B, Tq, d_model]."""
        batch, _, length, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))

    def memory_rows(self, memory, cache) -> int:
        """Rows of the encoder output this cross-attention reads: the cached keys' once computed, else ``memory``'s."""
        if cache is not None and cache.is_updated.get(self.layer_idx):
            return cache.cross_attention_cache.layers[self.layer_idx].keys.shape[0]
        return memory.shape[0]

    def forward(self, hidden, memory=None, mask=None, causal=False, cache=None, output_attentions=False):
        batch, length, width = hidden.shape
        sources = self.memory_rows(memory, cache) if self.is_cross else batch
        # Grouped memory: the `batch // sources` consecutive rows of a sentence share its keys/values; queries attend
        # independently, so they go as one sequence of (batch // sources) * length queries.
        if sources != batch:
            hidden = hidden.reshape(sources, -1, width)
        q, k, v = self.project(hidden, memory, cache)
        if not output_attentions:
            return self.merge(self.attend(q, k, v, mask, causal)).reshape(batch, length, -1)
        out, weights = self.attend_with_weights(q, k, v, mask, causal)
        return self.merge(out).reshape(batch, length, -1), ungroup_weights(weights, batch)


def attention_classes() -> dict:
    """Attention kind name -> module class. Imported lazily: the kind files import this skeleton."""
    from .gaussian import GaussianAttention
    from .hard_retrieval import HardRetrievalAttention
    from .recurrent import RecurrentCrossAttention

    return {"soft": SoftAttention, "hard_retrieval": HardRetrievalAttention,
            "recurrent": RecurrentCrossAttention, "gaussian": GaussianAttention}


def build_attention(kind: str, config: HardAttnConfig, role: str, layer_idx: int):
    """The attention module of ``kind`` for ``role`` in layer ``layer_idx``; None for kind "none" (no sub-layer)."""
    if kind == "none":
        return None
    classes = attention_classes()
    if kind not in classes:
        raise ValueError(f"`{ROLES[role][0]}` entry {kind!r} is not a known attention kind; allowed: {sorted(classes) + ['none']}.")
    return classes[kind](config, role, layer_idx)


class SubLayer(nn.Module):
    """Residual connection + layer norm around one sub-layer: post-norm LN(x + f(x)) or pre-norm x + f(LN(x))."""

    def __init__(self, config: HardAttnConfig, module: nn.Module):
        super().__init__()
        self.module, self.norm = module, nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.pre_norm, self.dropout = config.normalize_before, config.dropout

    def forward(self, x, *args, output_attentions=False, **kwargs):
        """The new residual stream; with ``output_attentions`` (attention sub-layers), ``(stream, weights)``."""
        out = self.module(self.norm(x) if self.pre_norm else x, *args,
                          **(dict(kwargs, output_attentions=True) if output_attentions else kwargs))
        out, weights = out if output_attentions else (out, None)
        out = F.dropout(out, self.dropout, self.training)
        x = x + out if self.pre_norm else self.norm(x + out)
        return (x, weights) if output_attentions else x


class EncoderLayer(GradientCheckpointingLayer):  # recomputed in backward under gradient_checkpointing_enable()
    def __init__(self, config: HardAttnConfig, layer_idx: int, kind: str):
        super().__init__()
        attention = build_attention(kind, config, "encoder", layer_idx)
        self.self_attn = SubLayer(config, attention) if attention is not None else None
        ffn = FeedForward(config.d_model, config.encoder_ffn_dim, config.activation_function, config.activation_dropout)
        self.ffn = SubLayer(config, ffn)

    def forward(self, x, mask, output_attentions=False):
        """The layer output; with ``output_attentions``, ``(output, self-attention weights or None for kind "none")``."""
        weights = None
        if self.self_attn is not None:
            x = self.self_attn(x, mask=mask, output_attentions=output_attentions)
            x, weights = x if output_attentions else (x, None)
        x = self.ffn(x)
        return (x, weights) if output_attentions else x


class DecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: HardAttnConfig, layer_idx: int, self_kind: str, cross_kind: str):
        super().__init__()
        attention = build_attention(self_kind, config, "decoder", layer_idx)
        self.self_attn = SubLayer(config, attention) if attention is not None else None
        attention = build_attention(cross_kind, config, "cross", layer_idx)
        self.cross_attn = SubLayer(config, attention) if attention is not None else None
        ffn = FeedForward(config.d_model, config.decoder_ffn_dim, config.activation_function, config.activation_dropout)
        self.ffn = SubLayer(config, ffn)

    def forward(self, x, memory, self_mask, causal, cross_mask, cache, output_attentions=False):
        """The layer output; with ``output_attentions``, ``(output, self-attention weights, cross-attention weights)``,
        None for a sub-layer of kind "none"."""
        self_weights = cross_weights = None
        if self.self_attn is not None:
            x = self.self_attn(x, mask=self_mask, causal=causal, cache=cache, output_attentions=output_attentions)
            x, self_weights = x if output_attentions else (x, None)
        if self.cross_attn is not None:
            x = self.cross_attn(x, memory=memory, mask=cross_mask, cache=cache, output_attentions=output_attentions)
            x, cross_weights = x if output_attentions else (x, None)
        x = self.ffn(x)
        return (x, self_weights, cross_weights) if output_attentions else x


def padding_mask(attention_mask):
    """[B, S] 0/1 mask -> bool [B, 1, 1, S] key mask, or None when nothing is padded (enables fast kernels)."""
    if attention_mask is None or (not is_tracing() and bool(attention_mask.all())):
        return None
    return attention_mask[:, None, None, :].bool()


def check_memory_rows(rows, encoder_hidden_states, encoder_attention_mask, grouped: bool):
    """The encoder output has one row per decoder row (of ``rows``) or, where the decoder reads a ``grouped`` memory,
    one per group of ``rows // sources`` consecutive decoder rows; its mask has the encoder output's rows."""
    sources = encoder_hidden_states.shape[0]
    if sources != rows and (rows % sources or not grouped):
        allowed = f"{rows} or a divisor of it" if grouped else \
            f"{rows} (this model reads one encoder row per decoder row)"
        raise ValueError(f"`encoder_hidden_states` (`encoder_outputs`) has {sources} rows for {rows} decoder rows; "
                         f"allowed: {allowed}.")
    if encoder_attention_mask is not None and encoder_attention_mask.shape[0] != sources:
        raise ValueError(f"`attention_mask` has {encoder_attention_mask.shape[0]} rows for an encoder output of "
                         f"{sources} rows; allowed: {sources}.")


def embedding_norm(config: HardAttnConfig):
    """The LayerNorm over token + position embeddings of ``config.layernorm_embedding`` (BART, mBART), or None."""
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.layernorm_embedding else None


class HardAttnEncoder(nn.Module):
    def __init__(self, config: HardAttnConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        self.embed_tokens, self.embed_positions = embed_tokens, PositionEmbedding(config)
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.layernorm_embedding = embedding_norm(config)
        kinds = config.attention_kinds("encoder")
        self.layers = nn.ModuleList(EncoderLayer(config, i, kind) for i, kind in enumerate(kinds))
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, return_dict=None,
                output_attentions=None, output_hidden_states=None, **kwargs):
        """``BaseModelOutput``: ``last_hidden_state`` [B, S, d]; with ``output_hidden_states``, ``hidden_states`` = the
        embeddings (layer 0's input) and every layer's output, the last one after the final norm of a pre-norm model
        (as transformers' encoders); with ``output_attentions``, ``attentions`` = one [B, heads, S, S] tensor per layer
        (None for a layer of kind "none"). Flags default to the config's. A left-padded source (padding before the
        tokens) gets the same positions as the sentence alone."""
        config = self.config
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        check_one_of("input_ids", input_ids, "inputs_embeds", inputs_embeds)
        if inputs_embeds is None:
            check_ids("input_ids", input_ids, config.vocab_size)
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        elif inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.d_model or 0 in inputs_embeds.shape:
            raise ValueError(f"`inputs_embeds` must be [batch, length, d_model={config.d_model}] (not empty), got "
                             f"{tuple(inputs_embeds.shape)}.")
        if attention_mask is not None:
            check_mask("attention_mask", attention_mask, [inputs_embeds.shape[:2]])
        positions = token_positions(attention_mask)
        x = inputs_embeds + (self.embed_positions(0, inputs_embeds.shape[1]) if positions is None
                             else self.embed_positions.at(positions))
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = F.dropout(x, config.dropout, self.training)
        mask = padding_mask(attention_mask)
        hidden_states, attentions = [x] if output_hidden_states else None, [] if output_attentions else None
        for layer in self.layers:
            if output_attentions:
                x, weights = layer(x, mask, output_attentions=True)
                attentions.append(weights)
            else:
                x = layer(x, mask)
            if output_hidden_states:
                hidden_states.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if output_hidden_states:
            hidden_states[-1] = x
        output = BaseModelOutput(last_hidden_state=x, hidden_states=hidden_states and tuple(hidden_states),
                                 attentions=attentions if attentions is None else tuple(attentions))
        return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()


class HardAttnDecoder(nn.Module):
    def __init__(self, config: HardAttnConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        self.embed_tokens, self.embed_positions = embed_tokens, PositionEmbedding(config)
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.layernorm_embedding = embedding_norm(config)
        self_kinds, cross_kinds = config.attention_kinds("decoder"), config.attention_kinds("cross")
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, s, c) for i, (s, c) in enumerate(zip(self_kinds, cross_kinds))
        )
        # Whether every cross-attention reads a grouped memory (see SoftAttention); the kinds are fixed at construction
        # (with_attention builds a new model), so it is derived once here, not at every decoding step.
        self.reads_memory_grouped = all(layer.cross_attn is None or
                                        getattr(layer.cross_attn.module, "reads_memory_grouped", False)
                                        for layer in self.layers)
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None

    def embed(self, input_ids, inputs_embeds, past_length):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        x = inputs_embeds + self.embed_positions(past_length, inputs_embeds.shape[1])
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return F.dropout(x, self.config.dropout, self.training)

    @staticmethod
    def self_attention_mask(decoder_attention_mask, query_length, past_length, device):
        """(mask, causal) for decoder self-attention: no mask at all for one cached step, SDPA's causal flag for a
        whole unpadded sequence, an explicit bool mask otherwise."""
        key_length = past_length + query_length
        if decoder_attention_mask is not None and (is_tracing() or not bool(decoder_attention_mask.all())):
            pad = decoder_attention_mask[:, None, None, -key_length:].bool()
            return causal_mask(query_length, key_length, device) & pad, False
        if query_length == 1:
            return None, False
        if past_length == 0:
            return None, True
        return causal_mask(query_length, key_length, device), False

    def forward(self, input_ids=None, encoder_hidden_states=None, encoder_attention_mask=None, attention_mask=None,
                inputs_embeds=None, cache=None, output_attentions=None, output_hidden_states=None, return_dict=None,
                **kwargs):
        """``BaseModelOutputWithPastAndCrossAttentions``: ``last_hidden_state`` [B, T, d] (the input of the output
        layer); with ``output_hidden_states``, ``hidden_states`` = the embeddings and every layer's output (the last
        after the final norm of a pre-norm model); with ``output_attentions``, ``attentions`` (self-attention
        [B, heads, T, past + T]) and ``cross_attentions`` ([B, heads, T, S]), one tensor per layer, None for a
        sub-layer of kind "none". Flags default to the config's."""
        config = self.config
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        out = self.run(input_ids, encoder_hidden_states, encoder_attention_mask, attention_mask, inputs_embeds, cache,
                       output_attentions, output_hidden_states)
        output = BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=out.last_hidden_state, hidden_states=out.hidden_states, attentions=out.attentions,
            cross_attentions=out.cross_attentions, **{CACHE_FIELD: cache})
        return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()

    def run(self, input_ids, encoder_hidden_states, encoder_attention_mask, attention_mask, inputs_embeds, cache,
            output_attentions=False, output_hidden_states=False) -> "DecoderResult":
        """``forward`` as a :class:`DecoderResult` (a plain tuple: what the model's ``decode`` reads at every step,
        without building a ModelOutput)."""
        past_length = cache.get_seq_length() if cache is not None else 0
        x = self.embed(input_ids, inputs_embeds, past_length)
        self_mask, causal = self.self_attention_mask(attention_mask, x.shape[1], past_length, x.device)
        check_memory_rows(x.shape[0], encoder_hidden_states, encoder_attention_mask, self.reads_memory_grouped)
        cross_mask = padding_mask(encoder_attention_mask)
        hidden_states = [x] if output_hidden_states else None
        attentions, cross_attentions = ([], []) if output_attentions else (None, None)
        for layer in self.layers:
            if output_attentions:
                x, self_weights, cross_weights = layer(x, encoder_hidden_states, self_mask, causal, cross_mask, cache,
                                                       output_attentions=True)
                attentions.append(self_weights)
                cross_attentions.append(cross_weights)
            else:
                x = layer(x, encoder_hidden_states, self_mask, causal, cross_mask, cache)
            if output_hidden_states:
                hidden_states.append(x)
        if cache is not None:
            cache.seen_tokens += x.shape[1]
        if self.final_norm is not None:
            x = self.final_norm(x)
        if output_hidden_states:
            hidden_states[-1] = x
        return DecoderResult(x, hidden_states and tuple(hidden_states), attentions and tuple(attentions),
                             cross_attentions and tuple(cross_attentions))


class DecoderResult(NamedTuple):
    """What ``decode`` hands to ``forward``: the output layer's input (``last_hidden_state``: [B, T, d], or the
    beam-joint candidates) and, when asked, the per-layer outputs in transformers' layout."""

    last_hidden_state: Any
    hidden_states: tuple | None = None
    attentions: tuple | None = None
    cross_attentions: tuple | None = None


def check_ids(name: str, ids: torch.Tensor, vocab_size: int):
    """Token ids [batch, length]: integers in [0, vocab_size), at least one sentence of at least one token."""
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"`{name}` must be an integer tensor [batch, length], got {ids.dtype} of shape "
                         f"{tuple(ids.shape)}.")
    if 0 in ids.shape:
        raise ValueError(f"`{name}` is empty (shape {tuple(ids.shape)}); allowed: at least one sentence of at least "
                         f"one token.")
    if is_tracing():
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        raise ValueError(f"`{name}` holds {ids[bad][0].item()}, outside the vocabulary; allowed: ids in [0, {vocab_size}).")


def check_mask(name: str, mask: torch.Tensor, shapes: list, right_padded: bool = False, values: bool = True):
    """A 0/1 padding mask whose shape is one of ``shapes``, with a token in every row (and, ``right_padded``, its
    padding after its tokens); ``values=False`` checks the shape only."""
    if tuple(mask.shape) not in [tuple(shape) for shape in shapes]:
        allowed = " or ".join(str(tuple(shape)) for shape in shapes)
        raise ValueError(f"`{name}` has shape {tuple(mask.shape)}; allowed: {allowed} (one 0/1 entry per token).")
    if is_tracing() or not values:
        return
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ValueError(f"`{name}` must hold 0 (padding) and 1 (token) only, got {mask[bad][0].item()}.")
    present = mask.bool()
    empty = ~present.any(-1)
    if bool(empty.any()):
        raise ValueError(f"`{name}` row {int(empty.nonzero()[0])} is all padding; allowed: at least one token (1) per "
                         f"row.")
    if right_padded:
        left = present[:, 1:] & ~present[:, :-1]  # a token after padding
        if bool(left.any()):
            raise ValueError(f"`{name}` row {int(left.nonzero()[0, 0])} has padding before a token: "
                             f"{mask[int(left.nonzero()[0, 0])].tolist()}; decoder inputs must be padded on the right.")


def check_one_of(first: str, a, second: str, b, allow_neither: bool = False):
    if a is not None and b is not None:
        raise ValueError(f"Pass `{first}` or `{second}`, not both.")
    if a is None and b is None and not allow_neither:
        raise ValueError(f"Pass `{first}` or `{second}` (or `labels`, from which the decoder inputs are made).")


def check_labels(labels: torch.Tensor, vocab_size: int):
    """``labels`` [B, T]: integers, each -100 (ignored) or in [0, vocab_size), padded on the right. A row that starts
    with -100 and has real labels after it is left-padded (DataCollatorForSeq2Seq pads the labels on the tokenizer's
    ``padding_side``): its decoder input would be [start, pad, ..., y_1, ...], so it is refused, not learned from."""
    if labels.dim() != 2 or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"`labels` must be an integer tensor [batch, target length], got {labels.dtype} of shape "
                         f"{tuple(labels.shape)}.")
    if is_tracing():  # (the loss checks its labels inside the graph)
        return
    bad = (labels != -100) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        raise ValueError(f"`labels` must be -100 (ignored) or in [0, {vocab_size}), got {labels[bad][0].item()}.")
    left = (labels[:, 0] == -100) & (labels != -100).any(-1)
    if bool(left.any()):
        row = int(left.nonzero()[0])
        raise ValueError(f"`labels` row {row} starts with -100 (ignored) before its tokens: {labels[row].tolist()}; "
                         f"labels must be padded on the right (the collator pads them on the tokenizer's side: set "
                         f"tokenizer.padding_side='right').")


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher-forcing decoder inputs: [start, y_1, ..., y_{n-1}], with -100 label padding replaced by pad."""
    shifted = labels.new_empty(labels.shape)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill_(shifted == -100, pad_token_id)


# ----------------------------------------------------------------------------------------------------------------
# PreTrainedModel
# ----------------------------------------------------------------------------------------------------------------
class HardAttnPreTrainedModel(PreTrainedModel):
    config_class = HardAttnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    # gradient_checkpointing_enable(): every EncoderLayer / DecoderLayer (and the hybrid's GRU step) keeps only its
    # inputs for backward and is recomputed there; torch.utils.checkpoint restores the RNG state for the recomputation,
    # so dropout masks and hard-retrieval samples are drawn again identically
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _no_split_modules = ["EncoderLayer", "DecoderLayer"]

    # Shown in the model card written by save_pretrained (variants override).
    card_title = "Transformer encoder-decoder"
    card_description = "Standard Transformer (Vaswani et al., 2017) with scaled dot-product attention."
    card_citation = "Vaswani et al. (2017). Attention Is All You Need. NeurIPS."

    ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False,
                                              allow_all_kernels=False) -> str:
        """``attn_implementation`` (config, ``from_pretrained`` or ``set_attn_implementation``): None or "sdpa" (torch's
        fused kernel for soft attention, the default) or "eager" (softmax(QK^T / sqrt(d_k)) written out). The other
        kinds have their own kernels under both. Anything else is refused: transformers' other kernels (flash, flex,
        paged, the registry's) expect Marian-style attention modules, which these models do not have."""
        requested = "sdpa" if attn_implementation is None else attn_implementation
        if requested not in self.ATTN_IMPLEMENTATIONS:
            raise ValueError(f"`attn_implementation`={attn_implementation!r} is not supported by {type(self).__name__}; "
                             f"allowed: {list(self.ATTN_IMPLEMENTATIONS)} (or None for 'sdpa').")
        return requested

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        """transformers' method (checked by :meth:`_check_and_adjust_attn_implementation`); the soft attention modules
        then follow the new implementation."""
        super().set_attn_implementation(attn_implementation, *args, **kwargs)
        for module in self.modules():
            if isinstance(module, SoftAttention):
                module.eager = self.config._attn_implementation == "eager"

    def mark_tied_weights_as_initialized(self, loading_info):
        """transformers flags every tied target as initialised before loading the missing keys; our targets are the very
        Parameter of their source (``model.shared.weight``), so the source got the flag too and, absent from a checkpoint,
        was dropped from the missing keys and left on the meta device. A tied source that the checkpoint lacks stays
        missing here, so that it is reported, materialised and initialised (as transformers does for MarianMTModel)."""
        missing_sources = set(self.all_tied_weights_keys.values()) & loading_info.missing_keys
        super().mark_tied_weights_as_initialized(loading_info)
        for key in missing_sources:
            self.get_parameter(key)._is_hf_initialized = False
        loading_info.missing_keys |= missing_sources

    @torch.no_grad()
    def _init_weights(self, module):
        """``config.init_std`` None: Xavier-uniform linear layers, N(0, d^-1/2) token embeddings (scaled by sqrt(d) on
        use); a number: both N(0, init_std) (Marian's, BART's). Zero biases, unit norms, and the sinusoidal table (a
        non-persistent buffer, rebuilt after loading on the meta device)."""
        std = self.config.init_std
        if isinstance(module, nn.Linear):
            if std is None:
                init.xavier_uniform_(module.weight)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=self.config.d_model**-0.5 if std is None else std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, PositionEmbedding) and module.kind == "sinusoidal":
            init.copy_(module.table, module.sinusoids(module.limit))
        elif isinstance(module, HardAttnForConditionalGeneration) and module.final_logits_bias is not None:
            init.zeros_(module.final_logits_bias)

    def pack_linears(self, max_rows: int = DEFAULT_MAX_ROWS):
        """Faster CPU decoding: linear layers multiply inputs of at most ``max_rows`` rows (batch x beams per step)
        with a oneDNN-prepacked copy of their weight, when no gradient is needed (see ``packed_linear.py``; outputs
        equal to float rounding, parameters unchanged). Returns the model; ``unpack_linears()`` undoes it."""
        return pack_linears(self, max_rows)

    def unpack_linears(self):
        return unpack_linears(self)

    # linear layers whose weight the model reads directly (not through the layer's call): kept in fp32 by
    # quantize_int8 (name suffixes; variants extend it)
    INT8_KEEP: tuple = ()
    is_int8: bool = False  # set by quantize_int8

    def quantize_int8(self):
        """int8 inference on CPU (issue #44): every linear layer (the vocabulary projection and the hybrid's GRU/LSTM
        gate projections included) becomes torch's dynamic int8 linear (``torch.ao.quantization.quantize_dynamic``,
        packed for fbgemm on every x86 CPU, whatever ``torch.backends.quantized.engine`` says): int8 weights with one scale per output channel (symmetric, w ~ s_j * round(w / s_j), s_j =
        max|w_j| / 127.5), activations quantised at every call to 7-bit unsigned integers with one scale and zero
        point for the whole input tensor (its min and max), int32 accumulation, fp32 output. Because the activation
        scale is shared by the rows of a call, an int8 output depends slightly on the other sentences of the batch
        and on whether earlier positions are cached (the fp32 model's do not). Layers whose weight the model reads
        directly stay fp32 (``INT8_KEEP``: beam-joint's vocabulary mixture and candidate readout, the additive
        attention's score vector); attention kernels, embeddings, norms and the gate arithmetic stay fp32. Packed
        linears are unpacked first (int8 replaces them). Inference only: afterwards ``train()`` and
        ``save_pretrained`` raise; reload the fp32 checkpoint to undo. Returns the model."""
        import warnings

        if self.training:
            raise ValueError("quantize_int8() is for inference: call model.eval() first (int8 layers have no gradient).")
        if self.is_int8:
            raise ValueError("quantize_int8(): the model is already int8; reload the fp32 checkpoint to start again.")
        kinds = {(p.dtype, p.device.type) for p in self.parameters()}
        if kinds != {(torch.float32, "cpu")}:
            raise ValueError(f"quantize_int8() needs an fp32 model on the CPU (torch's int8 layers run there only); "
                             f"its parameters are {sorted(f'{d} on {t}' for d, t in kinds)}: load or keep it in "
                             f"float32 (bfloat16 and int8 are two separate choices).")
        unpack_linears(self)
        keep = self.INT8_KEEP or ("\0",)
        names = [name for name, module in self.named_modules()
                 if isinstance(module, nn.Linear) and not name.endswith(keep)]
        for name in names:  # a subclass of nn.Linear (the hybrid's RNNHiddenProjection) is called as a plain layer:
            module = self.get_submodule(name)  # torch quantizes nn.Linear itself only
            if type(module) is not nn.Linear:
                plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
                plain.weight, plain.bias = module.weight, module.bias
                self.set_submodule(name, plain)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice (still shipped in 2.13)
            from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

            engine = torch.backends.quantized.engine  # the packed weights keep the engine they were packed with:
            if "fbgemm" in torch.backends.quantized.supported_engines:  # fbgemm on every x86 CPU, not "x86"'s
                torch.backends.quantized.engine = "fbgemm"  # per-CPU choice (oneDNN, other rounding, on VNNI CPUs)
            try:
                quantize_dynamic(self, dict.fromkeys(names, per_channel_dynamic_qconfig), dtype=torch.qint8,
                                 inplace=True)
            finally:
                torch.backends.quantized.engine = engine
        for name in names:  # the same kernel on a shorter call path (packed_linear.Int8Linear)
            Int8Linear.swap_into(self.get_submodule(name))
        self.is_int8 = True
        return self

    def _apply(self, fn, *args, **kwargs):
        """``to`` / ``half`` / ``bfloat16`` / ``cuda``: refused on an int8 model for any other dtype than float32 or a
        device other than the CPU (its int8 layers would fail deep inside the first call)."""
        if self.is_int8:
            probe = fn(torch.zeros((), dtype=torch.float32))
            if probe.dtype != torch.float32 or probe.device.type != "cpu":
                raise ValueError(f"this model was quantized with quantize_int8(): its int8 layers take float32 inputs on "
                                 f"the CPU, so it cannot move to {probe.dtype} on {probe.device.type}; reload the fp32 "
                                 f"checkpoint for that (int8 and bfloat16 are two separate choices).")
        return super()._apply(fn, *args, **kwargs)

    def train(self, mode: bool = True):
        if mode and self.is_int8:
            raise ValueError("this model was quantized with quantize_int8() for inference; reload the fp32 checkpoint "
                             "to train it.")
        return super().train(mode)

    # arguments of save_pretrained(push_to_hub=True) that go to the upload (``token`` also goes to transformers)
    PUSH_ARGUMENTS = ("repo_id", "commit_message", "commit_description", "private", "revision", "create_pr", "tags")

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, tokenizer=None, **kwargs):
        """``PreTrainedModel.save_pretrained`` (safetensors, config, remote code) plus a model card (README.md), the
        sha256 of the weights (``hardattn_checksums.json``, checked by ``from_pretrained``) and the ``tokenizer`` when
        given. The files are written into a new sibling folder that then replaces ``save_directory`` in one step
        (``safe_io.atomic_folder``): a process killed at any point of the save leaves the old or the new complete
        model, and the folder's other files are kept. With ``push_to_hub=True`` the files it writes go to the Hub in
        one commit, as in transformers, but with this card: ``repo_id`` (default: the folder's name) and
        ``push_to_hub``'s arguments (``commit_message``, ``commit_description``, ``private``, ``token``,
        ``revision``, ``create_pr``, ``tags``)."""
        if self.is_int8:
            raise ValueError("save_pretrained: an int8 model (quantize_int8) is not saved; save the fp32 model and call "
                             "quantize_int8() after loading it.")
        if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
            raise TypeError(f"`tokenizer` must be a tokenizer with save_pretrained(), got {type(tokenizer).__name__}")
        hub = {key: kwargs.pop(key) for key in self.PUSH_ARGUMENTS if key in kwargs} if push_to_hub else {}
        if not kwargs.get("is_main_process", True):  # another rank's call: transformers' own (it writes nothing)
            return super().save_pretrained(save_directory, *args, **kwargs)
        final = target_folder(save_directory)
        # transformers' rule: push the files this call (re)writes, not older ones in the folder
        before = self._get_files_timestamps(final) if os.path.isdir(final) else {}
        with atomic_folder(final, drop=stale_weights(kwargs.get("variant"))) as staging:
            super().save_pretrained(staging, *args, **kwargs)
            results = os.path.join(final, RESULTS_FILE)
            if os.path.isfile(results):  # the card shows the folder's results
                shutil.copy2(results, os.path.join(staging, RESULTS_FILE))
            write_model_card(self, staging)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            write_checksums(staging)
        if push_to_hub:
            repo_id = hub.pop("repo_id", os.path.basename(os.path.normpath(str(save_directory))))
            self._upload_to_hub(final, repo_id, before, token=kwargs.get("token"), **hub)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, verify_checksums: bool = True, **kwargs):
        """``PreTrainedModel.from_pretrained``; a local folder is checked first: a truncated or malformed safetensors
        file, or one whose sha256 differs from the one ``save_pretrained`` recorded (``hardattn_checksums.json``),
        raises ``safe_io.CorruptFileError`` naming the file (``verify_checksums=False`` skips the sha256, not the
        header check). Hub downloads are not re-hashed here."""
        if pretrained_model_name_or_path is not None:
            folder = os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
            if os.path.isdir(folder):
                verify_folder(folder, checksums=verify_checksums)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def push_to_hub(self, repo_id: str, *, commit_message=None, commit_description=None, private=None, token=None,
                    revision=None, create_pr: bool = False, max_shard_size="50GB", tags=None, tokenizer=None):
        """``PreTrainedModel.push_to_hub`` (same arguments) plus ``tokenizer``: weights, config, modeling code, this
        package's model card (not transformers' generic template) and the tokenizer when given, in one commit.
        Returns the commit's ``CommitInfo``."""
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, max_shard_size=max_shard_size, tokenizer=tokenizer)
            return self._upload_to_hub(folder, repo_id, {}, private=private, token=token, tags=tags,
                                       commit_message=commit_message, commit_description=commit_description,
                                       revision=revision, create_pr=create_pr)

    def _upload_to_hub(self, folder, repo_id, files_timestamps, *, private=None, token=None, tags=None, **commit):
        """Create the repo if needed, add the model's and the given ``tags`` to the card (as transformers does), and
        upload the files of ``folder`` written after ``files_timestamps`` in one commit (``_upload_modified_files``)."""
        repo_id = hf_api().create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        tags = list(self.model_tags or []) + ([tags] if isinstance(tags, str) else list(tags or []))
        if tags:
            path = os.path.join(folder, "README.md")
            card = ModelCard.load(path)
            card.data.tags = list(dict.fromkeys((card.data.tags or []) + tags))
            card.save(path)
        return self._upload_modified_files(folder, repo_id, files_timestamps, token=token, **commit)


class HardAttnModel(HardAttnPreTrainedModel):
    """Shared token embeddings + encoder + decoder (no output layer)."""

    _tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight", "decoder.embed_tokens.weight": "shared.weight"}

    decoder_class = HardAttnDecoder  # variants with another decoder (the hybrid's GRU) replace it

    def __init__(self, config: HardAttnConfig):
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.encoder = HardAttnEncoder(config, self.shared)
        self.decoder = self.decoder_class(config, self.shared)
        self.post_init()

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, value):
        self.shared = self.encoder.embed_tokens = self.decoder.embed_tokens = value

    def get_encoder(self, *args, **kwargs):
        return self.encoder


class HardAttnForConditionalGeneration(HardAttnPreTrainedModel, GenerationMixin):
    """Encoder-decoder with a (tied) vocabulary projection; trains with a label-smoothed cross-entropy and decodes
    with ``generate()`` (greedy, beam search, sampling) through :class:`HardAttnCache`."""

    _tied_weights_keys = {
        "lm_head.weight": "model.shared.weight",
        "model.encoder.embed_tokens.weight": "model.shared.weight",
        "model.decoder.embed_tokens.weight": "model.shared.weight",
    }
    model_class = HardAttnModel  # variants with another decoder (RNN) replace it

    def __init__(self, config: HardAttnConfig):
        super().__init__(config)
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # `config.final_logits_bias`: a fixed bias added to the logits (a buffer, as in BART / Marian), else None
        self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size) if config.final_logits_bias
                             else None)
        self.post_init()

    def get_encoder(self, *args, **kwargs):
        return self.model.encoder

    def get_decoder(self, *args, **kwargs):
        return self.model.decoder

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor):
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def decode(self, decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
               decoder_inputs_embeds, cache, output_attentions=False, output_hidden_states=False) -> DecoderResult:
        """The decoder's :class:`DecoderResult` (hidden states [B, T, d] for the output layer; per-layer weights and
        states when asked). Variants whose decoder is not the skeleton's override this."""
        return self.model.decoder.run(decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
                                      decoder_inputs_embeds, cache, output_attentions, output_hidden_states)

    def output_logits(self, hidden, **kwargs):
        """Vocabulary scores [B, T, V] from decoder states (the beam-joint variant overrides this)."""
        logits = self.lm_head(hidden)
        return logits if self.final_logits_bias is None else logits + self.final_logits_bias

    def resize_token_embeddings(self, *args, **kwargs):
        """``PreTrainedModel.resize_token_embeddings``; the ``final_logits_bias`` buffer, when there is one, follows
        the new vocabulary size (kept rows unchanged, new ones 0), as in BART."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        bias = self.final_logits_bias
        if bias is not None and bias.shape[-1] != embeddings.weight.shape[0]:
            size = embeddings.weight.shape[0]
            new = bias.new_zeros(1, size)
            new[:, : min(size, bias.shape[-1])] = bias[:, :size]
            self.final_logits_bias = new
        return embeddings

    def compute_loss(self, logits, labels, num_items_in_batch=None):
        """Label-smoothed cross-entropy over the non-ignored (-100) target tokens (:func:`smoothed_cross_entropy`, equal
        to ``F.cross_entropy(..., label_smoothing=...)``). With ``num_items_in_batch`` (given by the Trainer under
        gradient accumulation) the token sum is divided by it, so accumulated micro-batches give exactly the loss of
        one large batch."""
        labels = labels.reshape(-1).to(logits.device)
        total = smoothed_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, self.config.label_smoothing).sum()
        return token_mean(total, labels, num_items_in_batch)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        encoder_outputs=None,
        past_key_values=None,
        inputs_embeds=None,
        decoder_inputs_embeds=None,
        labels=None,
        use_cache=None,
        return_dict=None,
        num_items_in_batch=None,
        cache=None,
        output_attentions=None,
        output_hidden_states=None,
        **kwargs,
    ):
        """``Seq2SeqLMOutput`` (a tuple in its field order with ``return_dict=False``). ``output_attentions`` adds
        ``encoder_attentions``, ``decoder_attentions`` and ``cross_attentions``: one tensor per layer, [batch, heads,
        query, key], holding the weights each attention kind really used (see each kind's ``attend_with_weights`` /
        ``forward``), None in the slot of a sub-layer of kind "none". ``output_hidden_states`` adds
        ``encoder_hidden_states`` and ``decoder_hidden_states`` (the embeddings and every layer's output; the last
        decoder one is the output layer's input). Both default to the config's flags and cost nothing when off."""
        config = self.config
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = config.return_dict if return_dict is None else return_dict
        if cache is not None and past_key_values is not None:
            raise ValueError("Pass the decoding cache as `cache` or as `past_key_values` (its name before "
                             "transformers 5.24), not both.")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if labels is not None:
            check_labels(labels, self.config.vocab_size)
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        if use_cache and self.training and torch.is_grad_enabled() and self._decoder_checkpointing():
            # a checkpointed layer runs again in backward: it would write its keys/values into the cache twice
            logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing in training. Setting "
                                "`use_cache=False`.")
            use_cache = False
        source_given = encoder_outputs is not None  # (else the encoder checks the source as it reads it)
        if encoder_outputs is None:
            encoder_outputs = self.model.encoder(input_ids, attention_mask, inputs_embeds, return_dict=True,
                                                 output_attentions=output_attentions,
                                                 output_hidden_states=output_hidden_states)
        elif isinstance(encoder_outputs, (tuple, list)):  # as transformers' models read a tuple
            encoder_outputs = BaseModelOutput(*encoder_outputs[:3])
        cache = HardAttnCache.from_cache(past_key_values if cache is None else cache) if use_cache else None
        self.check_decoder_inputs(decoder_input_ids, decoder_attention_mask, decoder_inputs_embeds,
                                  encoder_outputs.last_hidden_state, attention_mask if source_given else None, cache)
        decoded = self.decode(
            decoder_input_ids, encoder_outputs.last_hidden_state, attention_mask, decoder_attention_mask,
            decoder_inputs_embeds, cache, output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        logits = self.output_logits(decoded.last_hidden_state, encoder_hidden_states=encoder_outputs.last_hidden_state,
                                    attention_mask=attention_mask)
        if not self.training and not is_tracing():
            check_finite_logits(logits, self)
        loss = self.compute_loss(logits, labels, num_items_in_batch) if labels is not None else None
        output = Seq2SeqLMOutput(
            loss=loss, logits=logits, decoder_hidden_states=decoded.hidden_states,
            decoder_attentions=decoded.attentions, cross_attentions=decoded.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states, encoder_attentions=encoder_outputs.attentions,
            **{CACHE_FIELD: cache},
        )
        return output if return_dict else output.to_tuple()

    def check_decoder_inputs(self, decoder_input_ids, decoder_attention_mask, decoder_inputs_embeds, memory,
                             attention_mask, cache):
        """Clear errors where the decoder's inputs enter: ids in the vocabulary or embeddings of d_model (one of the
        two), a right-padded 0/1 ``decoder_attention_mask`` of [B, T] or [B, cached + T] (continuing from a cache),
        and a given encoder output's ``attention_mask`` of its [B, S]."""
        check_one_of("decoder_input_ids", decoder_input_ids, "decoder_inputs_embeds", decoder_inputs_embeds)
        if decoder_inputs_embeds is None:
            check_ids("decoder_input_ids", decoder_input_ids, self.config.vocab_size)
            rows, length = decoder_input_ids.shape
        else:
            if decoder_inputs_embeds.dim() != 3 or decoder_inputs_embeds.shape[-1] != self.config.d_model \
                    or 0 in decoder_inputs_embeds.shape:
                raise ValueError(f"`decoder_inputs_embeds` must be [batch, length, d_model={self.config.d_model}] (not "
                                 f"empty), got {tuple(decoder_inputs_embeds.shape)}.")
            rows, length = decoder_inputs_embeds.shape[:2]
        if decoder_attention_mask is not None:
            past = cache.get_seq_length() if cache is not None else 0
            check_mask("decoder_attention_mask", decoder_attention_mask, [(rows, length), (rows, past + length)],
                       right_padded=True)
        if attention_mask is not None:  # (its values once per sentence: generate() passes the same mask at every step)
            check_mask("attention_mask", attention_mask, [memory.shape[:2]],
                       values=cache is None or cache.get_seq_length() == 0)

    def _decoder_checkpointing(self) -> bool:
        """Whether gradient checkpointing is on for any part of the decoder (``gradient_checkpointing_enable()``)."""
        return any(getattr(module, "gradient_checkpointing", False) for module in self.model.decoder.modules())

    def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs):
        """``generate()`` repeats every sentence ``expand_size`` times (beams, ``num_return_sequences``). When the
        decoder reads a grouped memory (skeleton decoder and output layer, cross-attention kinds that allow it), the
        encoder output and its mask stay at one row per sentence: cross-attention keys/values are then projected,
        cached and read once per sentence instead of once per beam. Outputs are unchanged (tested against the
        expanded path)."""
        grouped = (expand_size > 1 and is_encoder_decoder and model_kwargs.get("encoder_outputs") is not None
                   and self._memory_grouped_decoding())
        kept = {key: model_kwargs.pop(key) for key in ("encoder_outputs", "attention_mask")
                if grouped and key in model_kwargs}
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size=expand_size, is_encoder_decoder=is_encoder_decoder and not grouped, input_ids=input_ids,
            **model_kwargs)
        model_kwargs.update(kept)
        return input_ids, model_kwargs

    decode_reads_memory_grouped = True  # declared beside each ``decode`` that passes a grouped memory through

    def _memory_grouped_decoding(self) -> bool:
        """Whether generate() may hand the decoder a grouped memory: the class that defines ``decode`` declares that it
        passes one through, the output layer is this one, and the decoder reads it. A variant that overrides
        ``decode`` or ``output_logits`` (beam-joint) keeps the expanded memory unless it declares otherwise."""
        owner = next(cls for cls in type(self).__mro__ if "decode" in vars(cls))
        return (vars(owner).get("decode_reads_memory_grouped", False)
                and type(self).output_logits is HardAttnForConditionalGeneration.output_logits
                and self.model.decoder.reads_memory_grouped)

    def with_attention(self, **kinds):
        """A copy of this model whose attention kinds are replaced, sharing no tensors with it, e.g.
        ``model.with_attention(cross_attention="hard_retrieval")`` to decode a soft-trained model with hard
        retrieval (hard-retrieval paper, Table 4). Keys: encoder_attention, decoder_attention, cross_attention.
        Kinds with other parameters than the trained ones fail with the missing/unexpected parameter names."""
        fields = [field for field, _ in ROLES.values()]
        for key in kinds:
            if key not in fields:
                raise ValueError(f"`{key}` is not an attention role field; allowed: {fields}.")
        config = copy.deepcopy(self.config)
        for key, value in kinds.items():
            setattr(config, key, value)
        config.check()
        model = type(self)(config).to(device=self.device, dtype=self.dtype)
        model.load_state_dict(self.state_dict(), strict=True)
        model.generation_config = copy.deepcopy(self.generation_config)
        return model.train(self.training)


__all__ = [
    "HardAttnCache",
    "SoftAttention",
    "HardAttnModel",
    "HardAttnPreTrainedModel",
    "HardAttnForConditionalGeneration",
    "attention_classes",
    "build_attention",
]
