"""The shared encoder-decoder skeleton of hf_hardattn (Vaswani et al., 2017).

Written once; every variant plugs into it:

* an attention *kind* per role (encoder self-attention, decoder self-attention, cross-attention), built from its
  entry in ``registry.KINDS``; every kind implements the small interface of :class:`~layers.SoftAttention`
  (``forward(hidden, memory=None, mask=None, causal=False, cache=None)``), usually by overriding ``attend``;
* :class:`~caches.HardAttnCache`, an ``EncoderDecoderCache`` that also carries per-step recurrent state
  (``cache.states``) and reorders it for beam search;
* :class:`HardAttnForConditionalGeneration` (this file), the ``PreTrainedModel`` + ``GenerationMixin`` that every
  variant subclasses with its own config class.

The skeleton by concern: ``layers.py`` (attention, layers, encoder, decoder), ``caches.py``, ``inputs.py`` (input
checks), ``loss.py``, ``int8.py`` (``quantize_int8``), ``saving.py`` (atomic save, checksums, Hub upload) and this
file, the models themselves. Each name is imported from the file that defines it.

Runtime code shipped with saved models (``trust_remote_code``): keep it flat, same-folder relative imports only.
"""

import copy
import difflib
import types

import torch
from torch import nn
from transformers import CompileConfig, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput
from transformers.utils import logging

from .caches import CACHE_FIELD, HardAttnCache, StaticHardAttnCache
from .configuration_hardattn import HardAttnConfig
from .inputs import (check_finite_logits, check_generated_length, check_generation_config, check_ids, check_labels,
                     check_labels_match, check_mask, check_one_of, is_tracing, shift_tokens_right)
from .int8 import Int8Mixin
from .layers import DecoderResult, HardAttnDecoder, HardAttnEncoder, PositionEmbedding, SoftAttention
from .loss import smoothed_cross_entropy, token_mean
from .packed_linear import DEFAULT_MAX_ROWS, pack_linears, unpack_linears
from .registry import KINDS, ROLES, attention_class
from .saving import SavingMixin

logger = logging.get_logger(__name__)

REUSES_STATIC_CACHE = CACHE_FIELD == "cache"  # transformers >= 5.24 (see _prepare_cache_for_generation)

# generate() without length or beam arguments: a generation config fit for translation, as Marian checkpoints ship one
TRANSLATION_MAX_LENGTH = 512  # Marian's max_length (transformers' model-agnostic default, 20, cuts sentences)
TRANSLATION_NUM_BEAMS = 4  # the package's usual beam (`hf-hardattn translate` / `train` --num-beams)


def set_translation_generation_defaults(model, num_beams: int | None = None):
    """Fill the fields of ``model.generation_config`` that are unset (None), never one already set: ``max_length``
    = 512 (Marian's) bounded by the model's position table (``max_position_embeddings``: learned positions end there,
    and transformers bounds its own default by it), and ``num_beams`` when given. Returns the model."""
    generation = model.generation_config
    if generation.max_length is None:
        limit = getattr(model.config, "max_position_embeddings", None)
        generation.max_length = min(TRANSLATION_MAX_LENGTH, limit or TRANSLATION_MAX_LENGTH)
    if num_beams is not None and generation.num_beams is None:
        generation.num_beams = num_beams
    return model


def compiled_decoding(model, backend: str = "inductor", dynamic: bool | None = True, **options) -> dict:
    """``generate()`` keywords that decode with a static cache and compiled decoding steps (transformers' convention,
    for any model whose generate() supports it: the hf_hardattn types that ``check_static_decoding`` allows, Marian,
    BART): ``cache_implementation="static"`` and a ``CompileConfig`` with ``fullgraph=True`` (a graph break is an
    error, not a slow path), ``dynamic=True`` (one graph for every batch size and source length, see
    docs/usage.md), allowed on a CPU too (``_compile_all_devices``), CUDA graphs on a GPU (``mode="reduce-overhead"``,
    transformers' default). ``options``: more ``CompileConfig`` fields (e.g. ``options={"freezing": True}``)."""
    mode = "reduce-overhead" if model.device.type == "cuda" else None
    config = CompileConfig(**{"fullgraph": True, "dynamic": dynamic, "backend": backend, "mode": mode, **options})
    config._compile_all_devices = True  # (transformers compiles on a CPU only when asked)
    return {"cache_implementation": "static", "compile_config": config}


def refuse_model_arguments(cls, config, args, kwargs):
    """The models take their config only. transformers' ``from_pretrained(path, key=value)`` applies a key that is an
    attribute of the config and passes any other on to the model's constructor (so does ``from_pretrained(path,
    config=config, key=value)``, for every key): refused here naming the key, its value and what is allowed, not with a
    TypeError about ``__init__``."""
    if args:
        raise ValueError(f"{cls.__name__} takes its config only, got {len(args)} more positional argument(s): "
                         f"{', '.join(repr(arg) for arg in args)[:200]}.")
    for key, value in kwargs.items():
        fields = list(getattr(config, "__dataclass_fields__", ()))
        if hasattr(config, key):  # (with `config=` given, transformers applies no keyword to it)
            raise ValueError(f"`{key}`={value!r} is a field of {type(config).__name__}, but {cls.__name__} takes its "
                             f"config only: with `config=` given, set it on the config (config.{key} = {value!r}); "
                             f"without it, from_pretrained(path, {key}={value!r}) applies it to the saved config.")
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.75)
        hint = f"did you mean `{close[0]}`? " if close else ""
        raise ValueError(f"`{key}`={value!r} is neither a field of {type(config).__name__} nor an argument of "
                         f"from_pretrained, and {cls.__name__} takes its config only; {hint}allowed: the config's fields "
                         f"(e.g. d_model, dropout, cross_attention) and transformers' from_pretrained arguments.")


# ----------------------------------------------------------------------------------------------------------------
# PreTrainedModel
# ----------------------------------------------------------------------------------------------------------------
class HardAttnPreTrainedModel(Int8Mixin, SavingMixin, PreTrainedModel):
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

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """Every model type can switch (:meth:`set_attn_implementation` sets its soft attention modules). transformers'
        heuristic reads the class's module source: a ``class *Attention*(nn.Module)`` there without its
        ``AttentionInterface`` made it refuse gaussian and hybrid (and, through the cached value it stores on the
        class, their subclasses such as beam_joint_rnn) with only a logged warning, leaving them on "sdpa"."""
        return True

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
        use); a number: both N(0, init_std) (Marian's, BART's); "lipschitz": Xu et al. 2020a's Lipschitz-constrained
        init (linears U(-1/sqrt(fan_in), 1/sqrt(fan_in)), embeddings U(-b, b), b = sqrt(2 / (rows + columns))).
        ``config.embed_init_std``, when a number, replaces the embeddings' init with N(0, embed_init_std). Zero
        biases, unit norms, and the sinusoidal table (a non-persistent buffer, rebuilt after loading on the meta
        device)."""
        std = self.config.init_std
        embed_std = getattr(self.config, "embed_init_std", None)
        if embed_std is None and std != "lipschitz":
            embed_std = self.config.d_model**-0.5 if std is None else std
        if isinstance(module, nn.Linear):
            if std is None:
                init.xavier_uniform_(module.weight)
            elif std == "lipschitz":
                # the authors' code (hfxunlp/transformer utils/init.py, init_model_params_lipschitz): Kaiming-uniform
                # with gain sqrt(1/3), bound sqrt(3) * sqrt(1/3) / sqrt(fan_in) = 1 / sqrt(fan_in)
                bound = module.in_features**-0.5
                init.uniform_(module.weight, -bound, bound)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            if embed_std is None:  # "lipschitz": Glorot-uniform with gain sqrt(1/3), sqrt(6) sqrt(1/3) / sqrt(V + d)
                bound = (2.0 / (module.num_embeddings + module.embedding_dim)) ** 0.5
                init.uniform_(module.weight, -bound, bound)
            else:
                init.normal_(module.weight, mean=0.0, std=embed_std)
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


class HardAttnModel(HardAttnPreTrainedModel):
    """Shared token embeddings + encoder + decoder (no output layer): the bare encoder-decoder, what ``AutoModel``
    loads (as ``MarianModel``). Its :meth:`run` is the one path of the decoder states; the full model
    (:class:`HardAttnForConditionalGeneration`, whose ``.model`` this is) projects them to the vocabulary."""

    _tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight", "decoder.embed_tokens.weight": "shared.weight"}

    decoder_class = HardAttnDecoder  # variants with another decoder (the hybrid's GRU) replace it

    def __init__(self, config: HardAttnConfig, *args, **kwargs):
        refuse_model_arguments(type(self), config, args, kwargs)
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

    def get_decoder(self, *args, **kwargs):
        return self.decoder

    decode_reads_memory_grouped = True  # declared beside each ``decode`` that passes a grouped memory through

    def decode(self, decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
               decoder_inputs_embeds, cache, output_attentions=False, output_hidden_states=False) -> DecoderResult:
        """The decoder's :class:`DecoderResult` (hidden states [B, T, d] for the output layer; per-layer weights and
        states when asked). Variants whose decoder is not the skeleton's override this."""
        return self.decoder.run(decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
                                decoder_inputs_embeds, cache, output_attentions, output_hidden_states)

    STATIC_KINDS = tuple(sorted(name for name, kind in KINDS.items() if kind.static_cache))  # (registry.py)
    decode_writes_static_cache = True  # declared beside each ``decode`` whose decoder writes a StaticHardAttnCache

    def static_decoding_refusal(self) -> str | None:
        """Why this model cannot decode with a :class:`~caches.StaticHardAttnCache`, or None when it can: the class
        that defines its ``decode`` declares ``decode_writes_static_cache``, its decoder module
        ``writes_static_cache`` (every state written in place, see ``StaticHardAttnCache``), and its decoder self- and
        cross-attention kinds are registered with ``static_cache`` (``STATIC_KINDS``)."""
        owner = next(cls for cls in type(self).__mro__ if "decode" in vars(cls))
        if not vars(owner).get("decode_writes_static_cache", False) or not getattr(self.decoder,
                                                                                    "writes_static_cache", False):
            return f"its decoder ({type(self.decoder).__name__}) does not write a static cache"
        kinds = sorted({kind for role in ("decoder", "cross") for kind in self.config.attention_kinds(role)}
                       - set(self.STATIC_KINDS))
        return f"its decoder uses the attention kind(s) {kinds}" if kinds else None

    decode_reads_left_padding = True  # declared beside each ``decode`` whose decoder reads a left-padded prompt

    def left_padding_refusal(self) -> str | None:
        """Why this model refuses a left-padded ``decoder_attention_mask``, or None when it decodes such a prompt as
        the prompt alone (positions from each row's first real token, padded keys hidden): the class that defines its
        ``decode`` declares ``decode_reads_left_padding``, its decoder module ``reads_left_padding``, and the class of
        every decoder self- and cross-attention kind ``reads_left_padding`` itself (not inherited): True, or the roles
        it reads one in (e.g. ``("decoder",)``). Found once per model (its modules are fixed at construction)."""
        if "_left_padding_refusal" in vars(self):
            return vars(self)["_left_padding_refusal"]
        owner = next(cls for cls in type(self).__mro__ if "decode" in vars(cls))
        kinds = sorted({f"{kind} ({role})" for role in ("decoder", "cross")
                        for kind in self.config.attention_kinds(role)
                        if (cls := attention_class(kind, self.config)) is not None
                        and (declared := vars(cls).get("reads_left_padding", False)) is not True
                        and role not in (declared or ())})
        if not vars(owner).get("decode_reads_left_padding", False):
            refusal = f"{owner.__name__}.decode counts decoder positions from the first column"
        elif not getattr(self.decoder, "reads_left_padding", False):
            refusal = f"its decoder ({type(self.decoder).__name__}) counts positions from the first column"
        else:
            refusal = f"its attention kind(s) {kinds} read positions from the first column" if kinds else None
        self.__dict__["_left_padding_refusal"] = refusal
        return refusal

    def decoder_checkpointing(self) -> bool:
        """Whether gradient checkpointing is on for any part of the decoder (``gradient_checkpointing_enable()``)."""
        return any(getattr(module, "gradient_checkpointing", False) for module in self.decoder.modules())

    def run(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
            encoder_outputs=None, cache=None, inputs_embeds=None, decoder_inputs_embeds=None, use_cache=None,
            output_attentions=False, output_hidden_states=False):
        """The encoder (unless ``encoder_outputs`` is given) and the decoder: (encoder outputs, the decoder's
        :class:`DecoderResult`, the cache or None). The one path of :meth:`forward` and of the full model's."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and self.training and torch.is_grad_enabled() and self.decoder_checkpointing():
            # a checkpointed layer runs again in backward: it would write its keys/values into the cache twice
            logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing in training. Setting "
                                "`use_cache=False`.")
            use_cache = False
        source_given = encoder_outputs is not None  # (else the encoder checks the source as it reads it)
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids, attention_mask, inputs_embeds, return_dict=True,
                                           output_attentions=output_attentions,
                                           output_hidden_states=output_hidden_states)
        elif isinstance(encoder_outputs, (tuple, list)):  # as transformers' models read a tuple
            encoder_outputs = BaseModelOutput(*encoder_outputs[:3])
        cache = HardAttnCache.from_cache(cache) if use_cache else None
        self.check_decoder_inputs(decoder_input_ids, decoder_attention_mask, decoder_inputs_embeds,
                                  encoder_outputs.last_hidden_state, attention_mask if source_given else None, cache)
        decoded = self.decode(
            decoder_input_ids, encoder_outputs.last_hidden_state, attention_mask, decoder_attention_mask,
            decoder_inputs_embeds, cache, output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        return encoder_outputs, decoded, cache

    def check_decoder_inputs(self, decoder_input_ids, decoder_attention_mask, decoder_inputs_embeds, memory,
                             attention_mask, cache):
        """Clear errors where the decoder's inputs enter: ids in the vocabulary or embeddings of d_model (one of the
        two), a 0/1 ``decoder_attention_mask`` of [B, T] or [B, cached + T] (continuing from a cache) padded on the
        right, or also on the left where the model reads a left-padded prompt (:meth:`left_padding_refusal`), and a
        given encoder output's ``attention_mask`` of its [B, S]."""
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
            if isinstance(past, torch.Tensor):  # a static cache's position (while tracing: any width up to its slots)
                past = decoder_attention_mask.shape[-1] - length if is_tracing() else int(past)
                if past + length > cache.max_cache_len:
                    raise ValueError(f"`decoder_attention_mask` covers {past + length} positions, more than the static "
                                     f"cache's `max_cache_len`={cache.max_cache_len}; allowed: at most "
                                     f"{cache.max_cache_len}.")
            refusal = None if is_tracing() else self.left_padding_refusal()  # (traced: values are not checked)
            new_only = bool(past) and decoder_attention_mask.shape[-1] == length  # (the new positions, after the past)
            if refusal is not None:
                reason = (f" for model_type {self.config.model_type!r} ({refusal}); allowed for it: padding after each "
                          f"row's last token only")
            else:  # (a mask of the new positions only)
                reason = (" when the mask covers the new positions only (they follow the cached ones); a left-padded "
                          "prompt's mask covers every position, [batch, cached + new]")
            check_mask("decoder_attention_mask", decoder_attention_mask, [(rows, length), (rows, past + length)],
                       right_padded=refusal is not None or new_only, edges_only=True, reason=reason)
        if attention_mask is not None:  # (its values once per sentence: generate() passes the same mask at every step)
            check_mask("attention_mask", attention_mask, [memory.shape[:2]],
                       values=cache is None or cache.get_seq_length() == 0)

    def model_output(self, encoder_outputs, decoded, cache):
        """The :meth:`forward` output: ``Seq2SeqModelOutput`` (variants whose decoder output is not one hidden state
        override this)."""
        return Seq2SeqModelOutput(
            last_hidden_state=decoded.last_hidden_state, decoder_hidden_states=decoded.hidden_states,
            decoder_attentions=decoded.attentions, cross_attentions=decoded.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states, encoder_attentions=encoder_outputs.attentions,
            **{CACHE_FIELD: cache},
        )

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
        use_cache=None,
        return_dict=None,
        cache=None,
        output_attentions=None,
        output_hidden_states=None,
        **kwargs,
    ):
        """``Seq2SeqModelOutput`` as ``MarianModel``'s (a tuple in its field order with ``return_dict=False``):
        ``last_hidden_state`` is the decoder's last hidden state (the full model's output-layer input), with the cache
        and, when asked, the decoder's and encoder's hidden states and attention weights (as the full model's
        ``forward`` describes them)."""
        config = self.config
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = config.return_dict if return_dict is None else return_dict
        if cache is not None and past_key_values is not None:
            raise ValueError("Pass the decoding cache as `cache` or as `past_key_values` (its name before "
                             "transformers 5.24), not both.")
        encoder_outputs, decoded, cache = self.run(
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
            past_key_values if cache is None else cache, inputs_embeds, decoder_inputs_embeds, use_cache,
            output_attentions, output_hidden_states)
        output = self.model_output(encoder_outputs, decoded, cache)
        return output if return_dict else output.to_tuple()


class HardAttnForConditionalGeneration(HardAttnPreTrainedModel, GenerationMixin):
    """Encoder-decoder with a (tied) vocabulary projection; trains with a label-smoothed cross-entropy and decodes
    with ``generate()`` (greedy, beam search, sampling) through :class:`HardAttnCache`."""

    _tied_weights_keys = {
        "lm_head.weight": "model.shared.weight",
        "model.encoder.embed_tokens.weight": "model.shared.weight",
        "model.decoder.embed_tokens.weight": "model.shared.weight",
    }
    model_class = HardAttnModel  # variants with another decoder (RNN) replace it

    def __init__(self, config: HardAttnConfig, *args, **kwargs):
        refuse_model_arguments(type(self), config, args, kwargs)
        super().__init__(config)
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # `config.final_logits_bias`: a fixed bias added to the logits (a buffer, as in BART / Marian), else None
        self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size) if config.final_logits_bias
                             else None)
        self.post_init()
        set_translation_generation_defaults(self)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """A saved generation config without ``max_length`` (models saved before the translation defaults) gets
        :func:`set_translation_generation_defaults`'s; one that sets it keeps it."""
        loaded = super().from_pretrained(*args, **kwargs)
        set_translation_generation_defaults(loaded[0] if isinstance(loaded, tuple) else loaded)
        return loaded

    def _prepare_generated_length(self, generation_config, has_default_max_length, *args, **kwargs):
        # A call's max_new_tokens replaces the model's own max_length (its generation config's default) without
        # transformers' "Both `max_new_tokens` and `max_length` seem to have been set" warning, meant for a call that
        # sets both; max_new_tokens takes precedence either way.
        if (generation_config.max_new_tokens is not None
                and generation_config.max_length == self.generation_config.max_length):
            has_default_max_length = True
        return super()._prepare_generated_length(generation_config, has_default_max_length, *args, **kwargs)

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
        if labels is not None:
            check_labels(labels, self.config.vocab_size)
            check_labels_match(labels, decoder_input_ids, decoder_inputs_embeds)
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        encoder_outputs, decoded, cache = self.model.run(  # the bare model's path (as MarianMTModel's self.model)
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
            past_key_values if cache is None else cache, inputs_embeds, decoder_inputs_embeds, use_cache,
            output_attentions, output_hidden_states)
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

    # ---- static cache and compiled decoding steps (generate(..., cache_implementation="static")) ----------------
    output_logits_static = True  # declared beside each ``output_logits`` that runs a decoding step's shapes unchanged

    def check_static_decoding(self):
        """A clear error unless this model decodes with a static cache (see ``HardAttnModel.static_decoding_refusal``;
        the class that defines ``output_logits`` declares ``output_logits_static`` too)."""
        reason = self.model.static_decoding_refusal()
        owner = next(cls for cls in type(self).__mro__ if "output_logits" in vars(cls))
        if reason is None and not vars(owner).get("output_logits_static", False):
            reason = f"its output layer ({owner.__name__}.output_logits) is not declared static"
        if reason is not None:
            raise ValueError(
                f"`cache_implementation`='static' is not yet supported for model_type {self.config.model_type!r} "
                f"({reason}); allowed for it: None or 'dynamic'. Static caches serve the decoder attention kinds "
                f"{list(HardAttnModel.STATIC_KINDS)}.")

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length, *args, **kwargs):
        """transformers' cache preparation, except for ``cache_implementation="static"``: a
        :class:`~caches.StaticHardAttnCache` for the call's rows (sentences x beams or returned sequences) and
        ``max_length - 1`` target positions (at least the ``max_cache_len`` of the generation config and of this
        model's earlier static calls, so that a compiled step keeps its shapes across calls), which generate() then
        compiles the decoding steps for when its ``compile_config`` allows it (on CPU: ``_compile_all_devices``)."""
        implementation = generation_config.cache_implementation
        # transformers' dynamic kinds ("dynamic_full": what earlier 5.x's assisted decoding sets) go to its own path
        if (implementation is None or implementation in ("dynamic", "dynamic_full", "offloaded", "quantized")
                or model_kwargs.get(CACHE_FIELD) is not None or generation_config.use_cache is False):
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                                         max_cache_length, *args, **kwargs)
        if implementation != "static":
            raise ValueError(f"`cache_implementation`={implementation!r} is not supported by {type(self).__name__}; "
                             f"allowed: None, 'dynamic' or 'static'.")
        self.check_static_decoding()
        draft = 0  # assisted decoding / prompt lookup: a draft is fed past the last kept position before a crop
        if generation_mode == "assisted_generation":
            draft = max(generation_config.prompt_lookup_num_tokens or 0, int(generation_config.num_assistant_tokens or 0))
        length = max(max_cache_length + draft, getattr(generation_config, "max_cache_len", None) or 0,
                     getattr(self, "_previous_max_cache_length", 0))
        rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1) * batch_size
        # reused when the shapes allow (compiled graphs keep its buffers), on the transformers releases where that is
        # tested (5.24 on; under 5.10's generate() a reused cache's slots and the decoder's mask part)
        cache = getattr(self, "_static_cache", None) if REUSES_STATIC_CACHE else None
        if cache is None or (cache.max_cache_len, cache.max_batch_size, cache.model_dtype, cache.position.device) != (
                length, rows, self.dtype, self.device):
            cache = self._static_cache = StaticHardAttnCache(self.config.decoder_layers, length, rows,
                                                             device=self.device)
            cache.model_dtype = self.dtype  # (the dtype its buffers will take at the first step)
        else:
            cache.reset()
        model_kwargs[CACHE_FIELD] = cache
        self._previous_max_cache_length = length

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """What generate() hands a compileable cache's forward as the decoder mask: the 2D padding mask (or None) as
        given; the decoder builds its own fixed-shape mask over the static slots (``static_self_attention_mask``)."""
        return attention_mask

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        """transformers' check of generate()'s settings, plus those it lets through to a deep failure (``num_beams``
        below 1, an offloaded cache off CUDA: :func:`~inputs.check_generation_config`)."""
        check_generation_config(generation_config, self)
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def compiled_forward(self, compile_config):
        """``forward`` under ``torch.compile`` with ``compile_config``'s settings (a ``CompileConfig``), compiled once
        per config and kept on the model (as transformers keeps its compiled ``__call__``).

        Each model compiles its own copy of ``forward``'s code: torch keeps compiled graphs per code object, at most
        ``torch._dynamo.config.recompile_limit`` (8) of them, and every model of a process that compiled the one shared
        ``forward`` (or transformers' ``Module.__call__``) would add its graphs to the same list, with
        ``fullgraph=True`` a hard error at the ninth, and guards checked against every other model's graphs at each
        step. A copy per model keeps each model's graphs (a few: see docs/usage.md) to itself."""
        if getattr(self, "_compiled_forward_config", None) != compile_config:
            forward = type(self).forward
            code = forward.__code__.replace(co_name=f"{forward.__name__}_{id(self):x}")  # (a code object of its own)
            own = types.FunctionType(code, forward.__globals__, code.co_name, forward.__defaults__,
                                     forward.__closure__)
            own.__kwdefaults__ = forward.__kwdefaults__
            self._compiled_forward = torch.compile(own.__get__(self), **compile_config.to_dict())
            self._compiled_forward_config = compile_config
        return self._compiled_forward

    def get_compiled_call(self, compile_config):
        """What transformers' greedy search and sampling call for the steps after the first with a compileable cache:
        this model's :meth:`compiled_forward` (transformers compiles ``Module.__call__``, one code object shared by
        every module of the process)."""
        return self.compiled_forward(compile_config or self._default_compile_config())

    def _beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                     **model_kwargs):
        """transformers' beam search, its sequences (and beam indices) returned contiguous: transformers crops them
        from its fixed-width buffer to the generated length, a view that ``.view()`` refuses (MarianMTModel's loss
        reads ``labels.view(-1)``, so a beam output passed back as ``labels=`` failed there).

        With a compileable cache and a ``compile_config`` that allows it (the criteria of transformers' greedy search
        and sampling, ``_valid_auto_compile_criteria``), the steps after the first run :meth:`compiled_forward`, as
        transformers' greedy search and sampling run theirs (its beam search, 5.24, always runs the eager forward)."""
        arguments = (input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus)
        if not self._valid_auto_compile_criteria(model_kwargs, generation_config):
            output = super()._beam_search(*arguments, **model_kwargs)
        else:
            compiled, calls = self.compiled_forward(generation_config.compile_config), [0]

            def forward(*args, **kwargs):  # the first call is the prefill (eager, as transformers' own)
                calls[0] += 1
                return (compiled if calls[0] > 1 else type(self).forward.__get__(self))(*args, **kwargs)

            self.forward = forward
            try:
                output = super()._beam_search(*arguments, **model_kwargs)
            finally:
                del self.forward
        if isinstance(output, torch.Tensor):
            return output.contiguous()
        output.sequences = output.sequences.contiguous()
        if getattr(output, "beam_indices", None) is not None:
            output.beam_indices = output.beam_indices.contiguous()
        return output

    def _validate_generated_length(self, generation_config, input_ids_length, has_default_max_length):
        """transformers' check of the generated length, plus the decoder's learned position table: a ``max_length``
        / ``max_new_tokens`` beyond it is refused before the first decoding step
        (:func:`~inputs.check_generated_length`)."""
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        limits = [module.limit for module in self.get_decoder().modules()
                  if isinstance(module, PositionEmbedding) and module.kind == "learned"]
        check_generated_length(generation_config, min(limits, default=None))

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

    def _memory_grouped_decoding(self) -> bool:
        """Whether generate() may hand the decoder a grouped memory: the bare model's class that defines ``decode``
        declares that it passes one through, the output layer is this one, and the decoder reads it. A variant that
        overrides ``decode`` or ``output_logits`` (beam-joint) keeps the expanded memory unless it declares
        otherwise."""
        owner = next(cls for cls in type(self.model).__mro__ if "decode" in vars(cls))
        return (vars(owner).get("decode_reads_memory_grouped", False)
                and type(self).output_logits is HardAttnForConditionalGeneration.output_logits
                and self.model.decoder.reads_memory_grouped)

    def with_attention(self, **kinds):
        """A copy of this model whose attention kinds are replaced, sharing no tensors with it, e.g.
        ``model.with_attention(cross_attention="hard_retrieval")`` to decode a soft-trained model with hard
        retrieval (hard-retrieval paper, Table 4). Keys: encoder_attention, decoder_attention, cross_attention.
        Kinds with other parameters than the trained ones fail with the missing/unexpected parameter names."""
        fields = [role.field for role in ROLES.values()]
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
    "compiled_decoding",
    "REUSES_STATIC_CACHE",
    "HardAttnModel",
    "HardAttnPreTrainedModel",
    "HardAttnForConditionalGeneration",
    "TRANSLATION_MAX_LENGTH",
    "TRANSLATION_NUM_BEAMS",
    "set_translation_generation_defaults",
]
