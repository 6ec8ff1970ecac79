r"""Beam-joint / full-joint attention (Shankar, Garg & Sarawagi, "Surprisingly Easy Hard-Attention for Sequence to
Sequence Learning", EMNLP 2018) as an *output mechanism*.

Soft attention marginalises early: P(y_t) = P(y_t | sum_a P_t(a) x_a) (Eq. 2). The joint model marginalises late,
the paper's Eq. 4 ("full-joint") and Eq. 5 ("beam-joint"), exactly as printed:

    $$\log P_t(y_t|\mathbf{x}_{1...m}) = \log \sum_a P_t(a)P_t(y_t|\mathbf{x}_a) \quad (4)$$
    $$\log P_t(y_t|\mathbf{x}_{1...m}) \approx \log \sum_{a \in \text{TopK}(P_t(a))} P_t(y_t|\mathbf{x}_a)$$ (5)

Eq. 5 as printed has no weight P_t(a); the text around it has one: "select the Top-K input positions from the
multinomial, next with hard attention on each position compute K output softmax, and finally compute the attention
weighted output mixture distribution" (Sec. 3), and Eq. 5 approximates Eq. 4 ("approximates the full joint log
probability as"). So the mixture here is Eq. 4 restricted to the top K:

    log P_t(y_t) ~= log sum_{a in TopK(P_t)} P_t(a) P_t(y_t | x_a)                (Eq. 5 with the weight)

where P_t(y | x_a) is the output distribution computed with hard attention on source state a (the same output layer
as the soft path, the context replaced by that single state). TopK is a pass-through operator: no gradient flows
through the *selection*, the gradient reaches the attention scores through the mixture weights P_t(a_k).

The paper never renormalises the top-K weights; ``renormalize_joint`` (default True) divides them by their sum so
that the mixture is a distribution, except at K=1 in training (:meth:`JointOutputMixin.renormalizes`): one
renormalised weight is exactly 1 and the attention would get no gradient, whereas the paper trains K=1 (Figure 2:
"On En-Vi BLEU increases from 16.0 to 25.7 to 26.5 as K increases from 1 to 2 to 3"; Table 2's K=1 at inference,
26.5 on En-Vi, is another model) with the beam-approximation as it is: "We used the default pass-through TopK
operator (which is not differentiable) and optimize the beam-approximation directly." At K=1 the training loss is
-log P_t(a_1) - log P_t(y_t | x_{a_1}) (a_1 the argmax of P_t): the attention's gradient is that of log P_t(a_1).

The mixture is computed in log space (logsumexp, fp32) and returned as ``logits`` holding LOG-PROBABILITIES, so
generate() (greedy / beam / sampling) and the Trainer's loss work unchanged: log_softmax of log-probabilities is the
identity. The K x vocabulary logits are never all alive at once: :class:`JointMixture` computes them chunk by chunk
and recomputes them chunk by chunk in backward (memory O(tokens x V + chunk x V), not O(tokens x K x V)).

Two settings:

* :class:`BeamJointTransformerForConditionalGeneration` (the paper's future work, multi-head Transformer): in one
  designated decoder cross-attention layer (default the last) the joint is taken over source positions with the
  head-averaged attention distribution; per selected position every head attends only to it, and the rest of that
  layer (output projection, residual, norms, FFN), any later layers and the vocabulary projection run per candidate.
* :class:`BeamJointRNNForConditionalGeneration` (the paper's own setting, Sec. 2.1): an attentional RNN decoder
  (``hybrid.py``; the paper's Luong step with input feeding in ``luong_decoder.py``) over the Transformer encoder. Default ``rnn_decoder_style="luong"`` with ``rnn_cell="lstm"`` and
  ``rnn_attention="dot"`` (the authors' code: tensorflow/nmt, LSTM decoder, scaled Luong attention, input feeding):
  P_t(a) is queried with the CURRENT state s_t (after reading y_{t-1}); candidate a's output-layer input is
  h~_{t,a} = tanh(W_c [s_t; x_a] + b_c), built from s_t and the single encoder state x_a only (pure hard attention);
  the soft attentional output h~_t = tanh(W_c [s_t; c_t] + b_c) is fed to the NEXT step (input feeding), as the paper's
  c_t "is fed to the decoder RNN along with y_t for computing the next state s_{t+1}".
  ``rnn_decoder_style="bahdanau"`` (the hybrid paper's decoder, and what every beam_joint_rnn model saved before the
  field existed uses: a saved config without ``rnn_decoder_style`` / ``rnn_cell`` loads as bahdanau / gru) is a
  departure from the paper: the attention is queried with s_{t-1}, the soft context c_t enters s_t, and every
  candidate's readout tanh(W_o [s_t; x_a] + b_o) still contains that soft context through s_t.

Runtime code shipped with saved models: flat, same-folder relative imports only.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers.utils import ModelOutput

from .configuration_hardattn import HardAttnConfig
from .caches import CACHE_FIELD, HardAttnCache, StaticHardAttnCache
from .hybrid import HybridConfig, HybridForConditionalGeneration, HybridModel
from .inputs import is_tracing
from .joint_kernel import JointWorkspace, at_least_fp32, joint_log_probs, joint_mixture, select_candidates
from .layers import DecoderResult, check_memory_rows
from .loss import token_mean
from .modeling_hardattn import HardAttnForConditionalGeneration, HardAttnModel
from .registry import attention_class, kinds_allowed



class JointCandidates(NamedTuple):
    """What a beam-joint ``decode`` hands to ``output_logits``: the output-layer input of every candidate
    [B, T, K, d] and the candidates' log mixture weights [B, T, K]."""

    hidden: torch.Tensor
    log_weights: torch.Tensor


def check_joint_fields(config):
    for name in ("joint_k", "full_joint_max_source_length", "joint_chunk_size"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    value = config.joint_inference_k
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"`joint_inference_k` must be None (= joint_k) or an integer >= 1, got {value!r}.")
    for name in ("full_joint", "renormalize_joint"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"`{name}` must be True or False, got {getattr(config, name)!r}.")
    if getattr(config, "final_logits_bias", False):
        raise ValueError("`final_logits_bias` must be False for beam-joint models: the mixture's output layer (the tied "
                         "vocabulary projection) has no bias; allowed: False.")


class JointDecoding:
    """Shared by both settings' bare and full models: the active K and the checks of the candidates' inputs."""

    def active_k(self) -> int:
        check_joint_fields(self.config)  # fields may have been edited after construction
        k = self.config.joint_k
        if not self.training and self.config.joint_inference_k is not None:
            k = self.config.joint_inference_k
        return k

    def renormalizes(self, k: int) -> bool:
        """Whether the top-``k`` weights are renormalised: ``renormalize_joint``, except with a single candidate in
        training. One renormalised weight is exactly 1, so the attention would get no gradient from the loss; the
        paper trains K=1 (its Figure 2) and optimises "the attention weighted output mixture distribution" (Sec. 3)
        with the weight P_t(a_1) of Eq. 1 (module docstring). In eval (decoding, scoring) K=1 stays renormalised:
        hard attention on the argmax, a distribution, as Table 2's K=1 decoding ("Since the output now has only a
        single softmax component")."""
        return self.config.renormalize_joint and not (self.training and k == 1)

    @staticmethod
    def check_memory(decoder_input_ids, decoder_inputs_embeds, encoder_hidden_states, attention_mask):
        """One encoder row per decoder row: the joint mixes each row's own source states (no grouped memory)."""
        rows = (decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds).shape[0]
        check_memory_rows(rows, encoder_hidden_states, attention_mask, grouped=False)

    def check_source_length(self, source_length: int):
        limit = self.config.full_joint_max_source_length
        if self.config.full_joint and source_length > limit:
            raise ValueError(
                f"full_joint=True mixes over every source position; this batch has source length {source_length} > "
                f"`full_joint_max_source_length`={limit}. Allowed: sources of at most {limit} positions (raise the "
                f"limit, or use full_joint=False with joint_k)."
            )



@dataclass
class BeamJointModelOutput(ModelOutput):
    """The bare beam-joint model's output (``AutoModel``): its decoder gives no single hidden state per position but
    K candidates and their mixture weights, which the full model's output layer turns into the mixture (Eq. 4-5).

    Args:
        candidate_hidden_states: [B, T, K, d_model], the output-layer input of each candidate a_k (hard attention on
            one source state; see the full model's class docstring), i.e. ``lm_head`` gives log P_t(y | x_{a_k}).
        candidate_log_weights: [B, T, K], log P_t(a_k) (renormalised over the K when ``renormalize_joint``, see
            :meth:`JointDecoding.renormalizes`); log sum_k exp(w_k + log_softmax(lm_head(h_k))) is the full model's
            ``logits``.
        cache (``past_key_values`` before transformers 5.24), decoder_hidden_states, decoder_attentions,
        cross_attentions, encoder_last_hidden_state, encoder_hidden_states, encoder_attentions: as
        ``Seq2SeqModelOutput``'s (the decoder's as the full model's ``forward`` describes them).
    """

    candidate_hidden_states: torch.Tensor | None = None
    candidate_log_weights: torch.Tensor | None = None
    __annotations__[CACHE_FIELD] = HardAttnCache | None  # the cache's field name of the installed transformers
    locals()[CACHE_FIELD] = None
    decoder_hidden_states: tuple | None = None
    decoder_attentions: tuple | None = None
    cross_attentions: tuple | None = None
    encoder_last_hidden_state: torch.Tensor | None = None
    encoder_hidden_states: tuple | None = None
    encoder_attentions: tuple | None = None


class JointModelMixin(JointDecoding):
    """The bare beam-joint models: their output is :class:`BeamJointModelOutput`."""

    def model_output(self, encoder_outputs, decoded, cache):
        candidates = decoded.last_hidden_state
        return BeamJointModelOutput(
            candidate_hidden_states=candidates.hidden, candidate_log_weights=candidates.log_weights,
            decoder_hidden_states=decoded.hidden_states, decoder_attentions=decoded.attentions,
            cross_attentions=decoded.cross_attentions, encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states, encoder_attentions=encoder_outputs.attentions,
            **{CACHE_FIELD: cache},
        )


class JointOutputMixin(JointDecoding):
    """The full beam-joint models: the mixture head and the loss."""

    # quantize_int8 keeps these fp32: the chunked mixture reads the vocabulary projection's weight, and the RNN
    # setting's candidates split the readout's weight (candidate_readouts; a layer that is not a plain nn.Linear is
    # called instead, at K times the readout's cost)
    INT8_KEEP = ("lm_head", "decoder.readout_proj", ".score")
    output_logits_static = True  # a traced step takes joint_log_probs' plain form: no buffers, shapes unchanged

    def output_logits(self, hidden, **kwargs):
        """LOG-probabilities [B, T, V] of the mixture (Eq. 4-5), fp32."""
        if not isinstance(hidden, JointCandidates):
            raise TypeError("beam-joint output_logits expects the JointCandidates returned by `decode`.")
        if type(self.lm_head) is not nn.Linear:  # a PEFT adapter, a quantized layer: its weight is not its map
            return joint_mixture(self.lm_head(hidden.hidden), hidden.log_weights)
        workspace = None  # a traced graph takes joint_log_probs' plain form: no buffers, the model's left alone
        if not is_tracing():
            if getattr(self, "_joint_workspace", None) is None:  # a plain attribute: not a parameter, never saved
                self._joint_workspace = JointWorkspace()  # the mixture's buffers, kept between training steps
            workspace = self._joint_workspace
        return joint_log_probs(hidden.hidden, hidden.log_weights, self.lm_head.weight, self.config.joint_chunk_size,
                               workspace)

    def release_joint_workspace(self):
        """Free the mixture's buffers kept between calls (three buffers of ``joint_chunk_size`` x V values); the next
        call allocates them again."""
        if getattr(self, "_joint_workspace", None) is not None:
            self._joint_workspace.release()

    def compute_loss(self, logits, labels, num_items_in_batch=None):
        """Negative log-likelihood (label-smoothed when ``label_smoothing`` > 0; the beam-joint configs default to 0,
        the paper's plain likelihood) of the mixture log-probabilities, used as they are (no extra
        log_softmax), so that ``renormalize_joint=False`` really trains the un-renormalised Eq. 5. With renormalised
        weights it equals the skeleton's cross-entropy exactly (log_softmax of log-probabilities is the identity)."""
        log_probs = logits.reshape(-1, logits.shape[-1]).float()
        labels = labels.reshape(-1).to(log_probs.device)
        valid = labels != -100
        nll = -log_probs.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
        eps = self.config.label_smoothing
        per_token = (1.0 - eps) * nll - eps * log_probs.mean(-1) if eps > 0 else nll
        return token_mean(per_token.masked_fill(~valid, 0.0).sum(), labels, num_items_in_batch)


# ----------------------------------------------------------------------------------------------------------------
# Setting 2: multi-head Transformer decoder
# ----------------------------------------------------------------------------------------------------------------
@dataclass(repr=False, kw_only=True)
class JointFields:
    """The joint-output fields both beam-joint configs declare, and their validation.

    Args:
        label_smoothing: default 0.0 for the beam-joint types (:class:`HardAttnConfig`: 0.1): the paper trains the
            mixture with plain likelihood.
        joint_k: K of the attention beam (Eq. 5) during training (default 6, the paper's default).
        joint_inference_k: K in eval mode (generation); None = ``joint_k``. The paper's Table 2 trains with K=6
            and decodes with K=1.
        full_joint: mix over every source position (Eq. 4) instead of the top K; for small vocabularies and short
            sources such as character-level inflection.
        full_joint_max_source_length: full-joint refuses (ValueError) batches whose padded source length exceeds
            this, since its cost is source length x vocabulary per target token.
        renormalize_joint: divide the top-K weights by their sum so that the mixture is a distribution (default
            True; the paper never renormalises: its Eq. 5 is the plain top-K sum). Not at K=1 in training, where the
            one renormalised weight would be exactly 1 and give the attention no gradient: a K=1 model trains with
            the paper's weight P_t(a_1) (module docstring); in eval K=1 is renormalised (hard attention on the argmax).
            With False, the log-probabilities of the un-renormalised Eq. 5 sum to sum_k P(a_k) <= 1 and the loss
            trains that bound directly; generate() still works (beam search renormalises with log_softmax).
        joint_chunk_size: candidate rows (tokens x K) whose vocabulary logits are materialised at once; bounds the
            memory of the K x vocabulary logits: three buffers of joint_chunk_size x V values live from forward to
            the end of backward (fp32 probabilities and scratch, logits in the GEMM's dtype) instead of
            ~3 x tokens x K x V; chunks beyond the last are recomputed in backward (a batch of at most this many rows
            is never recomputed). The model keeps these buffers between steps (page faults on fresh ones cost as much
            as the work): ``model.release_joint_workspace()`` frees them.
    """

    joint_k: int = 6
    joint_inference_k: int | None = None
    full_joint: bool = False
    full_joint_max_source_length: int = 64
    renormalize_joint: bool = True
    joint_chunk_size: int = 16384
    label_smoothing: float | int = 0.0  # the paper trains the mixture with plain likelihood

    def check(self):
        super().check()
        check_joint_fields(self)


class BeamJointTransformerConfig(JointFields, HardAttnConfig):
    """Transformer whose output is the beam-joint (Eq. 5) or full-joint (Eq. 4) attention-output mixture taken in one
    decoder cross-attention layer.

    Args (besides :class:`HardAttnConfig`'s and the joint fields of :class:`JointFields`):
        joint_layer: the decoder layer whose cross-attention defines P_t(a) (head-averaged) and is made hard per
            candidate; -1 (default) = the last layer; negative values count from the end. Its cross-attention kind
            must be "soft"; decoder self-attention of the layers after it must be "soft" or "none".
    """

    model_type = "beam_joint_transformer"
    joint_layer: int = -1

    def check(self):
        super().check()  # JointFields.check: the joint fields
        layer = self.joint_layer_index()
        for index, kind in enumerate(self.attention_kinds("cross")[layer + 1 :], start=layer + 1):
            # the candidates' queries run as K rows per position: a kind that places a query by its position or
            # carries state from step to step would misplace them (it reads no grouped memory, see SoftAttention)
            module = attention_class(kind, self)
            if module is not None and not module.reads_memory_grouped:
                allowed = [name for name in kinds_allowed("cross") if name == "none" or attention_class(name, self)
                           .reads_memory_grouped]
                raise ValueError(
                    f"`cross_attention` of layer {index} (after `joint_layer`={layer}) must treat each query on its "
                    f"own (each candidate is a query, not a target position); allowed: {allowed}, got {kind!r}."
                )

    def joint_layer_index(self) -> int:
        n = self.decoder_layers
        layer = self.joint_layer
        if isinstance(layer, bool) or not isinstance(layer, int) or not -n <= layer < n:
            raise ValueError(f"`joint_layer` must be a decoder layer index in [{-n}, {n - 1}], got {layer!r}.")
        layer = layer % n
        cross = self.attention_kinds("cross")[layer]
        if cross != "soft":
            raise ValueError(
                f"`cross_attention` of the joint layer {layer} must be 'soft' (its distribution is P_t(a)), got {cross!r}."
            )
        for index, kind in enumerate(self.attention_kinds("decoder")[layer + 1 :], start=layer + 1):
            if kind not in ("soft", "none"):
                raise ValueError(
                    f"`decoder_attention` of layer {index} (after `joint_layer`={layer}) must be 'soft' or 'none' "
                    f"(candidates attend to the soft history), got {kind!r}."
                )
        return layer


class BeamJointTransformerModel(JointModelMixin, HardAttnModel):
    """The bare beam-joint Transformer (``AutoModel``): encoder + decoder up to the K candidates of each position
    (:class:`BeamJointModelOutput`), without the vocabulary projection and mixture."""

    config_class = BeamJointTransformerConfig

    decode_writes_static_cache = True  # (see HardAttnModel.static_decoding_refusal)
    # a left-padded decoder prompt: the skeleton's start() counts positions from each row's first real token and hides
    # its padding; the candidates read the soft history through the same mask (see HardAttnModel.left_padding_refusal)
    decode_reads_left_padding = True

    def decode(self, decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
               decoder_inputs_embeds, cache, output_attentions=False, output_hidden_states=False):
        """The skeleton decoder's layers up to the joint layer, the joint layer with its cross-attention made hard on
        the top-K positions of P_t(a) (:meth:`DecoderLayer.forward_hard_cross`), the later layers per candidate beside
        the soft stream (:meth:`DecoderLayer.forward_with_candidates`), the final norm on the candidates.

        With a :class:`~caches.StaticHardAttnCache` the candidates of the later layers read the cache's slots before
        their own position (a mask from the position tensor), one position per call: a call of several positions
        decodes them one by one (:meth:`decode_positions`)."""
        config, decoder = self.config, self.decoder
        joint = config.joint_layer_index()
        k_active = self.active_k()
        self.check_source_length(encoder_hidden_states.shape[1])
        self.check_memory(decoder_input_ids, decoder_inputs_embeds, encoder_hidden_states, attention_mask)
        last = len(decoder.layers) - 1
        inputs = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
        static = isinstance(cache, StaticHardAttnCache)
        if static and joint < last and inputs.shape[1] > 1:
            return self.decode_positions(decoder_input_ids, encoder_hidden_states, attention_mask,
                                         decoder_attention_mask, decoder_inputs_embeds, cache, output_attentions,
                                         output_hidden_states)
        state = decoder.start(decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
                              decoder_inputs_embeds, cache, output_attentions, output_hidden_states)
        decoder.run_layers(state, 0, joint)
        history_mask = state.attention_mask  # the decoder's [B, past + T] padding mask: what candidates may read
        if static and joint < last:  # the slots before the query's position (its mask over the slots, [B or 1, slots])
            slots = state.self_masks[joint][0][:, 0, 0, :]
            history_mask = slots & (torch.arange(slots.shape[-1], device=slots.device) < cache.get_seq_length())

        def select(log_heads):  # P_t(a): the head average of Eq. 1's weights; the attention beam (Eq. 4-5)
            log_p = torch.logsumexp(log_heads, dim=1) - math.log(log_heads.shape[1])
            return select_candidates(log_p, k_active, config.full_joint, self.renormalizes(k_active))

        self_mask, causal = state.self_masks[joint]
        x, y, (log_w, _), self_weights, log_heads = decoder.layers[joint].forward_hard_cross(
            state.x, state.memory, self_mask, causal, state.cross_mask, cache, select, joint < last, output_attentions)
        state.record(y, self_weights, log_heads.exp() if output_attentions else None)
        for index in range(joint + 1, last + 1):  # candidates attend to the soft history and themselves
            self_mask, causal = state.self_masks[index]
            x, y, self_weights, cross_weights = decoder.layers[index].forward_with_candidates(
                x, y, state.memory, self_mask, causal, history_mask, state.cross_mask, cache, index < last,
                output_attentions)
            state.record(y, self_weights, cross_weights)
        return decoder.finish(state)._replace(last_hidden_state=JointCandidates(state.x, log_w))

    def decode_positions(self, decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
                         decoder_inputs_embeds, cache, output_attentions=False, output_hidden_states=False):
        """:meth:`decode` of a call of several positions over a static cache, one position at a time, the results
        joined along the positions (the decoder's mask covers the positions from 0, so every call takes it whole)."""
        def position(x, t):
            return None if x is None else x[:, t:t + 1]

        inputs = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
        steps = [self.decode(position(decoder_input_ids, t), encoder_hidden_states, attention_mask,
                             decoder_attention_mask, position(decoder_inputs_embeds, t), cache, output_attentions,
                             output_hidden_states) for t in range(inputs.shape[1])]

        def joined(parts, dim):  # per-layer tuples (entries None for a missing sub-layer) or tensors
            if parts[0] is None:
                return None
            if isinstance(parts[0], tuple):
                return tuple(joined(list(layer), dim) for layer in zip(*parts))
            return torch.cat(parts, dim)

        candidates = JointCandidates(*(torch.cat(part, 1) for part in zip(*(step.last_hidden_state for step in steps))))
        return DecoderResult(candidates, joined([step.hidden_states for step in steps], 1),
                             joined([step.attentions for step in steps], 2),
                             joined([step.cross_attentions for step in steps], 2))


class BeamJointTransformerForConditionalGeneration(JointOutputMixin, HardAttnForConditionalGeneration,
                                                   GenerationMixin):
    """Beam-joint attention on a multi-head Transformer decoder (the paper's "future work").

    In the joint layer L (``config.joint_layer``): P_t(a) = mean over heads of softmax(q k^T / sqrt(d_k)) (Eq. 1,
    head-averaged); for each of the top-K positions a every head attends only to a, i.e. the attention output is
    out_proj(concat_h v_h[a]) = x_a; the residual, norms and FFN of layer L, every later layer and the vocabulary
    projection run once per candidate, and the K output distributions are mixed (Eq. 5). Decoder positions
    are causal: the state of position t that later positions (and later layers' self-attention) see is the soft
    one (as in the paper's RNN, where the soft context feeds the next step, Sec. 2.1); a candidate at t attends to
    that soft history plus its own state. Attention dropout is not applied to the mixture weights P_t(a) (it still
    applies to the soft stream that later layers see).

    Outputs (``output_attentions`` / ``output_hidden_states``): layers before the joint layer as in the soft model.
    The joint layer's ``cross_attentions`` slot holds every head's softmax [B, H, T, S]: P_t(a) is its mean over the
    heads (dim 1), and the top-K set of position t is ``P_t.topk(K).indices`` (K = ``joint_k`` in training,
    ``joint_inference_k`` when set in eval; ties aside; ``full_joint``: every position). From the joint layer on,
    ``decoder_hidden_states`` are the candidates' states [B, T, K, d] (the last one: the output layer's input, whose K
    distributions mix into the logits), and the attentions of later layers are the candidates': queries flattened as
    t * K + k, self-attention [B, H, T * K, past + T + 1] over the soft history plus (last column) the candidate's own
    state, cross-attention [B, H, T * K, S].
    """

    config_class = BeamJointTransformerConfig
    model_class = BeamJointTransformerModel
    card_title = "Transformer with beam-joint attention"
    card_description = (
        "Output mechanism of Shankar, Garg & Sarawagi (2018), extended to a multi-head Transformer decoder as the "
        "paper's future work proposes. In one designated cross-attention layer (`joint_layer`, default the last "
        "decoder layer) the attention distribution P_t(a) over source positions is the head-averaged softmax "
        "attention. For each of the top-K positions (`joint_k`, default 6), every head attends only to that "
        "position; the rest of that layer (output projection, residual, FFN, norms), any later decoder layers "
        "(whose self-attention sees the soft decoder's history) and the tied vocabulary projection are computed per "
        "candidate, and the K output distributions are mixed: log sum_k P_t(a_k) P_t(y | x_{a_k}) (Eq. 5, top-K "
        "weights renormalised to sum to one by default, `renormalize_joint`). `full_joint=True` mixes over every "
        "source position (Eq. 4). `joint_inference_k` sets another K for decoding (the paper's Table 2 decodes a "
        "K=6 model with K=1). The model returns LOG-PROBABILITIES as `logits` (mixture in log space, fp32), so "
        "generate() and the Trainer work unchanged; K x vocabulary logits are computed in chunks "
        "(`joint_chunk_size`)."
    )
    card_citation = (
        "Shiv Shankar, Siddhant Garg, Sunita Sarawagi. Surprisingly Easy Hard-Attention for Sequence to Sequence "
        "Learning. EMNLP 2018."
    )


# ----------------------------------------------------------------------------------------------------------------
# Setting 1: the paper's RNN decoder (hybrid.py's RNN decoder with luong_decoder.py's step by default)
# ----------------------------------------------------------------------------------------------------------------
class BeamJointRNNConfig(JointFields, HybridConfig):
    """Transformer encoder + attentional RNN decoder (:class:`HybridConfig`) whose output is the beam-joint (Eq. 5)
    or full-joint (Eq. 4) mixture over the RNN attention's distribution P_t(a) (head-averaged for ``rnn_attention=
    "multihead"``).

    Defaults that differ from :class:`HybridConfig` (the beam-joint paper's setting, Sec. 2.1 and 4.1; the authors'
    code is tensorflow/nmt with an LSTM decoder, scaled Luong attention and input feeding):
        rnn_decoder_style: ``"luong"`` (P_t(a) queried with the current state s_t; each candidate from s_t and x_a
            alone; the soft attentional output fed to the next step). ``"bahdanau"`` is the hybrid paper's decoder,
            a departure here (P_t(a) from s_{t-1}, every candidate carries the soft context through s_t).
        rnn_cell: ``"lstm"`` (the paper's cell; ``"gru"`` also works).
        rnn_attention: ``"dot"`` (Luong's "general" score scaled by 1/sqrt(H); tensorflow/nmt's "scaled_luong"
            scales by a learned scalar instead).
    A saved config without ``rnn_decoder_style`` / ``rnn_cell`` (written before these fields existed) loads with
    the behaviour it was trained with: ``"bahdanau"`` / ``"gru"`` (see :meth:`from_dict`); ``rnn_attention`` and
    ``label_smoothing`` were always saved.

    The joint fields are :class:`JointFields`'s.
    """

    model_type = "beam_joint_rnn"
    rnn_decoder_style: str = "luong"
    rnn_cell: str = "lstm"
    rnn_attention: str = "dot"

    # what a config saved before the field existed was trained with
    LEGACY_DEFAULTS = {"rnn_decoder_style": "bahdanau", "rnn_cell": "gru"}

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """A dict without ``rnn_decoder_style`` / ``rnn_cell`` is a config saved before they existed (every config
        written since has them: ``to_dict`` and ``save_pretrained`` write every field): it gets the GRU
        Bahdanau-style decoder it was trained with, not today's defaults. Explicit keyword overrides still win."""
        missing = {k: v for k, v in cls.LEGACY_DEFAULTS.items() if k not in config_dict and k not in kwargs}
        if missing:
            config_dict = {**config_dict, **missing}
        return super().from_dict(config_dict, **kwargs)


def _log_probs(probs):
    """log of attention probabilities whose padded entries are exactly 0: -inf there, with a zero (not NaN)
    gradient."""
    positive = probs > 0
    return torch.where(positive, torch.where(positive, probs, torch.ones_like(probs)).log(), float("-inf"))


class BeamJointRNNModel(JointModelMixin, HybridModel):
    """The bare beam-joint RNN model (``AutoModel``): encoder + RNN decoder up to the K candidates' readouts of each
    position (:class:`BeamJointModelOutput`), without the vocabulary projection and mixture."""

    config_class = BeamJointRNNConfig
    # the hybrid's decoder writes the RNN states, the hard contexts are sentence states (see
    # HardAttnModel.static_decoding_refusal)
    decode_writes_static_cache = True
    # a left-padded decoder prompt: the hybrid's decoder keeps its states through the padding (see
    # HardAttnModel.left_padding_refusal)
    decode_reads_left_padding = True

    def hard_contexts(self, encoder_hidden_states, cache):
        """[B, S, C] hard contexts, computed once per sentence during cached decoding (kept in
        ``cache.sentence_states``: the same for every beam of a sentence, so beam search does not reorder them)."""
        if cache is not None and "beam_joint.hard_contexts" in cache.sentence_states:
            return cache.sentence_states["beam_joint.hard_contexts"]
        hard = self.decoder.hard_contexts(encoder_hidden_states)
        if cache is not None:
            cache.sentence_states["beam_joint.hard_contexts"] = hard
        return hard

    def candidate_readouts(self, states, hard, index):
        """readout(s_t, x_a) for every selected a (luong: h~_{t,a}; bahdanau: o_{t,a}): states [B, T, H], hard
        [B, S, C], index [B, T, K] -> [B, T, K, d]. The readout is tanh(W [s; c] + b) (HybridDecoder.readout), so
        W = [W_s | W_c] splits: W_s s_t once per step, W_c x_a once per source position, and each candidate costs
        one gather + add + tanh (tested against ``decoder.readout`` on explicitly built candidates). A readout layer
        that is not a plain ``nn.Linear`` (a PEFT adapter, a quantized layer) is called on [s_t; x_a] per candidate:
        its weight alone is not the map it applies."""
        proj = self.decoder.readout_proj
        batch, length, n_cand = index.shape

        def pick(source):  # [B, S, n] -> [B, T, K, n]: the rows of the selected positions
            rows = torch.gather(source, 1, index.reshape(batch, -1, 1).expand(-1, -1, source.shape[-1]))
            return rows.view(batch, length, n_cand, -1)

        if type(proj) is not nn.Linear:
            return self.decoder.readout(states[:, :, None, :].expand(-1, -1, n_cand, -1), pick(hard))
        hidden = states.shape[-1]
        from_state = F.linear(states, proj.weight[:, :hidden], proj.bias)  # [B, T, d]
        from_context = F.linear(hard, proj.weight[:, hidden:])  # [B, S, d]
        return torch.tanh(from_state[:, :, None, :] + pick(from_context))

    def decode(self, decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
               decoder_inputs_embeds, cache, output_attentions=False, output_hidden_states=False):
        """Outputs as the hybrid's (its ``cross_attentions`` layer holds every head's a_t: P_t(a) is their mean over
        dim 1 and the top-K set ``P_t.topk(K).indices``, see BeamJointTransformerForConditionalGeneration), except that
        the last ``decoder_hidden_states`` entry is the candidates' readouts [B, T, K, d_model]."""
        self.check_source_length(encoder_hidden_states.shape[1])
        self.check_memory(decoder_input_ids, decoder_inputs_embeds, encoder_hidden_states, attention_mask)
        k_active = self.active_k()
        out = self.decoder_outputs(decoder_input_ids, encoder_hidden_states, attention_mask, decoder_inputs_embeds,
                                   cache, output_hidden_states, decoder_attention_mask)
        heads = out.attentions  # [B, heads, T, S]
        p = heads[:, 0] if heads.shape[1] == 1 else heads.mean(1)  # P_t(a), head-averaged for multi-head
        log_w, index = select_candidates(_log_probs(at_least_fp32(p)), k_active, self.config.full_joint,
                                         self.renormalizes(k_active))
        hard = self.hard_contexts(encoder_hidden_states, cache)
        if self.config.rnn_decoder_style == "luong":  # h~_{t,a} = tanh(W_c [s_t; x_a] + b), not dropped (as h~_t)
            readouts = self.candidate_readouts(out.states, hard, index)
        else:  # dropout as HybridDecoder.forward's bahdanau readout: on s_t and on the readout
            dropout, training = self.config.dropout, self.training
            states = F.dropout(out.states, dropout, training)
            readouts = F.dropout(self.candidate_readouts(states, hard, index), dropout, training)
        hidden_states = out.hidden_states[:-1] + (readouts,) if output_hidden_states else None
        return DecoderResult(JointCandidates(readouts, log_w), hidden_states,
                             (None,) * self.config.decoder_layers if output_attentions else None,
                             (heads,) if output_attentions else None)


class BeamJointRNNForConditionalGeneration(JointOutputMixin, HybridForConditionalGeneration, GenerationMixin):
    """Beam-joint attention in the paper's own setting, an attentional RNN decoder (``hybrid.py``).

    ``rnn_decoder_style="luong"`` (default, the paper's): at step t the RNN reads y_{t-1} and the previous soft
    attentional output h~_{t-1} (input feeding) into s_t; the attention queried with s_t gives P_t(a) (Eq. 1). For
    each of the top-K positions a the output layer reads h~_{t,a} = tanh(W_c [s_t; x_a] + b_c) (x_a: the hard context
    of a, :meth:`HybridDecoder.hard_contexts`), P_t(y | x_a) = softmax(lm_head(h~_{t,a})), and the K distributions
    are mixed (Eq. 5). The soft h~_t = tanh(W_c [s_t; c_t] + b_c) is what the next step reads: the candidates never
    contain the soft context of their own step.

    ``rnn_decoder_style="bahdanau"`` (earlier saved models; not the paper's): P_t(a) is queried with s_{t-1}, the soft
    context c_t enters s_t = RNN([E y_{t-1}; c_t], s_{t-1}), and the candidates are readout(s_t, x_a), each still
    carrying c_t through s_t."""

    config_class = BeamJointRNNConfig
    model_class = BeamJointRNNModel
    card_title = "Transformer encoder + attentional RNN decoder with beam-joint attention"
    card_description = (
        "Output mechanism of Shankar, Garg & Sarawagi (2018) in the paper's own setting, an attentional RNN decoder "
        "over a Transformer encoder. Default (`rnn_decoder_style=\"luong\"`, `rnn_cell=\"lstm\"`, `rnn_attention="
        "\"dot\"`, as the paper's LSTM decoder with Luong attention and input feeding): the LSTM reads the previous "
        "word and the previous soft attentional output; the attention queried with the new state s_t gives P_t(a); "
        "for each of the top-K source positions (`joint_k`, default 6) the output layer reads tanh(W_c [s_t; x_a] + b) "
        "from s_t and that single encoder state x_a (pure hard attention) and the K distributions are mixed: "
        "log sum_k P_t(a_k) P_t(y | x_{a_k}) (Eq. 5; the top-K weights are renormalised to sum to one by default, "
        "`renormalize_joint`). Trained with plain likelihood (`label_smoothing` 0, as the paper). "
        "`rnn_decoder_style=\"bahdanau\"` (the hybrid paper's GRU decoder, the setting of models saved before the "
        "field existed) queries the attention with the previous state and feeds its soft context into the state that "
        "every candidate reads: not the paper's. For multi-head RNN attention P_t(a) is the head average and the hard "
        "context has every head attend to a. `full_joint=True` mixes over every source position (Eq. 4, e.g. "
        "character-level inflection). `joint_inference_k` sets another K for decoding (Table 2: train K=6, decode "
        "K=1). The model returns LOG-PROBABILITIES as `logits` (mixture in log space, fp32), so generate() and the "
        "Trainer work unchanged; K x vocabulary logits are computed in chunks (`joint_chunk_size`)."
    )
    card_citation = BeamJointTransformerForConditionalGeneration.card_citation


__all__ = [
    "BeamJointModelOutput",
    "BeamJointRNNConfig",
    "BeamJointRNNForConditionalGeneration",
    "BeamJointRNNModel",
    "BeamJointTransformerConfig",
    "BeamJointTransformerForConditionalGeneration",
    "BeamJointTransformerModel",
    "JointCandidates",
]
