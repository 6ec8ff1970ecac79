"""transformers' ``ModelTesterMixin.test_eager_matches_sdpa_inference`` (tests/test_modeling_common.py of
transformers 5.24, not installed with the wheel), run here for every model type as it runs there.

Its 25 cases per model: dtype fp16 / fp32 / bf16 x padding side left / right x with / without attention mask x
with / without sdpa's flash and memory-efficient kernels, plus ``fp32_pad_left_output_attentions``. Each case, as the
mixin does it: ``set_seed(42)``, ``set_config_for_less_flaky_test(config)`` (which sets ``layer_norm_epsilon`` and
other names that are no fields of ours: the case needs the saved config to load, see test_config_roundtrip.py),
``model_class(config)``, ``save_pretrained`` then ``from_pretrained(dtype=..., attn_implementation="sdpa")``, a
deep copy switched to ``set_attn_implementation("eager")``, ``set_model_for_less_flaky_test`` on both (every
LayerNorm's eps 1.0), a batch of 7 (``input_ids``, ``decoder_input_ids`` and, with the mask, a
``decoder_attention_mask`` whose last row has 2 padded positions on the given side; the mixin passes no encoder
``attention_mask`` to an encoder-decoder model), forward under ``torch.nn.attention.sdpa_kernel``, and the last
``decoder_hidden_states`` compared with the mixin's tolerances (padded positions of the last row left out, bf16's atol
raised to 3% of the outputs' magnitude), at least 80% of the rows within them. The cases of one model type and dtype
build, save and load the same models: they are built once per model type and dtype and shared (`loaded_models`).

The inputs are those of transformers' MarianModelTester (``input_ids`` >= 3 ending in EOS, random
``decoder_input_ids``), drawn from a seeded generator instead of the mixin's unseeded ``global_rng``.
"""

import copy
import random
import tempfile
from unittest import mock

import numpy as np
import pytest
import torch
from common import tiny_kwargs
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import set_seed
from transformers.testing_utils import set_config_for_less_flaky_test, set_model_for_less_flaky_test
from transformers.utils import is_torch_bf16_available_on_device, is_torch_fp16_available_on_device

import hf_hardattn  # noqa: F401
from hf_hardattn import layers
from hf_hardattn.registry import MODEL_TYPES, model_classes

# TEST_EAGER_MATCHES_SDPA_INFERENCE_PARAMETERIZATION of transformers 5.24
CASES = [
    (f"{dtype}_pad_{side}{'' if mask else '_no_attn_mask'}{'_sdpa_kernels' if kernels else ''}",
     dtype, side, mask, False, kernels)
    for dtype in ("fp16", "fp32", "bf16") for side in ("left", "right") for mask in (True, False)
    for kernels in (True, False)
] + [("fp32_pad_left_output_attentions", "fp32", "left", True, True, False)]
DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
# the mixin's CPU tolerances: (kernels, dtype) -> atol, rtol (float64, not the mixin's: its fp32 ones)
ATOL = {torch.float32: 1e-6, torch.float16: 5e-3, torch.bfloat16: 1e-2, torch.float64: 1e-6}
RTOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2, torch.float64: 1e-4}
BATCH, SEQ, TESTER_BATCH = 7, 7, 13


# The mixin's "pad_left" cases with a mask (7 of 25: fp16 / fp32 / bf16 x kernels, and fp32_pad_left_output_attentions)
# left-pad the *decoder* (`decoder_attention_mask` [0, 0, 1, ...]). The types that read a left-padded prompt
# (`HardAttnModel.left_padding_refusal()` is None: positions from each row's first real token, padded keys hidden)
# compare eager with sdpa on it as the mixin does; the others refuse that input where it enters (their positions or
# step state would count the padding: a left-padded target decoded at shifted positions, an RNN stepping through the
# padding), with the same ValueError from "eager" and "sdpa", which those cases check instead of comparing outputs.
# transformers' Marian accepts it and computes shifted positions silently.
LEFT_PADDED_DECODER = "allowed for it: padding after each row's last token only"


# Design difference (bf16, beyond the mixin's shapes): hard retrieval's argmax (decoder self- and cross-attention of
# hard_retrieval_transformer) and beam-joint's top-K of the cross-attention distribution select keys; the fused kernel
# and the written-out softmax differ within bf16's rounding (8-bit mantissa: many near-ties among scores), which flips
# a selected key and changes the decoder's output by O(1) (measured: max 1.18, no row within the mixin's atol), as
# any argmax does. In fp32 a near-tie flips the same way (a last-bit difference decides it, on some CPU kind), so
# these types run in float64 there, where the two computations agree to ~1e-15 and every row must be within the
# tolerance (`selection_case`); in bf16 and fp16 they are checked on their encoder output (all soft attention).
# beam_joint_rnn selects its top-K from the RNN attention the same way (its last decoder_hidden_states entry is the K
# candidates' readouts, in top-K order): it passed by chance while its rnn_hidden_size was 1024 whatever d_model (86%
# of rows, max difference 0.32); at today's 2 * d_model = 64 a flipped candidate leaves no row within atol (max 1.12;
# the mixture's logits differ by 0.29 of 4.8, as a swapped candidate makes them).
DISCRETE_SELECTION = ("hard_retrieval_transformer", "beam_joint_transformer", "beam_joint_rnn")


def ids_tensor(shape, vocab_size, rng):
    return torch.tensor([rng.randint(0, vocab_size - 1) for _ in range(int(np.prod(shape)))]).view(shape)


def marian_tester_inputs(config, rng, seq=SEQ):
    """MarianModelTester.prepare_config_and_inputs (batch 13, length 7)."""
    input_ids = ids_tensor([TESTER_BATCH, seq], config.vocab_size, rng).clamp(3)
    input_ids[:, -1] = config.eos_token_id
    decoder_input_ids = ids_tensor([TESTER_BATCH, seq], config.vocab_size, rng)
    return dict(input_ids=input_ids, decoder_input_ids=decoder_input_ids,
                attention_mask=input_ids.ne(config.pad_token_id).long())


_LOADED = {}  # (model type, dtype, device, tiny_rnn) -> (config, "sdpa" model, "eager" model): see `loaded_models`


@pytest.fixture(scope="module", autouse=True)
def _release_loaded_models():
    yield
    _LOADED.clear()


def loaded_models(model_type, dtype, device, tiny_rnn):
    """The mixin's models of one case: ``set_seed(42)``, the config made less flaky, ``model_class(config)`` saved and
    loaded in ``dtype`` with "sdpa", a deep copy switched to "eager", both made less flaky. Every case of one model type
    and dtype builds, saves and loads exactly these (the same seed, config and calls); the cases differ in their inputs
    and sdpa backends only. So they are built once per model type and dtype and shared by those cases (which run
    forward in eval mode without gradient on them). ``tiny_rnn``: the RNN decoders (hybrid, beam_joint_rnn) with
    rnn_hidden_size 32, as the other tests' tiny RNN models, instead of their default 1024 (a 10M-parameter model)."""
    key = (model_type, dtype, device, tiny_rnn)
    if key not in _LOADED:
        config_class, model_class = model_classes(model_type)
        set_seed(42)
        rnn = dict(rnn_hidden_size=32) if tiny_rnn and MODEL_TYPES[model_type].rnn_decoder else {}
        config = config_class(**tiny_kwargs(**rnn))
        set_config_for_less_flaky_test(config)
        model = model_class(config)
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            with pytest.warns(UserWarning, match="layer_norm_epsilon"):  # kept from the saved config, with a warning
                model_sdpa = model_class.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        model_sdpa = model_sdpa.eval().to(device)
        model_eager = copy.deepcopy(model_sdpa)
        model_eager.set_attn_implementation("eager")
        model_eager = model_eager.eval().to(device)
        assert model_sdpa.config._attn_implementation == "sdpa" and model_eager.config._attn_implementation == "eager"
        set_model_for_less_flaky_test(model_eager)
        set_model_for_less_flaky_test(model_sdpa)
        _LOADED[key] = config, model_sdpa, model_eager
    return _LOADED[key]


def selection_case(model_type, dtype):
    """(dtype, encoder, share of rows required) for a case: see DISCRETE_SELECTION."""
    if model_type not in DISCRETE_SELECTION:
        return dtype, False, 0.8
    return ("fp64", False, 1.0) if dtype == "fp32" else (dtype, True, 0.8)


def eager_matches_sdpa(model_type, dtype, padding_side, use_attention_mask, enable_kernels, device="cpu", seq=SEQ,
                       encoder=False, tiny_rnn=False):
    """The mixin's body for one model class; returns (share of rows within tolerance, atol, max abs difference,
    calls of torch's fused attention kernel made by the "sdpa" model). The models: `loaded_models`. The "sdpa"
    model runs torch's fused kernel at every shape (WRITTEN_OUT_QUERIES set to 0: at the mixin's 7 x 7 tokens it
    would write attention out as "eager" does, and the case would compare a computation with itself)."""
    dtype = DTYPES[dtype]
    if dtype == torch.float16 and not is_torch_fp16_available_on_device(device):
        pytest.skip(f"float16 not supported on {device}")
    if dtype == torch.bfloat16 and not is_torch_bf16_available_on_device(device):
        pytest.skip(f"bfloat16 not supported on {device}")
    config, model_sdpa, model_eager = loaded_models(model_type, dtype, device, tiny_rnn)
    inputs = marian_tester_inputs(config, random.Random(0), seq)

    processed = {"input_ids": inputs["input_ids"][:BATCH].to(device)}
    mask = None
    if use_attention_mask:
        mask = inputs["attention_mask"][:BATCH].clone().to(device)
        mask[:] = 1
        if padding_side == "left":
            mask[-1, :2] = 0
        else:
            mask[-1, -2:] = 0
    processed.update(decoder_input_ids=inputs["decoder_input_ids"][:BATCH].to(device), decoder_attention_mask=mask,
                     output_hidden_states=True)
    backends = ([SDPBackend.FLASH_ATTENTION] if enable_kernels else []) + [SDPBackend.MATH] + (
        [SDPBackend.EFFICIENT_ATTENTION] if enable_kernels else [])
    if use_attention_mask and padding_side == "left" and model_eager.model.left_padding_refusal() is not None:
        for model in (model_eager, model_sdpa):  # refused: see LEFT_PADDED_DECODER
            with pytest.raises(ValueError, match=r"`decoder_attention_mask` row 6 has padding before a token: "
                                                 r"\[0, 0, 1, 1, 1, 1, 1\].*" + LEFT_PADDED_DECODER):
                model(**processed)
        return None
    with torch.no_grad(), sdpa_kernel(backends):
        out_eager = model_eager(**processed)
        with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention",
                               wraps=torch.nn.functional.scaled_dot_product_attention) as fused, \
                mock.patch.object(layers, "WRITTEN_OUT_QUERIES", 0):
            out_sdpa = model_sdpa(**processed)
    eager, sdpa = out_eager.decoder_hidden_states[-1], out_sdpa.decoder_hidden_states[-1]
    if encoder:  # (no decoder mask applies to it)
        eager, sdpa, use_attention_mask = out_eager.encoder_last_hidden_state, out_sdpa.encoder_last_hidden_state, False
    if use_attention_mask:  # masked positions of the last row may differ: the mixin leaves them out
        _eager, _sdpa = torch.zeros_like(eager), torch.zeros_like(sdpa)
        _eager[:-1], _sdpa[:-1] = eager[:-1], sdpa[:-1]
        if padding_side == "left":
            _eager[-1:, 2:], _sdpa[-1:, 2:] = eager[-1:, 2:], sdpa[-1:, 2:]
        else:
            _eager[-1:, 2:], _sdpa[-1:, 2:] = eager[-1:, :-2], sdpa[-1:, :-2]
        eager, sdpa = _eager, _sdpa
    atol, rtol = ATOL[dtype], RTOL[dtype]
    if dtype == torch.bfloat16:
        atol = max(atol, float(torch.max(sdpa.abs().amax(), eager.abs().amax())) * 3e-2)
    rows = [torch.allclose(a, b, atol=atol, rtol=rtol) for a, b in zip(sdpa, eager)]
    return float(np.mean(rows)), atol, float((sdpa.float() - eager.float()).abs().max()), fused.call_count


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
@pytest.mark.parametrize("name,dtype,padding_side,use_attention_mask,output_attentions,enable_kernels", CASES,
                         ids=[case[0] for case in CASES])
@pytest.mark.numerics
def test_eager_matches_sdpa_inference(model_type, name, dtype, padding_side, use_attention_mask, output_attentions,
                                      enable_kernels):
    # output_attentions: the mixin sets it only for decoder-only models; an encoder-decoder runs the case without it.
    # "sdpa" runs the fused kernel (`eager_matches_sdpa`); the RNN decoders run with a tiny RNN state. The types that
    # select keys: `selection_case`.
    dtype, encoder, required = selection_case(model_type, dtype)
    result = eager_matches_sdpa(model_type, dtype, padding_side, use_attention_mask, enable_kernels, tiny_rnn=True,
                                encoder=encoder)
    if result is None:  # refused by both implementations (LEFT_PADDED_DECODER)
        assert use_attention_mask and padding_side == "left"
        return
    share, atol, diff, fused = result
    assert fused > 0  # the fused kernel did run
    assert share >= required, f"{name}: {share:.0%} of rows within atol={atol} (max abs difference {diff:.3e})"


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("padding_side,use_attention_mask", [("right", True), ("right", False)])
@pytest.mark.numerics
def test_eager_matches_the_fused_kernel_beyond_the_mixins_shapes(model_type, dtype, padding_side, use_attention_mask):
    """The same check at 12 tokens, beyond the decoding-step shortcut (hf_hardattn/layers.py SoftAttention.attend:
    at most WRITTEN_OUT_QUERIES = 8 queries per row are written out), where "sdpa" runs torch's fused kernel without
    the patch; with the mixin's tolerances, the key-selecting types as `selection_case` says."""
    dtype, encoder, required = selection_case(model_type, dtype)
    share, atol, diff, fused = eager_matches_sdpa(model_type, dtype, padding_side, use_attention_mask, False, seq=12,
                                                  encoder=encoder)
    assert fused > 0  # the fused kernel did run
    assert share >= required, f"{share:.0%} of rows within atol={atol} (max abs difference {diff:.3e})"
