"""HF integration of the foundation's two models: soft baseline and hard retrieval."""

import pytest
import torch

import hf_hardattn
from common import check_cache_equivalence, check_padded_batch, check_remote_code, check_save_load, fitted, tiny_kwargs
from hf_hardattn import (HardRetrievalConfig, HardRetrievalForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration)

VARIANTS = {
    "soft": lambda **kw: SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs(**kw))),
    "hard": lambda **kw: HardRetrievalForConditionalGeneration(HardRetrievalConfig(**tiny_kwargs(**kw))),
    "hard_all": lambda **kw: HardRetrievalForConditionalGeneration(
        HardRetrievalConfig(**tiny_kwargs(encoder_attention="hard_retrieval", **kw))),
}


_FITTED = {}


def fitted_variant(name):
    """One briefly fitted model per variant, shared by the tests of this file (the checks copy it or only read it)."""
    if name not in _FITTED:
        torch.manual_seed(0)  # the initial weights each test drew after the per-test seed (conftest)
        _FITTED[name] = fitted(VARIANTS[name]())
    return _FITTED[name]


@pytest.fixture(params=sorted(VARIANTS))
def model(request):
    return fitted_variant(request.param)


def test_cache_equals_no_cache(model):
    check_cache_equivalence(model)


def test_padded_batch_equals_single(model):
    check_padded_batch(model)


def test_save_load(model, tmp_path):
    check_save_load(model, tmp_path)


@pytest.mark.parametrize("name", ["soft", "hard"])
def test_remote_code_fresh_process(name, tmp_path):
    check_remote_code(fitted_variant(name), tmp_path)
