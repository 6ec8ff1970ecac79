"""pack_linears (packed_linear.py): decoding with oneDNN-prepacked linear weights gives the outputs of the plain
model (a second code path: F.linear), for every variant and MarianMTModel; training, state dicts, saving and copies
are unaffected; the packed copy follows in-place weight changes. Both paths are fp32 only (the packed one exists for
fp32), so generated tokens are compared where the plain model's margins exceed the paths' rounding
(common.assert_same_tokens_where_margins_allow)."""

import copy

import pytest
import torch
from common import (FP32_PATHS_RTOL, assert_fp32_path_premise, assert_nontrivial, assert_output_layer_premise,
                    assert_same_tokens_where_margins_allow, decoding_batch, fitted, generate_kwargs, randomize,
                    recorded_generate, source_batch, tiny_kwargs)
from transformers import AutoModelForSeq2SeqLM, MarianConfig, MarianMTModel

import hf_hardattn  # noqa: F401
from hf_hardattn import (BeamJointRNNConfig, BeamJointRNNForConditionalGeneration, BeamJointTransformerConfig,
                         BeamJointTransformerForConditionalGeneration, GaussianConfig, GaussianForConditionalGeneration,
                         HardRetrievalConfig, HardRetrievalForConditionalGeneration, HybridConfig,
                         HybridForConditionalGeneration, RecurrentConfig, RecurrentForConditionalGeneration,
                         SoftTransformerConfig, SoftTransformerForConditionalGeneration)
from hf_hardattn import packed_linear
from hf_hardattn.packed_linear import is_packed, pack_linears, packed_layers, unpack_linears

RNN_KW = dict(decoder_layers=1, rnn_hidden_size=32)
pytestmark = [pytest.mark.skipif(not packed_linear.packing_available(), reason="no oneDNN prepacked linear"),
              pytest.mark.numerics]
HALF = 0.5  # of the decisions (sentences x steps) at least this share clear of rounding (seen: 0.87-1 for beams)

MODELS = {
    "soft": lambda: SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs())),
    "hard_retrieval": lambda: HardRetrievalForConditionalGeneration(HardRetrievalConfig(**tiny_kwargs())),
    "sh_x": lambda: GaussianForConditionalGeneration(GaussianConfig.preset("sh-x", **tiny_kwargs())),
    "hybrid": lambda: HybridForConditionalGeneration(HybridConfig(**tiny_kwargs(**RNN_KW, rnn_attention="dot"))),
    "recurrent": lambda: RecurrentForConditionalGeneration(RecurrentConfig(**tiny_kwargs(recurrent_variant="expand_1"))),
    "beam_joint": lambda: BeamJointTransformerForConditionalGeneration(
        BeamJointTransformerConfig(**tiny_kwargs(joint_k=3))),
    "beam_joint_rnn": lambda: BeamJointRNNForConditionalGeneration(BeamJointRNNConfig(**tiny_kwargs(**RNN_KW))),
}


def logits(model, ids=None, mask=None):
    if ids is None:
        ids, mask = source_batch()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :5]).logits


def assert_packed_path_used(model):
    """Guards the comparisons: the packed kernel really ran (a packed copy exists) in at least 80% of the linear
    layers (beam-joint multiplies by its output layer's weight in its own mixture GEMM, not through the layer)."""
    packed = [m.packed_weight.key is not None for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert packed and sum(packed) >= 0.8 * len(packed), f"packed path ran in {sum(packed)} of {len(packed)} layers"


def recorded(model, mode):
    ids, mask = decoding_batch()
    return recorded_generate(model, input_ids=ids, attention_mask=mask, **generate_kwargs(mode))


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_decoding_equals_plain(name):
    """Teacher-forced logits within rounding; greedy and beam search (4 beams; 32 rows, all packed) give the plain
    model's tokens and step scores wherever its margins allow, at least half of the 80 decisions (8 sentences x 10
    steps) each."""
    torch.manual_seed(0)  # the same model whichever tests ran before
    plain = fitted(MODELS[name]())  # varied outputs (random tied-embedding models repeat one token)
    packed = copy.deepcopy(plain).pack_linears()
    assert_output_layer_premise(plain)
    for model in (plain, packed):  # each path within half the bound of exact arithmetic: the two within the bound
        assert_fp32_path_premise(model)
    expected = logits(plain)  # the bound is relative to each position's largest |logit|
    assert ((logits(packed) - expected).abs() <= FP32_PATHS_RTOL * expected.abs().amax(-1, keepdim=True)).all()
    for mode, beams in (("greedy", 1), ("beam", 4)):
        expected = recorded(plain, mode)
        assert_nontrivial(expected["sequences"])
        assert_same_tokens_where_margins_allow(expected, recorded(packed, mode), num_beams=beams, min_steps=HALF * 80)
    assert_packed_path_used(packed)


def test_marian_too():
    config = MarianConfig(vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=0,
                          eos_token_id=2, decoder_start_token_id=1, forced_eos_token_id=None,
                          max_position_embeddings=64)
    torch.manual_seed(0)
    plain = randomize(MarianMTModel(config))
    packed = pack_linears(copy.deepcopy(plain))
    assert_output_layer_premise(plain)  # FP32_PATHS_RTOL's premises, on both paths (where they agree bit for bit, the
    for model in (plain, packed):  # float64 comparison still exercises each path's half of the bound)
        assert_fp32_path_premise(model)
    ids, mask = decoding_batch()
    expected = logits(plain, ids, mask)
    assert ((logits(packed, ids, mask) - expected).abs() <= FP32_PATHS_RTOL * expected.abs().amax(-1, keepdim=True)).all()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, num_beams=3)
    expected = recorded_generate(plain, **kwargs)
    got = recorded_generate(packed, **kwargs)
    assert_same_tokens_where_margins_allow(expected, got, num_beams=3, min_steps=HALF * 64)  # 8 sentences x 8 steps
    assert packed.lm_head.packed_weight.key is not None


def test_rows_above_max_rows_use_f_linear():
    model = randomize(MODELS["soft"]()).pack_linears(max_rows=3)
    x = torch.randn(2, 2, 32)  # 4 rows > 3
    with torch.no_grad():
        out = model.lm_head(x)
    assert model.lm_head.packed_weight.key is None
    torch.testing.assert_close(out, torch.nn.functional.linear(x, model.lm_head.weight), rtol=0, atol=0)
    with torch.no_grad():
        model.lm_head(x[:1])  # 2 rows: packed
    assert model.lm_head.packed_weight.key is not None


def test_training_is_unchanged_and_never_packs():
    """With gradients the layers run F.linear: same loss and gradients as the plain model; nothing is packed."""
    torch.manual_seed(0)
    plain = randomize(MODELS["soft"]()).train()
    packed = copy.deepcopy(plain).pack_linears()
    ids, mask = source_batch()
    for model in (plain, packed):
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), packed.parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert all(m.packed_weight.key is None for m in packed.modules() if isinstance(m, torch.nn.Linear))


def test_a_trainable_bias_alone_still_gets_its_gradient():
    """Frozen weight, trainable bias: the layer needs autograd, so it runs F.linear and the bias gets its gradient."""
    layer = pack_linears(torch.nn.Sequential(torch.nn.Linear(8, 4)))[0]
    layer.weight.requires_grad_(False)
    x = torch.randn(3, 8)
    layer(x).sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((4,), 3.0))
    assert layer.packed_weight.key is None


def test_packed_copy_follows_weight_changes(tmp_path):
    """After in-place weight changes (an optimizer step) and after load_state_dict, the packed copies hold the new
    weights: the model gives bit for bit what a model packed afresh from those weights gives (the same oneDNN kernel on
    the same packed weights, so no rounding allowance: a packed-vs-plain comparison would need one, and the kernels'
    rounding differs by CPU and by `ONEDNN_MAX_CPU_ISA`), while a stale copy would miss a change of order one."""
    def packed_afresh(source):
        fresh = pack_linears(unpack_linears(copy.deepcopy(source)))
        assert not any(m.packed_weight.key is not None for m in packed_layers(fresh))
        return fresh

    torch.manual_seed(0)
    model = randomize(MODELS["soft"]()).pack_linears()
    before = logits(model)  # packs every layer
    with torch.no_grad():  # in place, as an optimizer step does
        for param in model.parameters():
            param.mul_(0.9).add_(0.01)
    reference = packed_afresh(model)
    after = logits(model)
    torch.testing.assert_close(after, logits(reference), rtol=0, atol=0)
    assert (after - before).abs().max() > 0.1, "the weight change must be visible in the logits"
    other = randomize(MODELS["soft"](), seed=1)
    model.load_state_dict(other.state_dict())
    loaded = logits(model)
    torch.testing.assert_close(loaded, logits(packed_afresh(other)), rtol=0, atol=0)
    assert (loaded - after).abs().max() > 0.1
    for m in (model, reference):
        assert_packed_path_used(m)


def test_state_dict_save_load_and_unpack(tmp_path):
    torch.manual_seed(0)
    plain = randomize(MODELS["soft"]())
    packed = copy.deepcopy(plain).pack_linears()
    logits(packed)
    assert is_packed(packed) and list(packed.state_dict()) == list(plain.state_dict())
    packed.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert not is_packed(loaded)
    torch.testing.assert_close(logits(loaded), logits(plain), rtol=0, atol=0)
    unpack_linears(packed)
    assert not is_packed(packed) and "forward" not in packed.lm_head.__dict__
    torch.testing.assert_close(logits(packed), logits(plain), rtol=0, atol=0)


def test_bad_input(monkeypatch):
    model = MODELS["soft"]()
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match="`max_rows` must be a positive integer"):
            model.pack_linears(max_rows=bad)
    monkeypatch.setattr(packed_linear, "packing_available", lambda: False)
    with pytest.raises(RuntimeError, match="oneDNN"):
        model.pack_linears()
