"""Static caches, compiled decoding steps and crop for the model types whose decoder carries a per-step state
(``cache.states``): recurrent_transformer (recurrent cross-attention) and hybrid_transformer (RNN decoder); crop of
the dynamic cache and of the static one (each state's history).

References: the eager decoding of the same float64 model with its growing (dynamic) cache, through generate() and
step by step through forward(); for crop, the logits of the same positions decoded without cropping, and plain
greedy generate() for assisted decoding.
"""

import pytest
import torch
from transformers import GenerationConfig

from common import (TYPE_MODELS, as_float64, assert_nontrivial, assert_step_scores_close, contract_model, randomize,
                    source_batch)
from hf_hardattn.caches import CACHE_FIELD, HardAttnCache, StaticHardAttnCache
from hf_hardattn.recurrent import RECURRENT_VARIANTS
from test_static_cache import MODES, Counter, assert_same, compile_config, generate

# generate(max_cache_len=...) is a generation setting of the later transformers 5.x (5.10 refuses it as unused)
needs_max_cache_len = pytest.mark.skipif("max_cache_len" not in GenerationConfig().to_dict(),
                                         reason="this transformers' generate() takes no max_cache_len")



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


@pytest.mark.parametrize("name, backend", [("recurrent_expand_1", "eager"), ("recurrent_coverage", "eager")])
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


# ----------------------------------------------------------------------------------------------------------------
# crop: assisted decoding and prompt lookup for decoders with step state (dynamic cache); the model types with
# keys/values alone: tests/test_cache.py
# ----------------------------------------------------------------------------------------------------------------
CROP_MODELS = ("recurrent_expand_1", "recurrent_coverage", "hybrid_additive", "hybrid_luong_lstm", "beam_joint_rnn",
               "gaussian_hc_all")  # (Gaussian decoder self-attention: its kept value rows are a per-step state)


@pytest.fixture
def crops(monkeypatch):
    """The positions each crop removed, recorded."""
    from hf_hardattn.caches import cropped_length

    removed, crop = [], HardAttnCache.crop

    def recording_crop(cache, n):
        removed.append(cache.seen_tokens - cropped_length(cache.seen_tokens, n))
        return crop(cache, n)

    monkeypatch.setattr(HardAttnCache, "crop", recording_crop)
    return removed


ASSISTED_SOURCE = torch.tensor([[7, 22, 35, 12, 19, 2]])  # (assisted decoding: one sentence; varied tokens for each)


def check_assisted_equals_greedy(model, assistant, removed, **extra):
    """With ``prompt_lookup_num_tokens``, a decoder prompt that repeats its first tokens (the start and the first three
    greedy ones, then the first two again), whose n-grams prompt lookup proposes continuations from."""
    kwargs = dict(input_ids=ASSISTED_SOURCE, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                  output_scores=True, return_dict_in_generate=True)
    plain = model.generate(**kwargs)
    assert_nontrivial(plain.sequences)
    if "prompt_lookup_num_tokens" in extra:
        if "max_cache_len" not in GenerationConfig().to_dict():  # (earlier 5.x: the releases before it)
            pytest.skip("earlier transformers 5.x's prompt lookup runs one token past max_new_tokens after a decoder "
                        "prompt (plain greedy does not): no equal reference there")
        first = plain.sequences[:, :4]
        kwargs["decoder_input_ids"] = torch.cat([first, first[:, 1:3]], 1)
        plain = model.generate(**kwargs)
    removed.clear()
    assisted = model.generate(**kwargs, **extra, **({} if assistant is None else {"assistant_model": assistant}))
    assert sum(removed) > 0  # drafts were rejected and cropped away
    assert torch.equal(assisted.sequences, plain.sequences), (assisted.sequences.tolist(), plain.sequences.tolist())
    for t, (step, expected) in enumerate(zip(assisted.scores, plain.scores, strict=True)):
        assert_step_scores_close(step, expected, f"step {t}")


@pytest.mark.parametrize("name", CROP_MODELS)
def test_prompt_lookup_and_assisted_decoding_equal_greedy_decoding(name, crops):
    """float64 fitted models: ``prompt_lookup_num_tokens=3`` and an assistant of the same type with other (random)
    weights, whose drafts the model partly rejects (the crops land inside a call of several positions, and for the
    assistant across its one-position calls), give the tokens and scores of plain greedy decoding."""
    model = as_float64(contract_model(name))
    check_assisted_equals_greedy(model, None, crops, prompt_lookup_num_tokens=3)
    check_assisted_equals_greedy(model, as_float64(contract_model(name, fit=False)), crops)


@pytest.mark.parametrize("name", ["recurrent_coverage", "hybrid_luong_lstm", "gaussian_hc_all"])
@pytest.mark.parametrize("calls, k", [((1, 3, 2), 1), ((1, 3, 2), 3), ((2, 4), 2), ((1, 1, 1, 1, 1, 1), 4)])
def test_crop_then_the_same_tokens_again_equals_no_crop(name, calls, k):
    """Decoder inputs fed in calls of the given sizes, crop(-k) (inside a call of several positions, to the end of
    one, or across several one-position calls), then the removed k positions fed again one at a time: the logits of
    the decode that never cropped, and the cache's length and states as they were (float64)."""
    model = as_float64(contract_model(name))
    ids, mask = source_batch()
    reference, whole = step_logits(model, None, DECODER_IDS, input_ids=ids, attention_mask=mask)
    cache, start = None, 0
    for size in calls:
        _, cache = step_logits(model, cache, DECODER_IDS[:, start: start + size], size, input_ids=ids,
                               attention_mask=mask)
        start += size
    cache.crop(-k)
    assert cache.get_seq_length() == 6 - k
    again, cache = step_logits(model, cache, DECODER_IDS[:, 6 - k:], input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(again, reference[:, 6 - k:], rtol=1e-12, atol=1e-12)
    assert cache.get_seq_length() == 6 and cache.states.keys() == whole.states.keys()
    for key, state in cache.states.items():
        torch.testing.assert_close(state, whole.states[key], rtol=1e-12, atol=1e-12)


def test_crop_after_a_batch_selection():
    """batch_select_indices keeps the chosen rows of every kept state: crop(-2) after it, then the same tokens again,
    gives the selected row's logits without cropping (float64)."""
    model = as_float64(contract_model("hybrid_luong_lstm"))
    ids, mask = source_batch()
    reference, _ = step_logits(model, None, DECODER_IDS, input_ids=ids, attention_mask=mask)
    _, cache = step_logits(model, None, DECODER_IDS[:, :4], 2, input_ids=ids, attention_mask=mask)
    cache.batch_select_indices(torch.tensor([1]))
    cache.crop(-3)
    again, _ = step_logits(model, cache, DECODER_IDS[1:, 1:], input_ids=ids[1:], attention_mask=mask[1:])
    torch.testing.assert_close(again, reference[1:, 1:], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# crop of a static cache with states: each state's history, preallocated and written in place (caches.py)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["recurrent_coverage", "recurrent_expand_1", "hybrid_luong_lstm", "gaussian_hc_all"])
@pytest.mark.parametrize("calls, k", [((1, 3, 2), 1), ((1, 3, 2), 3), ((2, 4), 2), ((1, 1, 1, 1, 1, 1), 4),
                                      ((2, 4), 6)])
def test_a_static_cache_crops_then_the_same_tokens_again_equal_no_crop(name, calls, k):
    """A static cache of 6 slots, decoder inputs fed in calls of the given sizes, crop(-k) (inside a call, to the end
    of one, across one-position calls, to position 0), the removed positions fed again one at a time: the logits of
    the dynamic decode that never cropped, its states at the end, and every buffer at its address (float64)."""
    model = as_float64(contract_model(name))
    ids, mask = source_batch()
    reference, whole = step_logits(model, None, DECODER_IDS, input_ids=ids, attention_mask=mask)
    cache, start = StaticHardAttnCache(model.config.decoder_layers, 6, 2), 0
    for size in calls:
        _, cache = step_logits(model, cache, DECODER_IDS[:, start: start + size], size, input_ids=ids,
                               attention_mask=mask)
        start += size
    addresses = {name: state.data_ptr() for name, state in cache.states.items()}
    assert cache.is_croppable
    cache.crop(-k)
    assert int(cache.get_seq_length()) == 6 - k and bool(cache.states) == (k < 6)
    again, cache = step_logits(model, cache, DECODER_IDS[:, 6 - k:], input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(again, reference[:, 6 - k:], rtol=1e-12, atol=1e-12)
    assert int(cache.get_seq_length()) == 6 and cache.states.keys() == whole.states.keys()
    for key, state in cache.states.items():
        torch.testing.assert_close(state, whole.states[key], rtol=1e-12, atol=1e-12)
    if k < 6:  # (a crop to position 0 drops the states: the next step starts from the initial ones)
        assert {name: state.data_ptr() for name, state in cache.states.items()} == addresses


@pytest.mark.parametrize("static", [False, True])
def test_crops_restore_states_in_the_rows_order_after_beam_reorders(static):
    """Three decoder rows of one source, each sequence with its own first token (so no two rows share a state): 3
    positions (one call), a beam reorder ``[2, 0, 1]``, 1 position, a reorder ``[1, 1, 0]`` (a row copied), 1 position;
    crop(-2) to position 3: the restored states follow both reorders (row i holds sequence [0, 0, 2][i]), so feeding
    each row's tokens again gives the logits of those sequences decoded without cropping; then crop(-4) to position 1
    (inside the first call, before both reorders), a reorder ``[2, 1, 1]`` at the end and crop(-3): the same (the
    dynamic cache and the static one; float64)."""
    model = as_float64(contract_model("recurrent_coverage"))
    ids, mask = source_batch()
    ids, mask = ids[:1].expand(3, -1), mask[:1].expand(3, -1)
    sequences = torch.tensor([[1, 6, 9, 12, 15, 3], [5, 8, 10, 4, 5, 7], [9, 9, 4, 12, 6, 8]])
    reference, _ = step_logits(model, None, sequences, input_ids=ids, attention_mask=mask)
    cache = StaticHardAttnCache(model.config.decoder_layers, 6, 3) if static else None
    _, cache = step_logits(model, cache, sequences[:, :3], 3, input_ids=ids, attention_mask=mask)
    rows = torch.arange(3)
    for position, beam_idx in ((3, torch.tensor([2, 0, 1])), (4, torch.tensor([1, 1, 0]))):
        cache.reorder_cache(beam_idx)
        rows = rows[beam_idx]
        _, cache = step_logits(model, cache, sequences[rows, position: position + 1], input_ids=ids,
                               attention_mask=mask)
    assert rows.tolist() == [0, 0, 2]
    for k, stop in ((2, 5), (4, 6)):
        cache.crop(-k)
        start = int(cache.get_seq_length())
        again, cache = step_logits(model, cache, sequences[rows, start:stop], input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(again, reference[rows, start:stop], rtol=1e-12, atol=1e-12, msg=f"crop(-{k})")
    cache.reorder_cache(torch.tensor([2, 1, 1]))
    rows = rows[torch.tensor([2, 1, 1])]
    cache.crop(-3)
    again, _ = step_logits(model, cache, sequences[rows, 3:], input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(again, reference[rows, 3:], rtol=1e-12, atol=1e-12)


@pytest.fixture
def static_crops(monkeypatch):
    """The positions each crop of a static cache removed, recorded."""
    removed, crop = [], StaticHardAttnCache.crop

    def recording_crop(cache, n):
        removed.append(min(-n, int(cache.position)))
        return crop(cache, n)

    monkeypatch.setattr(StaticHardAttnCache, "crop", recording_crop)
    return removed


@pytest.mark.parametrize("name", ["recurrent_coverage", "hybrid_additive", "hybrid_luong_lstm"])
def test_prompt_lookup_and_assisted_decoding_over_a_static_cache_equal_greedy_decoding(name, static_crops):
    """``cache_implementation="static"`` (generate() leaves room for a draft past the last position): prompt lookup
    and an assistant with other weights, whose rejected drafts crop the static cache, give the tokens and scores of
    plain greedy decoding (float64)."""
    model = as_float64(contract_model(name))
    model._static_cache, model._previous_max_cache_length = None, 0  # (the room is the call's own)
    static = dict(cache_implementation="static")
    check_assisted_equals_greedy(model, None, static_crops, prompt_lookup_num_tokens=3, **static)
    check_assisted_equals_greedy(model, as_float64(contract_model(name, fit=False)), static_crops, **static)


@needs_max_cache_len
def test_a_static_cache_written_by_compiled_steps_crops(fresh_dynamo):
    """generate() with compiled steps (fullgraph, backend "eager") writes the states' histories inside the graph: its
    returned static cache, cropped by 2 positions, continues (generate() again from the kept tokens) with the tokens
    and scores of one dynamic call (float64)."""
    model = as_float64(contract_model("hybrid_luong_lstm"))
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True)
    whole = model.generate(**kwargs, max_new_tokens=8, min_new_tokens=8)
    counter = Counter("eager")
    first = model.generate(**kwargs, max_new_tokens=6, min_new_tokens=6, cache_implementation="static",
                           max_cache_len=8, compile_config=compile_config(counter))
    assert counter.compiled == 1
    cache = getattr(first, CACHE_FIELD)
    assert int(cache.get_seq_length()) == 6
    cache.crop(-2)
    kept = first.sequences[:, :5]  # the start token and 4 generated: 4 positions cached, the last one fed
    second = model.generate(**kwargs, max_new_tokens=4, min_new_tokens=4, decoder_input_ids=kept,
                            decoder_attention_mask=torch.ones_like(kept), **{CACHE_FIELD: cache})
    assert_nontrivial(whole.sequences)
    assert torch.equal(second.sequences, whole.sequences)
    for t, (got, expected) in enumerate(zip(second.scores, whole.scores[4:], strict=True)):
        assert_step_scores_close(got, expected, f"step {4 + t}")


def test_a_static_crop_inside_a_call_written_as_a_whole_is_refused():
    """A state written once for a call of several positions (no ``per_position``) is known at the call's end only:
    a crop inside that call is refused naming the state and what is allowed, one to its end or start restores the
    state (in place); ``per_position`` of another length than the call is refused as by the dynamic cache."""
    cache = StaticHardAttnCache(1, 6, 2)
    written = [torch.full((2, 3), float(t)) for t in range(4)]
    cache.set_state("s", written[0])
    cache.advance(1)
    cache.set_state("s", written[1])  # a call of 3 positions, the state of its end only
    cache.advance(3)
    buffer = cache.states["s"]
    with pytest.raises(NotImplementedError, match=r"`crop` to 3 positions \(from 4.*state\(s\) \['s'\] after "
                                                  r"position 3.*`cache.set_state\(name, value, per_position=...\)`"):
        cache.crop(-1)
    assert int(cache.get_seq_length()) == 4 and torch.equal(cache.states["s"], written[1])
    cache.set_state("s", written[2])
    cache.advance(1)
    cache.crop(-1)
    assert int(cache.get_seq_length()) == 4 and torch.equal(cache.states["s"], written[1])
    cache.crop(-3)
    assert int(cache.get_seq_length()) == 1 and torch.equal(cache.states["s"], written[0])
    assert cache.states["s"] is buffer
    cache.set_state("s", written[3], [written[3]] * 2)
    with pytest.raises(ValueError, match=r"`per_position` of state\(s\) \{'s': 2\} .* allowed: 3"):
        cache.advance(3)


def test_crop_by_hand_restores_the_kept_states_and_refuses_one_written_only_for_a_whole_call():
    """HardAttnCache alone: states written one position a call come back as written (the same tensors); a state
    written once for a call of several positions without ``per_position`` is known at the call's ends only, so a crop
    inside that call is refused naming it, and one to its start restores the state from before it."""
    cache = HardAttnCache()
    written = [torch.full((2, 3), float(t)) for t in range(3)]
    for value in written:
        cache.set_state("s", value)
        cache.advance(1)
    cache.crop(-2)
    assert cache.get_seq_length() == 1 and cache.states["s"] is written[0]
    cache.set_state("s", torch.zeros(2, 3))  # a call of 3 positions, the state of its end only
    cache.advance(3)
    with pytest.raises(NotImplementedError, match=r"`crop` to 3 positions \(from 4.*state\(s\) \['s'\] after "
                                                  r"position 3.*`cache.set_state\(name, value, per_position=...\)`"):
        cache.crop(-1)
    assert cache.get_seq_length() == 4
    cache.crop(-3)
    assert cache.get_seq_length() == 1 and cache.states["s"] is written[0]
    cache.crop(-1)
    assert cache.get_seq_length() == 0 and not cache.states


def test_a_hybrid_call_the_static_cache_cannot_hold_is_refused_before_it_writes():
    """The hybrid keeps no key/value slots, so its decoder asks the static cache first: more positions than it holds,
    a batch larger than it, or other rows than its first step's are refused as for the Transformer decoders, and the
    cache is left as it was (position and states)."""
    model = as_float64(contract_model("hybrid_additive"))
    ids, mask = source_batch()
    with pytest.raises(ValueError, match=r"batch of 2 rows .* larger than the static cache's `max_batch_size`=1"):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=DECODER_IDS[:, :1],
              cache=StaticHardAttnCache(model.config.decoder_layers, 4, 1))
    cache = StaticHardAttnCache(model.config.decoder_layers, 3, 2)
    model(input_ids=ids, attention_mask=mask, decoder_input_ids=DECODER_IDS[:, :2], cache=cache)
    states = {name: state.clone() for name, state in cache.states.items()}
    with pytest.raises(ValueError, match=r"holds 3 positions \(`max_cache_len`\) and 2 are filled; a step of 2 more"):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=DECODER_IDS[:, 2:4], cache=cache)
    with pytest.raises(ValueError, match=r"holds 2 rows since its first step, got a step of 1 rows"):
        model(input_ids=ids[:1], attention_mask=mask[:1], decoder_input_ids=DECODER_IDS[:1, 2:3], cache=cache)
    assert int(cache.get_seq_length()) == 2
    assert all(torch.equal(state, states[name]) for name, state in cache.states.items())


@needs_max_cache_len
@pytest.mark.parametrize("name", ["recurrent_coverage", "hybrid_luong_lstm"])
def test_generate_continues_from_a_returned_static_cache(name):
    """4 tokens with a static cache of 8 slots, then 4 more from the returned cache (the sequence so far as decoder
    input, its mask covering it): the tokens and scores of 8 tokens in one dynamic call (float64)."""
    model = as_float64(contract_model(name))
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True)
    whole = model.generate(**kwargs, max_new_tokens=8, min_new_tokens=8)
    first = model.generate(**kwargs, max_new_tokens=4, min_new_tokens=4, cache_implementation="static",
                           max_cache_len=8)
    cache = getattr(first, CACHE_FIELD)
    assert isinstance(cache, StaticHardAttnCache) and int(cache.get_seq_length()) == 4
    second = model.generate(**kwargs, max_new_tokens=4, min_new_tokens=4, decoder_input_ids=first.sequences,
                            decoder_attention_mask=torch.ones_like(first.sequences), **{CACHE_FIELD: cache})
    assert_nontrivial(whole.sequences)
    assert torch.equal(second.sequences, whole.sequences)
    for t, (got, expected) in enumerate(zip(second.scores, whole.scores[4:], strict=True)):
        assert_step_scores_close(got, expected, f"step {4 + t}")
    assert int(cache.get_seq_length()) == 8


def test_per_position_states_of_another_length_than_the_call_are_refused():
    cache = HardAttnCache()
    cache.set_state("s", torch.zeros(2, 3), [torch.zeros(2, 3)] * 2)
    with pytest.raises(ValueError, match=r"`per_position` of state\(s\) \{'s': 2\} .* allowed: 3"):
        cache.advance(3)
