"""The soft baseline: the standard Transformer with scaled dot-product attention in every role.

Runtime code shipped with saved models: flat, same-folder relative imports only.
"""

from transformers import GenerationMixin

from .configuration_hardattn import HardAttnConfig
from .modeling_hardattn import HardAttnForConditionalGeneration, HardAttnModel


class SoftTransformerConfig(HardAttnConfig):
    """Transformer-base defaults (d_model 512, 6+6 layers, 8 heads, FFN 2048), soft attention everywhere."""

    model_type = "soft_transformer"


class SoftTransformerModel(HardAttnModel):
    """The bare encoder-decoder (``AutoModel``): last_hidden_state = the decoder's last hidden state."""

    config_class = SoftTransformerConfig


class SoftTransformerForConditionalGeneration(HardAttnForConditionalGeneration, GenerationMixin):
    config_class = SoftTransformerConfig
    model_class = SoftTransformerModel
    card_title = "Soft Transformer baseline"
    card_description = (
        "The standard Transformer encoder-decoder (post-norm, tied embeddings, sinusoidal positions) with "
        "multi-head scaled dot-product attention (`torch.nn.functional.scaled_dot_product_attention`) in every "
        "role. It is the baseline every hf_hardattn variant is measured against."
    )


__all__ = ["SoftTransformerConfig", "SoftTransformerForConditionalGeneration", "SoftTransformerModel"]
