"""Bad input over every model type: each case raises a ValueError whose message names the parameter (and says what is
allowed), where the input enters (forward, generate, config, loading), instead of a deep torch error or a silently
wrong result. The matrix's counts are in the session notes."""

import json
import warnings

import pytest
import torch

from common import contract_model, source_batch, tiny_kwargs
from hf_hardattn import GaussianConfig, HardRetrievalForConditionalGeneration, SoftTransformerConfig

TYPES = ["soft", "hard_retrieval", "gaussian_hc_all", "hybrid_additive", "recurrent_expand_1", "beam_joint_transformer",
         "beam_joint_rnn"]  # the seven model types
DEC = torch.tensor([[1, 6, 9, 12], [1, 8, 10, 2]])


def inputs(**changes):
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC)
    kwargs.update(changes)
    return {k: v for k, v in kwargs.items() if v is not None}


ids, mask = source_batch()
FORWARD_CASES = {  # name -> (forward kwargs, regex the message must match)
    "mask_too_long": (inputs(attention_mask=torch.ones(2, 9, dtype=torch.long)),
                      r"`attention_mask` has shape \(2, 9\); allowed: \(2, 7\)"),
    "mask_1d": (inputs(attention_mask=torch.ones(7, dtype=torch.long)), r"`attention_mask` has shape \(7,\)"),
    "mask_3d": (inputs(attention_mask=mask[:, None, :]), r"`attention_mask` has shape \(2, 1, 7\)"),
    "mask_value_-1": (inputs(attention_mask=mask.masked_fill(mask == 0, -1)), r"`attention_mask` must hold 0 .* -1"),
    "mask_value_2": (inputs(attention_mask=mask * 2), r"`attention_mask` must hold 0 .*got 2"),
    "mask_row_all_padding": (inputs(attention_mask=torch.stack([mask[0], torch.zeros(7, dtype=torch.long)])),
                             r"`attention_mask` row 1 is all padding"),
    "ids_out_of_vocabulary": (inputs(input_ids=ids.masked_fill(ids == 9, 40)), r"`input_ids` holds 40.*\[0, 40\)"),
    "ids_negative": (inputs(input_ids=ids.masked_fill(ids == 9, -3)), r"`input_ids` holds -3"),
    "ids_float": (inputs(input_ids=ids.float()), r"`input_ids` must be an integer tensor"),
    "ids_1d": (inputs(input_ids=ids[0], attention_mask=None), r"`input_ids` must be an integer tensor \[batch, length\]"),
    "empty_batch": (inputs(input_ids=ids[:0], attention_mask=None, decoder_input_ids=DEC[:0]), r"`input_ids` is empty"),
    "empty_source": (inputs(input_ids=ids[:, :0], attention_mask=None), r"`input_ids` is empty"),
    "ids_and_embeds": (inputs(inputs_embeds=torch.zeros(2, 7, 32)), r"Pass `input_ids` or `inputs_embeds`, not both"),
    "embeds_wrong_width": (inputs(input_ids=None, inputs_embeds=torch.zeros(2, 7, 5)),
                           r"`inputs_embeds` must be \[batch, length, d_model=32\]"),
    "decoder_ids_out_of_vocabulary": (inputs(decoder_input_ids=DEC + 30), r"`decoder_input_ids` holds 4\d"),
    "decoder_ids_float": (inputs(decoder_input_ids=DEC.float()), r"`decoder_input_ids` must be an integer tensor"),
    "decoder_ids_empty": (inputs(decoder_input_ids=DEC[:, :0]), r"`decoder_input_ids` is empty"),
    "no_decoder_inputs": (inputs(decoder_input_ids=None), r"Pass `decoder_input_ids` or `decoder_inputs_embeds`"),
    "decoder_mask_wrong_shape": (inputs(decoder_attention_mask=torch.ones(2, 9, dtype=torch.long)),
                                 r"`decoder_attention_mask` has shape \(2, 9\); allowed: \(2, 4\)"),
    "decoder_mask_left_padded": (inputs(decoder_attention_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])),
                                 r"`decoder_attention_mask` row 1 has padding before a token"),
    "decoder_mask_value": (inputs(decoder_attention_mask=torch.full((2, 4), 3)), r"`decoder_attention_mask` must hold"),
    "labels_negative": (inputs(decoder_input_ids=None, labels=torch.tensor([[5, 6, -5, 2], [8, 2, -100, -100]])),
                        r"`labels` must be -100 \(ignored\) or in \[0, 40\), got -5"),
    "labels_out_of_vocabulary_last": (inputs(decoder_input_ids=None, labels=torch.tensor([[5, 6, 7, 40], [8, 2, 2, 2]])),
                                      r"`labels` must be -100 .*got 40"),
    "labels_float": (inputs(decoder_input_ids=None, labels=DEC.float()), r"`labels` must be an integer tensor"),
    "labels_left_padded": (inputs(decoder_input_ids=None, labels=torch.tensor([[5, 6, 7, 2], [-100, -100, 8, 2]])),
                           r"`labels` row 1 starts with -100"),
}


@pytest.mark.parametrize("case", FORWARD_CASES)
@pytest.mark.parametrize("name", TYPES)
def test_forward_refuses_bad_input_naming_it(name, case):
    model = contract_model(name, fit=False)
    kwargs, pattern = FORWARD_CASES[case]
    with pytest.raises(ValueError, match=pattern):
        model(**kwargs)


def test_encoder_outputs_with_a_mask_of_another_length_are_refused():
    model = contract_model("soft", fit=False)
    encoder_outputs = model.get_encoder()(ids, mask)
    with pytest.raises(ValueError, match=r"`attention_mask` has shape \(2, 5\); allowed: \(2, 7\)"):
        model(encoder_outputs=encoder_outputs, attention_mask=mask[:, :5], decoder_input_ids=DEC)


@pytest.mark.parametrize("name", TYPES)
def test_generate_refuses_bad_source_naming_it(name):
    model = contract_model(name, fit=False)
    with pytest.raises(ValueError, match=r"`input_ids` holds 40"):
        model.generate(input_ids=ids.masked_fill(ids == 9, 40), attention_mask=mask, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"`attention_mask` row 1 is all padding"):
        model.generate(input_ids=ids, attention_mask=torch.stack([mask[0], torch.zeros(7, dtype=torch.long)]),
                       max_new_tokens=3)


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
    # refused: whatever save_pretrained writes must load (issue #52; tests/test_config_roundtrip.py)
    with pytest.warns(UserWarning, match=r"`cross_atention` is not a field .*did you mean `cross_attention`\? "
                                         r"\(`cross_attention` is 'soft'\)"):
        loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert loaded.config.cross_atention == "soft"


def test_hard_retrieval_training_on_a_row_without_visible_keys_is_finite():
    """A direct call with a fully padded key row (the model refuses such masks at its entry) samples over all keys."""
    attention = contract_model("hard_retrieval", fit=False).model.decoder.layers[0].cross_attn.module.train()
    hidden, memory = torch.randn(2, 3, 32), torch.randn(2, 5, 32)
    key_mask = torch.tensor([[True] * 5, [False] * 5])[:, None, None, :]
    assert torch.isfinite(attention(hidden, memory=memory, mask=key_mask)).all()


def test_translate_of_no_sources_is_empty_and_of_non_strings_an_error():
    from hf_hardattn.tools.training import translate
    from common import toy_tokenizer

    model, tokenizer = contract_model("soft", fit=False), toy_tokenizer()
    assert translate(model, tokenizer, []) == []
    with pytest.raises(ValueError, match=r"`sources` must be strings, got int"):
        translate(model, tokenizer, ["t5 t6", 7])
