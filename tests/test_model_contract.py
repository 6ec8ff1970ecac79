"""The PreTrainedModel / GenerationMixin contract for every model type: resize_token_embeddings, num_parameters,
get_encoder / get_decoder, GenerationMixin among each generative class's own bases, and loading a checkpoint that lacks
the tied embedding.

References: a model built at the new size, a plain count of the parameters, the full forward against the encoder's
output reused; transformers' MarianMTModel for the bases and for a checkpoint's missing keys.
"""

import contextlib
import copy
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM, MarianConfig, MarianMTModel

from common import (DECODER_INPUTS as DEC, JOINT_TYPES, PAD, TYPE_MODELS, TYPE_NAMES, contract_model, forward_logits,
                    randomize, source_batch)
from hf_hardattn import SoftTransformerForConditionalGeneration
from hf_hardattn.safe_io import CHECKSUM_FILE

FORCED = torch.tensor([[1, 6, 9, 12, 15, 7], [1, 8, 10, 2, 0, 0]])  # teacher-forced decoder inputs of the loading test


# ----------------------------------------------------------------------------------------------------------------
# resize_token_embeddings, num_parameters, get_encoder / get_decoder, GenerationMixin
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TYPE_NAMES)
def test_resize_token_embeddings(name, tmp_path):
    """Growing the vocabulary keeps the old rows and the ties (encoder, decoder, lm_head all read model.shared),
    updates config.vocab_size, and gives the model that a config of the new size builds with the same weights."""
    model = randomize(TYPE_MODELS[name]())
    old_rows, old_logits = model.get_input_embeddings().weight.detach().clone(), forward_logits(model)
    embedding = model.resize_token_embeddings(45, pad_to_multiple_of=8)
    assert embedding is model.model.shared and embedding.weight.shape == (48, 32) and model.config.vocab_size == 48
    assert model.model.encoder.embed_tokens is embedding and model.model.decoder.embed_tokens is embedding
    assert model.lm_head.weight is embedding.weight
    assert torch.equal(embedding.weight[:40], old_rows)
    assert embedding.padding_idx == model.config.pad_token_id
    if name not in JOINT_TYPES:  # plain logits over the old vocabulary do not depend on the new rows
        torch.testing.assert_close(forward_logits(model)[..., :40], old_logits, rtol=0, atol=0)
    built = type(model)(copy.deepcopy(model.config)).eval()
    built.load_state_dict(model.state_dict())
    new_ids = torch.tensor([[44, 47, 9, 2], [46, 45, 2, 0]])
    new_dec = torch.tensor([[1, 47, 45], [1, 46, 0]])
    resized = forward_logits(model, new_ids, (new_ids != 0).long(), new_dec)
    assert resized.shape == (2, 3, 48)
    torch.testing.assert_close(resized, forward_logits(built, new_ids, (new_ids != 0).long(), new_dec), rtol=0, atol=0)
    generated = model.generate(input_ids=new_ids, attention_mask=(new_ids != 0).long(), max_new_tokens=4,
                               min_new_tokens=4, num_beams=2)
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    assert reloaded.config.vocab_size == 48 and reloaded.lm_head.weight is reloaded.model.shared.weight
    torch.testing.assert_close(forward_logits(reloaded, new_ids, (new_ids != 0).long(), new_dec), resized, rtol=0, atol=0)
    assert torch.equal(reloaded.generate(input_ids=new_ids, attention_mask=(new_ids != 0).long(), max_new_tokens=4,
                                         min_new_tokens=4, num_beams=2), generated)


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_num_parameters_counts_tied_weights_once(name):
    model = TYPE_MODELS[name]()
    unique = {id(p): p for _, p in model.named_parameters(remove_duplicate=False)}  # the tied table once
    total = sum(p.numel() for p in unique.values())
    assert model.num_parameters() == total
    assert model.num_parameters(exclude_embeddings=True) == total - model.model.shared.weight.numel()
    model.model.shared.weight.requires_grad_(False)
    assert model.num_parameters(only_trainable=True) == total - model.model.shared.weight.numel()


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_get_encoder_and_get_decoder(name):
    model = randomize(TYPE_MODELS[name]())
    assert model.get_encoder() is model.model.encoder is model.model.get_encoder()
    assert model.get_decoder() is model.model.decoder is model.model.get_decoder()
    ids, mask = source_batch()
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=ids, attention_mask=mask)
        full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, use_cache=False)
        reused = model(encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=DEC, use_cache=False)
    assert torch.equal(encoded.last_hidden_state, full.encoder_last_hidden_state)
    assert torch.equal(reused.logits, full.logits)


def test_every_generative_class_lists_generation_mixin_among_its_own_bases():
    """transformers' GenerationTesterMixin.test_inherits_generation_mixin: for each class that can generate,
    ``"GenerationMixin" in str(model_class.__bases__)`` (PreTrainedModel.can_generate otherwise only finds it through a
    parent class), as for its own MarianMTModel. Every class of the runtime modules that can generate is checked."""
    import importlib
    import inspect
    import pkgutil

    from transformers import MarianMTModel, PreTrainedModel

    import hf_hardattn
    from hf_hardattn.registry import MODEL_TYPES, model_classes

    def direct(cls):
        return "GenerationMixin" in str(cls.__bases__)

    assert direct(MarianMTModel)  # the reference
    assert not direct(type("Sub", (SoftTransformerForConditionalGeneration,), {}))  # what the check catches
    generative = set()
    for info in pkgutil.iter_modules(hf_hardattn.__path__):
        if info.ispkg or info.name.startswith("__"):
            continue
        module = importlib.import_module(f"hf_hardattn.{info.name}")
        generative |= {cls for cls in vars(module).values() if inspect.isclass(cls) and cls.__module__ == module.__name__
                       and issubclass(cls, PreTrainedModel) and cls.can_generate()}
    assert {model_classes(name)[1] for name in MODEL_TYPES} <= generative
    assert sorted(cls.__name__ for cls in generative if not direct(cls)) == []


# ----------------------------------------------------------------------------------------------------------------
# A checkpoint without the (tied) embedding
# ----------------------------------------------------------------------------------------------------------------
def drop_keys(folder, *keys):
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    for key in keys:
        state.pop(key)
    save_file(state, path, metadata={"format": "pt"})
    # replaced on purpose: the sha256 save_pretrained recorded no longer applies (from_pretrained would refuse the file)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, CHECKSUM_FILE))


TIED = {"model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
        "lm_head.weight"}


@pytest.mark.parametrize("name", ["soft", "hard_retrieval", "gaussian_sh_x", "hybrid_additive", "recurrent_expand_1",
                                  "beam_joint_transformer", "beam_joint_rnn"])  # the seven model types
def test_a_checkpoint_without_the_embedding_reports_it_missing_and_initialises_it(name, tmp_path):
    """As transformers does for MarianMTModel (checked here too): every tied key is reported missing, the embedding
    is materialised (not left on the meta device) with the model's init (N(0, embed_init_std or d^-1/2), pad row 0),
    the output layer stays tied to it, and the model runs. A missing untied weight is reported and initialised as well."""
    model = contract_model(name, fit=False)
    model.save_pretrained(tmp_path)
    layer_norm = "model.encoder.layers.0.ffn.norm.weight"
    drop_keys(tmp_path, "model.shared.weight", layer_norm)
    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == TIED | {layer_norm}
    weight = loaded.model.shared.weight
    assert weight.device.type == "cpu" and loaded.lm_head.weight is weight
    expected = loaded.config.embed_init_std or 32**-0.5  # the type's default embedding init
    assert abs(float(weight[1:].detach().std()) / expected - 1) < 0.2 and weight[PAD].abs().max() == 0
    assert torch.equal(loaded.get_parameter(layer_norm), torch.ones(32))
    other = {k: v for k, v in loaded.state_dict().items() if k not in TIED | {layer_norm}}
    for key, value in other.items():
        assert torch.equal(value, model.state_dict()[key]), key
    ids, mask = source_batch()
    assert torch.isfinite(loaded(input_ids=ids, attention_mask=mask, decoder_input_ids=FORCED).logits).all()

    marian_dir = tmp_path / "marian"
    MarianMTModel(MarianConfig(vocab_size=40, d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=64,
                               decoder_ffn_dim=64, pad_token_id=PAD)).save_pretrained(marian_dir)
    drop_keys(marian_dir, "model.shared.weight")
    _, marian_info = MarianMTModel.from_pretrained(marian_dir, output_loading_info=True)
    assert set(marian_info["missing_keys"]) == TIED  # the reference behaviour
