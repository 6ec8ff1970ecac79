"""``attn_implementation``: "eager" is honoured by every model type (soft attention written out, torch's fused kernel
not called) and gives the "sdpa" output; other values are refused naming the allowed ones.

References: the "sdpa" model (float64); transformers' MarianMTModel for ``set_attn_implementation``.
"""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSeq2SeqLM, MarianConfig, MarianMTModel

from common import CONTRACT_MODELS, contract_model, source_batch, tiny_kwargs
from hf_hardattn.layers import SoftAttention


DEC = torch.tensor([[1, 6, 9, 12, 15, 7], [1, 8, 10, 2, 0, 0]])  # teacher-forced decoder inputs


def test_eager_attention_is_honoured_and_equals_sdpa(monkeypatch, tmp_path):
    model = contract_model("soft", fit=False).double()
    ids, mask = source_batch()
    reference = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC).logits
    model.set_attn_implementation("eager")

    def fused(*args, **kwargs):
        raise AssertionError("the fused kernel ran under attn_implementation='eager'")

    with monkeypatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", fused)
        eager = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC).logits
    torch.testing.assert_close(eager, reference, rtol=0, atol=1e-10)
    model.save_pretrained(tmp_path)
    assert AutoModelForSeq2SeqLM.from_pretrained(tmp_path, attn_implementation="eager").config._attn_implementation \
        == "eager"


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_set_attn_implementation_eager_is_honoured_by_every_model_type(name):
    """As on transformers' MarianMTModel, ``set_attn_implementation("eager")`` switches the model (not only a logged
    warning): the config says so, every soft attention module writes Eq. 1 out (torch's fused kernel does not run) and
    the output is the "sdpa" model's."""
    marian = MarianMTModel(MarianConfig(**{k: v for k, v in tiny_kwargs().items() if k in MarianConfig().to_dict()}))
    marian.set_attn_implementation("eager")
    assert marian.config._attn_implementation == "eager"  # the reference
    model = contract_model(name, fit=False).double()
    assert model.config._attn_implementation == "sdpa"
    ids, mask = source_batch()
    soft = [module for module in model.modules()  # soft attention (hard retrieval, a subclass, has its own kernel)
            if getattr(type(module), "attend", None) is SoftAttention.attend]
    with mock.patch.object(F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention) as fused:
        reference = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC).logits
        calls = fused.call_count
        assert (calls > 0) == bool(soft)  # the default runs the fused kernel wherever there is soft attention
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC).logits
        assert fused.call_count == calls
    assert model.config._attn_implementation == "eager"
    assert all(module.eager for module in model.modules() if isinstance(module, SoftAttention))
    torch.testing.assert_close(eager, reference, rtol=0, atol=1e-10)


@pytest.mark.parametrize("value", ["flash_attention_2", "flex_attention", "paged|eager", "kernels-community/flash-attn"])
def test_other_attn_implementations_are_refused_naming_the_allowed_ones(value, tmp_path):
    model = contract_model("soft", fit=False)
    with pytest.raises(ValueError, match=r"`attn_implementation`=.*allowed: \['sdpa', 'eager'\]"):
        model.set_attn_implementation(value)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"allowed: \['sdpa', 'eager'\]"):
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path, attn_implementation=value)
