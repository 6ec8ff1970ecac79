"""The decoding cache (HardAttnCache) through generate(): continuing from a returned cache, and cropping it for
assisted decoding (decoders with step state too: the dynamic cache keeps the state after every position).

References: one generate() call of all the tokens; plain greedy decoding; transformers' own DynamicLayer for crop's
meaning of its argument.
"""

import pytest
import torch

from common import (CONTRACT_MODELS, TYPE_MODELS, as_float64, assert_nontrivial, assert_step_scores_close,
                    contract_model, randomize, source_batch, tiny_kwargs)
from hf_hardattn import GaussianConfig, GaussianForConditionalGeneration, HardAttnCache
from hf_hardattn.caches import CACHE_FIELD, StaticHardAttnCache, cropped_length


# ----------------------------------------------------------------------------------------------------------------
# Continuing generate() from a returned cache
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONTRACT_MODELS)
@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.numerics
def test_generate_continues_from_a_returned_cache(name, mode):
    """4 tokens, then 4 more from the returned cache (the sequence so far as decoder input, its mask covering it, as
    transformers asks of MarianMTModel too): the same tokens and scores (common.assert_step_scores_close) as 8 tokens
    in one call, in float64 (exact tokens between two code paths: see common.as_float64). The decoders that keep no
    key/value layers (Gaussian self-attention, GRU) must not feed the cached prefix again."""
    model = as_float64(contract_model(name))
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=mode == "sample", return_dict_in_generate=True,
                  output_scores=True)
    torch.manual_seed(7)
    whole = model.generate(**kwargs, max_new_tokens=8, min_new_tokens=8)
    torch.manual_seed(7)
    first = model.generate(**kwargs, max_new_tokens=4, min_new_tokens=4)
    cache = getattr(first, CACHE_FIELD)
    assert cache.get_seq_length() == 4
    second = model.generate(**kwargs, max_new_tokens=4, min_new_tokens=4, decoder_input_ids=first.sequences,
                            decoder_attention_mask=torch.ones_like(first.sequences), **{CACHE_FIELD: cache})
    assert_nontrivial(whole.sequences)
    assert torch.equal(second.sequences, whole.sequences)
    for t, (a, b) in enumerate(zip(second.scores, whole.scores[4:], strict=True)):
        assert_step_scores_close(a, b, f"step {4 + t}")
    assert cache.get_seq_length() == 8


# ----------------------------------------------------------------------------------------------------------------
# Assisted decoding (crop of the cache)
# ----------------------------------------------------------------------------------------------------------------
KEY_VALUE_MODELS = {  # decoders whose cache is keys/values only (and the position count), which crop can roll back
    "soft": TYPE_MODELS["soft"],
    "hard_retrieval": TYPE_MODELS["hard_retrieval"],
    "beam_joint_transformer": TYPE_MODELS["beam_joint_transformer"],
    "gaussian_cross_soft_decoder": lambda **kw: GaussianForConditionalGeneration(
        GaussianConfig.preset("hc-all", **tiny_kwargs(decoder_attention="soft", length_ratio=1.3, **kw))),
}


@pytest.mark.parametrize("name", sorted(KEY_VALUE_MODELS))
def test_assisted_decoding_equals_greedy_decoding(name, monkeypatch):
    """An assistant with other weights proposes drafts that the model partly rejects; the cache is cropped back and
    decoding gives the tokens and scores of plain greedy decoding (float64: exact tokens between two code paths, see
    common.as_float64; the scores as common.assert_step_scores_close)."""
    model = randomize(KEY_VALUE_MODELS[name]()).double()
    assistant = randomize(KEY_VALUE_MODELS[name](), seed=1).double()
    removed, crop = [], HardAttnCache.crop

    def recording_crop(cache, n):
        removed.append(cache.seen_tokens - cropped_length(cache.seen_tokens, n))
        return crop(cache, n)

    monkeypatch.setattr(HardAttnCache, "crop", recording_crop)
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=10, min_new_tokens=10, do_sample=False,
                  output_scores=True, return_dict_in_generate=True)
    plain = model.generate(**kwargs)
    assert not removed
    assisted = model.generate(assistant_model=assistant, **kwargs)
    assert sum(removed) > 0  # drafts were rejected and cropped away
    assert torch.equal(assisted.sequences, plain.sequences)
    for t, (step, expected) in enumerate(zip(assisted.scores, plain.scores, strict=True)):
        assert_step_scores_close(step, expected, f"step {t}")


@pytest.mark.parametrize("n", [-2, -6, 0, 3, 6, 9])
def test_cache_crop_follows_transformers_convention(n):
    """crop(n) of the decoder self-attention cache layer and of HardAttnCache's position count against transformers'
    DynamicLayer, whose meaning of n changed within 5.x (length to keep, or minus the positions to remove)."""
    from transformers.cache_utils import DynamicLayer

    keys = torch.arange(6.0).view(1, 1, 6, 1)
    cache, dynamic = HardAttnCache(), DynamicLayer()
    cache.self_attention_cache.update(keys, keys, 0)
    cache.seen_tokens = 6
    dynamic.update(keys, keys)
    try:
        dynamic.crop(n)
    except ValueError:
        with pytest.raises(ValueError, match=r"`crop` takes minus the number of positions to remove"):
            cache.crop(n)
        return
    cache.crop(n)
    layer = cache.self_attention_cache.layers[0]
    assert torch.equal(layer.keys, dynamic.keys) and torch.equal(layer.values, dynamic.values)
    assert cache.get_seq_length() == layer.get_seq_length() == dynamic.get_seq_length()


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_cache_with_step_state_crops_back_to_the_kept_position(kind):
    """transformers 5.24's assisted decoding asks ``is_croppable`` after the first forward. Both caches keep the state
    after every position (the dynamic one as references, the static one in a preallocated history written in place),
    so a crop restores the state of the position kept: written at positions 1, 2, 3 (values 0, 1, 2), cropped by 2 ->
    the first's; cropped to 0 -> no state."""
    cache = HardAttnCache() if kind == "dynamic" else StaticHardAttnCache(1, 4, 1)
    keys = torch.zeros(1, 1, 1, 1)
    for step in range(3):
        cache.self_attention_cache.update(keys, keys, 0)
        cache.set_state("gru.0", torch.full((1, 4), float(step)))
        cache.advance(1)
    assert cache.is_croppable
    cache.crop(-2)
    assert int(cache.get_seq_length()) == 1 and cache.states["gru.0"].flatten().tolist() == [0.0] * 4
    cache.crop(-1)
    assert int(cache.get_seq_length()) == 0 and "gru.0" not in cache.states
