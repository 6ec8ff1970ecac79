"""hf_hardattn: alternatives to Transformer attention for encoder-decoder translation, as HuggingFace models.

What importing the package changes in transformers, and nothing else (``tests/test_import_effects.py`` holds it to
this list): every model type is registered with ``AutoConfig`` / ``AutoModelForSeq2SeqLM`` / ``AutoModel`` (the bare
encoder-decoder, ``SoftTransformerModel`` etc.; its classes marked for
remote-code saving, so a saved folder also loads with ``trust_remote_code=True`` where hf_hardattn is not installed);
the ``translation`` pipeline task is registered, for any seq2seq model, its entry leaves transformers'
``REMOVED_TASKS``, and the registry's lookup reads transformers 4's names ``translation_XX_to_YY``
(``hf_hardattn.pipelines``); the ``hard_retrieval`` attention implementations are registered with
``AttentionInterface`` and ``AttentionMaskInterface`` (``hf_hardattn.attention_interface``).

``hf_hardattn.convert(source, model_type, **config_overrides)`` maps a pretrained Marian / BART / mBART / M2M100 model
into any of these model types (``hf_hardattn/tools/convert.py``).

Layout: the top level holds the runtime (what a saved model carries, flat: remote code copies a model file and its
same-folder imports) and the two registrations with transformers (``pipelines``, ``attention_interface``);
``hf_hardattn.tools`` holds the tooling (command line, training, reproduction, data, plots, conversion), imported by
that path (``hf_hardattn.tools.training``, ...). ``registry.py`` lists the attention kinds and the model types.
"""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .attention_interface import register as _register_attention_interface
from .beam_joint import (BeamJointModelOutput, BeamJointRNNConfig, BeamJointRNNForConditionalGeneration,
                         BeamJointRNNModel, BeamJointTransformerConfig, BeamJointTransformerForConditionalGeneration,
                         BeamJointTransformerModel)
from .caches import HardAttnCache
from .configuration_hardattn import ATTENTION_KINDS, HardAttnConfig
from .gaussian import GaussianConfig, GaussianForConditionalGeneration, GaussianModel, fit_length_ratio
from .hard_retrieval import HardRetrievalConfig, HardRetrievalForConditionalGeneration, HardRetrievalModel
from .hybrid import HybridConfig, HybridForConditionalGeneration, HybridModel
from .modeling_hardattn import HardAttnForConditionalGeneration
from .pipelines import TranslationPipeline
from .pipelines import register as _register_pipelines
from .recurrent import RecurrentConfig, RecurrentForConditionalGeneration, RecurrentModel
from .registry import MODEL_TYPES, base_model_class, model_classes
from .soft import SoftTransformerConfig, SoftTransformerForConditionalGeneration, SoftTransformerModel
from .tools.convert import ConversionReport, convert

__version__ = "0.1.0"

MODEL_CLASSES = dict(model_classes(model_type) for model_type in MODEL_TYPES)  # config class -> model class


def _register():
    for config_class, model_class in MODEL_CLASSES.items():
        bare_class = base_model_class(config_class.model_type)  # the bare encoder-decoder, model_class's `.model`
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForSeq2SeqLM.register(config_class, model_class, exist_ok=True)
        AutoModel.register(config_class, bare_class, exist_ok=True)
        config_class.register_for_auto_class()
        model_class.register_for_auto_class("AutoModelForSeq2SeqLM")
        bare_class.register_for_auto_class("AutoModel")


_register()
_register_pipelines()
_register_attention_interface()  # "hard_retrieval" etc. for stock models (attention_interface.py)

__all__ = [
    "ATTENTION_KINDS",
    "BeamJointModelOutput",
    "BeamJointRNNConfig",
    "BeamJointRNNForConditionalGeneration",
    "BeamJointRNNModel",
    "BeamJointTransformerConfig",
    "BeamJointTransformerForConditionalGeneration",
    "BeamJointTransformerModel",
    "ConversionReport",
    "convert",
    "fit_length_ratio",
    "GaussianConfig",
    "GaussianForConditionalGeneration",
    "GaussianModel",
    "HardAttnCache",
    "HardAttnConfig",
    "HardAttnForConditionalGeneration",
    "HardRetrievalConfig",
    "HardRetrievalForConditionalGeneration",
    "HardRetrievalModel",
    "HybridConfig",
    "HybridForConditionalGeneration",
    "HybridModel",
    "MODEL_CLASSES",
    "RecurrentConfig",
    "RecurrentForConditionalGeneration",
    "RecurrentModel",
    "SoftTransformerConfig",
    "SoftTransformerForConditionalGeneration",
    "SoftTransformerModel",
    "TranslationPipeline",
]
