"""Static caches and compiled decoding steps of gaussian_transformer, beam_joint_transformer and beam_joint_rnn:
``generate(..., cache_implementation="static", compile_config=...)``.

References: the eager decoding of the same float64 model with its growing (dynamic) cache, generate()'s own and a
step-by-step forward (see tests/test_static_cache.py for the soft types).
"""

import pytest
import torch

from common import (TYPE_MODELS, as_float64, assert_nontrivial, contract_model, fitted, randomize, source_batch,
                    tiny_kwargs)
from hf_hardattn.beam_joint import BeamJointTransformerConfig, BeamJointTransformerForConditionalGeneration
from hf_hardattn.caches import CACHE_FIELD, StaticHardAttnCache
from hf_hardattn.gaussian import GaussianConfig, GaussianForConditionalGeneration
from test_static_cache import MODES, Counter, assert_same, compile_config, generate, graphs_over_shapes, step_logits


class CallCounter(Counter):
    """Counts the graphs compiled and the calls of the compiled graphs (a graph reused for beam search or sampling
    is still seen to run)."""

    calls = 0

    def __call__(self, graph, example_inputs):
        compiled = super().__call__(graph, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run


def with_implementation(model, implementation):
    """``model`` (a Gaussian model) with another ``gaussian_implementation``, the same weights (float64, eval)."""
    config = GaussianConfig.from_dict({**model.config.to_dict(), "gaussian_implementation": implementation})
    other = GaussianForConditionalGeneration(config).double().eval()
    other.load_state_dict(model.state_dict())
    return other


_FITTED = {}


def config_model(name):
    """float64 models of every configuration served: hc-all (Gaussian decoder self- and cross-attention, hc-all's cross
    heads) in each implementation, sh-x (one soft cross head in the last layer), hc-sa (soft cross-attention), and
    beam_joint_transformer with its joint layer first (a later layer runs per candidate) or last (the default), and
    beam_joint_rnn with the paper's Luong LSTM decoder and with the Bahdanau GRU one."""
    if name not in _FITTED:
        if name.startswith("hc_all"):
            model = with_implementation(as_float64(contract_model("gaussian_hc_all")), name.split("_")[-1])
        elif name == "sh_x":
            model = as_float64(contract_model("gaussian_sh_x"))
        elif name == "hc_sa":
            torch.manual_seed(0)
            model = as_float64(fitted(GaussianForConditionalGeneration(GaussianConfig.preset("hc-sa", **tiny_kwargs())),
                                      steps=100))
        elif name.startswith("rnn"):  # the paper's Luong LSTM decoder (multi-head attention), the Bahdanau GRU one
            model = as_float64(contract_model("beam_joint_rnn" + name[3:]))
        elif name == "joint_first":
            model = as_float64(contract_model("beam_joint_transformer"))  # joint_layer=0 of 2
        else:
            torch.manual_seed(0)
            model = as_float64(fitted(BeamJointTransformerForConditionalGeneration(
                BeamJointTransformerConfig(**tiny_kwargs(joint_k=3))), steps=100))
        _FITTED[name] = model
    return _FITTED[name]


GAUSSIAN = ("hc_all_full", "hc_all_conv", "hc_all_index", "sh_x", "hc_sa")
JOINT = ("joint_first", "joint_last", "rnn", "rnn_bahdanau")


@pytest.mark.parametrize("name", GAUSSIAN + JOINT)
def test_static_decoding_equals_eager_dynamic(name):
    """float64, a right-padded batch, greedy, beam 4 (2 returned), sampling with a seed: the static cache, run
    eagerly, gives the dynamic cache's tokens and scores."""
    model = config_model(name)
    for mode in MODES:
        reference = generate(model, mode)
        assert_nontrivial(reference.sequences)
        out = generate(model, mode, cache_implementation="static")
        assert isinstance(getattr(out, CACHE_FIELD), StaticHardAttnCache)
        assert_same(out, reference, f"{name} {mode} static")


@pytest.mark.parametrize("name, backend", [("hc_all_full", "aot_eager"), ("hc_all_index", "eager"),
                                           ("joint_first", "eager"), ("rnn", "eager")])
def test_compiled_decoding_equals_eager_dynamic(name, backend):
    """The same with the steps compiled (fullgraph=True: a graph break raises): the eager dynamic tokens and scores;
    the compiled graphs ran at every step after the first of each call (7 of 8). Gaussian decoder self-attention
    dense (full) and banded (index), Gaussian cross-attention (soft: tests/test_static_cache.py), the beam-joint
    layers per candidate and the RNN setting's; aot_eager (the tracing inductor needs) once."""
    torch._dynamo.reset()
    model = config_model(name)
    counter = CallCounter(backend)
    for mode in MODES:
        reference = generate(model, mode)
        calls = counter.calls
        compiled = generate(model, mode, cache_implementation="static", compile_config=compile_config(counter))
        assert_same(compiled, reference, f"{name} {mode} compiled")
        assert counter.calls - calls == 7, (mode, counter.calls - calls)
    assert counter.compiled == 1  # every row reads its own encoder row (no grouped memory): one graph for all modes
    torch._dynamo.reset()


def left_padded_source():
    ids = torch.tensor([[5, 9, 13, 17, 21, 25, 2], [0, 0, 7, 11, 19, 23, 2]])
    return ids, (ids != 0).long()


@pytest.mark.parametrize("name", GAUSSIAN + JOINT)
@pytest.mark.parametrize("steps", [1, 2])
def test_forward_steps_through_a_static_cache_equal_the_dynamic_cache(name, steps):
    """Decoder inputs fed 1 or 2 positions a call into a static cache of 9 slots give the logits of the same calls
    with the dynamic cache (float64), over a right-padded and (Gaussian cross-attention's shifted centres) a
    left-padded source; the states keep their buffers (written in place) and the cache counts its positions."""
    model = config_model(name)
    decoder_ids = torch.tensor([[1, 6, 9, 12, 15, 3, 4], [1, 8, 10, 4, 5, 7, 9]])
    for ids, mask in (source_batch(), left_padded_source()):
        reference, _ = step_logits(model, None, decoder_ids, steps, input_ids=ids, attention_mask=mask)
        cache = StaticHardAttnCache(model.config.decoder_layers, 9, 2)
        first, _ = step_logits(model, cache, decoder_ids[:, :2], steps, input_ids=ids, attention_mask=mask)
        addresses = {name: state.data_ptr() for name, state in cache.states.items()}
        rest, _ = step_logits(model, cache, decoder_ids[:, 2:], steps, input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(torch.cat([first, rest], 1), reference, rtol=1e-12, atol=1e-12)
        assert int(cache.get_seq_length()) == 7
        assert {name: state.data_ptr() for name, state in cache.states.items()} == addresses
        assert bool(addresses) == name.startswith(("hc_all", "sh_x", "hc_sa", "rnn"))  # Gaussian rows, RNN states


def test_attention_weights_over_the_static_slots():
    """``output_attentions`` over a static cache: Gaussian self-attention's weights over the cache's slots equal the
    dynamic cache's over the positions so far (0 on the later slots), cross-attention's over the source equal."""
    model = config_model("hc_all_full")
    ids, mask = source_batch()
    decoder_ids = torch.tensor([[1, 6, 9, 12, 15], [1, 8, 10, 4, 5]])
    dynamic, static = None, StaticHardAttnCache(model.config.decoder_layers, 8, 2)
    for t in range(decoder_ids.shape[1]):
        outputs = []
        for cache in (dynamic, static):
            out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids[:, t:t + 1], cache=cache,
                        use_cache=True, output_attentions=True)
            outputs.append(out)
        dynamic = getattr(outputs[0], CACHE_FIELD)
        for got, expected in zip(outputs[1].decoder_attentions, outputs[0].decoder_attentions, strict=True):
            assert got.shape[-1] == 8 and not got[..., t + 1:].any()
            torch.testing.assert_close(got[..., :t + 1], expected, rtol=1e-12, atol=1e-12)
        for got, expected in zip(outputs[1].cross_attentions, outputs[0].cross_attentions, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_gaussian_refuses_an_over_long_request_and_other_rows():
    """Gaussian self-attention keeps no key/value slots, so its own step asks the static cache what it holds: the
    static cache's errors, before anything is written."""
    model = config_model("hc_all_full")
    ids, mask = source_batch()
    cache = StaticHardAttnCache(model.config.decoder_layers, 3, 2)
    model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.ones(2, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"holds 3 positions \(`max_cache_len`\) and 2 are filled; a step of 2 more"):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.ones(2, 2, dtype=torch.long), cache=cache)
    assert int(cache.get_seq_length()) == 2
    with pytest.raises(ValueError, match=r"holds 2 rows since its first step, got a step of 1 rows"):
        model(input_ids=ids[:1], attention_mask=mask[:1], decoder_input_ids=torch.ones(1, 1, dtype=torch.long),
              cache=cache)
    with pytest.raises(ValueError, match=r"batch of 2 rows .* larger than the static cache's `max_batch_size`=1"):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.ones(2, 1, dtype=torch.long),
              cache=StaticHardAttnCache(model.config.decoder_layers, 4, 1))


def test_gaussian_compiles_are_bounded_over_batch_sizes_and_source_lengths():
    """``dynamic=True`` (hc-all: Gaussian self- and cross-attention): greedy calls of 2, 3, 5 and 17 sentences and
    sources of 7, 9 and 11 tokens share ONE graph (batch and source length symbolic); beam search (hc-all reads one
    encoder row per decoder row) and sampling take it too. A single sentence gets its own graph (torch specialises
    sizes of 1): at most 2 graphs in all, however many shapes."""
    torch._dynamo.reset()
    counter = CallCounter("eager")
    greedy, beam, total = graphs_over_shapes(randomize(TYPE_MODELS["gaussian"]()).eval(), counter,
                                             beam_extra=[dict(do_sample=True)])
    assert (greedy, beam) == (1, 1) and total <= 2 and counter.calls == 11 * 5
    torch._dynamo.reset()
