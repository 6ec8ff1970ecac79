"""Bad configs and bad loading, on every model type: a config value, a keyword to ``from_pretrained`` or a saved
folder that cannot give the model asked for raises where it enters, naming the parameter (or file) and its value and
saying what is allowed or what to do. Where transformers fails deep itself for the same input (a missing folder:
"Repo id must be ..."; an unknown ``from_pretrained`` keyword: TypeError about ``__init__``) the error is ours."""

import json
import warnings

import pytest
from transformers import MarianMTModel

from common import ONE_PER_TYPE, contract_model, tiny_kwargs
from hf_hardattn import GaussianConfig, HardRetrievalForConditionalGeneration, SoftTransformerConfig


# -- configs -----------------------------------------------------------------------------------------------------------
CONFIG_CASES = {
    "layer_norm_eps_zero": (dict(layer_norm_eps=0), r"`layer_norm_eps` must be a positive finite number"),
    "layer_norm_eps_nan": (dict(layer_norm_eps=float("nan")), r"`layer_norm_eps`"),
    "d_model_bool": (dict(d_model=True), r"`d_model` must be a positive integer, got True"),
    "pad_outside_vocabulary": (dict(pad_token_id=40), r"`pad_token_id` must be None or a token id in \[0, vocab_size=40\)"),
    "start_negative": (dict(decoder_start_token_id=-1), r"`decoder_start_token_id` must be None or a token id"),
    "eos_list_outside": (dict(eos_token_id=[2, 99]), r"`eos_token_id` must be None, a token id"),
    "misspelled_field": (dict(cross_atention="soft"), r"`cross_atention` is not a field .*did you mean `cross_attention`"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_config_refuses_bad_values_naming_them(case):
    changes, pattern = CONFIG_CASES[case]
    with pytest.raises(ValueError, match=pattern):
        SoftTransformerConfig(**tiny_kwargs(**changes))


def test_unknown_config_key_warns_naming_it():
    with pytest.warns(UserWarning, match=r"`flavour` is not a field of SoftTransformerConfig"):
        SoftTransformerConfig(**tiny_kwargs(flavour="sweet"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the keys transformers itself passes warn nothing
        SoftTransformerConfig(**tiny_kwargs(attn_implementation="eager", output_attentions=True))
        # a kind's settings in a plain config that uses the kind are read by it: no warning
        SoftTransformerConfig(**tiny_kwargs(cross_attention="gaussian", length_ratio=1.2, gaussian_sigma=0.5))
        SoftTransformerConfig(**tiny_kwargs(cross_attention=["soft", "recurrent"], recurrent_variant="coverage"))
    with pytest.warns(UserWarning, match=r"`length_ratio` is not a field"):  # ... but warn where no kind reads them
        SoftTransformerConfig(**tiny_kwargs(length_ratio=1.2))


def test_kind_settings_are_the_variants_own_fields():
    from hf_hardattn import HardAttnConfig
    from hf_hardattn.configuration_hardattn import KIND_SETTINGS
    from hf_hardattn.recurrent import DEFAULTS

    own = set(GaussianConfig.__dataclass_fields__) - set(HardAttnConfig.__dataclass_fields__)
    assert set(KIND_SETTINGS["gaussian"]) == own, own ^ set(KIND_SETTINGS["gaussian"])
    assert set(KIND_SETTINGS["recurrent"]) == set(DEFAULTS)


def test_gaussian_offsets_beyond_every_sentence_are_refused():
    with pytest.raises(ValueError, match=r"`cross_offsets` offsets must be within \(-64, 64\)"):
        GaussianConfig.preset("hc-all", **tiny_kwargs(cross_offsets=[0, 1000]))


# -- loading -----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> a folder holding the saved tiny model of that type."""
    folders = {}
    for name in ONE_PER_TYPE:
        folders[name] = tmp_path_factory.mktemp(name)
        contract_model(name, fit=False).save_pretrained(folders[name])
    return folders


def test_loading_refuses_another_model_type_and_warns_on_a_misspelled_key(tmp_path):
    model = contract_model("soft", fit=False)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'soft_transformer', not 'hard_retrieval_transformer'"):
        HardRetrievalForConditionalGeneration.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["cross_atention"] = config.pop("cross_attention")
    (tmp_path / "config.json").write_text(json.dumps(config))
    from transformers import AutoModelForSeq2SeqLM
    # read back from disk a key is kept with a warning naming the field (and the value that field now has), not
    # refused: whatever save_pretrained writes must load (tests/test_config_roundtrip.py)
    with pytest.warns(UserWarning, match=r"`cross_atention` is not a field .*did you mean `cross_attention`\? "
                                         r"\(`cross_attention` is 'soft'\)"):
        loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert loaded.config.cross_atention == "soft"


@pytest.mark.parametrize("name", ONE_PER_TYPE)
def test_from_pretrained_refuses_a_keyword_that_is_no_config_field(name, saved):
    model_class = type(contract_model(name, fit=False))
    # a misspelled field (refused naming the field, whether the config's check or from_pretrained's catches it)
    with pytest.raises(ValueError, match=r"`d_modle`.*did you mean `d_model`"):
        model_class.from_pretrained(saved[name], d_modle=3)
    with pytest.raises(ValueError, match=r"`flavour`='sweet' is neither a field of \w+Config nor an argument of "
                                         r"from_pretrained"):
        model_class.from_pretrained(saved[name], flavour="sweet")
    config = model_class.config_class.from_pretrained(saved[name])
    with pytest.raises(ValueError, match=r"`dropout`=0.3 is a field of \w+Config.*set it on the config"):
        model_class.from_pretrained(saved[name], config=config, dropout=0.3)
    with pytest.raises(ValueError, match=r"`flavour`='sweet' is neither"):
        model_class(config, flavour="sweet")
    assert model_class.from_pretrained(saved[name], dropout=0.3).config.dropout == 0.3  # a field still applies


def test_auto_from_pretrained_refuses_an_unknown_keyword(saved):
    from transformers import AutoModelForSeq2SeqLM

    with pytest.raises(ValueError, match=r"`flavour`='sweet' is neither a field of SoftTransformerConfig"):
        AutoModelForSeq2SeqLM.from_pretrained(saved["soft"], flavour="sweet")


@pytest.mark.parametrize("name", ONE_PER_TYPE)
def test_from_pretrained_of_a_missing_folder_names_it(name, tmp_path, monkeypatch):
    """Marian's from_pretrained calls such a path an invalid repo id (an OSError); ours is a FileNotFoundError (an
    OSError too) naming the path and the nearest folder that exists."""
    model_class = type(contract_model(name, fit=False))
    missing = tmp_path / "runs" / "best"
    with pytest.raises(FileNotFoundError, match=rf"`pretrained_model_name_or_path`='{missing}' is no folder \(the "
                                                rf"nearest existing folder on that path is '{tmp_path}'\)"):
        model_class.from_pretrained(missing)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"`pretrained_model_name_or_path`='./best' is no folder"):
        model_class.from_pretrained("./best")
    with pytest.raises(OSError):
        MarianMTModel.from_pretrained(missing)
    with pytest.raises(OSError) as raised:  # a valid repo id stays transformers' Hub lookup (offline here)
        model_class.from_pretrained("someone/no-such-model")
    assert "is no folder" not in str(raised.value)


@pytest.mark.parametrize("name", ONE_PER_TYPE)
def test_missing_weights_listed_in_the_checksums_say_what_to_do(name, saved, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(saved[name], folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(OSError, match=r"model.safetensors is missing: hardattn_checksums.json lists it as part of this "
                                      r"model. Restore the file from a copy \(or save the model again\); .*delete "
                                      r"hardattn_checksums.json \(or pass verify_checksums=False to from_pretrained\)"):
        type(contract_model(name, fit=False)).from_pretrained(folder)


@pytest.mark.parametrize("name", ONE_PER_TYPE)
def test_a_config_without_model_type_is_refused_where_the_package_loads_it(name, saved, tmp_path):
    """A config.json that lost its "model_type": transformers' AutoConfig asks whether to run the folder's own code
    (the config has ``auto_map``) instead of naming the problem; the package's loaders (translate / plot / publish,
    train --init-from, convert, distill --teacher) refuse it first, naming the file and the type its "architectures"
    give. (A user's own ``AutoModelForSeq2SeqLM.from_pretrained`` call reaches transformers before any package code:
    that path stays transformers' own.)"""
    import json
    import shutil

    from hf_hardattn.tools import cli, convert
    from hf_hardattn_cli.arguments import CommandError

    folder = tmp_path / "model"
    shutil.copytree(saved[name], folder)
    config = json.loads((folder / "config.json").read_text())
    model_type = config.pop("model_type")
    (folder / "config.json").write_text(json.dumps(config))
    expected = rf'config.json has no "model_type".*add "model_type": "{model_type}" \(its "architectures"'
    with pytest.raises(CommandError, match=expected):
        cli.load_for_translation(str(folder), None)
    with pytest.raises(ValueError, match=r"`source`=.*" + expected):
        convert.convert(str(folder), "soft_transformer")
    config.pop("architectures")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r'has no "model_type".*add its "model_type" \(hf_hardattn types: '
                                         r"soft_transformer, hard_retrieval_transformer"):
        convert.convert(str(folder), "soft_transformer")
    (folder / "config.json").write_text(json.dumps(dict(config, model_type=model_type)))
    from transformers import AutoModelForSeq2SeqLM

    from hf_hardattn.tools.arguments import check_model_type

    check_model_type(folder)  # restored: passes, and the folder loads
    assert AutoModelForSeq2SeqLM.from_pretrained(folder).config.model_type == model_type
