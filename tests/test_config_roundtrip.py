"""Whatever ``save_pretrained`` writes, ``from_pretrained`` loads, for every model type.

A key that is no field of the config is refused with the field it is close to where the user types it (constructor
keywords, ``--set``, ``from_pretrained(path, key=value)``), and kept with a warning naming it (and the close field)
where it is read back from a saved config: ``config.layer_norm_epsilon = 1e-6`` (users, libraries, transformers'
``set_config_for_less_flaky_test``) saves and loads, as with transformers' own configs (MarianConfig keeps such a key;
``PreTrainedConfig.__post_init__`` sets every extra key as an attribute and ``to_dict`` writes it back).
"""

import json
import warnings

import pytest
import torch
from common import tiny_kwargs
from transformers import AutoConfig, AutoModelForSeq2SeqLM, MarianConfig, MarianMTModel
from transformers.testing_utils import set_config_for_less_flaky_test

import hf_hardattn  # noqa: F401  (registers the model types with the Auto classes)
from hf_hardattn.registry import MODEL_TYPES, model_classes
from hf_hardattn.tools.tokenization import train_tokenizer
from hf_hardattn_cli.command import main as cli_main

MISSPELLED = r"`layer_norm_epsilon` is not a field of {name}.*did you mean `layer_norm_eps`\?"


def tiny_kwargs_of(model_type):
    """tiny_kwargs(), with a tiny RNN state for the RNN decoders (their default, 1024, makes a 10M-parameter model)."""
    return tiny_kwargs(**(dict(rnn_hidden_size=32) if MODEL_TYPES[model_type].rnn_decoder else {}))


def tiny_model(model_type):
    config_class, model_class = model_classes(model_type)
    torch.manual_seed(0)
    return model_class(config_class(**tiny_kwargs_of(model_type))).eval()


def tiny_marian():
    return MarianMTModel(MarianConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                      decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=40,
                                      max_position_embeddings=32, pad_token_id=0, eos_token_id=2,
                                      decoder_start_token_id=1))


def unknown_key_warnings(records):
    return [str(record.message) for record in records if "is not a field of" in str(record.message)]


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_a_misspelled_attribute_saves_and_loads_with_a_warning(model_type, tmp_path):
    model = tiny_model(model_type)
    config_class, model_class = model_classes(model_type)
    model.config.layer_norm_epsilon = 1e-6  # as a user, a library or set_config_for_less_flaky_test does
    model.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["layer_norm_epsilon"] == 1e-6
    for load in (lambda: model_class.from_pretrained(tmp_path / "m"),
                 lambda: AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "m")):
        with pytest.warns(UserWarning, match=MISSPELLED.format(name=config_class.__name__)):
            loaded = load()
        assert loaded.config.layer_norm_epsilon == 1e-6  # kept, as transformers keeps an extra key
        assert loaded.config.layer_norm_eps == model.config.layer_norm_eps  # the field is not changed by it
        for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
            assert torch.equal(a, b), name
    with pytest.warns(UserWarning, match=MISSPELLED.format(name=config_class.__name__)):
        config = AutoConfig.from_pretrained(tmp_path / "m")
    with pytest.warns(UserWarning, match=MISSPELLED.format(name=config_class.__name__)):
        config_class.from_json_file(tmp_path / "m" / "config.json")
    # and what the loaded model saves loads again
    loaded.save_pretrained(tmp_path / "again")
    with pytest.warns(UserWarning, match="layer_norm_epsilon"):
        assert model_class.from_pretrained(tmp_path / "again").config.layer_norm_epsilon == 1e-6
    assert config.to_dict()["layer_norm_epsilon"] == 1e-6


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_less_flaky_test_config_saves_and_loads(model_type, tmp_path):
    """transformers' own helper, as its eager-vs-sdpa test calls it before save_pretrained / from_pretrained."""
    model = tiny_model(model_type)
    set_config_for_less_flaky_test(model.config)
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        loaded = model_classes(model_type)[1].from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    named = unknown_key_warnings(records)
    assert any("`layer_norm_epsilon`" in text and "did you mean `layer_norm_eps`" in text for text in named), named
    assert loaded.config.layer_norm_eps == 1.0 and loaded.dtype == torch.bfloat16


def test_marian_keeps_an_extra_key_as_ours_do(tmp_path):
    """The behaviour ours follows on a disk read: MarianConfig keeps an unknown key as an attribute and writes it
    back (silently; ours also warns)."""
    marian = tiny_marian()
    marian.config.layer_norm_epsilon = 1e-6
    marian.save_pretrained(tmp_path / "marian")
    ours = tiny_model("soft_transformer")
    ours.config.layer_norm_epsilon = 1e-6
    ours.save_pretrained(tmp_path / "ours")
    reloaded = {}
    for name in ("marian", "ours"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reloaded[name] = AutoConfig.from_pretrained(tmp_path / name)
    for config in reloaded.values():
        assert config.layer_norm_epsilon == 1e-6 and config.to_dict()["layer_norm_epsilon"] == 1e-6


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_a_misspelling_typed_by_the_user_is_refused(model_type, tmp_path):
    config_class, model_class = model_classes(model_type)
    message = MISSPELLED.format(name=config_class.__name__)
    with pytest.raises(ValueError, match=message):
        config_class(**tiny_kwargs(), layer_norm_epsilon=1e-6)
    tiny_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        model_class.from_pretrained(tmp_path, layer_norm_epsilon=1e-6)
    with pytest.raises(ValueError, match=message):
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path, layer_norm_epsilon=1e-6)
    with pytest.raises(ValueError, match=message):
        AutoConfig.from_pretrained(tmp_path, layer_norm_epsilon=1e-6)
    with pytest.raises(ValueError, match=rf"`d_modle` is not a field of {config_class.__name__}.*`d_model`"):
        model_class.from_pretrained(tmp_path, d_modle=3)


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_a_correctly_named_attribute_round_trips_silently(model_type, tmp_path):
    model = tiny_model(model_type)
    model.config.layer_norm_eps = 1e-6
    model.config.dropout = 0.25
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        loaded = model_classes(model_type)[1].from_pretrained(tmp_path)
        overridden = model_classes(model_type)[1].from_pretrained(tmp_path, label_smoothing=0.3)
    assert unknown_key_warnings(records) == []
    assert (loaded.config.layer_norm_eps, loaded.config.dropout) == (1e-6, 0.25)
    assert overridden.config.label_smoothing == 0.3
    assert not hasattr(loaded.config, "layer_norm_epsilon")
    norms = [module.eps for module in loaded.modules() if isinstance(module, torch.nn.LayerNorm)]
    assert norms and set(norms) == {1e-6}  # read by the layers, not merely kept


def test_an_unknown_key_far_from_every_field_warns_on_both_paths(tmp_path):
    """No misspelling (nothing close): a warning where it is typed and where it is read back (as before: the setting
    of an attention kind the config does not use, ``length_ratio`` here, too)."""
    config_class, model_class = model_classes("soft_transformer")
    with pytest.warns(UserWarning, match=r"`flavour` is not a field of SoftTransformerConfig.*kept") as records:
        config = config_class(**tiny_kwargs(), flavour="x", length_ratio=1.5)
    assert not any("did you mean" in text for text in unknown_key_warnings(records))
    model_class(config).save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"the saved config has `flavour`='x'") as records:
        loaded = model_class.from_pretrained(tmp_path)
    assert loaded.config.flavour == "x" and loaded.config.length_ratio == 1.5
    assert not any("did you mean" in text for text in unknown_key_warnings(records))


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    pairs = [("a b c", "c b a"), ("d e", "e d"), ("a d e", "e d a"), ("b c d", "d c b")] * 4
    for index, lang in enumerate(("en", "de")):
        (folder / f"train.{lang}").write_text("".join(pair[index] + "\n" for pair in pairs))
    train_tokenizer([text for pair in pairs for text in pair], kind="char", min_frequency=1).save_pretrained(
        folder / "tok")
    return folder


def run_train(text_data, out, *extra):
    return cli_main(["train", "--train", str(text_data / "train"), "--source-lang", "en", "--target-lang", "de",
                     "--model-type", "soft_transformer", "--d-model", "16", "--output-dir", str(out), "--quiet",
                     "--threads", "1", "--max-steps", "1", "--tokenizer", str(text_data / "tok"), *extra])


def test_set_refuses_a_misspelling_in_train_and_convert(text_data, tmp_path, capsys):
    assert run_train(text_data, tmp_path / "new", "--set", "layer_norm_epsilon=1e-6") == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("hf-hardattn train: error:") and "did you mean `layer_norm_eps`" in error, error
    # --init-from a saved folder: the keys of --set go to from_pretrained(path, key=value)
    saved = tiny_model("soft_transformer")
    saved.save_pretrained(tmp_path / "saved")
    assert run_train(text_data, tmp_path / "init", "--init-from", str(tmp_path / "saved"), "--set",
                     "layer_norm_epsilon=1e-6") == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--init-from" in error and "did you mean `layer_norm_eps`" in error, error
    tiny_marian().save_pretrained(tmp_path / "marian")
    assert cli_main(["convert", str(tmp_path / "marian"), str(tmp_path / "out"), "--model-type", "soft_transformer",
                     "--set", "layer_norm_epsilon=1e-6"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("hf-hardattn convert: error:") and "did you mean `layer_norm_eps`" in error, error
    assert not (tmp_path / "out").exists()
