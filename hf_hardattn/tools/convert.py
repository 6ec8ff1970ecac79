"""Convert a pretrained transformers translation model into an hf_hardattn model: ``hf_hardattn.tools.convert``.

``convert(source, model_type, **config_overrides)`` takes a loaded ``MarianMTModel``, ``BartForConditionalGeneration``,
``MBartForConditionalGeneration`` or ``M2M100ForConditionalGeneration`` (NLLB checkpoints are M2M100) or a folder / Hub
id holding one, and returns a model of ``model_type`` whose weights are mapped from it. The tokenizer stays the
source's (save it beside: ``model.save_pretrained(out, tokenizer=AutoTokenizer.from_pretrained(source))``). CLI:
``hf-hardattn convert SRC OUT --model-type T [--set key=value ...]``.

The mapping, per family (all four share transformers' BART layer layout: separate q/k/v projections with biases,
``*_layer_norm`` after (post-norm) or before (pre-norm) each sub-layer, one shared token table tied to ``lm_head``):

============  ===========================================  ================  ==========  ================
family        positions                                    layernorm_emb.    norm        final_logits_bias
============  ===========================================  ================  ==========  ================
marian        sinusoidal, layout "marian", from 0          no                post        yes (buffer)
bart          learned, table rows 2.. (transformers' +2)   yes               post        yes (buffer)
mbart         learned, table rows 2..                      yes               pre + final yes (buffer)
m2m_100       sinusoidal, layout "fairseq", from pad + 1   no                pre + final no
============  ===========================================  ================  ==========  ================

q/k/v are concatenated into our fused ``qkv_proj`` (self-attention) and ``kv_proj`` (cross-attention); a
``final_logits_bias`` that is all zeros is not kept (``final_logits_bias=False``), which changes nothing. The source's generation config
(``num_beams``, ``max_length``, ``bad_words_ids``, ``forced_bos_token_id``/``forced_eos_token_id``, ...) is copied, so
that ``generate()`` without arguments decodes as the source does; only a ``max_length`` the source leaves unset (where
it would stop at transformers' 20) becomes the package's translation default (``set_translation_generation_defaults``).

Targets: ``soft_transformer`` reproduces the source (logits, greedy and beam search). The other Transformer types get
every parameter they share with it, per layer and attention kind (kinds may be overridden per role, e.g.
``cross_attention=["soft", "hard_retrieval"]``): ``hard_retrieval`` has soft attention's parameters (the hard-retrieval
paper's Table 4 model: soft-trained, decoded hard); ``gaussian`` keeps v/out projections and drops q/k; ``recurrent``
keeps the projections and initialises the variant's extra parameters (none for expand_1); ``none`` drops the whole
sub-layer; beam-joint Transformer keeps everything (its mixture output has no ``final_logits_bias``: a nonzero one is
dropped). What was initialised or dropped is returned (``return_report=True``: a :class:`ConversionReport`) and logged
as a warning. The hybrid models (RNN decoder) are refused: distil the converted soft model into one.

Refused, with the field named: untied or unshared embeddings (``tie_word_embeddings``,
``share_encoder_decoder_embeddings``, ``decoder_vocab_size``), layer norms of differing epsilon, M2M100 starting the
decoder with the padding token (``decoder_start_token_id``; fairseq positions skip it), a source position table that
is not the family's sinusoidal one. A nonzero ``encoder_layerdrop`` / ``decoder_layerdrop`` (training-time only: it
skips layers at random) is not carried over: inference is unchanged, the report lists it under ``dropped``.

Tooling (not runtime code): not copied with saved models.
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, PreTrainedModel
from transformers.utils import logging

from ..gaussian import GaussianAttention
from ..layers import SoftAttention
from ..modeling_hardattn import set_translation_generation_defaults
from ..registry import MODEL_TYPES, ROLES, model_classes
from .arguments import check_model_type

logger = logging.get_logger(__name__)

SUPPORTED_SOURCES = {  # model_type of the source config -> transformers class name
    "marian": "MarianMTModel",
    "bart": "BartForConditionalGeneration",
    "mbart": "MBartForConditionalGeneration",
    "m2m_100": "M2M100ForConditionalGeneration",
}
FAMILY_LAYOUT = {  # family -> (position kind, sinusoidal layout, layernorm_embedding, pre-norm)
    "marian": ("sinusoidal", "marian", False, False),
    "bart": ("learned", "interleaved", True, False),
    "mbart": ("learned", "interleaved", True, True),
    "m2m_100": ("sinusoidal", "fairseq", False, True),
}
# Model types with an RNN (GRU or LSTM) decoder: no Transformer decoder weight maps to it.
RNN_DECODER_TYPES = tuple(name for name, entry in MODEL_TYPES.items() if entry.rnn_decoder)
# Config fields the source's weights and computation fix: an override may only repeat the source's value.
SOURCE_FIXED_FIELDS = (
    "vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
    "encoder_ffn_dim", "decoder_ffn_dim", "activation_function", "max_position_embeddings", "position_embedding",
    "sinusoidal_layout", "position_offset", "layernorm_embedding", "final_logits_bias", "normalize_before",
    "scale_embedding", "layer_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
    "tie_word_embeddings", "is_encoder_decoder",
)


@dataclass
class ConversionReport:
    """What :func:`convert` did: ``mapped`` (our tensor <- the source's), ``initialised`` (our parameters that no source
    tensor maps to: freshly initialised), ``dropped`` (source tensors and settings not carried over, with why) and
    ``notes``. ``exact`` when nothing was initialised or dropped."""

    source: str
    model_type: str
    mapped: list[str] = field(default_factory=list)
    initialised: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.initialised and not self.dropped

    def __str__(self) -> str:
        lines = [f"converted {self.source} -> {self.model_type}: {len(self.mapped)} tensors mapped from the source"]
        for title, items in (("initialised (not in the source)", self.initialised),
                             ("dropped (not carried over)", self.dropped), ("notes", self.notes)):
            if items:
                lines.append(f"{title}:")
                lines += [f"  - {item}" for item in items]
        if self.exact:
            lines.append("nothing initialised or dropped")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------------
def convert(source, model_type: str, *, return_report: bool = False, **config_overrides):
    """A ``model_type`` model (any hf_hardattn type but the GRU-decoder ones) with its weights mapped from ``source``:
    a loaded ``MarianMTModel`` / ``BartForConditionalGeneration`` / ``MBartForConditionalGeneration`` /
    ``M2M100ForConditionalGeneration``, or a folder or Hub id holding one. ``config_overrides`` set fields of the
    target config that the source does not fix (dropout, label_smoothing, attention kinds, the variant's fields such as
    ``joint_k`` or ``recurrent_variant``). The model has the source's dtype, device, training mode and generation
    config. With ``return_report=True`` returns ``(model, ConversionReport)``. Raises ValueError (TypeError for a
    source of the wrong type) naming what cannot be converted, before building anything."""
    model_class, config_class = _target_classes(model_type)
    _check_override_names(config_class, config_overrides)
    source, described = _load_source(source)
    family = _family(source)
    fields, report = _source_fields(source, family, described, model_type)
    for name, value in config_overrides.items():
        if name in SOURCE_FIXED_FIELDS and name in fields and value != fields[name]:
            raise ValueError(f"`{name}`={value!r} cannot be overridden: the source fixes it to {fields[name]!r}; "
                             f"allowed overrides: fields the source does not fix (e.g. dropout, label_smoothing, "
                             f"attention kinds, the variant's own fields).")
    if model_type.startswith("beam_joint") and fields["final_logits_bias"]:
        fields["final_logits_bias"] = False
        bias = source.final_logits_bias
        report.dropped.append(f"final_logits_bias (max |b| = {bias.abs().max().item():.4g}): the beam-joint mixture "
                              f"output layer has no bias")
    config = config_class(**{**fields, **config_overrides})
    dtype = next(source.parameters()).dtype
    model = model_class(config).to(dtype)
    _map_weights(model, source, family, report)
    model.generation_config = copy.deepcopy(source.generation_config)
    set_translation_generation_defaults(model)
    model.to(next(source.parameters()).device).train(source.training)
    _describe_target(model, source, report)
    if report.initialised or report.dropped:
        logger.warning(str(report))
    else:
        logger.info(str(report))
    return (model, report) if return_report else model


# ----------------------------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------------------------
def _target_classes(model_type):
    allowed = sorted(set(MODEL_TYPES) - set(RNN_DECODER_TYPES))
    if model_type in RNN_DECODER_TYPES:
        raise ValueError(
            f"`model_type`={model_type!r} cannot be converted to: its decoder is an RNN (GRU or LSTM), which no "
            f"weight of a Transformer decoder maps to (only the encoder would be kept). Distil it instead, with the "
            f"converted soft model as "
            f"teacher: `hf-hardattn convert SRC TEACHER --model-type soft_transformer`, then `hf-hardattn distill "
            f"--teacher TEACHER --data DATA --out KD` and train the {model_type} model with the references and KD's "
            f"targets (the hybrid paper's two stages and Eq. 1: hf_hardattn.tools.distill.train_two_stage; "
            f"examples/distill_hybrid.py). Allowed "
            f"`model_type`: {allowed}.")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"`model_type` must be one of {allowed}, got {model_type!r}.")
    config_class, model_class = model_classes(model_type)
    return model_class, config_class


def _check_override_names(config_class, overrides):
    known = set(config_class.__dataclass_fields__)
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            hint = f"did you mean `{close[0]}`? " if close else ""
            raise ValueError(f"`{name}` is not a field of {config_class.__name__}; {hint}allowed overrides: its fields "
                             f"(e.g. dropout, label_smoothing, encoder_attention, decoder_attention, cross_attention).")


def _load_source(source):
    """(the source model, a description for the report) from a loaded model or a folder / Hub id."""
    if isinstance(source, PreTrainedModel):
        return source, type(source).__name__
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"`source` must be a loaded {'/'.join(SUPPORTED_SOURCES.values())} or a path / Hub id of "
                        f"one, got {type(source).__name__}.")
    path = os.fspath(source)
    if os.path.exists(path) and not os.path.isfile(os.path.join(path, "config.json")):
        what = "a file" if os.path.isfile(path) else "a folder without config.json"
        raise ValueError(f"`source`={path!r} is {what}, not a transformers seq2seq checkpoint; allowed: a folder "
                         f"(or Hub id) holding a {'/'.join(SUPPORTED_SOURCES.values())}.")
    check_model_type(path, "`source`")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"`source`={path!r} holds no loadable transformers config ({_one_line(error)}); allowed: "
                         f"a folder or Hub id holding a {'/'.join(SUPPORTED_SOURCES.values())}.") from error
    if config.model_type not in SUPPORTED_SOURCES:
        raise ValueError(_unsupported(f"`source`={path!r} holds a {config.model_type!r} model"))
    try:
        model = AutoModelForSeq2SeqLM.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"`source`={path!r} has a {config.model_type} config but its weights could not be loaded "
                         f"({_one_line(error)}).") from error
    return model, f"{type(model).__name__} ({path})"


def _unsupported(what: str) -> str:
    return (f"{what}; supported sources: {', '.join(SUPPORTED_SOURCES.values())} (model types "
            f"{list(SUPPORTED_SOURCES)}; NLLB checkpoints are m2m_100). An hf_hardattn model changes attention kinds "
            f"with model.with_attention(...) instead.")


def _family(source) -> str:
    for family, class_name in SUPPORTED_SOURCES.items():
        if type(source).__name__ == class_name and type(source).__module__.startswith("transformers.models."):
            return family
    raise TypeError(_unsupported(f"`source` is a {type(source).__name__}"))


def _one_line(error) -> str:
    return " ".join(str(error).split())


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
def _source_fields(source, family, described, model_type):
    """The target config fields the source fixes, after refusing what the skeleton cannot express."""
    cfg = source.config
    report = ConversionReport(source=described, model_type=model_type)

    def refuse(name, value, allowed, why):
        raise ValueError(f"{described}: `{name}`={value!r} cannot be expressed by hf_hardattn models ({why}); "
                         f"allowed: {allowed}.")

    if family == "marian":
        if not cfg.share_encoder_decoder_embeddings:
            refuse("share_encoder_decoder_embeddings", False, True, "encoder and decoder read one token table")
        if cfg.decoder_vocab_size not in (None, cfg.vocab_size):
            refuse("decoder_vocab_size", cfg.decoder_vocab_size, f"None or vocab_size ({cfg.vocab_size})",
                   "one vocabulary for source and target")
    shared = source.model.shared.weight
    tied = all(table is shared for table in (source.lm_head.weight, source.model.encoder.embed_tokens.weight,
                                             source.model.decoder.embed_tokens.weight))
    if not getattr(cfg, "tie_word_embeddings", True) or not tied:
        refuse("tie_word_embeddings", getattr(cfg, "tie_word_embeddings", None), True,
               "the output projection and both embeddings are one shared token table")
    norms = {module.eps for module in source.modules() if isinstance(module, torch.nn.LayerNorm)}
    if len(norms) != 1:
        refuse("layer_norm_eps", sorted(norms), "one epsilon for every layer norm", "one `layer_norm_eps`")
    if any(not module.elementwise_affine for module in source.modules() if isinstance(module, torch.nn.LayerNorm)):
        refuse("elementwise_affine", False, True, "layer norms have a gain and a bias")
    positions, layout, layernorm_embedding, pre_norm = FAMILY_LAYOUT[family]
    encoder = source.model.encoder
    if positions == "learned":
        limit = encoder.embed_positions.weight.shape[0] - encoder.embed_positions.offset
    else:
        limit = cfg.max_position_embeddings
    offset = 0
    if family == "m2m_100":
        offset = encoder.embed_positions.padding_idx + 1
        if cfg.decoder_start_token_id == cfg.pad_token_id:
            refuse("decoder_start_token_id", cfg.decoder_start_token_id,
                   f"a token other than pad_token_id ({cfg.pad_token_id})",
                   "fairseq positions skip padding tokens, so a decoder starting with one shifts every position")
    bias = getattr(source, "final_logits_bias", None)
    has_bias = bias is not None and bool(bias.any())
    if bias is not None and not has_bias:
        report.notes.append("final_logits_bias is all zeros: not kept (final_logits_bias=False), outputs unchanged")
    for name in ("encoder_layerdrop", "decoder_layerdrop"):
        value = getattr(cfg, name, 0.0) or 0.0
        if value:
            report.dropped.append(f"{name}={value} (LayerDrop skips layers at random in training only; inference is "
                                  f"unchanged, training of the converted model keeps every layer)")
    fields = dict(
        vocab_size=source.model.shared.num_embeddings, d_model=cfg.d_model, encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers, encoder_attention_heads=cfg.encoder_attention_heads,
        decoder_attention_heads=cfg.decoder_attention_heads, encoder_ffn_dim=cfg.encoder_ffn_dim,
        decoder_ffn_dim=cfg.decoder_ffn_dim, activation_function=cfg.activation_function,
        dropout=cfg.dropout, attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
        init_std=cfg.init_std, max_position_embeddings=limit, position_embedding=positions,
        sinusoidal_layout=layout, position_offset=offset, layernorm_embedding=layernorm_embedding,
        final_logits_bias=has_bias, normalize_before=pre_norm, scale_embedding=bool(cfg.scale_embedding),
        layer_norm_eps=norms.pop(), pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, decoder_start_token_id=cfg.decoder_start_token_id,
        use_cache=cfg.use_cache, tie_word_embeddings=True, is_encoder_decoder=True,
    )
    return fields, report


# ----------------------------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------------------------
class _Writer:
    """Copies source tensors into the target's, recording what was mapped."""

    def __init__(self, model, report):
        self.model, self.report, self.written = model, report, set()

    def copy(self, target: torch.Tensor, target_name: str, value: torch.Tensor, source_name: str):
        if tuple(target.shape) != tuple(value.shape):  # a mapping bug, never bad input
            raise RuntimeError(f"{target_name} {tuple(target.shape)} <- {source_name} {tuple(value.shape)}")
        with torch.no_grad():
            target.copy_(value)
        self.written.add(id(target))
        self.report.mapped.append(f"{target_name} <- {source_name}")

    def linear(self, target, target_name, sources, source_name):
        """``target`` (an nn.Linear) <- the row-wise concatenation of the ``sources`` linears (a missing bias = 0)."""
        weight = torch.cat([s.weight for s in sources])
        bias = torch.cat([s.bias if s.bias is not None else s.weight.new_zeros(s.weight.shape[0]) for s in sources])
        self.copy(target.weight, f"{target_name}.weight", weight, f"{source_name}.weight")
        self.copy(target.bias, f"{target_name}.bias", bias, f"{source_name}.bias")

    def norm(self, target, target_name, source, source_name):
        self.copy(target.weight, f"{target_name}.weight", source.weight, f"{source_name}.weight")
        self.copy(target.bias, f"{target_name}.bias", source.bias, f"{source_name}.bias")


def _map_weights(model, source, family, report):
    write = _Writer(model, report)
    ours, theirs = model.model, source.model
    write.copy(ours.shared.weight, "model.shared.weight", theirs.shared.weight, "model.shared.weight")
    for part in ("encoder", "decoder"):
        target, src = getattr(ours, part), getattr(theirs, part)
        _map_positions(write, target.embed_positions, f"model.{part}.embed_positions", src.embed_positions,
                       f"model.{part}.embed_positions", family)
        if target.layernorm_embedding is not None:
            write.norm(target.layernorm_embedding, f"model.{part}.layernorm_embedding", src.layernorm_embedding,
                       f"model.{part}.layernorm_embedding")
        if target.final_norm is not None:
            write.norm(target.final_norm, f"model.{part}.final_norm", src.layer_norm, f"model.{part}.layer_norm")
        for index, (layer, src_layer) in enumerate(zip(target.layers, src.layers)):
            prefix, src_prefix = f"model.{part}.layers.{index}", f"model.{part}.layers.{index}"
            roles = [("self_attn", "self_attn", "self_attn_layer_norm")]
            if part == "decoder":
                roles.append(("cross_attn", "encoder_attn", "encoder_attn_layer_norm"))
            for ours_name, src_name, src_norm in roles:
                sub = getattr(layer, ours_name)
                where = f"{src_prefix}.{src_name}"
                if sub is None:
                    report.dropped.append(f"{where} and {src_prefix}.{src_norm} (attention kind 'none': no sub-layer)")
                    continue
                write.norm(sub.norm, f"{prefix}.{ours_name}.norm", getattr(src_layer, src_norm),
                           f"{src_prefix}.{src_norm}")
                attn, src_attn, name = sub.module, getattr(src_layer, src_name), f"{prefix}.{ours_name}.module"
                if isinstance(attn, SoftAttention):  # soft, hard retrieval, recurrent: the same projections
                    q, k, v = src_attn.q_proj, src_attn.k_proj, src_attn.v_proj
                    if attn.is_cross:
                        write.linear(attn.q_proj, f"{name}.q_proj", [q], f"{where}.q_proj")
                        write.linear(attn.kv_proj, f"{name}.kv_proj", [k, v], f"{where}.{{k,v}}_proj")
                    else:
                        write.linear(attn.qkv_proj, f"{name}.qkv_proj", [q, k, v], f"{where}.{{q,k,v}}_proj")
                elif isinstance(attn, GaussianAttention):
                    write.linear(attn.v_proj, f"{name}.v_proj", [src_attn.v_proj], f"{where}.v_proj")
                    report.dropped.append(f"{where}.q_proj, {where}.k_proj (Gaussian attention has no query/key "
                                          f"projections)")
                else:  # a kind added later must say how it maps
                    raise NotImplementedError(f"no conversion for attention module {type(attn).__name__} ({name})")
                write.linear(attn.out_proj, f"{name}.out_proj", [src_attn.out_proj], f"{where}.out_proj")
            write.linear(layer.ffn.module.fc1, f"{prefix}.ffn.module.fc1", [src_layer.fc1], f"{src_prefix}.fc1")
            write.linear(layer.ffn.module.fc2, f"{prefix}.ffn.module.fc2", [src_layer.fc2], f"{src_prefix}.fc2")
            write.norm(layer.ffn.norm, f"{prefix}.ffn.norm", src_layer.final_layer_norm,
                       f"{src_prefix}.final_layer_norm")
    if model.final_logits_bias is not None:
        write.copy(model.final_logits_bias, "final_logits_bias", source.final_logits_bias, "final_logits_bias")
    seen = set()
    for name, param in model.named_parameters():
        if id(param) not in write.written and id(param) not in seen:
            report.initialised.append(f"{name} {tuple(param.shape)}")
        seen.add(id(param))


def _map_positions(write, target, target_name, source, source_name, family):
    """Learned tables: the source's rows from its offset (transformers' BART/mBART add 2 to every position).
    Sinusoidal tables are computed, not copied: the source's must equal ours exactly (an edited one is refused)."""
    if target.kind == "learned":
        rows = source.weight[source.offset : source.offset + target.limit]
        write.copy(target.embed.weight, f"{target_name}.embed.weight", rows, f"{source_name}.weight[{source.offset}:]")
        return
    theirs = source.weight if family == "marian" else source.weights[target.offset : target.offset + target.limit]
    mine = target.table[: theirs.shape[0]]
    if theirs.shape != mine.shape or not torch.equal(theirs.to(mine.dtype), mine):
        diff = (theirs.to(mine) - mine).abs().max().item() if theirs.shape == mine.shape else "shape"
        raise ValueError(f"the source's {source_name} is not the {target.layout!r} sinusoidal table (max difference "
                         f"{diff}); allowed: the family's unmodified sinusoidal positions, which hf_hardattn computes "
                         f"(`sinusoidal_layout`).")
    write.report.notes.append(f"{target_name}: {target.layout!r} sinusoidal table from position offset "
                              f"{target.offset}, equal to the source's {source_name} (computed, not stored)")


def _describe_target(model, source, report):
    """Notes on how the target's computation differs from the source's (beyond the initialised/dropped tensors)."""
    config = model.config
    kinds = {role: config.attention_kinds(role) for role in ROLES}
    heads = {role: source.config.encoder_attention_heads if role == "encoder" else source.config.decoder_attention_heads
             for role in ROLES}
    for role, per_layer in kinds.items():
        other = sorted(set(per_layer) - {"soft"})
        if other:
            report.notes.append(f"{role} attention: {per_layer} (the source: soft everywhere)")
    cross_heads = getattr(config, "cross_attention_heads", None)
    if cross_heads and cross_heads != heads["cross"]:
        report.notes.append(f"cross-attention heads: {cross_heads} (the source: {heads['cross']}); projections mapped "
                            f"unchanged")
    if "hard_retrieval" in kinds["decoder"] + kinds["cross"] + kinds["encoder"]:
        report.notes.append("hard retrieval shares soft attention's parameters: a soft-trained model decoded with hard "
                            "retrieval (the hard-retrieval paper's Table 4); fine-tune it to recover the soft model's "
                            "quality, or decode soft with model.with_attention(...)")
    if config.model_type == "beam_joint_transformer":
        report.notes.append(f"output: the beam-joint mixture over the top-{config.joint_k} source positions of decoder "
                            f"layer {config.joint_layer_index()}'s cross-attention (no parameters added)")
    if config.model_type == "recurrent_transformer":
        report.notes.append(f"recurrent cross-attention variant {config.recurrent_variant!r}: the layers' previous "
                            f"step now feeds their attention; extra parameters, if any, are listed as initialised")


__all__ = ["ConversionReport", "SUPPORTED_SOURCES", "convert"]
