"""The rest of the HuggingFace model surface, for all seven model types: gradient checkpointing,
resize_token_embeddings, num_parameters, get_encoder / get_decoder, torch.compile (forward and generate), bfloat16
weights, torch.export and dynamo ONNX export (run in ONNX Runtime), assisted decoding.

References: the same model without the feature (float64 where rounding could hide a difference), a model built at the
new size, a plain count of the parameters, the fp32 model, transformers' own DynamicLayer for the cache's crop.
"""

import copy
import warnings

import pytest
import torch

from common import assert_step_scores_close, collate, copy_task, randomize, source_batch, tiny_kwargs
from hf_hardattn import (BeamJointRNNConfig, BeamJointRNNForConditionalGeneration, BeamJointTransformerConfig,
                         BeamJointTransformerForConditionalGeneration, GaussianConfig, GaussianForConditionalGeneration,
                         HardAttnCache, HardRetrievalConfig, HardRetrievalForConditionalGeneration, HybridConfig,
                         HybridForConditionalGeneration, RecurrentConfig, RecurrentForConditionalGeneration,
                         SoftTransformerConfig, SoftTransformerForConditionalGeneration)
from hf_hardattn.hybrid import HybridDecoder
from hf_hardattn.caches import CACHE_FIELD, cropped_length
from hf_hardattn.inputs import is_tracing

RNN_KW = dict(decoder_layers=2, rnn_hidden_size=32)  # two GRU layers: dropout between them is checkpointed too
MODELS = {
    "soft": lambda **kw: SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs(**kw))),
    "hard_retrieval": lambda **kw: HardRetrievalForConditionalGeneration(HardRetrievalConfig(**tiny_kwargs(**kw))),
    "gaussian": lambda **kw: GaussianForConditionalGeneration(
        GaussianConfig.preset("hc-all", **tiny_kwargs(**{"length_ratio": 1.3, **kw}))),
    "hybrid": lambda **kw: HybridForConditionalGeneration(HybridConfig(**tiny_kwargs(**RNN_KW, **kw))),
    "recurrent": lambda **kw: RecurrentForConditionalGeneration(RecurrentConfig(**tiny_kwargs(**kw))),
    "beam_joint_transformer": lambda **kw: BeamJointTransformerForConditionalGeneration(
        BeamJointTransformerConfig(**tiny_kwargs(joint_k=3, **kw))),
    "beam_joint_rnn": lambda **kw: BeamJointRNNForConditionalGeneration(
        BeamJointRNNConfig(**tiny_kwargs(**RNN_KW, joint_k=3, **kw))),
}
NAMES = sorted(MODELS)
# beam_joint_rnn above is the paper's Luong-style LSTM decoder (its defaults); checkpointing also covers the others
CHECKPOINTED = {
    **MODELS,
    "hybrid_luong_lstm": lambda **kw: HybridForConditionalGeneration(HybridConfig(**tiny_kwargs(
        **RNN_KW, rnn_decoder_style="luong", rnn_cell="lstm", **kw))),
    "beam_joint_rnn_bahdanau": lambda **kw: BeamJointRNNForConditionalGeneration(BeamJointRNNConfig(**tiny_kwargs(
        **RNN_KW, joint_k=3, rnn_decoder_style="bahdanau", rnn_cell="gru", rnn_attention="additive", **kw))),
}
JOINT = ("beam_joint_transformer", "beam_joint_rnn")  # logits are the mixture's log-probabilities
DEC = torch.tensor([[1, 6, 9, 12, 15], [1, 8, 10, 2, 0]])  # decoder inputs (the second row ends early)
UNPADDED = torch.tensor([[5, 9, 13, 17, 21, 25, 2], [7, 11, 19, 23, 2, 30, 31]])  # source_batch's shape, no padding


def enable_checkpointing(model, **kwargs):
    """``gradient_checkpointing_enable`` (transformers 5.24 deprecates the name for ``activation_checkpointing_enable``
    with a FutureWarning; both run the same code)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


# ----------------------------------------------------------------------------------------------------------------
# gradient checkpointing
# ----------------------------------------------------------------------------------------------------------------
def checkpointed_modules(model):
    """(modules called inside a checkpointed unit, modules outside any): what gradient checkpointing recomputes in
    backward, for each type. Every encoder layer; every decoder layer, except in beam-joint Transformer the joint layer
    and the layers after it (``decode`` runs their sub-layers per candidate itself); the GRU decoder's step (its
    context projection runs once per step)."""
    inside = [layer.ffn for layer in model.model.encoder.layers]
    outside = []
    decoder = model.model.decoder
    if isinstance(decoder, HybridDecoder):
        inside.append(decoder.context_proj)
    else:
        joint = model.config.joint_layer_index() if isinstance(model, BeamJointTransformerForConditionalGeneration) \
            else len(decoder.layers)
        inside += [layer.ffn for layer in decoder.layers[:joint]]
        outside += [layer.ffn for layer in decoder.layers[joint:]]
    return inside, outside


def training_step(model, batch, seed=7, count_calls=True):
    """Loss and float64 gradients of one step from a fixed RNG state (dropout masks, hard-retrieval samples), and how
    often each module was called (a pre-hook: a recomputation stops once it has what backward needs, which may be
    before a module returns)."""
    calls = {}
    hooks = [module.register_forward_pre_hook(lambda m, i: calls.__setitem__(m, calls.get(m, 0) + 1))
             for module in model.modules()] if count_calls else []
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    for hook in hooks:
        hook.remove()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, calls


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_gradient_checkpointing_gives_the_same_float64_gradients(name, reentrant):
    """With dropout everywhere (and hard retrieval sampling), the checkpointed units are recomputed in backward with the
    RNG state of their forward: loss and every gradient equal those without checkpointing (float64)."""
    model = CHECKPOINTED[name](dropout=0.1, attention_dropout=0.1, activation_dropout=0.1).double().train()
    batch = collate(copy_task(4, seed=3))
    loss, grads, calls = training_step(model, batch)
    assert len(grads) == len(list(model.parameters()))
    enable_checkpointing(model, use_reentrant=reentrant)
    checkpointed_loss, checkpointed_grads, checkpointed_calls = training_step(model, batch)
    inside, outside = checkpointed_modules(model)
    for module in inside:  # recomputed in backward: the checkpoint really happened
        assert checkpointed_calls[module] == 2 * calls[module]
    for module in outside:
        assert checkpointed_calls[module] == calls[module]
    assert torch.equal(checkpointed_loss, loss)
    assert checkpointed_grads.keys() == grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[key], grad, rtol=1e-12, atol=1e-14, msg=key)


def test_gradient_checkpointing_redraws_the_same_hard_retrieval_samples():
    """Sampling is the only randomness here (no dropout): gradients equal with the checkpoint's RNG preservation, and
    differ without it (the recomputation then retrieves other value rows), so the equality above is not luck."""
    model = MODELS["hard_retrieval"]().double().train()
    batch = collate(copy_task(4, seed=3))
    _, grads, _ = training_step(model, batch)
    enable_checkpointing(model)
    _, preserved, _ = training_step(model, batch)
    enable_checkpointing(model, use_reentrant=False, preserve_rng_state=False)
    _, redrawn, _ = training_step(model, batch)
    assert all(torch.allclose(preserved[key], grad, rtol=1e-12, atol=1e-14) for key, grad in grads.items())
    assert not all(torch.allclose(redrawn[key], grad, rtol=1e-6, atol=1e-9) for key, grad in grads.items())


def test_gradient_checkpointing_turns_the_cache_off_only_in_training():
    """A checkpointed layer runs twice in training and would write its keys/values twice: forward drops the cache
    there (with transformers' warning); generate (no gradients) keeps it and decodes as without checkpointing."""
    model = randomize(MODELS["soft"]())
    ids, mask = source_batch()
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, num_beams=2)
    enable_checkpointing(model)
    model.train()
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, use_cache=True)
    assert getattr(out, CACHE_FIELD) is None
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                      num_beams=2), plain)


# ----------------------------------------------------------------------------------------------------------------
# resize_token_embeddings, num_parameters, get_encoder / get_decoder
# ----------------------------------------------------------------------------------------------------------------
def logits(model, ids=None, mask=None, dec=DEC, dec_mask=None):
    if ids is None:
        ids, mask = source_batch()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask,
                     use_cache=False).logits


def traced_batches():
    """(source, source mask, decoder inputs, decoder mask): padded as traced, then the same shapes unpadded, where
    eager decoding takes its no-mask fast paths and a traced graph its general one."""
    ids, mask = source_batch()
    return ((ids, mask, DEC, (DEC != 0).long()),
            (UNPADDED, torch.ones_like(UNPADDED), DEC, torch.ones_like(DEC)))


@pytest.mark.parametrize("name", NAMES)
def test_resize_token_embeddings(name, tmp_path):
    """Growing the vocabulary keeps the old rows and the ties (encoder, decoder, lm_head all read model.shared),
    updates config.vocab_size, and gives the model that a config of the new size builds with the same weights."""
    model = randomize(MODELS[name]())
    old_rows, old_logits = model.get_input_embeddings().weight.detach().clone(), logits(model)
    embedding = model.resize_token_embeddings(45, pad_to_multiple_of=8)
    assert embedding is model.model.shared and embedding.weight.shape == (48, 32) and model.config.vocab_size == 48
    assert model.model.encoder.embed_tokens is embedding and model.model.decoder.embed_tokens is embedding
    assert model.lm_head.weight is embedding.weight
    assert torch.equal(embedding.weight[:40], old_rows)
    assert embedding.padding_idx == model.config.pad_token_id
    if name not in JOINT:  # plain logits over the old vocabulary do not depend on the new rows
        torch.testing.assert_close(logits(model)[..., :40], old_logits, rtol=0, atol=0)
    built = type(model)(copy.deepcopy(model.config)).eval()
    built.load_state_dict(model.state_dict())
    new_ids = torch.tensor([[44, 47, 9, 2], [46, 45, 2, 0]])
    new_dec = torch.tensor([[1, 47, 45], [1, 46, 0]])
    resized = logits(model, new_ids, (new_ids != 0).long(), new_dec)
    assert resized.shape == (2, 3, 48)
    torch.testing.assert_close(resized, logits(built, new_ids, (new_ids != 0).long(), new_dec), rtol=0, atol=0)
    generated = model.generate(input_ids=new_ids, attention_mask=(new_ids != 0).long(), max_new_tokens=4,
                               min_new_tokens=4, num_beams=2)
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    assert reloaded.config.vocab_size == 48 and reloaded.lm_head.weight is reloaded.model.shared.weight
    torch.testing.assert_close(logits(reloaded, new_ids, (new_ids != 0).long(), new_dec), resized, rtol=0, atol=0)
    assert torch.equal(reloaded.generate(input_ids=new_ids, attention_mask=(new_ids != 0).long(), max_new_tokens=4,
                                         min_new_tokens=4, num_beams=2), generated)


@pytest.mark.parametrize("name", NAMES)
def test_num_parameters_counts_tied_weights_once(name):
    model = MODELS[name]()
    unique = {id(p): p for _, p in model.named_parameters(remove_duplicate=False)}  # the tied table once
    total = sum(p.numel() for p in unique.values())
    assert model.num_parameters() == total
    assert model.num_parameters(exclude_embeddings=True) == total - model.model.shared.weight.numel()
    model.model.shared.weight.requires_grad_(False)
    assert model.num_parameters(only_trainable=True) == total - model.model.shared.weight.numel()


@pytest.mark.parametrize("name", NAMES)
def test_get_encoder_and_get_decoder(name):
    model = randomize(MODELS[name]())
    assert model.get_encoder() is model.model.encoder is model.model.get_encoder()
    assert model.get_decoder() is model.model.decoder is model.model.get_decoder()
    ids, mask = source_batch()
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=ids, attention_mask=mask)
        full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=DEC, use_cache=False)
        reused = model(encoder_outputs=encoded, attention_mask=mask, decoder_input_ids=DEC, use_cache=False)
    assert torch.equal(encoded.last_hidden_state, full.encoder_last_hidden_state)
    assert torch.equal(reused.logits, full.logits)


# ----------------------------------------------------------------------------------------------------------------
# torch.compile, bfloat16, torch.export, ONNX
# ----------------------------------------------------------------------------------------------------------------
def test_is_tracing_is_true_only_while_a_graph_is_traced():
    assert not is_tracing()
    traced = torch.compile(lambda x: x + (1.0 if is_tracing() else 0.0), backend="eager", fullgraph=True)
    assert traced(torch.zeros(1)).item() == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_torch_compile_forward_and_generate(name):
    """``model.compile(fullgraph=True)``: forward is one graph (no data-dependent branch breaks it) that serves padded
    and unpadded batches without recompiling, with the eager logits (float64); generate() (beam search) runs the
    compiled forward at every step, with the eager tokens and scores. Backend aot_eager: dynamo + AOT autograd, the
    tracing that inductor also needs, at a fraction of its compile time (inductor: ~20 s for one model here)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = randomize(MODELS[name]()).double()
    eager = copy.deepcopy(model)  # the model is compiled before any eager call (e.g. beam-joint's buffers)
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, num_beams=2,
                  num_return_sequences=2, output_scores=True, return_dict_in_generate=True)
    counter = CompileCounterWithBackend("aot_eager")
    model.compile(backend=counter, fullgraph=True)
    for batch in traced_batches():
        torch.testing.assert_close(logits(model, *batch), logits(eager, *batch), rtol=0, atol=1e-10)
    assert counter.frame_count == 1
    reference = eager.generate(**kwargs)
    out = model.generate(**kwargs)
    assert counter.frame_count > 1  # the decoding steps ran compiled graphs
    assert torch.equal(out.sequences, reference.sequences)
    for step, expected in zip(out.scores, reference.scores, strict=True):
        torch.testing.assert_close(step, expected, rtol=0, atol=1e-5)
    torch._dynamo.reset()


def test_torch_compile_training_step():
    """A compiled training forward (labels: the loss and its label check included) is one graph; loss and float64
    gradients equal eager ones. (Soft only: the graph is the skeleton's; hard retrieval samples other indices under
    compile, whose random numbers are not eager's.)"""
    torch._dynamo.reset()
    model = MODELS["soft"](label_smoothing=0.1).double().train()
    batch = collate(copy_task(4, seed=3))
    loss, grads, _ = training_step(model, batch)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled_loss, compiled_grads, _ = training_step(compiled, batch, count_calls=False)
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-12, atol=0)
    for key, grad in grads.items():
        torch.testing.assert_close(compiled_grads[f"_orig_mod.{key}"], grad, rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()


def assert_close_in_bf16(got, expected, every_position):
    """Log-probabilities [B, T, V] of the bf16 model against the fp32 model's: bf16 (8 significant bits) moves them by
    about 0.01-0.06 here. Where a hard selection can flip at a near tie (hard retrieval's argmax, beam-joint's top K),
    a flipped position moves further, so for those kinds the bound holds for the median position."""
    error = (got.float() - expected).abs().amax(-1)  # per target position
    assert error.median() <= 0.1, error
    if every_position:
        assert error.max() <= 0.15, error


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_weights_forward_and_generate(name):
    """model.to(torch.bfloat16): every parameter and state in bf16 (beam-joint's mixture in fp32 by design), forward
    and decoding follow the fp32 model (decoding, greedy and beam search: the fp32 model teacher-forced on the bf16
    model's tokens); a beam hypothesis's score is the mean of its tokens' log-probabilities (length penalty 1), the
    hypotheses of a sentence best first."""
    model = randomize(MODELS[name](), std=0.2)  # moderate weights: attention neither flat nor saturated
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    every_position = name in ("soft", "gaussian", "hybrid", "recurrent")  # no hard selection
    ids, mask = source_batch()
    out = logits(bf16)
    assert out.dtype == (torch.float32 if name in JOINT else torch.bfloat16)
    assert_close_in_bf16(out.float().log_softmax(-1), logits(model).log_softmax(-1), every_position)
    greedy = bf16.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                           output_logits=True, return_dict_in_generate=True)
    steps = torch.stack(greedy.logits, 1).float().log_softmax(-1)
    teacher_forced = logits(model, ids, mask, greedy.sequences[:, :-1]).log_softmax(-1)
    assert_close_in_bf16(steps, teacher_forced, every_position)
    beams = bf16.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, num_beams=4,
                          num_return_sequences=2, output_scores=True, return_dict_in_generate=True)
    assert beams.sequences.shape == (4, 9)
    tokens = bf16.compute_transition_scores(beams.sequences, beams.scores, beams.beam_indices)  # [4, 8] fp32
    sums = tokens.sum(-1)  # fp32 sums of 8 terms in another order than generate's: 8 eps * sum |term| apart at most
    assert ((beams.sequences_scores - sums / 8).abs() <= 8 * torch.finfo(torch.float32).eps * tokens.abs().sum(-1)).all()
    assert (beams.sequences_scores[0::2] >= beams.sequences_scores[1::2]).all()  # 2 per sentence, best first
    teacher_forced = logits(model, ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), beams.sequences[:, :-1])
    expected = teacher_forced.log_softmax(-1).gather(-1, beams.sequences[:, 1:, None])
    assert_close_in_bf16(tokens[..., None], expected, every_position)


TIME_LOOPS = ("hybrid", "recurrent", "beam_joint_rnn")  # a Python loop over target positions: unrolled when traced


@pytest.mark.parametrize("name", NAMES)
def test_torch_export_equals_eager(name):
    """torch.export of forward(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask) without cache,
    traced on a padded batch with a dynamic batch size and source length (and target length, except where a loop over
    target positions unrolls: GRU decoder, recurrent cross-attention), gives the eager logits (float64) on it, on an
    unpadded batch of the same shape and on a padded batch of other sizes; the trace assigns no tensor to the model
    (e.g. Gaussian attention's weight memo)."""
    from torch.export import Dim

    model = randomize(MODELS[name]()).double()
    batches = list(traced_batches())
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (3, 9), generator=generator)
    ids[1, 6:] = 0
    dec = torch.randint(3, 40, (3, 5 if name in TIME_LOOPS else 4), generator=generator)
    batches.append((ids, (ids != 0).long(), dec, torch.ones_like(dec)))
    names = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")
    batch, source = Dim("batch", min=1, max=64), Dim("source", min=4, max=64)  # beam-joint: at least joint_k + 1
    target = {0: batch} if name in TIME_LOOPS else {0: batch, 1: Dim("target", min=2, max=64)}
    dynamic = dict(input_ids={0: batch, 1: source}, attention_mask={0: batch, 1: source}, decoder_input_ids=target,
                   decoder_attention_mask=target, use_cache=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = torch.export.export(model, (), dict(zip(names, batches[0]), use_cache=False), dynamic_shapes=dynamic)
    assert not [w for w in caught if "assigned during export" in str(w.message)]
    exported = program.module()
    for batch in batches:
        got = exported(**dict(zip(names, batch)), use_cache=False).logits
        torch.testing.assert_close(got, logits(model, *batch), rtol=0, atol=1e-10)


class LogitsOnly(torch.nn.Module):
    """forward(input_ids, attention_mask, decoder_input_ids) -> logits, no cache: the graph an ONNX file holds."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                          use_cache=False).logits


@pytest.mark.parametrize("name", NAMES)
def test_onnx_export_runs_in_onnxruntime(name, tmp_path):
    """torch.onnx.export(dynamo=True), traced on a padded batch; ONNX Runtime gives the eager logits on it and on an
    unpadded batch (fp32: ONNX Runtime's kernels round differently, so within 1e-4 of the logits' scale)."""
    pytest.importorskip("onnxscript")
    onnxruntime = pytest.importorskip("onnxruntime")
    model = randomize(MODELS[name]())
    ids, mask = source_batch()
    names = ["input_ids", "attention_mask", "decoder_input_ids"]
    program = torch.onnx.export(LogitsOnly(model).eval(), (ids, mask, DEC), dynamo=True, input_names=names,
                                output_names=["logits"], verbose=False)
    program.save(str(tmp_path / "model.onnx"))
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    for source, source_mask in ((ids, mask), (UNPADDED, torch.ones_like(UNPADDED))):
        (got,) = session.run(["logits"], dict(zip(names, (source.numpy(), source_mask.numpy(), DEC.numpy()))))
        expected = logits(model, source, source_mask)
        torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=1e-4 * float(expected.abs().max()))


# ----------------------------------------------------------------------------------------------------------------
# assisted decoding (crop of the cache)
# ----------------------------------------------------------------------------------------------------------------
KEY_VALUE_MODELS = {  # decoders whose cache is keys/values only (and the position count), which crop can roll back
    "soft": MODELS["soft"],
    "hard_retrieval": MODELS["hard_retrieval"],
    "beam_joint_transformer": MODELS["beam_joint_transformer"],
    "gaussian_cross_soft_decoder": lambda **kw: GaussianForConditionalGeneration(
        GaussianConfig.preset("hc-all", **tiny_kwargs(decoder_attention="soft", length_ratio=1.3, **kw))),
}


@pytest.mark.parametrize("name", sorted(KEY_VALUE_MODELS))
def test_assisted_decoding_equals_greedy_decoding(name, monkeypatch):
    """An assistant with other weights proposes drafts that the model partly rejects; the cache is cropped back and
    decoding gives the tokens and scores of plain greedy decoding (float64: exact tokens between two code paths, see
    common.as_float64; the scores as common.assert_step_scores_close)."""
    model = randomize(KEY_VALUE_MODELS[name]()).double()
    assistant = randomize(KEY_VALUE_MODELS[name](), seed=1).double()
    removed, crop = [], HardAttnCache.crop

    def recording_crop(cache, n):
        removed.append(cache.seen_tokens - cropped_length(cache.seen_tokens, n))
        return crop(cache, n)

    monkeypatch.setattr(HardAttnCache, "crop", recording_crop)
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=10, min_new_tokens=10, do_sample=False,
                  output_scores=True, return_dict_in_generate=True)
    plain = model.generate(**kwargs)
    assert not removed
    assisted = model.generate(assistant_model=assistant, **kwargs)
    assert sum(removed) > 0  # drafts were rejected and cropped away
    assert torch.equal(assisted.sequences, plain.sequences)
    for t, (step, expected) in enumerate(zip(assisted.scores, plain.scores, strict=True)):
        assert_step_scores_close(step, expected, f"step {t}")


@pytest.mark.parametrize("name", ["gaussian", "hybrid", "recurrent", "beam_joint_rnn"])
def test_assisted_decoding_is_refused_for_decoders_with_step_state(name):
    """GRU states, recurrent cross-attention state and Gaussian decoder self-attention's kept value rows cannot be
    rolled back: refused (transformers 5.24 asks the cache's is_croppable after the first forward; earlier releases
    reach our crop, which names the states)."""
    model = randomize(MODELS[name]())
    assistant = randomize(MODELS[name](), seed=1)
    ids, mask = source_batch()
    with pytest.raises((ValueError, NotImplementedError), match=r"crop"):
        model.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=10, min_new_tokens=10,
                       assistant_model=assistant)


@pytest.mark.parametrize("n", [-2, -6, 0, 3, 6, 9])
def test_cache_crop_follows_transformers_convention(n):
    """crop(n) of the decoder self-attention cache layer and of HardAttnCache's position count against transformers'
    DynamicLayer, whose meaning of n changed within 5.x (length to keep, or minus the positions to remove)."""
    from transformers.cache_utils import DynamicLayer

    keys = torch.arange(6.0).view(1, 1, 6, 1)
    cache, dynamic = HardAttnCache(), DynamicLayer()
    cache.self_attention_cache.update(keys, keys, 0)
    cache.seen_tokens = 6
    dynamic.update(keys, keys)
    try:
        dynamic.crop(n)
    except ValueError:
        with pytest.raises(ValueError, match=r"`crop` takes minus the number of positions to remove"):
            cache.crop(n)
        return
    cache.crop(n)
    layer = cache.self_attention_cache.layers[0]
    assert torch.equal(layer.keys, dynamic.keys) and torch.equal(layer.values, dynamic.values)
    assert cache.get_seq_length() == layer.get_seq_length() == dynamic.get_seq_length()


def test_a_cache_with_step_state_is_not_croppable():
    """transformers 5.24's assisted decoding asks ``is_croppable`` after the first forward and refuses up front."""
    cache = HardAttnCache()
    keys = torch.zeros(1, 1, 3, 1)
    cache.self_attention_cache.update(keys, keys, 0)
    assert cache.is_croppable
    cache.states["gru.0"] = torch.zeros(1, 4)
    assert not cache.is_croppable


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
