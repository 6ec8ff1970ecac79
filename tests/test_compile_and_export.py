"""Graph capture of every model type: torch.compile (forward, generate, a training step), torch.export and dynamo ONNX
export (run in ONNX Runtime).

References: the same model run eagerly (float64 where rounding could hide a difference; ONNX Runtime in float32).
"""

import copy
import warnings

import pytest
import torch

from common import (DECODER_INPUTS as DEC, TYPE_MODELS, TYPE_NAMES, UNPADDED, collate, copy_task, forward_logits,
                    randomize, source_batch, traced_batches, training_step)
from hf_hardattn.inputs import is_tracing


def test_is_tracing_is_true_only_while_a_graph_is_traced():
    assert not is_tracing()
    traced = torch.compile(lambda x: x + (1.0 if is_tracing() else 0.0), backend="eager", fullgraph=True)
    assert traced(torch.zeros(1)).item() == 1.0


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_torch_compile_forward_and_generate(name):
    """``model.compile(fullgraph=True)``: forward is one graph (no data-dependent branch breaks it) that serves padded
    and unpadded batches without recompiling, with the eager logits (float64); generate() (beam search) runs the
    compiled forward at every step, with the eager tokens and scores. Backend aot_eager: dynamo + AOT autograd, the
    tracing that inductor also needs, at a fraction of its compile time (inductor: ~20 s for one model here)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = randomize(TYPE_MODELS[name]()).double()
    eager = copy.deepcopy(model)  # the model is compiled before any eager call (e.g. beam-joint's buffers)
    ids, mask = source_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, num_beams=2,
                  num_return_sequences=2, output_scores=True, return_dict_in_generate=True)
    counter = CompileCounterWithBackend("aot_eager")
    model.compile(backend=counter, fullgraph=True)
    for batch in traced_batches():
        torch.testing.assert_close(forward_logits(model, *batch), forward_logits(eager, *batch), rtol=0, atol=1e-10)
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
    model = TYPE_MODELS["soft"](label_smoothing=0.1).double().train()
    batch = collate(copy_task(4, seed=3))
    loss, grads, _ = training_step(model, batch)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled_loss, compiled_grads, _ = training_step(compiled, batch, count_calls=False)
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-12, atol=0)
    for key, grad in grads.items():
        torch.testing.assert_close(compiled_grads[f"_orig_mod.{key}"], grad, rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()


TIME_LOOPS = ("hybrid", "recurrent", "beam_joint_rnn")  # a Python loop over target positions: unrolled when traced


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_torch_export_equals_eager(name):
    """torch.export of forward(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask) without cache,
    traced on a padded batch with a dynamic batch size and source length (and target length, except where a loop over
    target positions unrolls: GRU decoder, recurrent cross-attention), gives the eager logits (float64) on it, on an
    unpadded batch of the same shape and on a padded batch of other sizes; the trace assigns no tensor to the model
    (e.g. Gaussian attention's weight memo)."""
    from torch.export import Dim

    model = randomize(TYPE_MODELS[name]()).double()
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
        torch.testing.assert_close(got, forward_logits(model, *batch), rtol=0, atol=1e-10)


class LogitsOnly(torch.nn.Module):
    """forward(input_ids, attention_mask, decoder_input_ids) -> logits, no cache: the graph an ONNX file holds."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                          use_cache=False).logits


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_onnx_export_runs_in_onnxruntime(name, tmp_path):
    """torch.onnx.export(dynamo=True), traced on a padded batch; ONNX Runtime gives the eager logits on it and on an
    unpadded batch (fp32: ONNX Runtime's kernels round differently, so within 1e-4 of the logits' scale)."""
    pytest.importorskip("onnxscript")
    onnxruntime = pytest.importorskip("onnxruntime")
    model = randomize(TYPE_MODELS[name]())
    ids, mask = source_batch()
    names = ["input_ids", "attention_mask", "decoder_input_ids"]
    program = torch.onnx.export(LogitsOnly(model).eval(), (ids, mask, DEC), dynamo=True, input_names=names,
                                output_names=["logits"], verbose=False)
    program.save(str(tmp_path / "model.onnx"))
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    for source, source_mask in ((ids, mask), (UNPADDED, torch.ones_like(UNPADDED))):
        (got,) = session.run(["logits"], dict(zip(names, (source.numpy(), source_mask.numpy(), DEC.numpy()))))
        expected = forward_logits(model, source, source_mask)
        torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=1e-4 * float(expected.abs().max()))
