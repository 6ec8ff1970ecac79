"""Bad input to forward(), generate() and translate(), on every model type: each case raises a ValueError where the
input enters, naming the parameter and its value and saying what is allowed, instead of a deep torch error, a failure
inside transformers or a silently wrong result. Where transformers' MarianMTModel behaves in a defined way for the
same input, the test compares with it; where it fails deep itself (``num_beams=0``: ZeroDivisionError; an offloaded
cache on CPU: AssertionError) the error is ours."""

import pytest
import torch
from transformers import MarianConfig, MarianMTModel

import hf_hardattn as h
from common import ONE_PER_TYPE, contract_model, source_batch, tiny_kwargs

DEC = torch.tensor([[1, 6, 9, 12], [1, 8, 10, 2]])
ids, mask = source_batch()


def inputs(**changes):
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC)
    kwargs.update(changes)
    return {k: v for k, v in kwargs.items() if v is not None}


def marian():
    torch.manual_seed(0)
    return MarianMTModel(MarianConfig(**tiny_kwargs())).eval()


# -- forward() ---------------------------------------------------------------------------------------------------------
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
    "decoder_mask_hole": (inputs(decoder_attention_mask=torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]])),
                          r"`decoder_attention_mask` row 1 has padding between two tokens"),
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
@pytest.mark.parametrize("name", ONE_PER_TYPE)
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


# -- labels with decoder inputs ----------------------------------------------------------------------------------------
LABELS = {"longer": torch.tensor([[5, 6, 7, 2, 2], [8, 2, 2, 2, 2]]), "shorter": torch.tensor([[5, 6, 2], [8, 2, 2]]),
          "fewer_rows": torch.tensor([[5, 6, 7, 2]])}


@pytest.mark.parametrize("case", LABELS)
@pytest.mark.parametrize("name", ONE_PER_TYPE)
def test_labels_of_another_shape_than_the_decoder_inputs_are_refused(name, case):
    """Refused before the forward runs: unchecked, the beam-joint types would fail inside their mixture (longer) or
    train silently (shorter), the others in the loss after the whole forward. MarianMTModel raises a ValueError (in its
    loss) too."""
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


def test_left_padded_labels_are_refused():
    """DataCollatorForSeq2Seq with a left-padding tokenizer pads the labels on the left; the shifted decoder input
    would then be [start, pad, ..., y1, ...] and train silently on it."""
    model = contract_model("soft", fit=False)
    ids, mask = source_batch()
    labels = torch.tensor([[5, 6, 7, 2], [-100, -100, 8, 2]])
    with pytest.raises(ValueError, match=r"`labels` row 1 .*-100.*padding_side='right'"):
        model(input_ids=ids, attention_mask=mask, labels=labels)
    model(input_ids=ids, attention_mask=mask, labels=torch.tensor([[5, 6, 7, 2], [8, 2, -100, -100]]))  # right: fine


def test_hard_retrieval_training_on_a_row_without_visible_keys_is_finite():
    """A direct call with a fully padded key row (the model refuses such masks at its entry) samples over all keys."""
    attention = contract_model("hard_retrieval", fit=False).model.decoder.layers[0].cross_attn.module.train()
    hidden, memory = torch.randn(2, 3, 32), torch.randn(2, 5, 32)
    key_mask = torch.tensor([[True] * 5, [False] * 5])[:, None, None, :]
    assert torch.isfinite(attention(hidden, memory=memory, mask=key_mask)).all()


# -- generate() --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ONE_PER_TYPE)
def test_generate_refuses_bad_source_naming_it(name):
    model = contract_model(name, fit=False)
    with pytest.raises(ValueError, match=r"`input_ids` holds 40"):
        model.generate(input_ids=ids.masked_fill(ids == 9, 40), attention_mask=mask, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"`attention_mask` row 1 is all padding"):
        model.generate(input_ids=ids, attention_mask=torch.stack([mask[0], torch.zeros(7, dtype=torch.long)]),
                       max_new_tokens=3)


@pytest.mark.parametrize("name", ONE_PER_TYPE)
@pytest.mark.parametrize("beams", [0, -2])
def test_generate_refuses_num_beams_below_one(name, beams):
    model = contract_model(name, fit=False)
    with pytest.raises(ValueError, match=rf"`num_beams`={beams} is not a number of beams; allowed: an integer >= 1"):
        model.generate(input_ids=ids, attention_mask=mask, num_beams=beams, max_new_tokens=3)


@pytest.mark.parametrize("name", ONE_PER_TYPE)
@pytest.mark.parametrize("cache", ["offloaded", "offloaded_static"])
def test_generate_refuses_an_offloaded_cache(name, cache):
    """Unchecked, it fails on the CPU with an AssertionError about CUDA (as MarianMTModel does) and on a GPU with a
    device mismatch in every type's attention, which reads the cross-attention cache where it was offloaded."""
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


@pytest.mark.parametrize("name", ONE_PER_TYPE)
def test_generate_checks_the_learned_position_table_before_decoding(name):
    """16 learned decoder positions: 16 new tokens decode (positions 0..15 are fed; the last token is not), 17 are
    refused when generate() is called, before any decoding step (not at step 17). The RNN decoders
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


# -- translate() -------------------------------------------------------------------------------------------------------
def test_translate_of_no_sources_is_empty_and_of_non_strings_an_error():
    from hf_hardattn.tools.training import translate
    from common import toy_tokenizer

    model, tokenizer = contract_model("soft", fit=False), toy_tokenizer()
    assert translate(model, tokenizer, []) == []
    with pytest.raises(ValueError, match=r"`sources` must be strings, got int"):
        translate(model, tokenizer, ["t5 t6", 7])
