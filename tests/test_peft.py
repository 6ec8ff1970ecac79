"""PEFT adapters (LoRA) on the layers of every model type and decoder style: every adapter acts, and the adapted model
equals the model with the adapter merged into its layer's weight (float64) in a forward pass, in cached decoding
(greedy, beam, static cache) and in the adapters' gradients; an adapter saved by ``save_pretrained`` reloads onto a
fresh base model.

References: the merged model, whose layers are plain ``nn.Linear`` / ``nn.Embedding`` again and so take the paths that
read a layer's weight directly (beam-joint's chunked vocabulary mixture and split candidate readout, learned positions
by slice); peft's own ``merge`` / ``merge_and_unload``; the gradient of peft's ``get_delta_weight`` (autograd) at the
merged layer's weight gradient.

The models are built with ``tie_word_embeddings=False``, so that an adapter on ``lm_head`` merges into the output layer
alone (with tied weights peft's merge writes into the shared table, which the embeddings read too). ``model.shared``
is, as in transformers' BART and Marian, the tied source of the embedding layers, not a layer the forward calls: an
adapter on it does nothing there either, and it is left out of the targets.
"""

import copy

import pytest
import torch
from torch import nn

from common import CONTRACT_MODELS, DECODER_INPUTS, _contract_builders, randomize, source_batch

peft = pytest.importorskip("peft")
from peft.tuners.lora import LoraLayer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10  # float64: merged and adapted paths differ by rounding only (~1e-15 relative)


def untied(name):
    """A randomized float64 model of contract configuration ``name`` with its own output layer."""
    model = _contract_builders()[name]()
    config = model.config
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = randomize(type(model)(config)).double().eval()
    assert model.lm_head.weight is not model.model.shared.weight
    return model


def targets(model):
    """Every linear and embedding layer by its full name (lm_head included), but ``model.shared`` (see above)."""
    return sorted(name for name, module in model.named_modules()
                  if isinstance(module, (nn.Linear, nn.Embedding)) and name != "model.shared")


def adapted(model):
    return peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets(model), lora_dropout=0.0))


def factors(layer):
    """(A, B) of a LoRA layer's default adapter (linear: lora_A / lora_B; embedding: lora_embedding_A / _B)."""
    if "default" in layer.lora_A:
        return layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return layer.lora_embedding_A["default"], layer.lora_embedding_B["default"]


def lora_layers(model):
    return [(name.removeprefix("base_model.model."), module) for name, module in model.named_modules()
            if isinstance(module, LoraLayer)]


def randomize_adapter(layer, std=0.05, seed=0):
    """Both factors random (peft starts one of them at zero, so that a fresh adapter does nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for factor in factors(layer):
            factor.copy_(torch.randn(factor.shape, generator=generator, dtype=factor.dtype) * std)


def logits(model):
    ids, mask = source_batch()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=DECODER_INPUTS).logits


def assert_close(got, expected, what):
    scale = expected.abs().max().item()
    error = (got - expected).abs().max().item()
    assert error <= RTOL * max(scale, 1.0), f"{what}: adapted vs merged differ by {error:.2e} (scale {scale:.2e})"


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_every_adapter_acts_and_equals_its_merged_layer(name):
    """One adapter at a time: it changes the logits (no layer is read past its adapter), and merging it into the
    layer's weight (peft's merge: the plain layer again) gives the same logits."""
    plain = untied(name)
    names = targets(plain)
    model = adapted(plain)
    layers = lora_layers(model)
    assert sorted(n for n, _ in layers) == names
    base = logits(model)
    for number, (layer_name, layer) in enumerate(layers):
        saved = [factor.detach().clone() for factor in factors(layer)]
        randomize_adapter(layer, seed=number)
        adapted_logits = logits(model)
        assert not torch.equal(adapted_logits, base), f"the adapter on {layer_name} does not act"
        layer.merge()
        try:
            assert_close(logits(model), adapted_logits, layer_name)
        finally:
            layer.unmerge()
            with torch.no_grad():
                for factor, value in zip(factors(layer), saved):
                    factor.copy_(value)


GENERATE = {
    "greedy": dict(num_beams=1),
    "beam": dict(num_beams=3),
    "static": dict(num_beams=1, cache_implementation="static"),
}


@pytest.mark.parametrize("mode", sorted(GENERATE))
@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_adapted_decoding_equals_the_merged_model(name, mode):
    """Every adapter random at once: cached decoding of the adapted model gives the tokens and scores of
    ``merge_and_unload`` (a plain model)."""
    model = adapted(untied(name))
    for number, (_, layer) in enumerate(lora_layers(model)):
        randomize_adapter(layer, std=0.1, seed=number)
    merged = copy.deepcopy(model).merge_and_unload()
    assert not any(isinstance(module, LoraLayer) for module in merged.modules())
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                  output_scores=True, return_dict_in_generate=True, **GENERATE[mode])
    with torch.no_grad():
        got, expected = model.generate(**kwargs), merged.generate(**kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for step, (a, b) in enumerate(zip(got.scores, expected.scores)):
        finite = b.isfinite()
        assert torch.equal(finite, a.isfinite()), f"step {step}: other tokens ruled out"
        assert_close(a[finite], b[finite], f"{mode} step {step} scores")


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_adapter_gradients_equal_the_merged_weight_gradient(name):
    """The loss's gradient for each adapter's factors equals the merged layer's weight gradient G carried back
    through peft's delta weight (dL/dA, dL/dB = vjp of get_delta_weight at G): the adapted model's backward (through
    the adapter) against the merged model's (through the plain layer; beam-joint: the chunked mixture's own backward)."""
    model = adapted(untied(name))
    for number, (_, layer) in enumerate(lora_layers(model)):
        randomize_adapter(layer, std=0.1, seed=number)
    merged = copy.deepcopy(model).merge_and_unload().requires_grad_(True)  # (peft froze the base layers)
    ids, mask = source_batch()
    labels = DECODER_INPUTS[:, 1:].masked_fill(DECODER_INPUTS[:, 1:] == 0, -100).flatten()

    def loss(m):  # in float64 (the models' own loss is computed in fp32, as transformers' is)
        out = m(input_ids=ids, attention_mask=mask, decoder_input_ids=DECODER_INPUTS[:, :-1]).logits
        return nn.functional.cross_entropy(out.flatten(0, 1), labels)

    loss(model).backward()
    loss(merged).backward()
    for layer_name, layer in lora_layers(model):
        weight_grad = merged.get_submodule(layer_name).weight.grad
        a, b = factors(layer)
        if weight_grad is None:  # no gradient reaches the layer (hard retrieval's query in eval mode: an argmax)
            assert a.grad is None and b.grad is None, f"{layer_name}: the adapter has a gradient, the layer none"
            continue
        reference = torch.autograd.grad(layer.get_delta_weight("default"), (a, b), weight_grad)
        for factor, what, expected in zip((a, b), "AB", reference):
            assert factor.grad is not None, f"{layer_name}: no gradient reaches the adapter's {what}"
            assert_close(factor.grad, expected, f"{layer_name} d/d{what}")


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_a_saved_adapter_reloads_onto_a_fresh_base_model(name, tmp_path):
    """``PeftModel.save_pretrained`` writes the adapters; ``PeftModel.from_pretrained`` on the base model reloaded
    from its own ``save_pretrained`` gives the same logits."""
    base = untied(name)
    base.save_pretrained(tmp_path / "base")
    model = adapted(base)
    for number, (_, layer) in enumerate(lora_layers(model)):
        randomize_adapter(layer, std=0.1, seed=number)
    expected = logits(model)
    model.save_pretrained(tmp_path / "adapter")
    fresh = type(base).from_pretrained(tmp_path / "base", dtype=torch.float64).eval()
    reloaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    assert_close(logits(reloaded), expected, "reloaded")


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_int8_asks_for_merged_adapters_and_quantizes_the_merged_model(name):
    """``quantize_int8()`` on an adapted model (through the PeftModel) is refused naming ``merge_and_unload`` and
    changes nothing; the merged model quantizes and decodes."""
    model = adapted(untied(name).float())
    for number, (_, layer) in enumerate(lora_layers(model)):
        randomize_adapter(layer, std=0.1, seed=number)
    before = logits(model)
    with pytest.raises(ValueError, match=r"quantize_int8\(\): the model carries PEFT adapter layers.*merge_and_unload"):
        model.quantize_int8()
    assert not model.base_model.model.is_int8 and torch.equal(logits(model), before)
    merged = model.merge_and_unload().quantize_int8()
    assert merged.is_int8
    ids, mask = source_batch()
    assert merged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4).shape == (2, 5)
