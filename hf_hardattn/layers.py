"""The layers of the skeleton (Vaswani et al., 2017): positions, feed-forward, soft attention (the interface every
attention kind implements), the residual sub-layer, encoder and decoder layers, the encoder and the decoder.

An attention kind's module is built from its entry in ``registry.KINDS`` (:func:`build_attention`): the skeleton
imports no kind's file; the kinds plug into it.

Runtime code shipped with saved models (``trust_remote_code``): keep it flat, same-folder relative imports only.
"""

import contextlib
import itertools
import math
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPastAndCrossAttentions

from .caches import CACHE_FIELD, StaticHardAttnCache
from .configuration_hardattn import HardAttnConfig
from .inputs import check_ids, check_mask, check_one_of, is_tracing
from .registry import KINDS, ROLES, attention_class, kinds_allowed


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
            if type(self.embed) is nn.Embedding:  # its table is the map: a slice
                return self.embed.weight[start:end]
            return self.embed(torch.arange(start, end, device=self.embed.weight.device))  # wrapped (a PEFT adapter)
        if end > self.limit:  # sinusoidal positions extend beyond the table
            return self.sinusoids(length, start).to(self.table)
        return self.table[start:end]

    def steps(self, positions: torch.Tensor, end: int) -> torch.Tensor:
        """[T, d]: the embeddings of ``positions`` [T] (a tensor: a static cache's position, read without a sync or a
        graph constant), every one below ``end``."""
        self.check_length(end)
        if self.kind == "learned":
            return self.embed(positions)
        return (self.table if end <= self.limit else self.sinusoids(end).to(self.table))[positions]

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
    leading = leading_padding(attention_mask)[:, None]
    return (torch.arange(attention_mask.shape[-1], device=attention_mask.device) - leading).clamp(min=0)


def leading_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B]: the padding positions before each row's first real token of a 0/1 (or bool) mask [B, T]."""
    return (attention_mask.cumsum(-1) == 0).sum(-1)


def see_own_prefix(mask: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """A decoder self-attention ``mask`` (bool, True = may attend) whose query rows that see no key (the padding
    before a left-padded prompt's first token) see their causal prefix instead (padding only): finite outputs there,
    not NaN, which as keys would reach the real queries through their zero weights. Rows that see a key are kept."""
    return mask | (causal & ~mask.any(-1, keepdim=True))


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


# a CPU decoding step with up to WRITTEN_OUT_QUERIES queries per row and at least WRITTEN_OUT_MIN_QUERIES in all
# computes attention written out rather than by the fused kernel (faster there; see SoftAttention.attend)
WRITTEN_OUT_QUERIES, WRITTEN_OUT_MIN_QUERIES = 8, 16


class SoftAttention(nn.Module):
    """Multi-head scaled dot-product attention, softmax(QK^T / sqrt(d_k)) V (Vaswani et al., 2017, Eq. 1).

    The interface every attention kind implements:

    ``forward(hidden, memory=None, mask=None, causal=False, cache=None) -> [B, Tq, d_model]``

    * ``hidden``: the queries' layer input [B, Tq, d]; ``memory``: the encoder output [B, S, d] (cross-attention);
    * ``mask``: bool, broadcastable to [B, heads, Tq, Tk], True = may attend, or None;
    * ``causal``: the decoder's causal mask when ``mask`` is None and Tq == Tk (training, no cache); a kind that sets
      ``causal_built_in = True`` (its weights are 0 after the query by construction) gets as decoder self-attention
      only the key padding mask [B, 1, 1, Tk] (or None) and ``causal=False``;
    * ``cache``: a :class:`HardAttnCache` during cached decoding;
    * ``output_attentions``: also return the attention weights the kind used, ``(output, weights)`` with weights
      [B, heads, Tq, Tk] (transformers' layout; computed only when asked, the fused kernel stays the default).

    Kinds that keep the projections and change only how the weights are formed override :meth:`attend` and
    :meth:`attend_with_weights`.

    As cross-attention it also reads a *grouped* memory: ``memory`` with B rows for ``hidden`` with B x g rows, row r
    of ``hidden`` attending to row r // g of ``memory`` (g beams or returned sequences per sentence; see
    :meth:`HardAttnForConditionalGeneration._expand_inputs_for_generation`). Kinds whose ``forward`` or ``attend``
    treats a query by its position rather than on its own set ``reads_memory_grouped = False``.

    As cross-attention, a kind that reads the decoder's query positions (a left-padded decoder prompt counts them from
    each row's first real token) sets ``reads_decoder_padding = True``: the decoder then passes it the keyword
    ``decoder_padding``, [B] padding positions before each row's first real token (None when no row starts with
    padding); the other kinds never receive it.
    """

    reads_memory_grouped = True
    # declared by each kind's own class (not inherited: HardAttnModel.left_padding_refusal reads the class's own
    # attributes): a left-padded decoder prompt's padding reaches it only as masked keys, and it reads no position
    reads_left_padding = True

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

    def split_heads(self, x: torch.Tensor, parts: int):
        """[B, T, parts * d] -> `parts` tensors [B, H, T, head_dim]."""
        batch, length, _ = x.shape
        return x.view(batch, length, parts, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def project(self, hidden, memory, cache):
        """Queries, keys and values [B, H, T, head_dim], with the keys/values of earlier steps from the cache."""
        if not self.is_cross:
            q, k, v = self.split_heads(self.qkv_proj(hidden), 3)
            if cache is not None:
                k, v = cache.self_attention_cache.update(k, v, self.layer_idx)
            return q, k, v
        (q,) = self.split_heads(self.q_proj(hidden), 1)
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            return q, layer.keys, layer.values
        k, v = self.split_heads(self.kv_proj(memory), 2)
        if cache is not None:
            k, v = cache.cross_attention_cache.update(k, v, self.layer_idx)
            cache.is_updated[self.layer_idx] = True
        return q, k, v

    def attend(self, q, k, v, mask, causal):
        """Eq. 1 of Vaswani et al.: [B, H, Tq, head_dim], by torch's fused kernel (``attn_implementation="sdpa"``, the
        default) or written out (``"eager"``). Under CPU autocast (bf16 training on CPU) the fused kernel runs in fp32:
        the CPU flash kernel's bf16 backward is several times slower than its fp32 one, and attention is a small share
        of the GEMM work bf16 speeds up. A batched decoding step on CPU (no gradient, at most ``WRITTEN_OUT_QUERIES``
        queries per row: one, or one per beam of a grouped memory; at least ``WRITTEN_OUT_MIN_QUERIES`` in all) takes
        the written-out path too, where the fused kernel's overhead outweighs its work (a single row's step is faster
        fused, hence the lower bound on queries in all). While traced (torch.compile), whatever the batch: every step of one
        query per row is written out, so that one graph serves every batch size."""
        queries, rows = q.shape[-2], q.shape[0]
        step = not self.training and not torch.is_grad_enabled() and q.device.type == "cpu"
        if is_tracing():  # one path for every batch size (a compiled graph's rows may be symbolic): a step of one
            step = step and queries == 1  # query per row (a cached decoding step) written out
        else:
            step = step and queries <= WRITTEN_OUT_QUERIES and rows * queries >= WRITTEN_OUT_MIN_QUERIES
        if self.eager or step:
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

    def attend_candidates(self, hidden, k_hist, v_hist, length, attention_mask):
        """Self-attention of the candidates [B, T * K, d] (layer input; beam-joint, see
        :meth:`DecoderLayer.forward_with_candidates`) of the T positions that end the soft history ``k_hist`` /
        ``v_hist`` [B, H, Tk, head_dim]: candidate (t, k) attends to the history strictly before t (and, with
        ``attention_mask`` [B, >= Tk], to its unpadded keys only) and to its own state. Returns (output projection
        [B, T * K, d], weights [B, H, T * K, Tk + 1] after attention dropout, the last column the candidate's own)."""
        key_length = k_hist.shape[2]
        n_cand = hidden.shape[1] // length
        hist_mask = causal_mask(length, key_length, hidden.device).tril(key_length - length - 1)  # strictly earlier
        hist_mask = hist_mask.repeat_interleave(n_cand, dim=0)
        if attention_mask is not None:
            hist_mask = hist_mask & attention_mask[:, None, None, -key_length:].bool()
        q, k_own, v_own = self.split_heads(self.qkv_proj(hidden), 3)
        scale = self.head_dim**-0.5
        hist = (q @ k_hist.transpose(-1, -2)) * scale
        hist = hist.masked_fill(~hist_mask, torch.finfo(hist.dtype).min)
        own = (q * k_own).sum(-1, keepdim=True) * scale
        probs = F.dropout(torch.cat([hist, own], dim=-1).softmax(-1), self.dropout, self.training)
        return self.merge(probs[..., :-1] @ v_hist + probs[..., -1:] * v_own), probs

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
    """Attention kind name -> module class, for every kind of ``registry.KINDS`` with a module."""
    return {name: attention_class(name) for name, kind in KINDS.items() if kind.module is not None}


def build_attention(kind: str, config: HardAttnConfig, role: str, layer_idx: int):
    """The attention module of ``kind`` (its entry in ``registry.KINDS``) for ``role`` in layer ``layer_idx``; None for
    kind "none" (no sub-layer)."""
    if kind not in kinds_allowed(role):
        raise ValueError(f"`{ROLES[role].field}` entry {kind!r} is not a known attention kind; allowed: "
                         f"{kinds_allowed(role)}.")
    attention = attention_class(kind, config)
    return None if attention is None else attention(config, role, layer_idx)


class SubLayer(nn.Module):
    """Residual connection + layer norm around one sub-layer: post-norm LN(x + f(x)) or pre-norm x + f(LN(x))."""

    def __init__(self, config: HardAttnConfig, module: nn.Module):
        super().__init__()
        self.module, self.norm = module, nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.pre_norm, self.dropout = config.normalize_before, config.dropout

    def input(self, x):
        """What the sub-layer's module reads from the residual stream ``x``: LN(x) pre-norm, x post-norm."""
        return self.norm(x) if self.pre_norm else x

    def residual(self, x, out):
        """The new residual stream from ``x`` and the module's output ``out`` (dropout, residual, post-norm)."""
        out = F.dropout(out, self.dropout, self.training)
        return x + out if self.pre_norm else self.norm(x + out)

    def forward(self, x, *args, output_attentions=False, **kwargs):
        """The new residual stream; with ``output_attentions`` (attention sub-layers), ``(stream, weights)``."""
        out = self.module(self.input(x), *args, **(dict(kwargs, output_attentions=True) if output_attentions else kwargs))
        out, weights = out if output_attentions else (out, None)
        x = self.residual(x, out)
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
        # whether the cross-attention takes the ``decoder_padding`` keyword (SoftAttention's docstring)
        self.cross_reads_decoder_padding = bool(getattr(attention, "reads_decoder_padding", False))
        ffn = FeedForward(config.d_model, config.decoder_ffn_dim, config.activation_function, config.activation_dropout)
        self.ffn = SubLayer(config, ffn)

    def forward(self, x, memory, self_mask, causal, cross_mask, cache, output_attentions=False, decoder_padding=None):
        """The layer output; with ``output_attentions``, ``(output, self-attention weights, cross-attention weights)``,
        None for a sub-layer of kind "none". ``decoder_padding`` [B] (or None): each row's padding before its first
        real token, passed to a cross-attention that reads it (``reads_decoder_padding``)."""
        self_weights = cross_weights = None
        if self.self_attn is not None:
            x = self.self_attn(x, mask=self_mask, causal=causal, cache=cache, output_attentions=output_attentions)
            x, self_weights = x if output_attentions else (x, None)
        if self.cross_attn is not None:
            padding = {"decoder_padding": decoder_padding} if self.cross_reads_decoder_padding else {}
            x = self.cross_attn(x, memory=memory, mask=cross_mask, cache=cache, output_attentions=output_attentions,
                                **padding)
            x, cross_weights = x if output_attentions else (x, None)
        x = self.ffn(x)
        return (x, self_weights, cross_weights) if output_attentions else x

    # Beam-joint (Shankar et al. 2018) on a Transformer decoder: in its joint layer the cross-attention is made hard on
    # chosen source positions, one candidate stream per position; the later layers run every candidate beside the soft
    # stream. The selection and the mixture are the model's (beam_joint.py); these two steps run the layer.
    def forward_hard_cross(self, x, memory, self_mask, causal, cross_mask, cache, select, soft=True,
                           output_attentions=False):
        """The layer with its (soft) cross-attention made hard on chosen keys: the self-attention as in
        :meth:`forward`; the per-head log weights of the cross-attention, log softmax(QK^T / sqrt(d_k)) (Eq. 1 in log
        space, at least fp32; a masked key scores the most negative fp32 number, so that logs and gradients stay
        finite), go to ``select``, which returns ``(anything, index [B, T, K])``; candidate k of query t is the layer
        with every head attending only to key ``index[b, t, k]``: the attention output out_proj(concat_h v_h[a]) (a
        constant of the sentence, kept in ``cache.sentence_states`` while decoding with a cache), then residual,
        norms and FFN. One encoder row per decoder row (no grouped memory).

        Returns (the soft stream after the whole layer [B, T, d], or None unless ``soft``; the candidates
        [B, T, K, d]; what ``select`` returned; the self-attention weights (or None); the cross-attention's per-head
        log weights [B, H, T, S])."""
        self_weights = None
        if self.self_attn is not None:
            x = self.self_attn(x, mask=self_mask, causal=causal, cache=cache, output_attentions=output_attentions)
            x, self_weights = x if output_attentions else (x, None)
        sub = self.cross_attn
        attn = sub.module
        q, k, v = attn.project(sub.input(x), memory, cache)  # [B, H, T, hd], [B, H, S, hd]
        scores = q @ k.transpose(-1, -2)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * attn.head_dim**-0.5  # Eq. 1 per head
        if cross_mask is not None:
            scores = scores.masked_fill(~cross_mask, torch.finfo(torch.float32).min)
        log_weights = scores.log_softmax(-1)
        selected = select(log_weights)
        index = selected[-1]
        name = f"hard_cross.{attn.layer_idx}"
        hard = cache.sentence_states.get(name) if cache is not None else None
        if hard is None:  # every head on key a: out_proj(concat_h v_h[a])  [B, S, d]
            hard = attn.merge(v)
            if cache is not None:
                cache.sentence_states[name] = hard
        batch, length, n_cand = index.shape
        picked = torch.gather(hard, 1, index.reshape(batch, -1, 1).expand(-1, -1, hard.shape[-1]))
        y = self.ffn(sub.residual(x[:, :, None, :], picked.view(batch, length, n_cand, -1).to(x.dtype)))
        if soft:  # the soft stream feeds later layers' self-attention
            x = self.ffn(sub.residual(x, attn.merge(attn.attend(q, k, v, cross_mask, False))))
        return (x if soft else None), y, selected, self_weights, log_weights

    def forward_with_candidates(self, x, candidates, memory, self_mask, causal, attention_mask, cross_mask, cache,
                                soft=True, output_attentions=False):
        """A layer after the joint layer: the soft stream ``x`` [B, T, d] as in :meth:`forward` (its keys/values join
        the cache even when ``soft`` is False: later positions read them) and the ``candidates`` [B, T, K, d], whose
        self-attention (soft, or none) reads the soft stream's positions before t (and the cache's; ``attention_mask``
        the decoder's [B, past + T] padding mask, or None) and the candidate's own state, and whose cross-attention and
        FFN are the layer's. Returns (the soft stream, or None unless ``soft``; the candidates [B, T, K, d]; the
        candidates' self-attention weights [B, H, T * K, past + T + 1] (last column: the candidate's own state) or
        None; their cross-attention weights [B, H, T * K, S] or None), queries flattened as t * K + k."""
        batch, length, n_cand, _ = candidates.shape
        y = candidates.reshape(batch, length * n_cand, -1)
        self_weights = cross_weights = None
        if self.self_attn is not None:
            sub = self.self_attn
            attn = sub.module
            q, k, v = attn.project(sub.input(x), None, cache)  # the soft stream (updates the cache)
            out, self_weights = attn.attend_candidates(sub.input(y), k, v, length, attention_mask)
            y = sub.residual(y, out)
            if soft:
                x = sub.residual(x, attn.merge(attn.attend(q, k, v, self_mask, causal)))
        if self.cross_attn is not None:
            if soft:
                x = self.cross_attn(x, memory=memory, mask=cross_mask, cache=cache)
            y = self.cross_attn(y, memory=memory, mask=cross_mask, cache=cache, output_attentions=output_attentions)
            y, cross_weights = y if output_attentions else (y, None)
        if soft:
            x = self.ffn(x)
        y = self.ffn(y)
        return (x if soft else None), y.view(batch, length, n_cand, -1), self_weights, cross_weights


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
    writes_static_cache = True  # its states go through the cache's own writes (see HardAttnModel.static_decoding_refusal)
    # a left-padded decoder prompt: positions counted from each row's first real token, its padding hidden as keys (see
    # decoder_padding and HardAttnModel.left_padding_refusal)
    reads_left_padding = True
    LEADING_PADDING = "decoder.leading_padding"  # the cache's sentence state: [rows] padding before each row's prompt

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
        # per layer: its self-attention zeroes the weights after the query itself (or there is none), so it reads only
        # the key padding mask (see self_attention_mask)
        self.causal_built_in = [layer.self_attn is None or getattr(layer.self_attn.module, "causal_built_in", False)
                                for layer in self.layers]
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None

    def embed(self, input_ids, inputs_embeds, past_length, static_length=None, leading=None):
        """Token + position embeddings of positions past_length, ...; ``static_length``: a static cache's length,
        ``past_length`` then its position tensor; ``leading`` [B]: each row's padding before its first real token,
        subtracted from its positions (those of the padding clamped at 0)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        length = inputs_embeds.shape[1]
        if static_length is None and leading is None:
            x = inputs_embeds + self.embed_positions(past_length, length)
        else:
            positions = past_length + torch.arange(length, device=inputs_embeds.device)
            if leading is not None:  # [B, T]: the count of real tokens before each position
                positions = (positions[None, :] - leading[:, None]).clamp(min=0)
            end = past_length + length if static_length is None else static_length
            x = inputs_embeds + self.embed_positions.steps(positions, end)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return F.dropout(x, self.config.dropout, self.training)

    @staticmethod
    def self_attention_mask(decoder_attention_mask, query_length, past_length, device, causal_built_in=False,
                            left_padded=False):
        """(mask, causal) for decoder self-attention: no mask at all for one cached step, SDPA's causal flag for a
        whole unpadded sequence, an explicit bool mask otherwise. ``causal_built_in``: for a kind whose weights are
        zero after the query by construction (``causal_built_in = True``, e.g. Gaussian): the key padding mask
        [B, 1, 1, Tk] alone (None without padding), O(B Tk), never a [B, 1, Tq, Tk] one. ``left_padded``: some row
        starts with padding, whose queries then see their own prefix (:func:`see_own_prefix`)."""
        key_length = past_length + query_length
        padded = decoder_attention_mask is not None and (is_tracing() or not bool(decoder_attention_mask.all()))
        pad = decoder_attention_mask[:, None, None, -key_length:].bool() if padded else None
        if causal_built_in:
            return pad, False
        if padded:
            causal = causal_mask(query_length, key_length, device)
            mask = causal & pad
            return (see_own_prefix(mask, causal) if left_padded else mask), False
        if query_length == 1:
            return None, False
        if past_length == 0:
            return None, True
        return causal_mask(query_length, key_length, device), False

    @staticmethod
    def static_self_attention_mask(decoder_attention_mask, query_length, position, slots, left_padded=False):
        """Decoder self-attention over a static cache's ``slots`` key slots (:class:`~caches.StaticKVLayer`), bool
        [B or 1, 1, Tq, slots]: query i (at position ``position`` + i, a tensor) sees the slots up to its own and
        never the later ones, unwritten or stale (causal and unfilled in one comparison); with a decoder padding mask
        [B, w] (of positions 0, ..., w - 1), not its padding either (``left_padded``: the padding before a row's
        first token sees its own prefix, :func:`see_own_prefix`). The same shape at every step."""
        device = position.device
        queries = position + torch.arange(query_length, device=device)
        causal = (torch.arange(slots, device=device)[None, :] <= queries[:, None])[None, None]
        mask = causal
        if decoder_attention_mask is not None:
            pad = F.pad(decoder_attention_mask.bool(), (0, slots - decoder_attention_mask.shape[-1]), value=True)
            mask = causal & pad[:, None, None, :]
            if left_padded:
                mask = see_own_prefix(mask, causal)
        return mask

    def decoder_padding(self, attention_mask, cache, past_length, length):
        """(the decoder padding mask of every key, [B, past + T], or None; ``leading`` [B], each row's padding before
        its first real token, or None when no row starts with padding). A left-padded prompt decodes as it would
        alone, as decoder-only models do: each position counts the real tokens before it, and no real query sees a
        padded key. ``leading`` is kept in the cache (a sentence state: the same for every beam of a sentence) for
        later calls that pass no mask, or one of their new positions only (then its past from the cache). While traced
        with a static cache the mask covers every position so far, as generate() passes it."""
        static = isinstance(cache, StaticHardAttnCache)
        stored = cache.sentence_states.get(self.LEADING_PADDING) if cache is not None else None
        past = past_length if not static else 0 if is_tracing() else int(past_length)
        if attention_mask is None and stored is not None:  # the past's padding, from the cache
            width = cache.max_cache_len if static else past + length
            return torch.arange(width, device=stored.device)[None, :] >= stored[:, None], stored
        if attention_mask is None:
            return None, None
        if past and attention_mask.shape[-1] == length:  # the new positions' mask only: the past's before it
            before = (torch.arange(past, device=attention_mask.device)[None, :] >= stored[:, None] if stored is not None
                      else attention_mask.new_ones(attention_mask.shape[0], past))
            attention_mask = torch.cat([before.to(attention_mask.dtype), attention_mask], dim=-1)
        if not is_tracing() and bool(attention_mask[:, 0].all()):
            return attention_mask, None
        leading = leading_padding(attention_mask)
        if cache is not None and stored is None and not is_tracing():
            cache.sentence_states[self.LEADING_PADDING] = leading
        return attention_mask, leading

    def self_attention_masks(self, decoder_attention_mask, query_length, past_length, device, left_padded=False):
        """[(mask, causal)] per decoder layer, from :meth:`self_attention_mask`: the key padding mask alone for a layer
        whose self-attention builds its causal cut in (or that has none), the causal (& padding) mask otherwise; each
        built once, and the [B, 1, Tq, Tk] one only if some layer reads it."""
        built = {}

        def mask(built_in):
            if built_in not in built:
                built[built_in] = self.self_attention_mask(decoder_attention_mask, query_length, past_length, device,
                                                           built_in, left_padded)
            return built[built_in]

        return [mask(built_in) for built_in in self.causal_built_in]

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
        without building a ModelOutput): :meth:`start`, :meth:`run_layers` over every layer, :meth:`finish`."""
        state = self.start(input_ids, encoder_hidden_states, encoder_attention_mask, attention_mask, inputs_embeds,
                           cache, output_attentions, output_hidden_states)
        self.run_layers(state, 0, len(self.layers))
        return self.finish(state)

    # The public steps of `run`, for a model that runs some layers its own way (beam-joint's joint layer): start,
    # run_layers(a, b) for any split, finish.
    def start(self, input_ids, encoder_hidden_states, encoder_attention_mask, attention_mask, inputs_embeds, cache,
              output_attentions=False, output_hidden_states=False) -> "DecoderPass":
        """Embeddings (tokens + positions, after the cache's past), the self- and cross-attention masks, and the
        lists the outputs are recorded in: the :class:`DecoderPass` that :meth:`run_layers` and :meth:`finish` take."""
        past_length = cache.get_seq_length() if cache is not None else 0
        length = (input_ids if inputs_embeds is None else inputs_embeds).shape[1]
        attention_mask, leading = self.decoder_padding(attention_mask, cache, past_length, length)
        if isinstance(cache, StaticHardAttnCache):  # fixed slots: positions and masks from its position tensor
            x = self.embed(input_ids, inputs_embeds, past_length, cache.max_cache_len, leading)
            mask = self.static_self_attention_mask(attention_mask, length, past_length, cache.max_cache_len,
                                                   leading is not None)
            self_masks = [(mask, False)] * len(self.layers)
        else:
            x = self.embed(input_ids, inputs_embeds, past_length, leading=leading)
            self_masks = self.self_attention_masks(attention_mask, length, past_length, x.device, leading is not None)
        check_memory_rows(x.shape[0], encoder_hidden_states, encoder_attention_mask, self.reads_memory_grouped)
        return DecoderPass(x, encoder_hidden_states, self_masks, padding_mask(encoder_attention_mask), attention_mask,
                           cache, output_attentions, output_hidden_states, leading)

    def run_layers(self, state: "DecoderPass", first: int, stop: int) -> "DecoderPass":
        """Layers ``first`` ... ``stop - 1`` on ``state.x``, each recorded; returns ``state``."""
        for layer, (self_mask, causal) in itertools.islice(zip(self.layers, state.self_masks), first, stop):
            if state.output_attentions:
                x, self_weights, cross_weights = layer(state.x, state.memory, self_mask, causal, state.cross_mask,
                                                       state.cache, output_attentions=True,
                                                       decoder_padding=state.leading)
                state.record(x, self_weights, cross_weights)
            else:
                state.record(layer(state.x, state.memory, self_mask, causal, state.cross_mask, state.cache,
                                   decoder_padding=state.leading))
        return state

    def finish(self, state: "DecoderPass") -> "DecoderResult":
        """The cache's count of positions, the final norm of a pre-norm model on ``state.x`` (the last hidden state
        recorded is replaced by the normed one), the :class:`DecoderResult`."""
        x = state.x
        if state.cache is not None:
            state.cache.advance(x.shape[1])
        if self.final_norm is not None:
            x = self.final_norm(x)
        if state.hidden_states is not None:
            state.hidden_states[-1] = x
        return DecoderResult(x, state.hidden_states and tuple(state.hidden_states),
                             state.attentions and tuple(state.attentions),
                             state.cross_attentions and tuple(state.cross_attentions))


class DecoderPass:
    """One call of the decoder between :meth:`HardAttnDecoder.start` and :meth:`HardAttnDecoder.finish`: the stream
    ``x`` (the last recorded state), what every layer reads (memory, masks per layer, cache), the raw decoder
    ``attention_mask`` and ``leading`` (each row's padding before its first real token, [B], or None), and the
    outputs recorded so far (lists, or None when not asked)."""

    def __init__(self, x, memory, self_masks, cross_mask, attention_mask, cache, output_attentions,
                 output_hidden_states, leading=None):
        self.x, self.memory, self.self_masks, self.cross_mask = x, memory, self_masks, cross_mask
        self.attention_mask, self.cache, self.leading = attention_mask, cache, leading
        self.output_attentions, self.output_hidden_states = output_attentions, output_hidden_states
        self.hidden_states = [x] if output_hidden_states else None
        self.attentions, self.cross_attentions = ([], []) if output_attentions else (None, None)

    def record(self, x, self_weights=None, cross_weights=None):
        """A layer's output becomes the stream (and a hidden state, when asked) with its weights (when asked)."""
        self.x = x
        if self.hidden_states is not None:
            self.hidden_states.append(x)
        if self.attentions is not None:
            self.attentions.append(self_weights)
            self.cross_attentions.append(cross_weights)


class DecoderResult(NamedTuple):
    """What ``decode`` hands to ``forward``: the output layer's input (``last_hidden_state``: [B, T, d], or the
    beam-joint candidates) and, when asked, the per-layer outputs in transformers' layout."""

    last_hidden_state: Any
    hidden_states: tuple | None = None
    attentions: tuple | None = None
    cross_attentions: tuple | None = None


__all__ = ["DecoderLayer", "DecoderResult", "EncoderLayer", "FeedForward", "HardAttnDecoder", "HardAttnEncoder",
           "PositionEmbedding", "SoftAttention", "SubLayer", "WRITTEN_OUT_MIN_QUERIES", "WRITTEN_OUT_QUERIES",
           "attention_classes", "build_attention", "causal_mask", "check_memory_rows", "embedding_norm", "full_mask",
           "leading_padding", "padding_mask", "see_own_prefix", "sinusoidal_table", "token_positions", "ungroup_weights"]
