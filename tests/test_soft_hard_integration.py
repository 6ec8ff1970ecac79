"""HF integration of the foundation's two models: soft baseline and hard retrieval."""

import pytest

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


@pytest.fixture(params=sorted(VARIANTS))
def model(request):
    return fitted(VARIANTS[request.param]())


def test_cache_equals_no_cache(model):
    check_cache_equivalence(model)


def test_padded_batch_equals_single(model):
    check_padded_batch(model)


def test_save_load(model, tmp_path):
    check_save_load(model, tmp_path)


@pytest.mark.parametrize("name", ["soft", "hard"])
def test_remote_code_fresh_process(name, tmp_path):
    check_remote_code(fitted(VARIANTS[name]()), tmp_path)
