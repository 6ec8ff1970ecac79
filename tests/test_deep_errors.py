"""Bad inputs that used to fail deep inside transformers or the package (issue #52 item 8), on every model type they
apply to: each now raises where it enters, naming the parameter and its value and saying what is allowed. Where
transformers' MarianMTModel behaves in a defined way for the same input, the test compares with it; where it fails
deep itself (``num_beams=0``: ZeroDivisionError; an offloaded cache on CPU: AssertionError; a missing folder: "Repo id
must be ..."; an unknown ``from_pretrained`` keyword: TypeError about ``__init__``) the error is ours."""

import pytest
import torch
from transformers import MarianConfig, MarianMTModel

import hf_hardattn as h
from common import contract_model, source_batch, tiny_kwargs

TYPES = ["soft", "hard_retrieval", "gaussian_hc_all", "hybrid_additive", "recurrent_expand_1", "beam_joint_transformer",
         "beam_joint_rnn"]  # the seven model types (as in test_bad_inputs.py)
ids, mask = source_batch()
DEC = torch.tensor([[1, 6, 9, 12], [1, 8, 10, 2]])


def marian():
    torch.manual_seed(0)
    return MarianMTModel(MarianConfig(**tiny_kwargs())).eval()


# -- generate() settings ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("beams", [0, -2])
def test_generate_refuses_num_beams_below_one(name, beams):
    model = contract_model(name, fit=False)
    with pytest.raises(ValueError, match=rf"`num_beams`={beams} is not a number of beams; allowed: an integer >= 1"):
        model.generate(input_ids=ids, attention_mask=mask, num_beams=beams, max_new_tokens=3)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("cache", ["offloaded", "offloaded_static"])
def test_generate_refuses_an_offloaded_cache(name, cache):
    """On the CPU it failed with an AssertionError about CUDA (as MarianMTModel does); on an H200 (transformers 5.17)
    with a device mismatch in every type's attention, which reads the cross-attention cache where it was offloaded."""
    model = contract_model(name, fit=False)
    with pytest.raises(ValueError, match=rf"`cache_implementation`='{cache}' is not supported by \w+ \(on cpu\): it "
                                         rf"moves the cache to the CPU .*allowed `cache_implementation`: None or "
                                         rf"'dynamic'"):
        model.generate(input_ids=ids, attention_mask=mask, cache_implementation=cache, max_new_tokens=3)


def learned_positions_model(name, limit=16):
    """A model of type ``name`` whose position tables are learned, of ``limit`` positions."""
    kw = tiny_kwargs(position_embedding="learned", max_position_embeddings=limit)
    rnn = dict(decoder_layers=1, rnn_hidden_size=32)
    torch.manual_seed(0)
    return {
        "soft": lambda: h.SoftTransformerForConditionalGeneration(h.SoftTransformerConfig(**kw)),
        "hard_retrieval": lambda: h.HardRetrievalForConditionalGeneration(
            h.HardRetrievalConfig(**kw, encoder_attention="hard_retrieval")),
        "gaussian_hc_all": lambda: h.GaussianForConditionalGeneration(
            h.GaussianConfig.preset("hc-all", **kw, length_ratio=1.0)),
        "hybrid_additive": lambda: h.HybridForConditionalGeneration(h.HybridConfig(**{**kw, **rnn})),
        "recurrent_expand_1": lambda: h.RecurrentForConditionalGeneration(h.RecurrentConfig(**kw)),
        "beam_joint_transformer": lambda: h.BeamJointTransformerForConditionalGeneration(
            h.BeamJointTransformerConfig(**kw, joint_k=3, joint_layer=0)),
        "beam_joint_rnn": lambda: h.BeamJointRNNForConditionalGeneration(
            h.BeamJointRNNConfig(**{**kw, **rnn}, joint_k=3, rnn_attention="multihead")),
    }[name]().eval()


def forward_calls(model):
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize("name", TYPES)
def test_generate_checks_the_learned_position_table_before_decoding(name):
    """16 learned decoder positions: 16 new tokens decode (positions 0..15 are fed; the last token is not), 17 are
    refused when generate() is called, before any decoding step (it used to fail at step 17). The RNN decoders
    (hybrid, beam-joint RNN) have no decoder positions, so no limit."""
    model = learned_positions_model(name)
    calls = forward_calls(model)
    assert model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16).shape[1] == 17
    has_positions = name not in ("hybrid_additive", "beam_joint_rnn")
    calls.clear()
    if not has_positions:
        assert model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=17, min_new_tokens=17).shape[1] == 18
        return
    with pytest.raises(ValueError, match=r"`max_new_tokens`=17 needs 17 decoder positions, beyond "
                                         r"`max_position_embeddings`=16 .*allowed: `max_new_tokens` at most 16"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=17)
    with pytest.raises(ValueError, match=r"`max_length`=30 needs 29 decoder positions.*`max_length` at most 17"):
        model.generate(input_ids=ids, attention_mask=mask, max_length=30, use_cache=False)
    assert calls == []  # refused before the first decoding step


# -- labels with decoder inputs ---------------------------------------------------------------------------------------
LABELS = {"longer": torch.tensor([[5, 6, 7, 2, 2], [8, 2, 2, 2, 2]]), "shorter": torch.tensor([[5, 6, 2], [8, 2, 2]]),
          "fewer_rows": torch.tensor([[5, 6, 7, 2]])}


@pytest.mark.parametrize("case", LABELS)
@pytest.mark.parametrize("name", TYPES)
def test_labels_of_another_shape_than_the_decoder_inputs_are_refused(name, case):
    """The beam-joint types failed with a RuntimeError in beam_joint.py (longer) or trained silently (shorter); the
    others failed after the whole forward in the loss. MarianMTModel raises a ValueError (in its loss) too."""
    labels = LABELS[case]
    model = contract_model(name, fit=False)
    shape = ", ".join(map(str, labels.shape))
    with pytest.raises(ValueError, match=rf"`labels` has shape \({shape}\) but `decoder_input_ids` \(2, 4\)"):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, labels=labels)
    embeds = torch.zeros(2, 4, 32)
    with pytest.raises(ValueError, match=rf"`labels` has shape \({shape}\) but `decoder_inputs_embeds` \(2, 4\)"):
        model(input_ids=ids, attention_mask=mask, decoder_inputs_embeds=embeds, labels=labels)
    with pytest.raises(ValueError):
        marian()(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, labels=labels)
    assert model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, labels=DEC).loss.isfinite()


# -- loading ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> a folder holding the saved tiny model of that type."""
    folders = {}
    for name in TYPES:
        folders[name] = tmp_path_factory.mktemp(name)
        contract_model(name, fit=False).save_pretrained(folders[name])
    return folders


@pytest.mark.parametrize("name", TYPES)
def test_from_pretrained_refuses_a_keyword_that_is_no_config_field(name, saved):
    model_class = type(contract_model(name, fit=False))
    # a misspelled field (refused naming the field, wherever #52 item 1's config check or this one catches it)
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


@pytest.mark.parametrize("name", TYPES)
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


@pytest.mark.parametrize("name", TYPES)
def test_missing_weights_listed_in_the_checksums_say_what_to_do(name, saved, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(saved[name], folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(OSError, match=r"model.safetensors is missing: hardattn_checksums.json lists it as part of this "
                                      r"model. Restore the file from a copy \(or save the model again\); .*delete "
                                      r"hardattn_checksums.json \(or pass verify_checksums=False to from_pretrained\)"):
        type(contract_model(name, fit=False)).from_pretrained(folder)


@pytest.mark.parametrize("name", TYPES)
def test_a_config_without_model_type_is_refused_where_the_package_loads_it(name, saved, tmp_path):
    """A config.json that lost its "model_type": transformers' AutoConfig asks whether to run the folder's own code
    (the config has ``auto_map``) instead of naming the problem; the package's loaders (translate / plot / publish,
    train --init-from, convert, distill --teacher) refuse it first, naming the file and the type its "architectures"
    give. (A user's own ``AutoModelForSeq2SeqLM.from_pretrained`` call reaches transformers before any package code:
    that path stays transformers' own.)"""
    import json
    import shutil

    from hf_hardattn.tools import cli, convert
    from hf_hardattn.tools.arguments import CommandError

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
