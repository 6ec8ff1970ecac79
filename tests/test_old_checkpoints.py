"""Checkpoints saved before the package's re-layout load after it and compute the same function: tiny models
of every model type (and a soft model that mixes every attention kind) saved by commit d27b908
(``fixtures/saved_d27b908/make_checkpoints.py``), with their float64 logits computed there."""

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM

import hf_hardattn  # noqa: F401  (registers the model types)

FOLDER = os.path.join(os.path.dirname(__file__), "fixtures", "saved_d27b908")
EXPECTED = load_file(os.path.join(FOLDER, "expected_logits_float64.safetensors"))
IDS = torch.tensor([[5, 9, 13, 17, 2], [7, 11, 19, 2, 0]])
DECODER = torch.tensor([[1, 6, 8, 10], [1, 12, 14, 0]])


def test_every_model_type_is_there():
    assert set(hf_hardattn.registry.MODEL_TYPES) <= set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_checkpoint_saved_before_loads_and_computes_the_same(name):
    model = AutoModelForSeq2SeqLM.from_pretrained(os.path.join(FOLDER, name)).double().eval()
    assert model.config.model_type == (name if name != "soft_mixed_kinds" else "soft_transformer")
    with torch.no_grad():
        logits = model(input_ids=IDS, attention_mask=(IDS != 0).long(), decoder_input_ids=DECODER).logits
    # float64: two CPUs' roundings differ by ~1e-16 of the values, far below what a changed computation gives
    torch.testing.assert_close(logits, EXPECTED[name], rtol=1e-10, atol=1e-10)
