"""The generation config fit for translation.

transformers' model-agnostic default stops ``generate()`` at ``max_length`` 20 (21 with the decoder start token), so
plain ``generate()`` and ``pipeline("translation")`` cut every longer sentence. Marian checkpoints ship their own
generation config (``max_length`` 512, their beam count); every model type here gets ``max_length`` = 512 bounded by
its position table (``set_translation_generation_defaults``): new models, loaded ones whose saved config lacks it
(saved before this change), converted ones whose source lacks it; a converted model keeps what its source sets; the
CLI's ``train`` saves its ``--num-beams``. A call's ``max_new_tokens`` / ``max_length`` / ``num_beams`` still wins, and
the package's decoding paths do not print transformers' "Both `max_new_tokens` and `max_length` seem to have been set".

References: transformers' own lengths (``max_new_tokens=N`` gives N new tokens at most), a stock ``MarianMTModel``
(which, without a saved generation config, does stop at 21 and warns about it: what these tests guard against),
the generation config of the converted Marian source.
"""

import json
import logging
import os
import warnings

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, GenerationConfig, MarianConfig, MarianMTModel, pipeline

from common import EOS, PAD, randomize, tiny_kwargs, toy_tokenizer
from hf_hardattn import convert
from hf_hardattn.modeling_hardattn import TRANSLATION_MAX_LENGTH, set_translation_generation_defaults
from hf_hardattn.registry import MODEL_TYPES, model_classes
from hf_hardattn.tools import training
from hf_hardattn_cli.command import main as cli_main

TYPES = sorted(MODEL_TYPES)
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "saved_d27b908")
SOURCE = torch.tensor([[5, 9, 13, 17, 21, 25, 2]])
DEFAULT_NEW = 20  # transformers' model-agnostic max_length: 20 new tokens at most
LONG = 30  # new tokens that the chosen weights decode before any EOS (> DEFAULT_NEW)


def extra_kwargs(model_type):
    kwargs = {}
    if MODEL_TYPES[model_type].rnn_decoder:
        kwargs.update(decoder_layers=1, rnn_hidden_size=32)
    if model_type == "recurrent_transformer":
        kwargs.update(recurrent_context_norm=True)  # random weights: Eq. 5's context would overflow over 60 steps
    return kwargs


def new_model(model_type, **overrides):
    config_class, model_class = model_classes(model_type)
    return model_class(config_class(**tiny_kwargs(**extra_kwargs(model_type), **overrides)))


def long_output_model(model_type):
    """A randomized tiny model whose greedy translation of SOURCE is longer than 20 tokens: the first seed whose
    greedy decoding (max_new_tokens=LONG) has no EOS among its LONG new tokens. Searched, not assumed of a seed."""
    model = new_model(model_type)
    for seed in range(30):
        randomize(model, seed=seed)
        ids = model.generate(SOURCE, do_sample=False, num_beams=1, max_new_tokens=LONG)
        if ids.shape[-1] == LONG + 1 and EOS not in ids[0, 1:].tolist():
            return model, ids
    raise AssertionError(f"{model_type}: no seed of 30 gives a greedy output of {LONG} tokens without EOS, so no "
                         f"test here could show a cut at {DEFAULT_NEW}")


class Records(logging.Handler):
    """Every message logged by transformers (its loggers do not propagate to the root logger)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_messages():
    """The messages transformers logs or warns during the test."""
    handler, logger = Records(), logging.getLogger("transformers")
    logger.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda: handler.messages + [str(w.message) for w in caught]
    logger.removeHandler(handler)


def length_warnings(messages):
    return [m for m in messages if "seem to have been set" in m or "model-agnostic default `max_length`" in m]


def test_a_stock_marian_without_a_saved_generation_config_is_cut_at_20(transformers_messages):
    """The behaviour these tests guard against, on transformers' own model: with no max_length in its generation
    config, plain generate() stops after 20 new tokens and warns about the model-agnostic default."""
    marian = randomize(MarianMTModel(MarianConfig(**tiny_kwargs(max_position_embeddings=64))), seed=0)
    marian.generation_config.forced_eos_token_id = None
    assert marian.generate(SOURCE, num_beams=1).shape[-1] == DEFAULT_NEW + 1
    assert length_warnings(transformers_messages())


@pytest.mark.parametrize("model_type", TYPES)
def test_new_model_has_the_translation_max_length(model_type):
    assert new_model(model_type).generation_config.max_length == 64  # bounded by max_position_embeddings=64
    model = new_model(model_type, max_position_embeddings=1024)
    assert model.generation_config.max_length == TRANSLATION_MAX_LENGTH == 512  # Marian's
    assert model.generation_config.num_beams is None  # greedy, as a newly built MarianMTModel


@pytest.mark.parametrize("model_type", TYPES)
def test_plain_generate_is_not_cut_at_20(model_type, transformers_messages):
    model, reference = long_output_model(model_type)
    plain = model.generate(SOURCE)
    assert plain.shape[-1] > DEFAULT_NEW + 1, f"cut at {plain.shape[-1] - 1} new tokens"
    assert plain[0, :LONG + 1].tolist() == reference[0].tolist()
    assert plain.shape[-1] <= model.generation_config.max_length
    assert not length_warnings(transformers_messages())


@pytest.mark.parametrize("model_type", TYPES)
def test_the_translation_pipeline_is_not_cut_at_20(model_type, transformers_messages):
    model, reference = long_output_model(model_type)
    tokenizer = toy_tokenizer()
    text = tokenizer.decode(SOURCE[0])
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    out = translator(text)[0]["translation_text"]
    assert len(out.split()) > DEFAULT_NEW
    assert out.split()[:LONG] == tokenizer.decode(reference[0], skip_special_tokens=True).split()
    assert translator(text, max_new_tokens=5)[0]["translation_text"].split() == out.split()[:5]
    assert not length_warnings(transformers_messages())


@pytest.mark.parametrize("model_type", ["soft_transformer", "hybrid_transformer", "recurrent_transformer"])
def test_a_call_s_own_length_and_beam_win(model_type, transformers_messages):
    model, reference = long_output_model(model_type)
    model.generation_config.num_beams = 4
    assert model.generate(SOURCE, max_length=10).shape[-1] == 10
    assert model.generate(SOURCE, max_new_tokens=5, num_beams=1)[0].tolist() == reference[0, :6].tolist()
    beam = model.generate(SOURCE, num_beams=4, max_new_tokens=LONG)
    assert model.generate(SOURCE, max_new_tokens=LONG).tolist() == beam.tolist()  # the config's beam is used
    assert model.generate(SOURCE, num_beams=1, max_new_tokens=LONG).tolist() == reference.tolist()
    assert not length_warnings(transformers_messages())
    model.generate(SOURCE, max_new_tokens=5, max_length=10)  # a call that sets both still gets transformers' warning
    assert any("seem to have been set" in m for m in transformers_messages())


@pytest.mark.parametrize("model_type", TYPES)
def test_saved_and_loaded_generation_config_has_the_values(model_type, tmp_path):
    model = new_model(model_type)
    set_translation_generation_defaults(model, num_beams=4)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["max_length"] == 64 and saved["num_beams"] == 4
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert (loaded.generation_config.max_length, loaded.generation_config.num_beams) == (64, 4)
    model.generation_config.update(max_length=40, num_beams=1)  # a user's values are saved and loaded as set
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert (loaded.generation_config.max_length, loaded.generation_config.num_beams) == (40, 1)


@pytest.mark.parametrize("name", sorted(MODEL_TYPES))
def test_a_model_saved_before_loads_with_the_max_length_and_its_greedy_decoding(name):
    saved = json.load(open(os.path.join(FIXTURES, name, "generation_config.json")))
    assert "max_length" not in saved and "num_beams" not in saved
    model = AutoModelForSeq2SeqLM.from_pretrained(os.path.join(FIXTURES, name))
    positions = model.config.max_position_embeddings
    assert model.generation_config.max_length == min(TRANSLATION_MAX_LENGTH, positions)
    assert model.generation_config.num_beams is None


MARIAN_GENERATION = dict(max_length=512, num_beams=6, bad_words_ids=[[PAD]], forced_eos_token_id=EOS,
                         renormalize_logits=True)  # what Helsinki-NLP/opus-mt checkpoints ship (pad = their start)


@pytest.mark.parametrize("model_type", [t for t in TYPES if not MODEL_TYPES[t].rnn_decoder])
def test_a_converted_marian_keeps_its_generation_config(model_type, tmp_path):
    marian = MarianMTModel(MarianConfig(**tiny_kwargs(max_position_embeddings=64)))
    marian.generation_config.update(**MARIAN_GENERATION)
    model = convert(marian, model_type, **extra_kwargs(model_type))
    for folder in (None, tmp_path):
        if folder is not None:
            model.save_pretrained(folder)
            model = AutoModelForSeq2SeqLM.from_pretrained(folder)
        assert {key: getattr(model.generation_config, key) for key in MARIAN_GENERATION} == MARIAN_GENERATION
    bare = MarianMTModel(MarianConfig(**tiny_kwargs(max_position_embeddings=64)))
    bare.generation_config.num_beams = 3
    model = convert(bare, model_type, **extra_kwargs(model_type))
    assert bare.generation_config.max_length is None  # the source would stop at 20
    assert (model.generation_config.max_length, model.generation_config.num_beams) == (64, 3)


def test_the_package_s_decoding_paths_print_no_length_warning(tmp_path, transformers_messages):
    """training.translate (CLI translate/score, bleu, accuracy, distillation) and the CLI itself, which pass
    max_new_tokens while the model's generation config sets max_length."""
    model, _ = long_output_model("soft_transformer")
    tokenizer = toy_tokenizer()
    model.save_pretrained(tmp_path / "model", tokenizer=tokenizer)
    text = tokenizer.decode(SOURCE[0])
    training.translate(model, tokenizer, [text], num_beams=2)  # its own limit: 1.5 x the source + 10 new tokens
    assert len(training.translate(model, tokenizer, [text], num_beams=1, max_new_tokens=25)[0].split()) == 25
    (tmp_path / "in.txt").write_text(text + "\n")
    assert cli_main(["translate", str(tmp_path / "model"), "-i", str(tmp_path / "in.txt"), "-o",
                     str(tmp_path / "out.txt"), "--max-new-tokens", "25"]) == 0
    assert len((tmp_path / "out.txt").read_text().split()) > DEFAULT_NEW
    assert not length_warnings(transformers_messages())


def test_translate_on_a_stock_marian_with_its_generation_config_prints_no_length_warning(transformers_messages):
    """training.translate limits the new tokens through max_length when the model's generation config sets one
    (Marian's 512): the same outputs as transformers' max_new_tokens, without its "Both ... have been set"."""
    marian = randomize(MarianMTModel(MarianConfig(**tiny_kwargs(max_position_embeddings=64))), seed=0)
    marian.generation_config.update(**MARIAN_GENERATION)
    tokenizer = toy_tokenizer()
    text = tokenizer.decode(SOURCE[0])
    expected = marian.generate(SOURCE, num_beams=1, max_new_tokens=7)  # transformers' own: it warns
    assert any("seem to have been set" in m for m in transformers_messages())
    before = len(transformers_messages())
    assert training.translate(marian, tokenizer, [text], num_beams=1, max_new_tokens=7) == [
        tokenizer.decode(expected[0], skip_special_tokens=True).strip()]
    assert not length_warnings(transformers_messages()[before:])


def test_generation_config_defaults_fill_only_unset_fields():
    model = new_model("soft_transformer")
    model.generation_config = GenerationConfig(max_length=30, num_beams=2)
    set_translation_generation_defaults(model, num_beams=4)
    assert (model.generation_config.max_length, model.generation_config.num_beams) == (30, 2)
