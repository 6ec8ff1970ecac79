"""Static caches, compiled decoding steps and crop for the model types whose decoder carries a per-step state
(``cache.states``): recurrent_transformer (recurrent cross-attention) and hybrid_transformer (RNN decoder).

References: the eager decoding of the same float64 model with its growing (dynamic) cache, through generate() and
step by step through forward(); for crop, the logits of the same positions decoded without cropping, and plain
greedy generate() for assisted decoding.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import CompileConfig

from common import (TYPE_MODELS, as_float64, assert_nontrivial, assert_step_scores_close, contract_model, randomize,
                    source_batch)
from hf_hardattn.caches import CACHE_FIELD, HardAttnCache, StaticHardAttnCache
from hf_hardattn.recurrent import RECURRENT_VARIANTS

MODES = {
    "greedy": dict(do_sample=False),
    "beam": dict(num_beams=4, num_return_sequences=2, do_sample=False),
    "sample": dict(do_sample=True, top_k=0),
}


class Counter(CompileCounterWithBackend):
    """Counts the graphs compiled; kept itself when generate() deep-copies its compile config."""

    def __deepcopy__(self, memo):
        return self

    @property
    def compiled(self) -> int:
        """Graphs that compute something (dynamo may hand the backend an empty graph first)."""
        return sum(any(node.op == "call_function" for node in graph.graph.nodes) for graph in self.graphs)


def compile_config(counter, dynamic=True):
    config = CompileConfig(fullgraph=True, dynamic=dynamic, backend=counter, mode=None)
    config._compile_all_devices = True  # (generate() compiles on a CPU only when asked)
    return config


def generate(model, mode, seed=1234, **kwargs):
    ids, mask = kwargs.pop("source", source_batch())  # the second row right-padded
    torch.manual_seed(seed)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                          output_scores=True, return_dict_in_generate=True, **MODES[mode], **kwargs)


def assert_same(out, reference, what):
    assert torch.equal(out.sequences, reference.sequences), f"{what}: {out.sequences.tolist()} != " \
                                                            f"{reference.sequences.tolist()}"
    for step, (got, expected) in enumerate(zip(out.scores, reference.scores, strict=True)):
        assert_step_scores_close(got, expected, f"{what}, step {step}")


@pytest.fixture
def fresh_dynamo():
    """Compile tests start and end with dynamo's caches emptied."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def check_static_and_compiled(model, backend, name, graphs):
    """generate() with a static cache, eagerly and with its steps compiled (fullgraph=True), gives the dynamic
    cache's tokens and scores in every mode; the compiled runs ran compiled steps: ``graphs`` in all (one for greedy
    and sampling, one more for beam search where its memory is grouped)."""
    counter = Counter(backend)
    for mode in MODES:
        reference = generate(model, mode)
        assert_nontrivial(reference.sequences)
        assert_same(generate(model, mode, cache_implementation="static"), reference, f"{name} {mode} static")
        compiled = generate(model, mode, cache_implementation="static", compile_config=compile_config(counter))
        assert_same(compiled, reference, f"{name} {mode} compiled")
    assert counter.compiled == graphs, counter.compiled


def step_logits(model, cache, decoder_ids, steps=1, **inputs):
    logits = []
    for t in range(0, decoder_ids.shape[1], steps):
        out = model(**inputs, decoder_input_ids=decoder_ids[:, t: t + steps], cache=cache, use_cache=True)
        cache = getattr(out, CACHE_FIELD)
        logits.append(out.logits)
    return torch.cat(logits, 1), cache


DECODER_IDS = torch.tensor([[1, 6, 9, 12, 15, 3], [1, 8, 10, 4, 5, 7]])


# ----------------------------------------------------------------------------------------------------------------
# recurrent_transformer
# ----------------------------------------------------------------------------------------------------------------
def recurrent_model(variant):
    """A float64 recurrent model of ``variant`` with random weights (std 0.3: the expand variants' context stays far
    from the bound of check_bounded over these few steps)."""
    torch.manual_seed(0)
    return as_float64(randomize(TYPE_MODELS["recurrent"](recurrent_variant=variant), std=0.3))


@pytest.mark.parametrize("name, backend", [("recurrent_expand_1", "aot_eager"), ("recurrent_coverage", "eager")])
def test_recurrent_static_and_compiled_decoding_equal_eager_dynamic(name, backend, fresh_dynamo):
    """float64 fitted models (expand_1 in every layer; coverage in the second layer after a soft one), a right-padded
    batch: greedy, beam 4 (2 returned), sampling with a seed, static eager and compiled = dynamic. One graph: each beam
    carries its own state, so the memory is expanded to a row per beam, the shapes of greedy decoding."""
    check_static_and_compiled(as_float64(contract_model(name)), backend, name, graphs=1)


@pytest.mark.parametrize("variant", RECURRENT_VARIANTS)
def test_every_recurrent_variant_steps_through_a_static_cache_as_through_the_dynamic_one(variant):
    """Each variant's state, written in place in the static cache, gives the dynamic cache's logits (1 position a call,
    then 2: a call of several positions), and its buffers keep their address (float64)."""
    model = recurrent_model(variant)
    ids, mask = source_batch()
    reference, _ = step_logits(model, None, DECODER_IDS, input_ids=ids, attention_mask=mask)
    cache = StaticHardAttnCache(model.config.decoder_layers, 8, 2)
    first, _ = step_logits(model, cache, DECODER_IDS[:, :2], input_ids=ids, attention_mask=mask)
    addresses = {name: state.data_ptr() for name, state in cache.states.items()}
    rest, _ = step_logits(model, cache, DECODER_IDS[:, 2:], 2, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(torch.cat([first, rest], 1), reference, rtol=1e-12, atol=1e-12)
    assert addresses and {name: state.data_ptr() for name, state in cache.states.items()} == addresses
    assert int(cache.get_seq_length()) == 6


@pytest.mark.parametrize("variant", sorted(set(RECURRENT_VARIANTS) - {"expand_1", "coverage"}))
def test_every_recurrent_variant_compiles_to_one_graph(variant, fresh_dynamo):
    """The decoding step of each variant (those generate() does not compile above) traces with fullgraph=True (a graph
    break raises) and computes the eager step's logits (float64; dynamo alone, backend "eager")."""
    model = recurrent_model(variant)
    ids, mask = source_batch()
    reference, _ = step_logits(model, None, DECODER_IDS, input_ids=ids, attention_mask=mask)
    cache = StaticHardAttnCache(model.config.decoder_layers, 8, 2)
    first, cache = step_logits(model, cache, DECODER_IDS[:, :1], input_ids=ids, attention_mask=mask)
    encoder_outputs = model.get_encoder()(ids, mask, return_dict=True)
    counter = Counter("eager")
    forward = torch.compile(model.forward, fullgraph=True, dynamic=True, backend=counter)
    with torch.no_grad():  # (as generate(): a state that requires grad is another graph)
        rest = [forward(encoder_outputs=encoder_outputs, attention_mask=mask, cache=cache, use_cache=True,
                        decoder_input_ids=DECODER_IDS[:, t: t + 1].clone()).logits
                for t in range(1, DECODER_IDS.shape[1])]
    torch.testing.assert_close(torch.cat([first, *rest], 1), reference, rtol=1e-12, atol=1e-12)
    assert counter.compiled == 1


# ----------------------------------------------------------------------------------------------------------------
# hybrid_transformer
# ----------------------------------------------------------------------------------------------------------------
HYBRIDS = {"hybrid_additive": "aot_eager",  # GRU, bahdanau, additive attention, one layer
           "hybrid_multihead": "eager",  # GRU, bahdanau, multi-head attention, two layers
           "hybrid_luong_lstm": "eager"}  # LSTM, luong (input feeding: two more states), dot attention, two layers


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_hybrid_static_and_compiled_decoding_equal_eager_dynamic(name, fresh_dynamo):
    """float64 fitted hybrids of each attention function, a right-padded batch: greedy, beam 4 (2 returned), sampling
    with a seed, static eager and compiled = dynamic. Two graphs: beam search reads a grouped memory (one encoder row
    per sentence for its beams)."""
    check_static_and_compiled(as_float64(contract_model(name)), HYBRIDS[name], name, graphs=2)


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_hybrid_steps_through_a_static_cache_as_through_the_dynamic_one(name):
    """The RNN states written in place (their buffers keep their address) give the dynamic cache's logits, one
    position a call and then two (float64)."""
    model = as_float64(contract_model(name))
    ids, mask = source_batch()
    reference, _ = step_logits(model, None, DECODER_IDS, input_ids=ids, attention_mask=mask)
    cache = StaticHardAttnCache(model.config.decoder_layers, 8, 2)
    first, _ = step_logits(model, cache, DECODER_IDS[:, :2], input_ids=ids, attention_mask=mask)
    addresses = {name: state.data_ptr() for name, state in cache.states.items()}
    rest, _ = step_logits(model, cache, DECODER_IDS[:, 2:], 2, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(torch.cat([first, rest], 1), reference, rtol=1e-12, atol=1e-12)
    assert len(addresses) == len(model.model.decoder.state_names)
    assert {name: state.data_ptr() for name, state in cache.states.items()} == addresses
    assert int(cache.get_seq_length()) == 6


def test_hybrid_compiles_are_bounded_over_batch_sizes_and_source_lengths(fresh_dynamo):
    """``dynamic=True``: greedy calls of 2, 3, 5 and 17 sentences and sources of 7, 9 and 11 tokens share ONE graph of
    the hybrid's decoding step (batch and source length symbolic); beam search (a grouped memory) adds one; a single
    sentence gets its own (torch specialises sizes of 1): at most 4 graphs in all, however many shapes."""
    model = randomize(TYPE_MODELS["hybrid"]()).eval()
    counter = Counter("eager")
    config = compile_config(counter)
    generator = torch.Generator().manual_seed(0)

    def run(batch, length, **kwargs):
        ids = torch.randint(3, 40, (batch, length), generator=generator)
        model.generate(input_ids=ids, max_new_tokens=6, min_new_tokens=6, cache_implementation="static",
                       compile_config=config, **kwargs)

    for batch, length in ((2, 7), (3, 7), (3, 9), (5, 11), (17, 9)):
        run(batch, length)
    assert counter.compiled == 1
    for batch, length in ((2, 7), (3, 9)):
        run(batch, length, num_beams=4)
    assert counter.compiled == 2
    run(1, 5)
    run(1, 8, num_beams=4)
    run(4, 6)
    assert counter.compiled <= 4
