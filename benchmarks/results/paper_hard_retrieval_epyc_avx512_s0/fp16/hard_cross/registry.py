"""The registries of hf_hardattn: attention roles, attention kinds and model types, each listed here once.

Every reader takes its names from here: the config's validation, the skeleton (which builds a kind's module from its
entry), the attention interface for stock models, the plots, the conversion and the command line's choices. Adding an
attention kind is one entry of ``KINDS`` and its file; adding a model type, one entry of ``MODEL_TYPES`` and its file.

Runtime code shipped with saved models (``trust_remote_code``): keep it flat, same-folder relative imports only.
"""

import importlib
import importlib.util
import sys
from typing import NamedTuple

from transformers.utils import cached_file


class Role(NamedTuple):
    field: str  # the config field holding the role's kind(s)
    layers_field: str  # the config field holding the number of layers of that role

    @property
    def outputs(self) -> str:
        """The model output field holding the role's attention weights (``output_attentions=True``)."""
        return f"{self.field}s"


ROLES = {
    "encoder": Role("encoder_attention", "encoder_layers"),
    "decoder": Role("decoder_attention", "decoder_layers"),
    "cross": Role("cross_attention", "decoder_layers"),
}


class AttentionKind(NamedTuple):
    module: str | None  # the runtime file (module of this package) defining its class; None: no sub-layer
    class_name: str | None
    roles: tuple  # the roles it may fill
    settings: dict = {}  # config keys it reads from any config that uses it -> its default where a config lacks them
    static_cache: bool = False  # its decoder cache is keys/values alone: it decodes with a StaticHardAttnCache


KINDS = {
    "soft": AttentionKind("layers", "SoftAttention", tuple(ROLES), static_cache=True),
    "hard_retrieval": AttentionKind("hard_retrieval", "HardRetrievalAttention", tuple(ROLES), dict(
        retrieval_dropout="after_draw"), static_cache=True),
    "none": AttentionKind(None, None, tuple(ROLES), static_cache=True),  # the sub-layer removed (no parameters, no computation)
    "gaussian": AttentionKind("gaussian", "GaussianAttention", tuple(ROLES), dict(
        gaussian_implementation="full", gaussian_sigma=1.0, gaussian_window=3, length_ratio=None,
        cross_attention_heads=None, encoder_offsets=(-1, 1), decoder_offsets=(-1, 0), cross_offsets=(-1, 0, 1)),
        static_cache=True),
    "recurrent": AttentionKind("recurrent", "RecurrentCrossAttention", ("cross",), dict(
        recurrent_variant="expand_1", continuity_window=5, continuity_lambda=0.5, coverage_lambda=0.5,
        recurrent_context_norm=False), static_cache=True),
}


class ModelType(NamedTuple):
    module: str  # the runtime file defining its classes
    config_class: str
    model_class: str
    base_model_class: str  # the bare encoder-decoder (AutoModel), the model class's ``.model``
    rnn_decoder: bool = False  # an RNN decoder (no Transformer decoder layers to convert into)


MODEL_TYPES = {
    "soft_transformer": ModelType("soft", "SoftTransformerConfig", "SoftTransformerForConditionalGeneration",
                                  "SoftTransformerModel"),
    "hard_retrieval_transformer": ModelType("hard_retrieval", "HardRetrievalConfig",
                                            "HardRetrievalForConditionalGeneration", "HardRetrievalModel"),
    "gaussian_transformer": ModelType("gaussian", "GaussianConfig", "GaussianForConditionalGeneration",
                                      "GaussianModel"),
    "hybrid_transformer": ModelType("hybrid", "HybridConfig", "HybridForConditionalGeneration", "HybridModel",
                                    rnn_decoder=True),
    "recurrent_transformer": ModelType("recurrent", "RecurrentConfig", "RecurrentForConditionalGeneration",
                                       "RecurrentModel"),
    "beam_joint_transformer": ModelType("beam_joint", "BeamJointTransformerConfig",
                                        "BeamJointTransformerForConditionalGeneration", "BeamJointTransformerModel"),
    "beam_joint_rnn": ModelType("beam_joint", "BeamJointRNNConfig", "BeamJointRNNForConditionalGeneration",
                                "BeamJointRNNModel", rnn_decoder=True),
}


def kinds_allowed(role: str) -> list:
    """The kinds that may fill ``role``, sorted."""
    return sorted(name for name, kind in KINDS.items() if role in kind.roles)


def used_kinds(config) -> set:
    """The attention kinds named anywhere in ``config``'s role fields (a plain object or a config)."""
    used = set()
    for role in ROLES.values():
        value = getattr(config, role.field, None)
        used.update([value] if isinstance(value, str) else list(value or []))
    return used


def kind_files(config) -> set:
    """The runtime files (module names) of the attention kinds ``config`` uses."""
    return {KINDS[kind].module for kind in used_kinds(config) if kind in KINDS and KINDS[kind].module}


def attention_class(kind: str, config=None):
    """The module class of attention ``kind`` (its entry's file and class), or None for ``"none"``."""
    entry = KINDS[kind]
    return None if entry.module is None else getattr(runtime_module(entry.module, config), entry.class_name)


def model_classes(model_type: str) -> tuple:
    """(config class, model class) of ``model_type``."""
    entry = MODEL_TYPES[model_type]
    module = runtime_module(entry.module)
    return getattr(module, entry.config_class), getattr(module, entry.model_class)


def base_model_class(model_type: str):
    """The bare encoder-decoder class of ``model_type`` (``AutoModel``'s; the model class's ``.model``)."""
    entry = MODEL_TYPES[model_type]
    return getattr(runtime_module(entry.module), entry.base_model_class)


def runtime_module(name: str, config=None):
    """The runtime module ``name`` of this package. Loaded as remote code, a model's package holds the files that
    transformers copied for it (its model type's file and that file's relative imports): the file of another kind that
    its config names (a soft model decoding with hard retrieval) is then read from the folder or Hub repo the model was
    loaded from (``config._name_or_path``, where ``save_pretrained`` wrote it; a Hub file is fetched into the Hub
    cache, as transformers fetches those) and imported from there as a module of the model's package, so that its
    relative imports find the package's files. Nothing is written into the package's folder."""
    try:
        return importlib.import_module(f".{name}", __package__)
    except ModuleNotFoundError as error:
        source = getattr(config, "_name_or_path", None)
        if error.name != f"{__package__}.{name}" or not __package__.startswith("transformers_modules") or not source:
            raise
    path = cached_file(source, f"{name}.py", revision=getattr(config, "_commit_hash", None))
    return import_beside(f"{__package__}.{name}", path)


def import_beside(qualified_name: str, path: str):
    """Import the file ``path`` as the module ``qualified_name`` (of an imported package), as the import system would
    had the file been in that package's folder."""
    spec = importlib.util.spec_from_file_location(qualified_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[qualified_name]
        raise
    package, _, attribute = qualified_name.rpartition(".")
    setattr(sys.modules[package], attribute, module)
    return module


__all__ = ["KINDS", "MODEL_TYPES", "ROLES", "AttentionKind", "ModelType", "Role", "attention_class", "base_model_class",
           "import_beside", "kind_files", "kinds_allowed", "model_classes", "runtime_module", "used_kinds"]
