"""Left-padded decoder prompts (``decoder_input_ids`` + ``decoder_attention_mask`` with padding before a row's first
token) for the model types whose decoder carries a state from step to step: hybrid_transformer and beam_joint_rnn (the
GRU / LSTM states, luong's fed attentional state; beam-joint's candidates read them), recurrent_transformer (the
recurrent cross-attention's previous context, weights or accumulated weights). A padded position keeps the state, so a row's first real token reads the
initial state and the row decodes as its prompt alone.

References: each prompt decoded alone, unpadded, in float64 (the helpers and tests of tests/test_left_padding.py, run
here on these types).
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import CompileConfig

import test_left_padding as left_padding
from common import BOS, PAD, TYPE_MODELS, as_float64, assert_step_scores_close, contract_model, randomize
from hf_hardattn.caches import CACHE_FIELD, StaticHardAttnCache
from hf_hardattn.recurrent import RECURRENT_VARIANTS

# contract models (fitted: varied tokens) of every decoder with a per-step state
STATE_MODELS = ("hybrid_additive", "hybrid_multihead", "hybrid_luong_lstm", "beam_joint_rnn", "beam_joint_rnn_bahdanau",
                "recurrent_expand_1", "recurrent_coverage")


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("name", STATE_MODELS)
def test_left_padded_prompts_decode_as_each_prompt_alone(name, cache):
    """generate(), greedy and beam 4, dynamic and static cache: each row's tokens and step scores are those of its
    prompt decoded alone (tests/test_left_padding.py's test, on these types)."""
    left_padding.test_left_padded_decoder_prompts_decode_as_each_prompt_alone(name, cache)


@pytest.mark.parametrize("name", STATE_MODELS)
def test_left_padded_decoder_inputs_in_forward_equal_each_row_alone(name):
    """forward() without a cache, into a cache, and through the dynamic and the static cache, then positions without a
    mask: every real position's logits are the row's alone (tests/test_left_padding.py's test, on these types)."""
    left_padding.test_left_padded_decoder_inputs_in_forward_equal_each_row_alone(name)


def recurrent_model(variant):
    """A float64 recurrent model of ``variant``, random weights (std 0.3, as tests/test_static_states.py's)."""
    torch.manual_seed(0)
    return as_float64(randomize(TYPE_MODELS["recurrent"](recurrent_variant=variant), std=0.3))


PROMPTS = ([BOS, 9, 13, 6, 5, 7], [BOS, 8, 12, 4], [BOS, 17, 10])  # padding of 0, 2 and 3 positions


def check_one_position_a_call(model, what):
    """Left-padded prompts fed in calls into the dynamic and the static cache: the first up to every row's first token
    (a mask may not leave a row without one), so that two rows hold padding there, then one position a call, the
    mask growing a column a call (as generate() passes it): the logits of every real position are those of the row
    alone, unpadded, without a cache; those of the padding are finite."""
    ids, mask = left_padding.prompt_sources()
    decoder_ids, decoder_mask = left_padding.left_padded_prompts(PROMPTS)
    alone = left_padding.teacher_forced_alone(model, ids, mask, decoder_ids, decoder_mask)
    width = decoder_ids.shape[1]
    first = int((decoder_mask == 0).sum(-1).max()) + 1
    for cache in (None, StaticHardAttnCache(model.config.decoder_layers, width, 3)):
        logits = []
        for start, stop in [(0, first)] + [(t, t + 1) for t in range(first, width)]:
            out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids[:, start:stop],
                        decoder_attention_mask=decoder_mask[:, :stop], cache=cache, use_cache=True)
            cache = getattr(out, CACHE_FIELD)
            logits.append(out.logits)
        steps = torch.cat(logits, 1)
        assert steps.isfinite().all()
        left_padding.assert_real_positions(steps, alone, decoder_mask, f"{what}, {type(cache).__name__}")


@pytest.mark.parametrize("variant", RECURRENT_VARIANTS)
def test_every_recurrent_variant_decodes_left_padded_prompts_step_by_step_as_alone(variant):
    """Each variant's state (context, weights, accumulated weights or re-scaled energies) is not touched by a padded
    step: a call with padding, then one position a call, gives each row's logits alone (float64)."""
    check_one_position_a_call(recurrent_model(variant), variant)


@pytest.mark.parametrize("name", ["hybrid_additive", "hybrid_luong_lstm", "beam_joint_rnn"])
def test_the_hybrid_decodes_left_padded_prompts_step_by_step_as_alone(name):
    """The RNN states (GRU; LSTM [h; c] with luong's fed h~ and carried gates) stay at s_0 through the padding: a call
    with padding, then one position a call, gives each row's logits alone (float64)."""
    check_one_position_a_call(as_float64(contract_model(name)), name)


def test_a_padded_position_leaves_the_states_as_they_were():
    """After a left-padded batch of prompts, each row's states in the dynamic cache are those of its prompt decoded
    alone (float64): the padding wrote none of them."""
    for name in ("hybrid_luong_lstm", "recurrent_coverage"):
        model = as_float64(contract_model(name))
        ids, mask = left_padding.prompt_sources()
        decoder_ids, decoder_mask = left_padding.left_padded_prompts()
        batch = getattr(model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                              decoder_attention_mask=decoder_mask, use_cache=True), CACHE_FIELD)
        assert batch.states
        for row, real in enumerate(decoder_mask.bool()):
            alone = getattr(model(input_ids=ids[row : row + 1, mask[row].bool()],
                                  decoder_input_ids=decoder_ids[row : row + 1, real], use_cache=True), CACHE_FIELD)
            for key, state in alone.states.items():
                got = batch.states[key][row : row + 1]
                if key.startswith("recurrent."):  # [B, H, J] over the source: the row's real source positions
                    got = got[..., : state.shape[-1]]
                torch.testing.assert_close(got, state, rtol=0, atol=1e-12, msg=f"{name}, row {row}, {key}")


class Counter(CompileCounterWithBackend):
    def __deepcopy__(self, memo):  # kept itself when generate() deep-copies its compile config
        return self


@pytest.mark.parametrize("name", ["hybrid_additive", "recurrent_expand_1"])
def test_left_padded_prompts_through_compiled_static_steps(name):
    """generate() with compiled decoding steps over the static cache (fullgraph: a graph break raises; backend "eager",
    dynamo alone) decodes left-padded prompts with the eager dynamic cache's tokens and scores, greedy (float64);
    at most 2 graphs."""
    torch._dynamo.reset()
    model = as_float64(contract_model(name))
    ids, mask = left_padding.prompt_sources()
    decoder_ids, decoder_mask = left_padding.left_padded_prompts()
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                  decoder_attention_mask=decoder_mask, max_new_tokens=6, min_new_tokens=6,
                  return_dict_in_generate=True, output_scores=True)
    reference = model.generate(**kwargs)
    assert (reference.sequences[1:, :2] == PAD).all()
    counter = Counter("eager")
    config = CompileConfig(fullgraph=True, dynamic=True, backend=counter, mode=None)
    config._compile_all_devices = True  # (generate() compiles on a CPU only when asked)
    compiled = model.generate(**kwargs, cache_implementation="static", compile_config=config)
    assert torch.equal(compiled.sequences, reference.sequences)
    for step, (got, expected) in enumerate(zip(compiled.scores, reference.scores, strict=True)):
        assert_step_scores_close(got, expected, f"step {step}")
    assert 1 <= counter.frame_count <= 2, counter.frame_count
    torch._dynamo.reset()
