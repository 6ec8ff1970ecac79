"""Static caches and compiled decoding steps: ``generate(..., cache_implementation="static", compile_config=...)``.

References: the eager decoding of the same float64 model with its growing (dynamic) cache, generate()'s own and a
step-by-step forward; hand-built expectations for the cache's in-place writes, beam reorder and crop.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import CompileConfig

from common import (TYPE_MODELS, as_float64, assert_nontrivial, assert_step_scores_close, contract_model, randomize,
                    source_batch)
from hf_hardattn.caches import CACHE_FIELD, StaticHardAttnCache
from hf_hardattn.modeling_hardattn import REUSES_STATIC_CACHE

# the model types whose decoder decodes with a static cache (common.contract_model's fitted models: varied tokens;
# soft_prenorm: pre-norm with learned positions)
STATIC_TYPES = ("soft", "soft_prenorm", "hard_retrieval")
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
        """Graphs that compute something (dynamo may hand the backend an empty graph before restarting a frame's
        analysis with what it learnt about its shapes: not a graph that runs)."""
        return sum(any(node.op == "call_function" for node in graph.graph.nodes) for graph in self.graphs)


def compile_config(counter, dynamic=True):
    config = CompileConfig(fullgraph=True, dynamic=dynamic, backend=counter, mode=None)
    config._compile_all_devices = True  # (generate() compiles on a CPU only when asked)
    return config


def model_of(name):
    return as_float64(contract_model(name))


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


@pytest.mark.parametrize("name, backend", [("soft", "aot_eager"), ("soft_prenorm", "eager"),
                                           ("hard_retrieval", "eager")])
def test_static_and_compiled_decoding_equal_eager_dynamic(name, backend):
    """float64, a padded batch, greedy, beam 4 (2 returned) and sampling with a seed: the static cache run eagerly,
    and its steps compiled (fullgraph=True: a graph break raises), give the dynamic cache's tokens and scores. The
    compiled runs really ran compiled steps: one graph for greedy and sampling, one more for beam search (its grouped
    memory). Backend aot_eager (dynamo + AOT autograd, the tracing inductor needs too) once, dynamo alone ("eager")
    for the other models: the graph capture is what differs between them, at a third of the compile time."""
    torch._dynamo.reset()
    model = model_of(name)
    counter = Counter(backend)
    for mode in MODES:
        reference = generate(model, mode)
        assert_nontrivial(reference.sequences)
        assert_same(generate(model, mode, cache_implementation="static"), reference, f"{name} {mode} static")
        compiled = generate(model, mode, cache_implementation="static", compile_config=compile_config(counter))
        assert_same(compiled, reference, f"{name} {mode} compiled")
        assert counter.compiled == (1 if mode == "greedy" else 2), (mode, counter.compiled)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", STATIC_TYPES)
def test_generate_builds_a_static_cache_of_the_call(name):
    """generate() decodes with a StaticHardAttnCache of the call's rows (sentences x beams) and max_length - 1 slots
    (or more: the longest of the model's earlier static calls), and returns it; transformers sees it as compileable,
    with no linear (state-space) layer."""
    model = model_of(name)
    out = generate(model, "beam", cache_implementation="static")
    cache = getattr(out, CACHE_FIELD)
    assert isinstance(cache, StaticHardAttnCache)
    assert cache.is_compileable and not any(cache.is_linear)
    assert cache.max_cache_len == out.sequences.shape[1] - 1 == 8 and cache.max_batch_size == 2 * 4
    assert int(cache.get_seq_length()) == 8
    assert all(layer.keys.shape == (8, 4, 8, 8) for layer in cache.self_attention_cache.layers)
    shorter = model.generate(**dict(zip(("input_ids", "attention_mask"), source_batch())), max_new_tokens=4,
                             cache_implementation="static", return_dict_in_generate=True)
    assert getattr(shorter, CACHE_FIELD).max_cache_len == 8  # the longest so far: a compiled step keeps its shapes


def test_a_second_call_of_the_same_shapes_reuses_the_static_cache_and_gives_the_same_answers():
    """generate() keeps its static cache on the model and reuses it (reset in place: every buffer keeps its address,
    what inductor's freezing and CUDA graphs need) for a later call of the same length, rows, dtype and device; the
    reused cache gives the answers of a fresh one. Other rows (greedy after beam search) get a new cache."""
    model = model_of("hard_retrieval")
    first = generate(model, "beam", cache_implementation="static")
    cache = getattr(first, CACHE_FIELD)
    addresses = [layer.keys.data_ptr() for layer in cache.self_attention_cache.layers]
    second = generate(model, "beam", cache_implementation="static")
    assert (getattr(second, CACHE_FIELD) is cache) == REUSES_STATIC_CACHE  # (transformers >= 5.24)
    if REUSES_STATIC_CACHE:
        assert [layer.keys.data_ptr() for layer in cache.self_attention_cache.layers] == addresses
    assert_same(second, first, "reused cache")
    assert_same(second, generate(model, "beam"), "reused cache against the dynamic cache")
    greedy = generate(model, "greedy", cache_implementation="static")
    assert getattr(greedy, CACHE_FIELD) is not cache and getattr(greedy, CACHE_FIELD).max_batch_size == 2
    assert_same(greedy, generate(model, "greedy"), "greedy after beam search")


def graphs_over_shapes(model, counter, beam_extra=()) -> tuple:
    """Graphs compiled (``counter.compiled``) after static, compiled (``dynamic=True``) greedy calls of 2, 3, 5 and 17
    sentences over sources of 7, 9 and 11 tokens (6 steps each); after beam search (4 beams) at two of those shapes and
    the calls of ``beam_extra`` (generate() keywords); after a single sentence (greedy and beam) and one more batch."""
    config = compile_config(counter)
    generator = torch.Generator().manual_seed(0)

    def run(batch, length, **kwargs):
        ids = torch.randint(3, 40, (batch, length), generator=generator)
        model.generate(input_ids=ids, max_new_tokens=6, min_new_tokens=6, cache_implementation="static",
                       compile_config=config, **kwargs)

    counts = []
    for batch, length in ((2, 7), (3, 7), (3, 9), (5, 11), (17, 9)):
        run(batch, length)
    counts.append(counter.compiled)
    for batch, length in ((2, 7), (3, 9)):
        run(batch, length, num_beams=4)
    for kwargs in beam_extra:
        run(3, 8, **kwargs)
    counts.append(counter.compiled)
    run(1, 5)
    run(1, 8, num_beams=4)
    run(4, 6)
    counts.append(counter.compiled)
    return tuple(counts)


@pytest.mark.parametrize("name", ["soft", "hybrid"])
def test_compiles_are_bounded_over_batch_sizes_and_source_lengths(name):
    """``dynamic=True``: the greedy calls of every batch size and source length share ONE graph (batch and source
    length symbolic; the decoding step takes one path for every batch size); beam search (a grouped memory: g rows per
    sentence) adds one for every batch size and source length. A single sentence gets its own graph (torch specialises
    sizes of 1): at most 4 graphs in all, however many shapes. The soft skeleton and the hybrid's GRU decoder."""
    torch._dynamo.reset()
    greedy, beam, total = graphs_over_shapes(randomize(TYPE_MODELS[name]()).eval(), Counter("eager"))
    assert (greedy, beam) == (1, 2) and total <= 4
    torch._dynamo.reset()


def test_each_model_keeps_its_compiled_graphs_to_itself():
    """torch keeps compiled graphs per code object, at most ``recompile_limit`` of them (a hard error with
    fullgraph=True): models of different types compiled in one process would share ``forward``'s (or transformers'
    ``Module.__call__``'s) list. Each model compiles its own copy of the code (transformers' greedy path included,
    ``get_compiled_call``), so with the limit at 1 graph, three models of three types each compile theirs and decode
    as before; compiling the one shared ``forward`` of two of them fails at the second."""
    torch._dynamo.reset()
    names = ("soft", "hard_retrieval", "gaussian")
    models = [randomize(TYPE_MODELS[name]()).eval() for name in names]
    counter = Counter("eager")
    config = compile_config(counter)
    ids, mask = source_batch()
    with torch._dynamo.config.patch(recompile_limit=1):
        for model in models:
            assert model.get_compiled_call(config) is model.compiled_forward(config)
            reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                                 cache_implementation="static", compile_config=config)
            assert torch.equal(out, reference)
        assert counter.compiled == len(names)
        shared = torch.compile(type(models[0]).forward, backend="eager", fullgraph=True)
        cache_of = {model: StaticHardAttnCache(model.config.decoder_layers, 4, 2) for model in models[1:]}
        step = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.ones(2, 1, dtype=torch.long))
        shared(models[1], **step, cache=cache_of[models[1]])
        with pytest.raises(Exception, match="fullgraph"):  # (torch: "Hard failure due to fullgraph=True")
            shared(models[2], **step, cache=cache_of[models[2]])
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------------------
# The cache itself, step by step through forward()
# ----------------------------------------------------------------------------------------------------------------
def step_logits(model, cache, decoder_ids, steps, **inputs):
    logits = []
    for t in range(0, decoder_ids.shape[1], steps):
        out = model(**inputs, decoder_input_ids=decoder_ids[:, t: t + steps], cache=cache, use_cache=True)
        cache = getattr(out, CACHE_FIELD)
        logits.append(out.logits)
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize("name", STATIC_TYPES)
@pytest.mark.parametrize("steps", [1, 2])
def test_forward_steps_through_a_static_cache_equal_the_dynamic_cache(name, steps):
    """Decoder inputs fed 1 or 2 positions a call into a static cache of 9 slots (more than written: unwritten slots
    hold zeros, which the mask must hide) give the logits of the same calls with the dynamic cache (float64); the
    cache counts its positions and writes keys in place (the buffers keep their address)."""
    model = model_of(name)
    ids, mask = source_batch()
    decoder_ids = torch.tensor([[1, 6, 9, 12, 15, 3], [1, 8, 10, 4, 5, 7]])
    reference, _ = step_logits(model, None, decoder_ids, steps, input_ids=ids, attention_mask=mask)
    cache = StaticHardAttnCache(model.config.decoder_layers, 9, 2)
    first, _ = step_logits(model, cache, decoder_ids[:, :2], steps, input_ids=ids, attention_mask=mask)
    address = cache.self_attention_cache.layers[0].keys.data_ptr()
    rest, _ = step_logits(model, cache, decoder_ids[:, 2:], steps, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(torch.cat([first, rest], 1), reference, rtol=1e-12, atol=1e-12)
    assert int(cache.get_seq_length()) == 6 and cache.self_attention_cache.layers[0].keys.data_ptr() == address


def test_decoder_padding_mask_over_static_slots():
    """A right-padded decoder input with its ``decoder_attention_mask`` in one call: the padding's keys are hidden as
    with the dynamic cache (logits of the real positions equal, float64)."""
    model = model_of("soft")
    ids, mask = source_batch()
    decoder_ids = torch.tensor([[1, 6, 9, 12], [1, 8, 0, 0]])
    decoder_mask = (decoder_ids != 0).long()
    decoder_mask[0] = 1
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                  decoder_attention_mask=decoder_mask, use_cache=True)
    reference = model(**inputs).logits
    static = model(**inputs, cache=StaticHardAttnCache(model.config.decoder_layers, 6, 2)).logits
    torch.testing.assert_close(static, reference, rtol=1e-12, atol=1e-12)


def test_beam_reorder_and_crop_in_place():
    """reorder_cache moves every row's keys/values (in place: same buffers); crop(-n) takes back the last n positions
    (the next write lands there); reset empties it."""
    cache = StaticHardAttnCache(1, 4, 3)
    k = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 2, 1)  # row r holds r at positions 0, 1
    cache.self_attention_cache.update(k, k + 10, 0)
    cache.advance(2)
    layer = cache.self_attention_cache.layers[0]
    address = layer.keys.data_ptr()
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert layer.keys[:, 0, :2, 0].tolist() == [[2, 2], [2, 2], [0, 0]] and layer.keys.data_ptr() == address
    assert layer.values[:, 0, :2, 0].tolist() == [[12, 12], [12, 12], [10, 10]]
    cache.crop(-1)
    assert int(cache.get_seq_length()) == 1 == int(layer.cumulative_length)
    cache.self_attention_cache.update(k[:, :, :1] + 5, k[:, :, :1], 0)
    assert layer.keys[:, 0, :3, 0].tolist() == [[2, 5, 0], [2, 6, 0], [0, 7, 0]]
    cache.reset()
    assert int(cache.get_seq_length()) == 0 and not layer.keys.any()


# ----------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------
def test_an_over_long_request_is_refused():
    """Positions beyond the static length: refused before anything is written, naming max_cache_len."""
    model = model_of("soft")
    ids, mask = source_batch()
    cache = StaticHardAttnCache(model.config.decoder_layers, 3, 2)
    model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.ones(2, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"holds 3 positions \(`max_cache_len`\) and 2 are filled; a step of 2 more"):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.ones(2, 2, dtype=torch.long), cache=cache)
    assert int(cache.get_seq_length()) == 2


def test_a_batch_larger_than_the_cache_is_refused():
    model = model_of("soft")
    ids, mask = source_batch()
    with pytest.raises(ValueError, match=r"batch of 2 rows .* larger than the static cache's `max_batch_size`=1"):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.ones(2, 1, dtype=torch.long),
              cache=StaticHardAttnCache(model.config.decoder_layers, 4, 1))
    cache = StaticHardAttnCache(model.config.decoder_layers, 4, 2)
    model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.ones(2, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"holds 2 rows since its first step, got a step of 1 rows"):
        model(input_ids=ids[:1], attention_mask=mask[:1], decoder_input_ids=torch.ones(1, 1, dtype=torch.long),
              cache=cache)


@pytest.mark.parametrize("argument, value", [("num_layers", 0), ("max_cache_len", 2.5), ("max_batch_size", -1)])
def test_bad_cache_sizes_are_refused(argument, value):
    sizes = dict(num_layers=2, max_cache_len=4, max_batch_size=2)
    sizes[argument] = value
    with pytest.raises(ValueError, match=rf"`{argument}`={value!r}; allowed: an int >= 1"):
        StaticHardAttnCache(**sizes)


@pytest.mark.parametrize("part", ["decode", "output_logits"])
def test_a_variant_that_does_not_declare_static_writes_is_refused_naming_its_type(part):
    """Which models decode static is declared beside the code (``decode_writes_static_cache`` beside a ``decode``,
    ``output_logits_static`` beside an ``output_logits``): a variant overriding either without declaring it is refused
    with the model type, the part, and what is allowed for it, before any step."""
    model = TYPE_MODELS["soft"]().eval()
    owner = model.model if part == "decode" else model
    undeclared = type("Undeclared", (type(owner),), {part: lambda self, *a, **k: getattr(super(undeclared, self),
                                                                                           part)(*a, **k)})
    owner.__class__ = undeclared
    ids, mask = source_batch()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)  # (the dynamic cache still decodes)
    what = "its decoder" if part == "decode" else r"its output layer \(Undeclared.output_logits\)"
    with pytest.raises(ValueError, match=rf"'static' is not yet supported for model_type 'soft_transformer' \({what}"
                                         r".*allowed for it: None or 'dynamic'"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, cache_implementation="static")


def test_other_cache_implementations_are_refused():
    model = TYPE_MODELS["soft"]().eval()
    ids, mask = source_batch()
    with pytest.raises(ValueError, match=r"`cache_implementation`='sliding_window' is not supported .* allowed: "
                                         r"None, 'dynamic' or 'static'"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, cache_implementation="sliding_window")


# ----------------------------------------------------------------------------------------------------------------
# translate --compile and the translation pipeline
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_soft(tmp_path_factory):
    """The fitted float64 soft model saved with the toy tokenizer, and 7 sources of the reversal task."""
    from common import copy_task, toy_tokenizer

    folder = tmp_path_factory.mktemp("static") / "soft64"
    as_float64(contract_model("soft")).save_pretrained(folder, tokenizer=toy_tokenizer())
    sources = [" ".join(f"t{i}" for i in row["input_ids"][:-1]) for row in copy_task(7, seed=5)]
    return folder, sources


@pytest.fixture(scope="module")
def saved_soft32(tmp_path_factory, saved_soft):
    """The same model in float32 (int8 layers quantise float32 weights), and the same sources."""
    from common import toy_tokenizer

    folder = tmp_path_factory.mktemp("static") / "soft32"
    contract_model("soft").save_pretrained(folder, tokenizer=toy_tokenizer())
    return folder, saved_soft[1]


def test_translate_compile_gives_the_eager_lines(saved_soft, tmp_path, monkeypatch):
    """``hf-hardattn translate --compile`` (beam 4, batches of 3: padded, the last one smaller) writes the lines of
    the eager translate (float64 model); its decoding steps ran compiled (a graph was compiled: the backend is
    swapped for a counting dynamo-only one here, inductor's compile taking tens of seconds)."""
    import functools

    from hf_hardattn import modeling_hardattn
    from hf_hardattn.tools import cli
    from hf_hardattn_cli.command import main

    folder, sources = saved_soft
    source = tmp_path / "in.txt"
    source.write_text("\n".join(sources), encoding="utf-8")
    counter = Counter("eager")
    monkeypatch.setattr(cli, "compiled_decoding",  # the name translate calls
                        functools.partial(modeling_hardattn.compiled_decoding, backend=counter))
    outputs = []
    for extra in ([], ["--compile"]):
        out = tmp_path / f"out{len(extra)}.txt"
        assert main(["translate", str(folder), "-i", str(source), "-o", str(out), "--quiet", "--threads", "1",
                     "--num-beams", "4", "--batch-size", "3", "--max-new-tokens", "9", *extra]) == 0
        outputs.append(out.read_text().splitlines())
    assert len(set(outputs[0])) >= 5, outputs[0]  # varied: the comparison could fail
    assert outputs[1] == outputs[0]
    assert counter.compiled >= 1


@pytest.mark.parametrize("engine", ["fbgemm", "traced", "packed"])
def test_translate_compile_int8_or_packed_gives_the_eager_lines(saved_soft32, tmp_path, monkeypatch, engine):
    """``translate --int8 --compile`` and ``--pack-linears --compile``: the int8 layers compile into the decoding step
    (fbgemm's kernel as an opaque operator, the traced engine's torch operators), and so do the oneDNN-prepacked fp32
    layers (their kernel as an opaque operator): the same arithmetic as the eager run, its lines."""
    import functools

    from hf_hardattn import modeling_hardattn
    from hf_hardattn.tools import cli
    from hf_hardattn_cli.command import main

    folder, sources = saved_soft32
    source = tmp_path / "in.txt"
    source.write_text("\n".join(sources), encoding="utf-8")
    counter = Counter("eager")
    monkeypatch.setattr(cli, "compiled_decoding", functools.partial(modeling_hardattn.compiled_decoding,
                                                                    backend=counter))
    from hf_hardattn.int8_traced import int_mm_is_exact

    if engine == "traced" and not int_mm_is_exact():
        pytest.skip("torch._int_mm is not exact here: the traced engine refuses (tests/test_int8_compiled.py)")
    layers = ["--pack-linears"] if engine == "packed" else ["--int8", "--int8-engine", engine]
    outputs = []
    for extra in ([], ["--compile"]):
        out = tmp_path / f"out{len(extra)}.txt"
        assert main(["translate", str(folder), "-i", str(source), "-o", str(out), "--quiet", "--threads", "1",
                     "--batch-size", "3", "--max-new-tokens", "9", *layers, *extra]) == 0
        outputs.append(out.read_text().splitlines())
    assert len(set(outputs[0])) >= 5, outputs[0]
    assert outputs[1] == outputs[0]
    assert counter.compiled >= 1


def test_translation_pipeline_takes_the_compiled_decoding_keywords(saved_soft):
    """``pipeline("translation")`` passes compiled_decoding's generate() keywords through: the eager texts."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

    from hf_hardattn.modeling_hardattn import compiled_decoding

    folder, sources = saved_soft
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    translator = pipeline("translation", model=model, tokenizer=AutoTokenizer.from_pretrained(folder))
    counter = Counter("eager")
    eager = translator(sources[:3], num_beams=2, max_new_tokens=9)
    compiled = translator(sources[:3], num_beams=2, max_new_tokens=9, **compiled_decoding(model, backend=counter))
    assert compiled == eager and len({row["translation_text"] for row in eager}) == 3
    assert counter.compiled >= 1
