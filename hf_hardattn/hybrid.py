"""Hybrid of a self-attention encoder and an RNN decoder (Wang, Wu & Liu, "Accelerating Transformer Decoding via a
Hybrid of Self-attention and Recurrent Neural Network", Sec. 2.1), and its distillation objective (Sec. 2.2, Eq. 1).

The encoder is the skeleton's Transformer encoder (N layers). The decoder is an RNN (``rnn_cell``: ``"gru"``, Cho et
al. 2014, or ``"lstm"``; ``decoder_layers`` stacked layers, layer l>0 reading layer l-1's output) with an attention
over the encoder output h_1..h_S. ``rnn_decoder_style`` decides WHEN the attention is read and what feeds the cell:

``"bahdanau"`` (default; the hybrid paper's RNMT decoder, Bahdanau et al. 2014): the attention is queried with the
previous state, and its soft context enters the cell and the readout:

    c_t, a_t = attention(query = s_{t-1}, source = h_1..h_S)          a_t: distribution over source positions
    s_t      = RNN([E y_{t-1}; c_t], s_{t-1})
    o_t      = readout(s_t, c_t) = tanh(W_o [s_t; c_t] + b_o)           [.., d_model]
    P(y_t)   = softmax(lm_head(o_t))                                    lm_head tied to the shared embedding

``"luong"``: the beam-joint paper's decoder (Luong et al. 2015 with input feeding: the cell reads the previous
attentional state h~_{t-1}, the attention is queried with the current state s_t, h~_t = tanh(W_c [s_t; c_t] + b_c)
feeds the output layer), its step in ``luong_decoder.py``.

Both styles: s_0 = tanh(W_init mean_j h_j) (masked mean over source positions; an LSTM's memory cell starts at 0).
The paper's encoder is a bidirectional LSTM whose final state starts the decoder; a Transformer encoder has no final
state, hence the mean.

``rnn_cell``: ``"gru"``, the hybrid paper's (torch.nn.GRUCell's gates [r, z, n]), or ``"lstm"``, the beam-joint
paper's (``luong_decoder.lstm_update``; its state one tensor [h; c] per layer, so that the cache, beam reordering and
checkpointing treat both cells alike; the forget gate's bias initialised to 1).

Three attention functions (``HybridConfig.rnn_attention``, hybrid paper Sec. 2.1 "Attention mechanism"); q is
s_{t-1} (bahdanau) or s_t (luong), the top layer's output:

* ``"additive"`` (Bahdanau): e_j = v^T tanh(W_a q + U_a h_j + b), c_t = sum_j a_j h_j;
* ``"dot"``: e_j = q . (W_k h_j) / sqrt(H), c_t = sum_j a_j h_j (Luong's "general" score, scaled by a constant;
  tensorflow/nmt's "scaled_luong", the beam-joint authors' choice, scales by a learned scalar g initialised to 1);
* ``"multihead"``: the encoder's multi-head attention without FFN (no residual/norm: query and output sizes
  differ): q' = W_q q, per head softmax(q' k^T / sqrt(d_k)) v, c_t = W_out [head_1; ...; head_h].

Speed-ups of the hybrid paper's Sec. 3.1:

* pre-computed attention (Devlin, 2017): everything that depends only on the source (U_a h_j, W_k h_j, the
  multi-head keys/values) is computed once per sentence and kept in ``cache.cross_attention_cache`` (layer 0), which
  beam search never needs to reorder (all beams of a sentence share it; under ``generate()`` it holds one row per
  sentence, which the g consecutive beam rows of that sentence read: grouped memory, see SoftAttention);
* weight combination: the top layer's hidden-side gate projections and the attention's query projection read the same
  vector, so they are ONE matrix (``hidden_projs[-1]``, rows [W_h (gates); W_query]). Bahdanau: both read s_{t-1}.
  Luong: the query of step t and the gates of step t+1 both read s_t, so the gate part of that product is carried to
  the next step (``cache.states["luong.gates"]``). The word-side gate projections of all T target words given in one
  call are one matmul before the time loop.

The per-step state lives in ``cache.states`` (first dimension = rows, reordered by :class:`HardAttnCache` for beam
search): ``"{rnn_cell}.{l}"`` per layer ([B, H] GRU, [B, 2H] LSTM [h; c]), and for luong ``"luong.feed"`` (h~_{t-1},
[B, d_model]) and ``"luong.gates"`` (the top layer's hidden-side gate pre-activations of s_{t-1}).

Dropout (``config.dropout``): bahdanau: on the word embeddings, between stacked layers, on s_t before the readout and
on the readout. Luong (as tensorflow/nmt's DropoutWrapper on the cell input): on the word embeddings, on the fed
h~_{t-1} and between stacked layers; h~_t itself, the output layer's input, is not dropped.

Interface for other decoders built on this one (e.g. beam-joint attention):

* :meth:`HybridDecoder.readout` ``(state [.., H], context [.., C]) -> [.., d_model]``: o_t (bahdanau) or h~_t
  (luong), the vector that the tied ``lm_head`` projects to vocabulary scores;
* :meth:`HybridDecoder.forward` returns a :class:`HybridDecoderOutput` with ``readout`` [B, T, d_model], ``states``
  (top-layer output s_t) [B, T, H], ``contexts`` c_t [B, T, C] and ``attentions`` a_t [B, heads, T, S] (every head of
  the multi-head attention, one for additive and dot; padded source positions have weight 0);
* :meth:`HybridDecoder.hard_contexts` ``(encoder_hidden_states) -> [B, S, C]``: for each source position j the
  context the attention returns when it puts all of its weight on j (additive/dot: h_j; multi-head: the output
  projection of the per-head value rows at j). C == d_model for all three attentions.

Embedding sizes: the decoder's word embedding is the shared (encoder/decoder/output) table of size d_model. When
``rnn_embedding_size`` differs from d_model the decoder maps the shared embedding through a learned linear
``embed_in`` (d_model -> rnn_embedding_size, no bias) instead of keeping an untied table, so the three embeddings
stay tied and the readout (and ``lm_head``) stay at d_model. (Note that ``embed_in`` is followed by the linear RNN input
projection, so a size above d_model adds parameters but no expressiveness.)

Left-padded decoder prompts (``decoder_attention_mask`` with padding before a row's first token, as decoder-only models
take a batch of prompts): a padded position leaves every state as it was, s_t = s_{t-1} (and luong's h~_{t-1} and
carried gates), so a row's first real token reads s_0 (and h~_0 = 0) and the row decodes as its prompt alone; the RNN
has no positions to count. The mask's last T columns are the call's positions, so a later call reads only its own.

Runtime code shipped with saved models: flat, same-folder relative imports only.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers import initialization as init
from transformers.utils import ModelOutput

from .configuration_hardattn import HardAttnConfig
from .caches import HardAttnCache
from .inputs import is_tracing
from .layers import DecoderResult, check_memory_rows
from .luong_decoder import LUONG_STATE_NAMES, InputFeedingStep, lstm_update
from .modeling_hardattn import HardAttnForConditionalGeneration, HardAttnModel, HardAttnPreTrainedModel

RNN_ATTENTIONS = ("additive", "dot", "multihead")
RNN_DECODER_STYLES = ("bahdanau", "luong")
RNN_CELLS = ("gru", "lstm")


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
class HybridConfig(HardAttnConfig):
    r"""Transformer encoder + RNN decoder with attention (the hybrid paper's; defaults: 6-1, GRU, Bahdanau-style,
    additive attention).

    Args (besides :class:`HardAttnConfig`'s encoder fields):
        decoder_layers: number of stacked RNN layers (hybrid paper: 1).
        rnn_hidden_size: RNN state size H; None (the default) = 2 * d_model, the hybrid paper's ratio (1024 for its
            d_model 512), resolved when the config is built, so that a saved config.json holds the number (one saved
            before this default, 1024 whatever d_model, keeps the value it holds).
        rnn_embedding_size: RNN word-input size (hybrid paper: 512); None = d_model. See the module docstring for the
            choice made when it differs from d_model.
        rnn_attention: ``"additive"``, ``"dot"`` or ``"multihead"`` (heads: ``decoder_attention_heads``).
        additive_attention_size: size of the additive attention's hidden layer; None = d_model.
        rnn_decoder_style: ``"bahdanau"`` (default; attention queried with s_{t-1}, its context fed into s_t and the
            readout: the hybrid paper's decoder) or ``"luong"`` (input feeding: s_t reads y_{t-1} and the previous
            attentional state h~_{t-1}, the attention is queried with s_t, h~_t = tanh(W_c [s_t; c_t] + b): the
            beam-joint paper's decoder). See the module docstring.
        rnn_cell: ``"gru"`` (default; the hybrid paper's) or ``"lstm"`` (the beam-joint paper's).
        embed_init_std: default None here (embeddings N(0, d_model^-1/2) under Xavier linears), not the Transformer
            decoders' 0.02, which trained the RNN decoders far worse (docs/results.md, initialisation).
        decoder_attention / cross_attention: must stay ``"none"`` (there are no Transformer decoder layers).
    """

    model_type = "hybrid_transformer"

    decoder_layers: int = 1
    decoder_attention: str | list[str] = "none"
    cross_attention: str | list[str] = "none"
    rnn_attention: str = "additive"
    rnn_hidden_size: int | None = None  # None: 2 * d_model (see __post_init__)
    rnn_embedding_size: int | None = None
    additive_attention_size: int | None = None
    rnn_decoder_style: str = "bahdanau"
    rnn_cell: str = "gru"
    embed_init_std: float | None = None  # the RNN decoders keep N(0, d^-1/2) embeddings (see the docstring)

    def __post_init__(self, **kwargs):
        if self.rnn_hidden_size is None and isinstance(self.d_model, int) and not isinstance(self.d_model, bool):
            self.rnn_hidden_size = 2 * self.d_model  # (a bad d_model is refused by check, naming it)
        super().__post_init__(**kwargs)

    def check(self):
        super().check()
        for name, allowed in (("rnn_attention", RNN_ATTENTIONS), ("rnn_decoder_style", RNN_DECODER_STYLES),
                              ("rnn_cell", RNN_CELLS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {allowed}, got {getattr(self, name)!r}.")
        for name in ("rnn_hidden_size", "rnn_embedding_size", "additive_attention_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}` must be a positive integer (or None for the default), got {value!r}.")
        for name in ("decoder_attention", "cross_attention"):
            if set(self.attention_kinds("decoder" if name == "decoder_attention" else "cross")) != {"none"}:
                raise ValueError(
                    f"`{name}` must be 'none' for the hybrid model (its decoder is an RNN; choose its attention with "
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
        if type(self.score) is nn.Linear:  # v read as a vector
            scores = torch.matmul(hidden, self.score.weight[0])
        else:  # wrapped (a PEFT adapter): its weight is not its map
            scores = self.score(hidden).squeeze(-1)
        probs = _masked_softmax(scores, mask)  # [B, g, S]
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
# RNN decoder
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


CELLS = {"gru": (3, gru_update), "lstm": (4, lstm_update)}  # rnn_cell -> (gates, update)


class RNNHiddenProjection(nn.Linear):
    """h -> [W_h (one block per gate) (; W_query)] h + b: the RNN's hidden-side gate rows, on the top layer fused with
    the attention's query rows ("weight combination")."""

    def __init__(self, hidden_size: int, query_size: int = 0, gates: int = 3):
        super().__init__(hidden_size, gates * hidden_size + query_size)
        self.hidden_size, self.gates = hidden_size, gates


GRUHiddenProjection = RNNHiddenProjection  # the name before LSTM cells (gates=3: the GRU's)


@dataclass
class HybridDecoderOutput(ModelOutput):
    """readout [B, T, d_model] (o_t, or luong's h~_t), states (top layer's output s_t) [B, T, H], contexts [B, T, C],
    attentions a_t of every head [B, heads, T, S] (one head for additive and dot attention); with
    ``output_hidden_states``, ``hidden_states`` = (the word embeddings [B, T, d_model], the output of every RNN layer
    [B, T, H], ..., the readout)."""

    readout: torch.Tensor | None = None
    states: torch.Tensor | None = None
    contexts: torch.Tensor | None = None
    attentions: torch.Tensor | None = None
    hidden_states: tuple | None = None


class HybridDecoder(InputFeedingStep, nn.Module):
    reads_memory_grouped = True  # every attention function reads a grouped memory (see AdditiveAttention.attend)
    writes_static_cache = True  # its states go through the cache's own writes (see HardAttnModel.static_decoding_refusal)
    reads_left_padding = True  # padding before a row's first token holds the states (see real_positions)
    gradient_checkpointing = False  # set by model.gradient_checkpointing_enable(): see checkpointed_step

    def __init__(self, config: HybridConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        d, hidden, layers = config.d_model, config.rnn_hidden_size, config.decoder_layers
        self.hidden_size, self.num_layers = hidden, layers
        self.luong = config.rnn_decoder_style == "luong"
        self.cell = config.rnn_cell
        self.gates, self.cell_update = CELLS[config.rnn_cell]
        gate_rows = self.gates * hidden
        self.embed_tokens = embed_tokens
        self.embed_scale = math.sqrt(d) if config.scale_embedding else 1.0
        self.embed_in = nn.Linear(d, config.embedding_size, bias=False) if config.embedding_size != d else None
        self.attention = ATTENTION_FUNCTIONS[config.rnn_attention](config)
        self.context_size = d
        # Input side: layer 0 reads [E y; v] (word part W_e with the input bias; v = c_t (bahdanau) or the fed h~_{t-1}
        # (luong), both of size d_model, through `context_proj`), layer l>0 reads layer l-1's output. Hidden side:
        # one block per gate (+ the attention's query rows on the top layer).
        self.context_proj = nn.Linear(self.context_size, gate_rows, bias=False)
        self.input_projs = nn.ModuleList(
            nn.Linear(config.embedding_size if l == 0 else hidden, gate_rows) for l in range(layers)
        )
        query_size = self.attention.query_size
        self.hidden_projs = nn.ModuleList(
            RNNHiddenProjection(hidden, query_size if l == layers - 1 else 0, self.gates) for l in range(layers)
        )
        self.init_proj = nn.Linear(d, layers * hidden)  # s_0 = tanh(W_init mean_j h_j)
        self.readout_proj = nn.Linear(hidden + self.context_size, d)  # W_o (bahdanau) / W_c (luong)
        # cache.states names, in the order of the state list that `step` takes and returns
        self.state_names = [f"{self.cell}.{l}" for l in range(layers)] + (LUONG_STATE_NAMES if self.luong else [])

    # -- pieces -----------------------------------------------------------------------------------------------
    def readout(self, state, context):
        """tanh(W [s_t; c_t] + b): o_t (bahdanau) or h~_t (luong, Eq. 5 of Luong et al.), [.., d_model], the input of
        the tied lm_head."""
        return torch.tanh(self.readout_proj(torch.cat([state, context], dim=-1)))

    def output(self, state):
        """A layer's output h from its state: the state itself (GRU), its first half (LSTM: [h; c])."""
        return state[..., : self.hidden_size] if self.cell == "lstm" else state

    def hard_contexts(self, encoder_hidden_states):
        """[B, S, C]: the context when the attention puts all weight on source position j (see module docstring)."""
        return self.attention.hard_contexts(encoder_hidden_states)

    def initial_states(self, encoder_hidden_states, encoder_attention_mask=None):
        """The state list before the first word (as :meth:`step` takes it): s_0 = tanh(W_init mean_j h_j) of every
        layer ([B, H]; LSTM [s_0; c_0 = 0]) from the masked mean of the encoder output; luong adds h~_0 = 0 [B, d_model]
        and the top layer's hidden-side gate pre-activations of s_0."""
        if encoder_attention_mask is None:
            mean = encoder_hidden_states.mean(1)
        else:
            weights = encoder_attention_mask.to(encoder_hidden_states.dtype).unsqueeze(-1)
            mean = (encoder_hidden_states * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        states = list(torch.tanh(self.init_proj(mean)).split(self.hidden_size, dim=-1))
        if self.cell == "lstm":
            states = [torch.cat([s, torch.zeros_like(s)], dim=-1) for s in states]
        if self.luong:
            states += self.input_feeding_states(states, mean)
        return states

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
        """(word embeddings [B, T, d_model] after dropout, the word-side gate inputs W_e E y + b [B, T, gates x H] of
        layer 0 for all given positions in one matmul)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        embeddings = F.dropout(inputs_embeds, self.config.dropout, self.training)
        x = self.embed_in(embeddings) if self.embed_in is not None else embeddings
        return embeddings, self.input_projs[0](x)

    def layer_updates(self, x, top_gh, states):
        """Every layer's new state: layer 0 from its input-side gates ``x``, layer l>0 from layer l-1's new output (with
        dropout); the hidden-side gates of the top layer are given (``top_gh``, from the fused projection)."""
        top = self.num_layers - 1
        new_states = []
        for l in range(self.num_layers):
            if l > 0:
                x = self.input_projs[l](F.dropout(self.output(new_states[-1]), self.config.dropout, self.training))
            gh = top_gh if l == top else self.hidden_projs[l](self.output(states[l]))
            new_states.append(self.cell_update(x, gh, states[l]))
        return new_states

    def step(self, word_input, states, keys, values, mask=None):
        """One decoder step. word_input [B, gates x H] (from :meth:`word_inputs`), states: the list of
        :meth:`initial_states` (one per layer; luong: + h~_{t-1}, + the top layer's hidden-side gates), keys/values
        from :meth:`source`, mask bool [B, S] or None -> (new states, c_t [B, C], a_t of every head [B, heads, S]).
        Luong's h~_t is ``new_states[-2]``."""
        return (self.luong_step if self.luong else self.bahdanau_step)(word_input, states, keys, values, mask)

    def bahdanau_step(self, word_input, states, keys, values, mask=None):
        """c_t, a_t = attention(s_{t-1}); s_t = RNN([E y_{t-1}; c_t], s_{t-1})."""
        top, gate_rows = self.num_layers - 1, self.gates * self.hidden_size
        previous = self.output(states[top])
        fused = self.hidden_projs[top](previous)  # weight combination: [W_h; W_query] s_{t-1}
        query = fused[:, gate_rows:] if self.attention.query_size else previous
        context, probs = self.attention.attend(query, keys, values, mask)
        x = word_input + self.context_proj(context)
        return self.layer_updates(x, fused[:, :gate_rows], states), context, probs

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

    @staticmethod
    def real_positions(attention_mask, length):
        """bool [B, T]: which of the call's T positions are tokens (not padding before a row's first token), from the
        decoder mask's last T columns ([B, T] or [B, cached + T]); None when all are (no mask; eager: no padding)."""
        if attention_mask is None:
            return None
        real = attention_mask[:, -length:].bool()
        return None if not is_tracing() and bool(real.all()) else real

    # -- whole call -------------------------------------------------------------------------------------------
    def forward(self, input_ids=None, encoder_hidden_states=None, encoder_attention_mask=None, inputs_embeds=None,
                cache: HardAttnCache | None = None, output_hidden_states=False, attention_mask=None
                ) -> HybridDecoderOutput:
        """Run the T given target positions (teacher forcing; or the new token(s) of cached decoding, continuing from
        ``cache.states``). ``attention_mask``: the decoder mask; a padded position keeps the states (module
        docstring)."""
        embeddings, word_inputs = self.word_inputs(input_ids, inputs_embeds)
        real = self.real_positions(attention_mask, word_inputs.shape[1])
        rows = word_inputs.shape[0]  # grouped memory: rows // sources consecutive rows per encoder row (beams)
        check_memory_rows(rows, encoder_hidden_states, encoder_attention_mask, self.reads_memory_grouped)
        if cache is not None:  # (a static cache's rows and positions: no key/value slot checks them here)
            cache.check_room(rows, word_inputs.shape[1])
        mask = None
        if encoder_attention_mask is not None and (is_tracing() or not bool(encoder_attention_mask.all())):
            mask = encoder_attention_mask.bool()
        keys, values = self.source(encoder_hidden_states, cache)
        if cache is not None and self.state_names[0] in cache.states:
            states = [cache.states[name] for name in self.state_names]
        else:
            groups = rows // encoder_hidden_states.shape[0]
            states = [s.repeat_interleave(groups, dim=0) if groups > 1 else s
                      for s in self.initial_states(encoder_hidden_states, encoder_attention_mask)]
        tops, contexts, attentions, readouts, all_states = [], [], [], [], []
        per_position = [] if cache is not None and word_inputs.shape[1] > 1 else None  # (what a crop inside restores)
        checkpointed = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        step = self.checkpointed_step if checkpointed else self.step
        for t in range(word_inputs.shape[1]):
            new_states, context, probs = step(word_inputs[:, t], states, keys, values, mask)
            if real is not None:  # padding before a row's first token: s_t = s_{t-1} (its first token reads s_0)
                new_states = [torch.where(real[:, t, None], new, old) for new, old in zip(new_states, states)]
            states = new_states
            if per_position is not None:
                per_position.append(states)
            tops.append(self.output(states[self.num_layers - 1]))
            contexts.append(context)
            attentions.append(probs)
            if self.luong:
                readouts.append(states[-2])
            if output_hidden_states:
                all_states.append([self.output(s) for s in states[: self.num_layers]])
        if cache is not None:  # the cache's own writes (in place in a static cache)
            for i, (name, state) in enumerate(zip(self.state_names, states)):
                cache.set_state(name, state, None if per_position is None else [step[i] for step in per_position])
            cache.advance(word_inputs.shape[1])
        tops, contexts = torch.stack(tops, 1), torch.stack(contexts, 1)
        if self.luong:
            readout = torch.stack(readouts, 1)  # h~_t (not dropped: see the module docstring)
        else:
            readout = self.readout(F.dropout(tops, self.config.dropout, self.training), contexts)
            readout = F.dropout(readout, self.config.dropout, self.training)
        hidden_states = None
        if output_hidden_states:
            layers = [torch.stack([step[l] for step in all_states], 1) for l in range(self.num_layers)]
            hidden_states = (embeddings, *layers, readout)
        return HybridDecoderOutput(readout=readout, states=tops, contexts=contexts,
                                   attentions=torch.stack(attentions, 2), hidden_states=hidden_states)


# ----------------------------------------------------------------------------------------------------------------
# Eq. 1: the distillation objective of the second training stage (Sec. 2.2), with the teacher fixed:
#   L(theta_s) = sum_n log P(y^(n) | x^(n); theta_s) - lambda sum_n KL(P(y | x^(n); theta_t) || P(y | x^(n); theta_s))
# minimised as -L; its KL over whole sequences approximated per word (kd_loss) or per sequence (sequence_kd_loss).
# The training pipeline that runs it is hf_hardattn.tools.distill.
# ----------------------------------------------------------------------------------------------------------------
def _wide(logits):
    """fp32 for half-precision logits (bf16 autocast), float64 kept."""
    return logits if logits.dtype == torch.float64 else logits.float()


def _token_nll(logits, labels):
    """-log P(y_t) per position (0 where labels == -100)."""
    log_probs = torch.log_softmax(_wide(logits), dim=-1)
    nll = -log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels != -100, nll, 0.0)


def kd_loss(student_logits, teacher_logits, labels, kd_lambda: float = 1.0, num_items_in_batch=None,
            return_parts: bool = False):
    """Eq. 1, negated, with a word-level approximation of its KL (``eq1_word`` on reference labels; also
    ``sequence_word`` on the teacher's output, which is not Eq. 1): sum over target
    tokens (labels != -100) of -log P_s(y_t) + kd_lambda * KL(P_t(. | y_<t, x) || P_s(. | y_<t, x)), divided by
    ``num_items_in_batch`` (or the number of target tokens).

    KL(P_t || P_s) = sum_v P_t(v) (log P_t(v) - log P_s(v)); terms with P_t(v) = 0 count 0. With ``return_parts``
    also returns the (normalised) NLL and KL sums."""
    if not kd_lambda >= 0:
        raise ValueError(f"`kd_lambda` must be >= 0, got {kd_lambda!r}.")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ: "
            "`teacher_model` must share the student's tokenizer/vocabulary (same vocabulary size)."
        )
    mask = labels != -100
    log_student = torch.log_softmax(_wide(student_logits), dim=-1)
    log_teacher = torch.log_softmax(_wide(teacher_logits).to(log_student.dtype), dim=-1)
    nll = _token_nll(student_logits, labels)
    p_teacher = log_teacher.exp()
    kl = torch.where(p_teacher > 0, p_teacher * (log_teacher - log_student), 0.0).sum(-1)
    denominator = mask.sum() if num_items_in_batch is None else num_items_in_batch
    # an all-ignored batch (every label -100) gives 0, not 0 / 0 = NaN
    denominator = denominator.clamp(min=1) if isinstance(denominator, torch.Tensor) else max(denominator, 1)
    nll_sum, kl_sum = nll[mask].sum() / denominator, kl[mask].sum() / denominator
    loss = nll_sum + kd_lambda * kl_sum
    return (loss, nll_sum, kl_sum) if return_parts else loss


def sequence_kd_loss(reference_logits, labels, teacher_output_logits, teacher_labels, kd_lambda: float = 1.0,
                     num_items_in_batch=None, return_parts: bool = False):
    """Eq. 1, negated, with the sequence-level approximation of its KL (``eq1_sequence``):
    sum_n [-log P_s(y^(n) | x^(n)) + kd_lambda * -log P_s(y_hat^(n) | x^(n))] with y the reference (``labels``) and
    y_hat the teacher's beam output (``teacher_labels``), both as token sums, divided by ``num_items_in_batch`` (or
    the number of reference tokens), so that lambda weighs the two sentence-level sums as in Eq. 1. With
    ``return_parts`` also returns the (normalised) reference NLL and the KD term (its NLL of y_hat)."""
    if not kd_lambda >= 0:
        raise ValueError(f"`kd_lambda` must be >= 0, got {kd_lambda!r}.")
    denominator = (labels != -100).sum() if num_items_in_batch is None else num_items_in_batch
    reference = _token_nll(reference_logits, labels).sum() / denominator
    kd_term = _token_nll(teacher_output_logits, teacher_labels).sum() / denominator
    loss = reference + kd_lambda * kd_term
    return (loss, reference, kd_term) if return_parts else loss


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------
class HybridPreTrainedModel(HardAttnPreTrainedModel):
    config_class = HybridConfig
    _no_split_modules = ["EncoderLayer", "HybridDecoder"]

    @torch.no_grad()
    def _init_weights(self, module):
        """The skeleton's init (Xavier linears: every RNN/attention matrix here is an nn.Linear) plus orthogonal
        recurrent blocks (W_hr, W_hz, W_hn; LSTM: W_hi, W_hf, W_hg, W_ho: the usual RNN init, keeps the recurrence well
        conditioned) and, for an LSTM, a forget-gate bias of 1 (tensorflow/nmt's forget_bias, Jozefowicz et al. 2015).
        Loaded weights (flagged ``_is_hf_initialized``) are left alone, also for the row blocks, which are views without
        the flag."""
        super()._init_weights(module)
        if isinstance(module, RNNHiddenProjection):
            hidden = module.hidden_size
            if not getattr(module.weight, "_is_hf_initialized", False):
                for gate in range(module.gates):
                    init.orthogonal_(module.weight[gate * hidden : (gate + 1) * hidden])
            if module.gates == 4 and not getattr(module.bias, "_is_hf_initialized", False):
                init.ones_(module.bias[hidden : 2 * hidden])  # [i, f, g, o]: f


class HybridModel(HybridPreTrainedModel, HardAttnModel):
    """Shared token embeddings + Transformer encoder + RNN decoder (no output layer): the hybrid's bare model
    (``AutoModel``); ``last_hidden_state`` is the readout o_t (bahdanau) or h~_t (luong), the output layer's input."""

    decoder_class = HybridDecoder

    def decoder_outputs(self, decoder_input_ids, encoder_hidden_states, attention_mask, decoder_inputs_embeds=None,
                        cache=None, output_hidden_states=False, decoder_attention_mask=None) -> HybridDecoderOutput:
        """The full :class:`HybridDecoderOutput` (readout, states, contexts, attentions, hidden states when asked);
        ``decoder_attention_mask``: a left-padded prompt's padding keeps the states (see the module docstring)."""
        return self.decoder(decoder_input_ids, encoder_hidden_states, attention_mask, decoder_inputs_embeds, cache,
                            output_hidden_states=output_hidden_states, attention_mask=decoder_attention_mask)

    decode_reads_memory_grouped = True  # see HardAttnForConditionalGeneration._memory_grouped_decoding
    decode_writes_static_cache = True  # see HardAttnModel.static_decoding_refusal
    decode_reads_left_padding = True  # see HardAttnModel.left_padding_refusal

    def decode(self, decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
               decoder_inputs_embeds, cache, output_attentions=False, output_hidden_states=False) -> DecoderResult:
        """Readout vectors [B, T, d_model]. ``decoder_attention_mask``: right padding comes after the tokens that
        matter (a left-to-right RNN never reads it); padding before a row's first token (a left-padded prompt) keeps
        the states, so the row decodes as its prompt alone. With ``output_attentions`` the
        RNN decoder's attention over the source is its one ``cross_attentions`` layer [B, heads, T, S] (one head for
        additive and dot attention) and ``decoder_attentions`` holds None for each RNN layer (no self-attention);
        ``output_hidden_states`` gives (embeddings, every RNN layer's output [B, T, rnn_hidden_size], the readout)."""
        out = self.decoder_outputs(decoder_input_ids, encoder_hidden_states, attention_mask, decoder_inputs_embeds,
                                   cache, output_hidden_states, decoder_attention_mask)
        attentions = (None,) * self.config.decoder_layers if output_attentions else None
        return DecoderResult(out.readout, out.hidden_states, attentions,
                             (out.attentions,) if output_attentions else None)


class HybridForConditionalGeneration(HybridPreTrainedModel, HardAttnForConditionalGeneration, GenerationMixin):
    config_class = HybridConfig
    INT8_KEEP = (".score",)  # the additive attention's v, read as a vector (quantize_int8 keeps it fp32)
    model_class = HybridModel
    card_title = "Hybrid: self-attention encoder + RNN decoder"
    card_description = (
        "A Transformer encoder with a recurrent decoder (GRU by default, `rnn_cell`; one layer by default). "
        "`rnn_decoder_style=\"bahdanau\"` (default, the hybrid paper's RNMT decoder): the step reads the previous "
        "state, the previous word and an attention context over the encoder output queried with the previous state. "
        "`rnn_decoder_style=\"luong\"` (input feeding, Luong et al. 2015): the step reads the previous word and the "
        "previous attentional state, the attention is queried with the new state and the output layer reads "
        "tanh(W_c [s_t; c_t] + b). The attention is additive, dot-product or multi-head (`rnn_attention`); source "
        "keys/values are pre-computed once per sentence and the RNN's hidden projection is fused with the attention "
        "query projection. The RNN state lives in the cache and is reordered for beam search. "
        "The paper trains it in two stages: MLE on the bilingual data, then Eq. 1 (the likelihood of "
        "the references minus lambda * KL(teacher || student), a fixed Transformer teacher, lambda = 1). "
        "`hf_hardattn.tools.distill.train_two_stage` runs both; its default `kd_scheme=\"eq1_sequence\"` approximates the "
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
                        "rnn_cell", "rnn_hidden_size", "rnn_decoder_style", "rnn_attention", "vocab_size",
                        "position_embedding", "normalize_before")

    def card_roles_table(self) -> str:
        config = self.config
        heads = f", {config.decoder_attention_heads} heads" if config.rnn_attention == "multihead" else ""
        query = "the previous state s_{t-1}" if config.rnn_decoder_style == "bahdanau" else "the current state s_t"
        return "\n".join([
            "| role | kind |", "| --- | --- |",
            f"| encoder self-attention | {config.encoder_attention} |",
            f"| decoder | {config.rnn_cell.upper()} ({config.decoder_layers} layer(s), state {config.rnn_hidden_size}), "
            f"{config.rnn_decoder_style}-style, no self-attention |",
            f"| decoder attention over the encoder output | {config.rnn_attention}{heads} (one per step, queried with "
            f"{query}) |"])


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
    "RNNHiddenProjection",
    "gru_update",
    "kd_loss",
    "sequence_kd_loss",
]
