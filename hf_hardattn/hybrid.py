"""Hybrid of a self-attention encoder and an RNN decoder (Wang, Wu & Liu, "Accelerating Transformer Decoding via a
Hybrid of Self-attention and Recurrent Neural Network", Sec. 2.1).

The encoder is the skeleton's Transformer encoder (N layers). The decoder is a GRU (Cho et al., 2014; one layer by
default, paper: 512 embedding, 1024 hidden) whose step depends on the previous state s_{t-1}, the previous target
word y_{t-1} and a source context c_t from an attention over the encoder output (Bahdanau et al., 2014):

    c_t, a_t = attention(query = s_{t-1}, source = h_1..h_S)          a_t: distribution over source positions
    s_t      = GRU([E y_{t-1}; c_t], s_{t-1})                           (stacked layers: layer l>0 reads layer l-1)
    o_t      = readout(s_t, c_t) = tanh(W_o [s_t; c_t] + b_o)           [.., d_model]
    P(y_t)   = softmax(lm_head(o_t))                                    lm_head tied to the shared embedding
    s_0      = tanh(W_init mean_j h_j)                                  (masked mean over source positions)

Three attention functions (``HybridConfig.rnn_attention``, paper Sec. 2.1 "Attention mechanism"):

* ``"additive"`` (Bahdanau): e_j = v^T tanh(W_a s_{t-1} + U_a h_j + b), c_t = sum_j a_j h_j;
* ``"dot"``: e_j = s_{t-1} . (W_k h_j) / sqrt(H), c_t = sum_j a_j h_j (Luong's "general" score, scaled);
* ``"multihead"``: the encoder's multi-head attention without FFN (no residual/norm: query and output sizes
  differ): q = W_q s_{t-1}, per head softmax(q k^T / sqrt(d_k)) v, c_t = W_out [head_1; ...; head_h].

Speed-ups of the paper's Sec. 3.1:

* pre-computed attention (Devlin, 2017): everything that depends only on the source (U_a h_j, W_k h_j, the
  multi-head keys/values) is computed once per sentence and kept in ``cache.cross_attention_cache`` (layer 0), which
  beam search never needs to reorder (all beams of a sentence share it; under ``generate()`` it holds one row per
  sentence, which the g consecutive beam rows of that sentence read: grouped memory, see SoftAttention);
* weight combination: the GRU's hidden-side gate projections and the attention's query projection read the same
  s_{t-1}, so they are ONE matrix (``hidden_projs[-1]``, rows [W_hr; W_hz; W_hn; W_query]); the word-side gate
  projections of all T target words given in one call are one matmul before the time loop.

The GRU states (``cache.states["gru.{l}"]``, [B, H]) are the only per-step state; :class:`HardAttnCache` reorders them
for beam search.

Interface for other decoders built on this one (e.g. beam-joint attention):

* :meth:`HybridDecoder.readout` ``(state [.., H], context [.., C]) -> [.., d_model]``: the vector that the tied
  ``lm_head`` projects to vocabulary scores;
* :meth:`HybridDecoder.forward` returns a :class:`HybridDecoderOutput` with ``readout`` [B, T, d_model], ``states``
  (top-layer s_t) [B, T, H], ``contexts`` c_t [B, T, C] and ``attentions`` a_t [B, heads, T, S] (every head of the
  multi-head attention, one for additive and dot; padded source positions have weight 0);
* :meth:`HybridDecoder.hard_contexts` ``(encoder_hidden_states) -> [B, S, C]``: for each source position j the
  context the attention returns when it puts all of its weight on j (additive/dot: h_j; multi-head: the output
  projection of the per-head value rows at j). C == d_model for all three attentions.

Embedding sizes: the decoder's word embedding is the shared (encoder/decoder/output) table of size d_model. When
``rnn_embedding_size`` differs from d_model the decoder maps the shared embedding through a learned linear
``embed_in`` (d_model -> rnn_embedding_size, no bias) instead of keeping an untied table, so the three embeddings
stay tied and the readout (and ``lm_head``) stay at d_model. (Note that ``embed_in`` is followed by the linear GRU input
projection, so a size above d_model adds parameters but no expressiveness.)

Runtime code shipped with saved models: flat, same-folder relative imports only.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.utils import ModelOutput

from .configuration_hardattn import HardAttnConfig
from .modeling_hardattn import (DecoderResult, HardAttnCache, HardAttnForConditionalGeneration, HardAttnModel,
                                HardAttnPreTrainedModel, check_memory_rows, is_tracing)

RNN_ATTENTIONS = ("additive", "dot", "multihead")


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
class HybridConfig(HardAttnConfig):
    r"""Transformer encoder + GRU decoder with attention (the paper's hybrid; defaults: 6-1, additive attention).

    Args (besides :class:`HardAttnConfig`'s encoder fields):
        decoder_layers: number of stacked GRU layers (paper: 1).
        rnn_hidden_size: GRU state size H (paper: 1024).
        rnn_embedding_size: GRU word-input size (paper: 512); None = d_model. See the module docstring for the
            choice made when it differs from d_model.
        rnn_attention: ``"additive"``, ``"dot"`` or ``"multihead"`` (heads: ``decoder_attention_heads``).
        additive_attention_size: size of the additive attention's hidden layer; None = d_model.
        decoder_attention / cross_attention: must stay ``"none"`` (there are no Transformer decoder layers).
    """

    model_type = "hybrid_transformer"

    decoder_layers: int = 1
    decoder_attention: str | list[str] = "none"
    cross_attention: str | list[str] = "none"
    rnn_attention: str = "additive"
    rnn_hidden_size: int = 1024
    rnn_embedding_size: int | None = None
    additive_attention_size: int | None = None

    def check(self):
        super().check()
        if self.rnn_attention not in RNN_ATTENTIONS:
            raise ValueError(f"`rnn_attention` must be one of {RNN_ATTENTIONS}, got {self.rnn_attention!r}.")
        for name in ("rnn_hidden_size", "rnn_embedding_size", "additive_attention_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}` must be a positive integer (or None for the default), got {value!r}.")
        for name in ("decoder_attention", "cross_attention"):
            if set(self.attention_kinds("decoder" if name == "decoder_attention" else "cross")) != {"none"}:
                raise ValueError(
                    f"`{name}` must be 'none' for the hybrid model (its decoder is a GRU; choose its attention with "
                    f"`rnn_attention` in {RNN_ATTENTIONS}), got {getattr(self, name)!r}."
                )

    @property
    def embedding_size(self) -> int:
        return self.rnn_embedding_size or self.d_model


# ----------------------------------------------------------------------------------------------------------------
# Attention functions. Each owns the source-side parameters; its query projection (if any) is part of the decoder's
# fused hidden projection, so `attend` receives the already projected query.
# ----------------------------------------------------------------------------------------------------------------
def _masked_softmax(scores, mask):
    """softmax over the last dim; ``mask`` bool [B, S] (True = may attend, broadcast over middle dims) or None."""
    if mask is not None:
        scores = scores.masked_fill(~mask.view(mask.shape[0], *([1] * (scores.dim() - 2)), mask.shape[-1]),
                                    float("-inf"))
    return torch.softmax(scores, dim=-1)


class AdditiveAttention(nn.Module):
    """Bahdanau et al. (2014): e_j = v^T tanh(W_a s + U_a h_j + b), a = softmax(e), c = sum_j a_j h_j."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        size = config.additive_attention_size or config.d_model
        self.query_size = size  # rows of W_a (+ b) inside the decoder's fused hidden projection
        self.key_proj = nn.Linear(config.d_model, size, bias=False)  # U_a, pre-computed per sentence
        self.score = nn.Linear(size, 1, bias=False)  # v

    def source(self, memory):
        """(keys [B, 1, S, A], values [B, 1, S, d]): computed once per sentence (Devlin, 2017)."""
        return self.key_proj(memory).unsqueeze(1), memory.unsqueeze(1)

    def attend(self, query, keys, values, mask):
        """query [N, A] (= W_a s + b) -> context [N, d], probabilities [N, 1, S] (one head); N = B x g rows read B
        source rows (grouped memory: g consecutive rows per sentence, see :meth:`HybridDecoder.forward`)."""
        batch, rows = keys.shape[0], query.shape[0]
        hidden = torch.tanh(keys[:, 0, None] + query.view(batch, -1, 1, query.shape[-1]))  # [B, g, S, A]
        probs = _masked_softmax(torch.matmul(hidden, self.score.weight[0]), mask)  # [B, g, S]
        return torch.matmul(probs, values[:, 0]).view(rows, -1), probs.view(rows, 1, -1)

    def hard_contexts(self, memory):
        return memory


class DotAttention(nn.Module):
    """Dot-product attention: e_j = s . (W_k h_j) / sqrt(H), a = softmax(e), c = sum_j a_j h_j (the query is the GRU
    state itself, so it has no query projection)."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.query_size = 0
        self.key_proj = nn.Linear(config.d_model, config.rnn_hidden_size, bias=False)  # W_k, pre-computed
        self.scale = config.rnn_hidden_size**-0.5

    def source(self, memory):
        return (self.key_proj(memory) * self.scale).unsqueeze(1), memory.unsqueeze(1)  # scale folded into keys

    def attend(self, query, keys, values, mask):
        """query [N, H] (= s) -> context [N, d], probabilities [N, 1, S] (N = B x g, as in AdditiveAttention)."""
        batch, rows = keys.shape[0], query.shape[0]
        scores = torch.matmul(query.view(batch, -1, query.shape[-1]), keys[:, 0].transpose(1, 2))  # [B, g, S]
        probs = _masked_softmax(scores, mask)
        return torch.matmul(probs, values[:, 0]).view(rows, -1), probs.view(rows, 1, -1)

    def hard_contexts(self, memory):
        return memory


class MultiHeadAttention(nn.Module):
    """The encoder's multi-head attention without FFN (Vaswani et al., 2017, Eq. 1 + multi-head): the query W_q s
    comes from the fused hidden projection, keys/values (fused kv_proj as in ``SoftAttention``) are pre-computed,
    c = out_proj([head_1; ...; head_h])."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.query_size = config.d_model
        self.num_heads = config.decoder_attention_heads
        self.head_dim = config.d_model // self.num_heads
        self.kv_proj = nn.Linear(config.d_model, 2 * config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)

    def source(self, memory):
        """(keys * d_k^-1/2, values), each [B, heads, S, head_dim]."""
        batch, length, _ = memory.shape
        k, v = self.kv_proj(memory).view(batch, length, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return k * self.head_dim**-0.5, v

    def attend(self, query, keys, values, mask):
        """query [N, d] (= W_q s + b_q) -> context [N, d], probabilities of every head [N, heads, S] (N = B x g, as in
        AdditiveAttention)."""
        batch, rows = keys.shape[0], query.shape[0]
        q = query.view(batch, -1, self.num_heads, self.head_dim).transpose(1, 2)  # [B, heads, g, head_dim]
        probs = _masked_softmax(torch.matmul(q, keys.transpose(-1, -2)), mask)  # [B, heads, g, S]
        out = torch.matmul(probs, values).transpose(1, 2).reshape(rows, -1)  # heads concatenated
        return self.out_proj(out), probs.transpose(1, 2).reshape(rows, self.num_heads, -1)

    def hard_contexts(self, memory):
        _, values = self.kv_proj(memory).chunk(2, dim=-1)  # all heads on position j: concatenated value rows
        return self.out_proj(values)


ATTENTION_FUNCTIONS = {"additive": AdditiveAttention, "dot": DotAttention, "multihead": MultiHeadAttention}


# ----------------------------------------------------------------------------------------------------------------
# GRU decoder
# ----------------------------------------------------------------------------------------------------------------
def gru_update(gx, gh, state):
    """GRU (Cho et al., 2014; torch.nn.GRUCell's gate layout [r, z, n]) from the pre-computed input-side gx and
    hidden-side gh projections (biases included): r = sig(x_r + h_r), z = sig(x_z + h_z), n = tanh(x_n + r * h_n),
    s' = (1 - z) * n + z * s."""
    size = state.shape[-1]
    rz = torch.sigmoid(gx[..., : 2 * size] + gh[..., : 2 * size])
    r, z = rz[..., :size], rz[..., size:]
    n = torch.tanh(gx[..., 2 * size :] + r * gh[..., 2 * size :])
    return torch.lerp(n, state, z)  # n + z * (s - n)


class GRUHiddenProjection(nn.Linear):
    """s_{t-1} -> [W_hr; W_hz; W_hn (; W_query)] s_{t-1} + b: the GRU's hidden-side gate rows, on the top layer fused
    with the attention's query rows ("weight combination")."""

    def __init__(self, hidden_size: int, query_size: int = 0):
        super().__init__(hidden_size, 3 * hidden_size + query_size)
        self.hidden_size = hidden_size


@dataclass
class HybridDecoderOutput(ModelOutput):
    """readout [B, T, d_model], states (top GRU layer) [B, T, H], contexts [B, T, C], attentions a_t of every head
    [B, heads, T, S] (one head for additive and dot attention); with ``output_hidden_states``, ``hidden_states`` =
    (the word embeddings [B, T, d_model], the states of every GRU layer [B, T, H], ..., the readout)."""

    readout: torch.Tensor | None = None
    states: torch.Tensor | None = None
    contexts: torch.Tensor | None = None
    attentions: torch.Tensor | None = None
    hidden_states: tuple | None = None


class HybridDecoder(nn.Module):
    reads_memory_grouped = True  # every attention function reads a grouped memory (see AdditiveAttention.attend)
    gradient_checkpointing = False  # set by model.gradient_checkpointing_enable(): see checkpointed_step

    def __init__(self, config: HybridConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        d, hidden, layers = config.d_model, config.rnn_hidden_size, config.decoder_layers
        self.hidden_size, self.num_layers = hidden, layers
        self.embed_tokens = embed_tokens
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        self.embed_in = nn.Linear(d, config.embedding_size, bias=False) if config.embedding_size != d else None
        self.attention = ATTENTION_FUNCTIONS[config.rnn_attention](config)
        self.context_size = d
        # GRU input side: layer 0 reads [E y; c] (word part W_e with the input bias, context part W_c), layer l>0 reads
        # layer l-1's state. Hidden side: [W_hr; W_hz; W_hn] (+ the attention's query rows on the top layer).
        self.context_proj = nn.Linear(self.context_size, 3 * hidden, bias=False)
        self.input_projs = nn.ModuleList(
            nn.Linear(config.embedding_size if l == 0 else hidden, 3 * hidden) for l in range(layers)
        )
        query_size = self.attention.query_size
        self.hidden_projs = nn.ModuleList(
            GRUHiddenProjection(hidden, query_size if l == layers - 1 else 0) for l in range(layers)
        )
        self.init_proj = nn.Linear(d, layers * hidden)  # s_0 = tanh(W_init mean_j h_j)
        self.readout_proj = nn.Linear(hidden + self.context_size, d)

    # -- pieces -----------------------------------------------------------------------------------------------
    def readout(self, state, context):
        """o_t = tanh(W_o [s_t; c_t] + b_o): [.., d_model], the input of the tied lm_head."""
        return torch.tanh(self.readout_proj(torch.cat([state, context], dim=-1)))

    def hard_contexts(self, encoder_hidden_states):
        """[B, S, C]: the context when the attention puts all weight on source position j (see module docstring)."""
        return self.attention.hard_contexts(encoder_hidden_states)

    def initial_states(self, encoder_hidden_states, encoder_attention_mask=None):
        """s_0 for every layer (list of [B, H]) from the masked mean of the encoder output."""
        if encoder_attention_mask is None:
            mean = encoder_hidden_states.mean(1)
        else:
            weights = encoder_attention_mask.to(encoder_hidden_states.dtype).unsqueeze(-1)
            mean = (encoder_hidden_states * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return list(torch.tanh(self.init_proj(mean)).split(self.hidden_size, dim=-1))

    def source(self, encoder_hidden_states, cache=None):
        """The attention's pre-computed source keys/values, once per sentence (kept in the cross-attention cache)."""
        if cache is not None and cache.is_updated.get(0):
            layer = cache.cross_attention_cache.layers[0]
            return layer.keys, layer.values
        keys, values = self.attention.source(encoder_hidden_states)
        if cache is not None:
            keys, values = cache.cross_attention_cache.update(keys, values, 0)
            cache.is_updated[0] = True
        return keys, values

    def word_inputs(self, input_ids=None, inputs_embeds=None):
        """(word embeddings [B, T, d_model] after dropout, the word-side gate inputs W_e E y + b [B, T, 3H] of layer 0
        for all given positions in one matmul)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        embeddings = F.dropout(inputs_embeds, self.config.dropout, self.training)
        x = self.embed_in(embeddings) if self.embed_in is not None else embeddings
        return embeddings, self.input_projs[0](x)

    def step(self, word_input, states, keys, values, mask=None):
        """One decoder step. word_input [B, 3H] (from :meth:`word_inputs`), states: list of [B, H] (s_{t-1} per
        layer), keys/values from :meth:`source`, mask bool [B, S] or None -> (new states, c_t [B, C], a_t of every head
        [B, heads, S])."""
        top, hidden = self.num_layers - 1, self.hidden_size
        fused = self.hidden_projs[top](states[top])  # weight combination: [W_h; W_query] s_{t-1}
        top_gh = fused[:, : 3 * hidden]
        query = fused[:, 3 * hidden :] if self.attention.query_size else states[top]
        context, probs = self.attention.attend(query, keys, values, mask)
        x = word_input + self.context_proj(context)
        new_states = []
        for l in range(self.num_layers):
            if l > 0:
                x = self.input_projs[l](F.dropout(new_states[-1], self.config.dropout, self.training))
            gh = top_gh if l == top else self.hidden_projs[l](states[l])
            new_states.append(gru_update(x, gh, states[l]))
        return new_states, context, probs

    def checkpointed_step(self, word_input, states, keys, values, mask=None):
        """:meth:`step` under gradient checkpointing (``model.gradient_checkpointing_enable()``, training): a target
        position keeps only its inputs for backward and is recomputed there, as a Transformer layer is; the
        checkpoint restores the RNG state, so the recomputed dropout masks are the same. Every tensor is passed
        positionally and returned flat, so that reentrant checkpointing (``use_reentrant=True``) sees them too."""
        def flat_step(word_input, keys, values, mask, *states):
            new_states, context, probs = self.step(word_input, list(states), keys, values, mask)
            return (*new_states, context, probs)

        *new_states, context, probs = self._gradient_checkpointing_func(flat_step, word_input, keys, values, mask,
                                                                        *states)
        return new_states, context, probs

    # -- whole call -------------------------------------------------------------------------------------------
    def forward(self, input_ids=None, encoder_hidden_states=None, encoder_attention_mask=None, inputs_embeds=None,
                cache: HardAttnCache | None = None, output_hidden_states=False) -> HybridDecoderOutput:
        """Run the T given target positions (teacher forcing; or the new token(s) of cached decoding, continuing from
        ``cache.states``)."""
        embeddings, word_inputs = self.word_inputs(input_ids, inputs_embeds)
        rows = word_inputs.shape[0]  # grouped memory: rows // sources consecutive rows per encoder row (beams)
        check_memory_rows(rows, encoder_hidden_states, encoder_attention_mask, self.reads_memory_grouped)
        mask = None
        if encoder_attention_mask is not None and (is_tracing() or not bool(encoder_attention_mask.all())):
            mask = encoder_attention_mask.bool()
        keys, values = self.source(encoder_hidden_states, cache)
        if cache is not None and "gru.0" in cache.states:
            states = [cache.states[f"gru.{l}"] for l in range(self.num_layers)]
        else:
            groups = rows // encoder_hidden_states.shape[0]
            states = [s.repeat_interleave(groups, dim=0) if groups > 1 else s
                      for s in self.initial_states(encoder_hidden_states, encoder_attention_mask)]
        tops, contexts, attentions, all_states = [], [], [], []
        checkpointed = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        step = self.checkpointed_step if checkpointed else self.step
        for t in range(word_inputs.shape[1]):
            states, context, probs = step(word_inputs[:, t], states, keys, values, mask)
            tops.append(states[-1])
            contexts.append(context)
            attentions.append(probs)
            if output_hidden_states:
                all_states.append(states)
        if cache is not None:
            for l, state in enumerate(states):
                cache.states[f"gru.{l}"] = state
            cache.seen_tokens += word_inputs.shape[1]
        tops, contexts = torch.stack(tops, 1), torch.stack(contexts, 1)
        readout = self.readout(F.dropout(tops, self.config.dropout, self.training), contexts)
        readout = F.dropout(readout, self.config.dropout, self.training)
        hidden_states = None
        if output_hidden_states:
            layers = [torch.stack([step[l] for step in all_states], 1) for l in range(self.num_layers)]
            hidden_states = (embeddings, *layers, readout)
        return HybridDecoderOutput(readout=readout, states=tops, contexts=contexts,
                                   attentions=torch.stack(attentions, 2), hidden_states=hidden_states)


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------
class HybridPreTrainedModel(HardAttnPreTrainedModel):
    config_class = HybridConfig
    _no_split_modules = ["EncoderLayer", "HybridDecoder"]

    @torch.no_grad()
    def _init_weights(self, module):
        """The skeleton's init (Xavier linears: every GRU/attention matrix here is an nn.Linear) plus orthogonal
        recurrent blocks W_hr, W_hz, W_hn (the usual RNN init; keeps the recurrence well conditioned). Loaded weights
        (flagged ``_is_hf_initialized``) are left alone, also for the row blocks, which are views without the flag."""
        super()._init_weights(module)
        if isinstance(module, GRUHiddenProjection) and not getattr(module.weight, "_is_hf_initialized", False):
            hidden = module.hidden_size
            for gate in range(3):
                init.orthogonal_(module.weight[gate * hidden : (gate + 1) * hidden])


class HybridModel(HybridPreTrainedModel, HardAttnModel):
    """Shared token embeddings + Transformer encoder + GRU decoder (no output layer)."""

    decoder_class = HybridDecoder


class HybridForConditionalGeneration(HybridPreTrainedModel, HardAttnForConditionalGeneration):
    config_class = HybridConfig
    model_class = HybridModel
    card_title = "Hybrid: self-attention encoder + GRU decoder"
    card_description = (
        "A Transformer encoder with a single-layer GRU decoder (Bahdanau-style: the step reads the previous state, "
        "the previous word and an attention context over the encoder output). The attention is additive, dot-product "
        "or multi-head (`rnn_attention`); source keys/values are pre-computed once per sentence and the GRU's hidden "
        "projection is fused with the attention query projection. The GRU state lives in the cache and is reordered "
        "for beam search. The paper trains it in two stages: MLE on the bilingual data, then Eq. 1 (the likelihood of "
        "the references minus lambda * KL(teacher || student), a fixed Transformer teacher, lambda = 1). "
        "`hf_hardattn.distill.train_two_stage` runs both; its default `kd_scheme=\"eq1_sequence\"` approximates the "
        "KL at sequence level (Kim & Rush: the NLL of the teacher's beam output), `\"eq1_word\"` per token along the "
        "reference; `\"sequence_only\"` (the teacher's outputs only, not Eq. 1) produced the reproduction "
        "table's `hybrid_*_kd` rows."
    )
    card_citation = (
        "Chengyi Wang, Shuangzhi Wu, Shujie Liu. Accelerating Transformer Decoding via a Hybrid of Self-attention and "
        "Recurrent Neural Network (hybrid-self-attention-rnn-decoder)."
    )

    # the card lists the sizes this model has (no Transformer decoder layers: no decoder FFN, heads only for multihead)
    card_size_fields = ("d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "decoder_layers",
                        "rnn_hidden_size", "rnn_attention", "vocab_size", "position_embedding", "normalize_before")

    def card_roles_table(self) -> str:
        config = self.config
        heads = f", {config.decoder_attention_heads} heads" if config.rnn_attention == "multihead" else ""
        return "\n".join([
            "| role | kind |", "| --- | --- |",
            f"| encoder self-attention | {config.encoder_attention} |",
            f"| decoder | GRU ({config.decoder_layers} layer(s), state {config.rnn_hidden_size}), no self-attention |",
            f"| decoder attention over the encoder output | {config.rnn_attention}{heads} (one per step) |"])

    def decoder_outputs(self, decoder_input_ids, encoder_hidden_states, attention_mask, decoder_inputs_embeds=None,
                        cache=None, output_hidden_states=False) -> HybridDecoderOutput:
        """The full :class:`HybridDecoderOutput` (readout, states, contexts, attentions, hidden states when asked)."""
        return self.model.decoder(decoder_input_ids, encoder_hidden_states, attention_mask, decoder_inputs_embeds,
                                  cache, output_hidden_states=output_hidden_states)

    decode_reads_memory_grouped = True  # see HardAttnForConditionalGeneration._memory_grouped_decoding

    def decode(self, decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
               decoder_inputs_embeds, cache, output_attentions=False, output_hidden_states=False) -> DecoderResult:
        """Readout vectors [B, T, d_model]. Decoder inputs are right-padded (padding comes after the tokens that
        matter), so ``decoder_attention_mask`` is not needed by a left-to-right RNN. With ``output_attentions`` the
        GRU decoder's attention over the source is its one ``cross_attentions`` layer [B, heads, T, S] (one head for
        additive and dot attention) and ``decoder_attentions`` holds None for each GRU layer (no self-attention);
        ``output_hidden_states`` gives (embeddings, every GRU layer's states [B, T, rnn_hidden_size], the readout)."""
        out = self.decoder_outputs(decoder_input_ids, encoder_hidden_states, attention_mask, decoder_inputs_embeds,
                                   cache, output_hidden_states)
        attentions = (None,) * self.config.decoder_layers if output_attentions else None
        return DecoderResult(out.readout, out.hidden_states, attentions,
                             (out.attentions,) if output_attentions else None)


__all__ = [
    "AdditiveAttention",
    "DotAttention",
    "MultiHeadAttention",
    "HybridConfig",
    "HybridDecoder",
    "HybridDecoderOutput",
    "HybridModel",
    "HybridForConditionalGeneration",
    "GRUHiddenProjection",
    "gru_update",
]
