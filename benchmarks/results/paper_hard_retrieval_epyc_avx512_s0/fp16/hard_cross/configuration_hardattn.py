"""Configuration shared by every hf_hardattn encoder-decoder model.

Each variant (soft baseline, hard retrieval, Gaussian, recurrent, hybrid, beam-joint) subclasses
:class:`HardAttnConfig` with its own ``model_type`` and defaults.  The attention used by each *role*
(encoder self-attention, decoder self-attention, cross-attention) is a config field holding either one
kind for every layer or a list with one kind per layer, so that a config can mix kinds.

This file is part of the runtime code shipped with saved models (``trust_remote_code``): keep it flat,
with same-folder relative imports only.
"""

import contextlib
import contextvars
import difflib
import math
import warnings

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from .registry import KINDS, ROLES, kinds_allowed, used_kinds

# Attention kind -> the roles it may fill, and -> the settings it reads from any config that uses it (a plain
# HardAttnConfig too, where the kind's defaults apply: such keys are no unknown keys there); both from the one
# registry of kinds (registry.KINDS).
ATTENTION_KINDS = {name: kind.roles for name, kind in KINDS.items()}
KIND_SETTINGS = {name: tuple(kind.settings) for name, kind in KINDS.items() if kind.settings}
POSITION_EMBEDDINGS = ("sinusoidal", "learned")
# Feature layouts of the sinusoidal table (see layers.sinusoidal_table): ours (Vaswani et al.), Marian's
# (transformers' MarianMTModel) and fairseq's / tensor2tensor's (M2M100, NLLB).
SINUSOIDAL_LAYOUTS = ("interleaved", "marian", "fairseq")
# init_std's named schemes besides None (Xavier) and a number (normal): Xu et al. 2020a's Lipschitz-constrained init
INIT_SCHEMES = ("lipschitz",)


# True while a config is built from a saved dict (config.json, ``from_dict``, ``from_json_file``): whatever
# ``save_pretrained`` wrote must load, so an unknown key read back warns instead of refusing (see check_unknown_keys).
_READING_SAVED = contextvars.ContextVar("hardattn_reading_saved_config", default=False)


@contextlib.contextmanager
def _reading_saved():
    token = _READING_SAVED.set(True)
    try:
        yield
    finally:
        _READING_SAVED.reset(token)


def _positive_finite(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0 and math.isfinite(value)


def _check_range(name, value, low, high, high_inclusive=False):
    ok = low <= value <= high if high_inclusive else low <= value < high
    if not ok:
        bracket = "]" if high_inclusive else ")"
        raise ValueError(f"`{name}` must be in [{low}, {high}{bracket}, got {value!r}.")


class HardAttnConfig(PreTrainedConfig):
    r"""Transformer encoder-decoder (Vaswani et al., 2017) whose attention kind is chosen per role.

    Args:
        vocab_size: size of the joint (shared source/target) vocabulary.
        d_model: model width.
        encoder_layers / decoder_layers: number of layers.
        encoder_attention_heads / decoder_attention_heads: heads per attention sub-layer; must divide d_model.
        encoder_ffn_dim / decoder_ffn_dim: inner size of the feed-forward sub-layers.
        activation_function: FFN non-linearity (any key of ``transformers.activations.ACT2FN``).
        dropout / attention_dropout / activation_dropout: dropout on sub-layer outputs and embeddings, on
            attention probabilities, and inside the FFN.
        label_smoothing: label smoothing of the training loss.
        max_position_embeddings: size of the position table.  Learned positions cannot go beyond it;
            sinusoidal positions are computed on the fly beyond it.
        position_embedding: ``"sinusoidal"`` or ``"learned"``.
        sinusoidal_layout: the features of a sinusoidal position (``position_embedding="sinusoidal"`` only), with
            w_i = 10000^(-2i/d), i < d/2:
            ``"interleaved"`` (default; Vaswani et al. Sec. 3.5): sin(p w_i) at feature 2i, cos(p w_i) at 2i + 1;
            ``"marian"`` (transformers' MarianMTModel): the d/2 sines first, then the d/2 cosines, same frequencies;
            ``"fairseq"`` (fairseq / tensor2tensor, M2M100, NLLB): sines first, then cosines, with frequencies
            10000^(-i/(d/2 - 1)) (d_model >= 4).
        position_offset: position p gets the sinusoidal table's row p + position_offset (default 0; fairseq counts
            from pad_token_id + 1: M2M100 uses 2). Sinusoidal only: learned tables are sliced on conversion instead.
        layernorm_embedding: a LayerNorm over token + position embeddings, before the embedding dropout, in the
            encoder and the Transformer decoder (BART, mBART; default False). The hybrid models' GRU decoder embeds
            tokens without positions and has none.
        final_logits_bias: add a fixed (not trained) bias [1, vocab_size] to the output logits, a buffer named
            ``final_logits_bias`` as in BART and Marian (default False: no bias). The beam-joint models' mixture
            output layer has no bias and refuses it.
        normalize_before: pre-norm (True) instead of the original post-norm (False); pre-norm adds a final layer
            norm after the last encoder layer and the last decoder layer (mBART, M2M100).
        scale_embedding: multiply token embeddings by sqrt(d_model).
        layer_norm_eps: epsilon of every layer norm.
        init_std: the initialisation of a new model's linear layers. None (default): Xavier-uniform (Vaswani et al.,
            fairseq). A number: N(0, init_std), as transformers' MarianMTModel and BART (their 0.02). ``"lipschitz"``:
            the Lipschitz-constrained init of Xu et al. 2020a, which the hard-retrieval paper trains with (its
            authors' ``init_model_params_lipschitz``): every linear weight U(-1/sqrt(fan_in), 1/sqrt(fan_in)), every
            embedding U(-b, b) with b = sqrt(2 / (num_embeddings + embedding_dim)), zero biases. The embeddings
            follow ``init_std`` unless ``embed_init_std`` is a number. Layers with an initialisation of their own
            keep it (the RNN decoders' orthogonal recurrent blocks, an LSTM's forget-gate bias). Loaded weights are
            never re-initialised.
        embed_init_std: the initialisation of a new model's embeddings (token embeddings, tied to the output layer,
            and learned positions). A number: N(0, embed_init_std). None: as ``init_std`` says (N(0, d_model^-1/2)
            under Xavier; N(0, init_std) otherwise). Default 0.02 for soft, hard retrieval, recurrent and beam-joint
            Transformer models; None for the Gaussian, hybrid and beam-joint RNN models. Chosen per model type by
            measurement on subword Multi30k, where 0.02 helps the first group and hurts the second (see
            benchmarks/README.md, section "Initialisation"); the character-level nouns recipe (and the demo) keep
            None, which scores higher there for every type.
        encoder_attention / decoder_attention / cross_attention: the attention kind of each role, one of
            ``ATTENTION_KINDS``, either a single kind for every layer or a list with one kind per layer.
    """

    model_type = "hardattn"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache's name before / since transformers 5.24
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "decoder_attention_heads",
        "num_hidden_layers": "decoder_layers",
    }

    vocab_size: int = 8000
    d_model: int = 512
    encoder_layers: int = 6
    decoder_layers: int = 6
    encoder_attention_heads: int = 8
    decoder_attention_heads: int = 8
    encoder_ffn_dim: int = 2048
    decoder_ffn_dim: int = 2048
    activation_function: str = "relu"
    dropout: float | int = 0.1
    attention_dropout: float | int = 0.0
    activation_dropout: float | int = 0.0
    label_smoothing: float | int = 0.1
    max_position_embeddings: int = 1024
    position_embedding: str = "sinusoidal"
    sinusoidal_layout: str = "interleaved"
    position_offset: int = 0
    layernorm_embedding: bool = False
    final_logits_bias: bool = False
    normalize_before: bool = False
    scale_embedding: bool = True
    layer_norm_eps: float = 1e-5
    init_std: float | str | None = None
    embed_init_std: float | None = 0.02
    encoder_attention: str | list[str] = "soft"
    decoder_attention: str | list[str] = "soft"
    cross_attention: str | list[str] = "soft"
    use_cache: bool = True
    is_encoder_decoder: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 1

    # keys transformers itself passes on besides the fields (loading, saving, its own options)
    KNOWN_EXTRA_KEYS = {"auto_map", "model_type", "name_or_path", "_name_or_path", "_commit_hash", "transformers_version",
                        "architectures", "attn_implementation", "experts_implementation", "output_attentions", "dtype",
                        "torch_dtype"}

    def __post_init__(self, **kwargs):
        self.check_unknown_keys(kwargs)
        super().__post_init__(**kwargs)
        self.check()

    def check_unknown_keys(self, kwargs):
        """A key that is no field of this config is kept by transformers as an attribute nothing reads. Where the user
        types it (constructor keywords, ``--set``, ``from_pretrained(path, key=value)``: see :meth:`check_typed_keys`)
        one close to a field (a misspelling, ``cross_atention``) is an error naming both, any other a warning. Read
        back from a saved config (config.json: ``from_pretrained``, ``from_dict``, ``from_json_file``) every unknown
        key is kept and warned about, naming the close field if there is one: whatever ``save_pretrained`` wrote
        loads, as with transformers' own configs (MarianConfig keeps such a key silently), e.g.
        ``config.layer_norm_epsilon = 1e-6`` set by a user or by transformers' ``set_config_for_less_flaky_test``.
        The settings of a kind the config uses (``KIND_SETTINGS``, e.g. ``length_ratio`` with Gaussian
        cross-attention) are read by that kind and pass."""
        read = {key for kind in used_kinds(self) for key in KIND_SETTINGS.get(kind, ())}
        saved = _READING_SAVED.get()
        for key in kwargs:
            if key in read:
                continue
            close = self.unknown_key(key)
            if close is None:
                continue
            if close and not saved:
                raise ValueError(f"`{key}` is not a field of {type(self).__name__}; did you mean `{close}`?")
            hint = f"; did you mean `{close}`? (`{close}` is {getattr(self, close)!r})" if close else ""
            origin = "the saved config has" if saved else "got"
            warnings.warn(f"`{key}` is not a field of {type(self).__name__} (model_type {self.model_type!r}): "
                          f"{origin} `{key}`={kwargs[key]!r}; it is kept but nothing in the model reads it{hint}",
                          stacklevel=3)

    @classmethod
    def unknown_key(cls, key):
        """None for a key this config knows (a field, one of ``attribute_map``'s names, a key transformers passes on);
        else the field it is close to (a misspelling), or "" when none is."""
        fields = set(cls.__dataclass_fields__)
        if key in fields or key in cls.attribute_map or key in cls.KNOWN_EXTRA_KEYS:
            return None
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.85)
        return close[0] if close else ""

    @classmethod
    def check_typed_keys(cls, keys):
        """Refuse a misspelled field among keywords the user typed (``from_pretrained(path, key=value)``,
        ``AutoConfig.from_pretrained(path, key=value)``), naming the field it is close to."""
        for key in keys:
            close = cls.unknown_key(key)
            if close:
                raise ValueError(f"`{key}` is not a field of {cls.__name__}; did you mean `{close}`?")

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """``config_dict`` is a saved config (its unknown keys are kept with a warning: :meth:`check_unknown_keys`);
        ``kwargs`` are the caller's overrides (a misspelled field is refused, naming the field). Refuses a config of
        another model type (``HardRetrievalForConditionalGeneration.from_pretrained`` of a soft
        model's folder would otherwise build the class's model with that config, with only a logged warning)."""
        model_type = config_dict.get("model_type")
        if model_type and cls.model_type != HardAttnConfig.model_type and model_type != cls.model_type:
            raise ValueError(
                f"This config is of model_type {model_type!r}, not {cls.model_type!r} ({cls.__name__}). Load it with "
                f"AutoModelForSeq2SeqLM / AutoConfig (which pick the class of its type); to decode a model with other "
                f"attention kinds, pass them as overrides, e.g. from_pretrained(path, cross_attention='hard_retrieval').")
        cls.check_typed_keys(kwargs)  # the keywords are the user's; the dict is what was saved
        with _reading_saved():
            return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_json_file(cls, json_file):
        """A config.json read back: unknown keys warn (see :meth:`check_unknown_keys`)."""
        with _reading_saved():
            return super().from_json_file(json_file)

    # Every attention kind returns its weights on request whatever the implementation ("sdpa" switches to the written-out
    # softmax for the call that asks), so, unlike transformers' models, `output_attentions` needs no "eager".
    @property
    def output_attentions(self):
        return self._output_attentions

    @output_attentions.setter
    def output_attentions(self, value: bool):
        self._output_attentions = value

    def validate_output_attentions(self):
        pass

    # -- validation -------------------------------------------------------------------------------------
    def check(self):
        """Raise a ValueError naming the parameter and its allowed values for any inconsistent field."""
        for name in ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                     "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if not _positive_finite(self.layer_norm_eps):
            raise ValueError(f"`layer_norm_eps` must be a positive finite number (default 1e-5), got "
                             f"{self.layer_norm_eps!r}.")
        if self.init_std is not None and self.init_std not in INIT_SCHEMES and not _positive_finite(self.init_std):
            raise ValueError(f"`init_std` must be None (Xavier linears), one of {INIT_SCHEMES} (Xu et al. 2020a's "
                             f"init) or a positive finite number (every linear, and the embeddings unless "
                             f"`embed_init_std` is set, N(0, init_std)), got {self.init_std!r}.")
        if self.embed_init_std is not None and not _positive_finite(self.embed_init_std):
            raise ValueError(f"`embed_init_std` must be None (embeddings as `init_std` says) or a positive finite "
                             f"number (every embedding N(0, embed_init_std)), got {self.embed_init_std!r}.")
        for name in ("pad_token_id", "bos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value < self.vocab_size):
                raise ValueError(f"`{name}` must be None or a token id in [0, vocab_size={self.vocab_size}), got "
                                 f"{value!r}.")
        eos = self.eos_token_id
        for value in (eos if isinstance(eos, (list, tuple)) else [eos]):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value < self.vocab_size):
                raise ValueError(f"`eos_token_id` must be None, a token id in [0, vocab_size={self.vocab_size}) or a "
                                 f"list of them, got {eos!r}.")
        for name in ("encoder_attention_heads", "decoder_attention_heads"):
            heads = getattr(self, name)
            if self.d_model % heads:
                divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0 and h <= 64]
                raise ValueError(
                    f"`{name}`={heads} does not divide `d_model`={self.d_model}; allowed values are divisors of "
                    f"d_model, e.g. {divisors}."
                )
        for name in ("dropout", "attention_dropout", "activation_dropout", "label_smoothing"):
            _check_range(name, getattr(self, name), 0.0, 1.0)
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"`position_embedding` must be one of {POSITION_EMBEDDINGS}, got {self.position_embedding!r}."
            )
        if self.sinusoidal_layout not in SINUSOIDAL_LAYOUTS:
            raise ValueError(
                f"`sinusoidal_layout` must be one of {SINUSOIDAL_LAYOUTS}, got {self.sinusoidal_layout!r}."
            )
        offset = self.position_offset
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"`position_offset` must be an integer >= 0, got {offset!r}.")
        if self.position_embedding != "sinusoidal":
            for name, default in (("sinusoidal_layout", "interleaved"), ("position_offset", 0)):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"`{name}`={getattr(self, name)!r} applies to position_embedding='sinusoidal' only; with "
                        f"position_embedding={self.position_embedding!r} allowed: {default!r}."
                    )
        if self.sinusoidal_layout == "fairseq" and self.d_model < 4:
            raise ValueError(f"`sinusoidal_layout`='fairseq' divides by d_model / 2 - 1: `d_model` must be >= 4, got "
                             f"{self.d_model}.")
        for name in ("layernorm_embedding", "final_logits_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")
        if self.activation_function not in ACT2FN:
            raise ValueError(
                f"`activation_function` must be one of {sorted(ACT2FN)}, got {self.activation_function!r}."
            )
        for role in ROLES:
            self.attention_kinds(role)

    def attention_kinds(self, role: str) -> list[str]:
        """The attention kind of every layer of ``role`` ("encoder", "decoder" or "cross")."""
        if role not in ROLES:
            raise ValueError(f"`role` must be one of {tuple(ROLES)}, got {role!r}.")
        field, layers_field = ROLES[role].field, ROLES[role].layers_field
        value, n_layers = getattr(self, field), getattr(self, layers_field)
        kinds = [value] * n_layers if isinstance(value, str) else list(value)
        if len(kinds) != n_layers:
            raise ValueError(
                f"`{field}` has {len(kinds)} entries but `{layers_field}`={n_layers}: give one kind for every "
                f"layer, or a single string for all of them."
            )
        allowed = kinds_allowed(role)
        for kind in kinds:
            if kind not in allowed:
                raise ValueError(f"`{field}` entry {kind!r} is not a known attention kind; allowed: {allowed}.")
        return kinds


__all__ = ["HardAttnConfig", "ATTENTION_KINDS", "ROLES", "SINUSOIDAL_LAYOUTS"]
