"""int8 under torch.compile. quantize_int8(engine="traced") (int8 layers in torch operators, int8_traced.py): each
layer computes the quantisation written out by hand (float64, exact integer sums), its error against fp32 stays inside
what the rounding allows, the soft model's next-token probabilities stay inside the first-order rounding model and
the greedy tokens are fp32's wherever fp32's margin clears that model. Both that engine and the packed fbgemm layers
(through packed_linear.INT8_LINEAR_OP): the decoding step compiles to one graph with a static cache (fullgraph=True)
and gives the eager int8 tokens. The int8 model refuses training, saving and moves."""

import copy

import pytest
import torch
from torch import nn

from common import CONTRACT_MODELS, assert_step_scores_close, contract_model, decoding_batch, source_batch, tiny_kwargs
from hf_hardattn import SoftTransformerConfig, SoftTransformerForConditionalGeneration
from hf_hardattn import int8_traced
from hf_hardattn.int8_traced import Q_MAX, TracedInt8Linear, int_mm_is_exact
from hf_hardattn.modeling_hardattn import compiled_decoding
from test_static_cache import Counter, generate

pytestmark = pytest.mark.numerics  # CPU-dependent rounding: .ci/run runs these under other kernels too
EPS32 = torch.finfo(torch.float32).eps


# quantize_int8(engine="traced") refuses where torch._int_mm is not exact (oneDNN's s8 x s8 kernel without VNNI:
# an AVX2-only CPU, or ONEDNN_MAX_CPU_ISA below it; tested at the end): its tests run where it is allowed
TRACED_EXACT = int_mm_is_exact()
needs_exact_int_mm = pytest.mark.skipif(not TRACED_EXACT, reason="torch._int_mm is not exact here: the traced engine "
                                        "refuses (test_the_traced_engine_refuses_where_int_mm_is_not_exact)")


def traced_layers(model):
    return {name: module for name, module in model.named_modules() if isinstance(module, TracedInt8Linear)}


def near_half(values, tolerance=1e-4):
    """Where a value over its scale lies within ``tolerance`` of a rounding tie k + 1/2: there the layer's float32
    quotient and this float64 one (a few fp32 ulps of |v| <= 127 apart, about 1e-5) may round to neighbours."""
    return ((values - values.floor()) - 0.5).abs() < tolerance


def hand_int8_linear(x, weight, bias):
    """The layer's arithmetic written out for rows ``x`` [N, K] and an fp32 ``weight`` [M, K]: symmetric scales
    s = max|.| / 127 (float32, as stated; an all-zero row: 1), codes round(v / s) (float64 quotient here), the product
    of the codes summed exactly (float64 holds every int32 sum), times s_x s_w, plus the bias. Returns the result, the
    scales (s_x [N, 1], s_w [M]) and the slack the layer is allowed against it: a code at a tie one step away (an input
    code moves output j by s_x s_w |q_w_jk|, a weight code by s_x s_w |q_x_k|), and float32's rescale and bias add
    (4 eps of |acc| s_x s_w + |b|)."""
    x, weight = x.detach().float(), weight.detach().float()

    def scale(values):
        s = values.abs().amax(1, keepdim=True) / Q_MAX
        return torch.where(s == 0, 1.0, s)

    scale_x, scale_w = scale(x), scale(weight)
    vx, vw = x.double() / scale_x.double(), weight.double() / scale_w.double()
    q_x, q_w = vx.round().clamp(-Q_MAX, Q_MAX), vw.round().clamp(-Q_MAX, Q_MAX)
    unit = scale_x.double() * scale_w.double()[:, 0]  # [N, M]
    acc = q_x @ q_w.T
    bias = torch.zeros(weight.shape[0], dtype=torch.float64) if bias is None else bias.detach().double()
    slack = (unit * (near_half(vx).double() @ q_w.abs().T + q_x.abs() @ near_half(vw).double().T)
             + 4 * EPS32 * (acc.abs() * unit + bias.abs()))
    return acc * unit + bias, scale_x.double(), scale_w.double()[:, 0], slack


@needs_exact_int_mm
@pytest.mark.parametrize("bias", [True, False])
def test_a_layer_computes_the_hand_quantisation(bias):
    """One layer on [N, K], [1, K] and [B, T, K] inputs with an all-zero row and a zero weight row: the hand
    quantisation within its slack; the codes are stored in both layouts, the same, within [-127, 127]."""
    linear = nn.Linear(48, 20, bias=bias)
    with torch.no_grad():
        linear.weight[3] = 0
    layer = TracedInt8Linear(linear)
    assert layer.weight_int8.dtype == torch.int8 and layer.weight_int8.abs().max() == Q_MAX
    assert torch.equal(layer.weight_int8_by_column, layer.weight_int8.t())
    assert not list(layer.parameters())
    x = 3 * torch.randn(2, 7, 48)
    x[1, 2] = 0
    for inputs in (x, x[0], x[0, :1]):  # (a single row takes the weight's other layout)
        got = layer(inputs)
        assert got.shape == (*inputs.shape[:-1], 20) and got.dtype == torch.float32
        expected, _, _, slack = hand_int8_linear(inputs.reshape(-1, 48), linear.weight, linear.bias)
        assert ((got.reshape(expected.shape).double() - expected).abs() <= slack).all()
    assert torch.equal(layer(x)[1, 2], torch.zeros(20) if linear.bias is None else linear.bias.detach())


@needs_exact_int_mm
@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_every_layer_of_every_type_is_the_hand_quantisation_within_the_rounding_bound(name):
    """Each int8 layer of every type, on the inputs it sees in a forward pass: the hand quantisation within its slack,
    and against the fp32 layer within what rounding allows (no clipping: each scale is its row's largest |value|):
    |x.w - x~.w~| <= |x - x~|.|w| + |x~|.|w - w~| <= (s_x / 2)|w|_1 + (s_w / 2)(|x|_1 + K s_x / 2). Every linear
    layer is int8 except the declared ones (INT8_KEEP)."""
    reference = contract_model(name).eval()
    model = copy.deepcopy(reference)
    before = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert model.quantize_int8(engine="traced") is model and model.is_int8
    layers = traced_layers(model)
    kept = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kept == {n for n in before if n.endswith(model.INT8_KEEP)} and kept | set(layers) == set(before)
    seen = {}

    def keep_first(layer_name):
        def hook(module, args, out):
            seen.setdefault(layer_name, (args[0], out))  # returns None: the output is left as it is
        return hook

    hooks = [module.register_forward_hook(keep_first(n)) for n, module in layers.items()]
    ids, mask = source_batch()
    decoder = torch.tensor([[model.config.decoder_start_token_id, 5, 9, 7, 12, 6]] * ids.shape[0])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder)
    for hook in hooks:
        hook.remove()
    assert set(seen) == set(layers), set(layers) - set(seen)  # every int8 layer ran
    for layer_name, (x, out) in seen.items():
        linear = before[layer_name]
        rows = x.reshape(-1, x.shape[-1])
        expected, scale_x, scale_w, slack = hand_int8_linear(rows, linear.weight, linear.bias)
        got = out.reshape(expected.shape).double()
        assert ((got - expected).abs() <= slack).all(), (layer_name, ((got - expected).abs() - slack).max().item())
        x64, w64 = rows.double(), linear.weight.detach().double()
        exact = x64 @ w64.T + (0 if linear.bias is None else linear.bias.detach().double())
        bound = (scale_x / 2 * w64.abs().sum(1) + (x64.abs().sum(1, keepdim=True) + x64.shape[1] * scale_x / 2)
                 * scale_w / 2)
        assert ((got - exact).abs() <= bound * (1 + 1e-6) + slack).all(), layer_name


# First-order rounding model (as tests/test_int8.py's, for this quantisation): each input element of an int8 layer
# gets an independent error uniform in +-s_x/2 of ITS ROW (variance s_x^2 / 12), each weight one of s_w_j^2 / 12; the
# float64 model's gradients carry them to every next-token probability (standard deviation sigma). Asserted: every
# |dp| <= SIGMAS sigma + FLOOR, and the rms of |dp| / sigma inside CALIBRATED (errors of the size the steps make).
SIGMAS = 6.0
CALIBRATED = (0.5, 2.0)
FLOOR = 1e-6  # fp32 rounding of the probabilities themselves
MIN_CLEAR = 30  # positions of decoding_batch's 80 where fp32's margin clears both bounds (57 seen)


def probability_sigma(reference, layer_names, ids, mask, decoder_ids, chunk=400):
    """sigma [B, T, V] of every next-token probability of the int8 model around the fp32 one under the model above."""
    model = copy.deepcopy(reference).double()
    errors, variances = [], []

    def add_errors(module, args):
        x = args[0]
        step_x = x.detach().abs().amax(-1, keepdim=True) / Q_MAX  # per row
        error_x = torch.zeros_like(x, requires_grad=True)
        step_w = module.weight.detach().abs().amax(1, keepdim=True) / Q_MAX
        error_w = torch.zeros_like(module.weight, requires_grad=True)
        errors.extend([error_x, error_w])
        variances.extend([(step_x**2 / 12).expand_as(x), (step_w**2 / 12).expand_as(module.weight)])
        module._weight_error = error_w
        return (x + error_x,)

    def add_weight_error(module, args, out):
        return out + nn.functional.linear(args[0], module._weight_error)

    hooks = [hook for name, module in model.named_modules() if name in layer_names
             for hook in (module.register_forward_pre_hook(add_errors), module.register_forward_hook(add_weight_error))]
    probabilities = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits.softmax(-1)
    for hook in hooks:
        hook.remove()
    flat = probabilities.reshape(-1)
    one_hot = torch.eye(flat.numel(), dtype=flat.dtype)
    variance = torch.zeros_like(flat)
    for start in range(0, flat.numel(), chunk):
        grads = torch.autograd.grad(flat, errors, grad_outputs=one_hot[start : start + chunk], retain_graph=True,
                                    is_grads_batched=True, allow_unused=True)
        for grad, var in zip(grads, variances):
            if grad is not None:
                variance[start : start + chunk] += (grad.square() * var).flatten(1).sum(1)
    return variance.sqrt().reshape(probabilities.shape).float()


@needs_exact_int_mm
def test_probabilities_and_greedy_tokens_follow_fp32_within_the_rounding(name="soft"):
    """Teacher-forced on fp32's greedy tokens (a fitted model): every int8 next-token probability within SIGMAS sigma
    of fp32's (rms of |dp| / sigma in CALIBRATED); int8's argmax is fp32's wherever fp32's top-1 minus top-2
    probability exceeds the sum of the two bounds, at MIN_CLEAR positions at least; int8 generate()'s greedy tokens
    are fp32's up to the first position that is not that clear."""
    reference = contract_model(name).eval()
    model = copy.deepcopy(reference).quantize_int8(engine="traced")
    ids, mask = decoding_batch()
    steps = 10
    with torch.no_grad():
        tokens = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                    do_sample=False)
        expected = reference(input_ids=ids, attention_mask=mask, decoder_input_ids=tokens[:, :-1]).logits.softmax(-1)
        got = model(input_ids=ids, attention_mask=mask, decoder_input_ids=tokens[:, :-1]).logits.softmax(-1)
    sigma = probability_sigma(reference, set(traced_layers(model)), ids, mask, tokens[:, :-1])
    error = (got - expected).abs()
    assert (error <= SIGMAS * sigma + FLOOR).all(), (error / sigma).max().item()
    counted = sigma > 1e-4
    rms = (error[counted] / sigma[counted]).square().mean().sqrt().item()
    assert CALIBRATED[0] <= rms <= CALIBRATED[1], rms
    expected[..., model.config.eos_token_id] = 0  # min_new_tokens keeps generate() from choosing EOS
    got[..., model.config.eos_token_id] = 0
    top = expected.topk(2, -1)
    bound = SIGMAS * sigma + FLOOR
    room = top.values[..., 0] - top.values[..., 1] - bound.gather(-1, top.indices).sum(-1)
    clear = room > 0
    assert clear.sum() >= MIN_CLEAR, clear.tolist()
    assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
    with torch.no_grad():
        int8_tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                     do_sample=False)
    for row in range(ids.shape[0]):
        n = int(clear[row].long().cumprod(0).sum())  # leading clear positions
        assert torch.equal(int8_tokens[row, : n + 1], tokens[row, : n + 1]), (row, n)


@pytest.mark.parametrize("name, backend, modes, engine", [("soft", "aot_eager", ("greedy",), "traced"),
                                                          ("hard_retrieval", "eager", ("greedy",), "traced"),
                                                          ("soft", "aot_eager", ("greedy", "beam"), "fbgemm")])
def test_compiled_int8_decoding_is_one_graph_with_the_eager_tokens(name, backend, modes, engine):
    """The int8 decoding step with a static cache under torch.compile (fullgraph=True: a graph break raises; one graph
    for greedy and sampling, one more for beam search), with the traced layers or with the packed fbgemm layers (their
    kernel called through packed_linear.INT8_LINEAR_OP), gives the eager static-cache steps' tokens, and their scores
    within 8 fp32 ulps of the step's largest |score| (`assert_step_scores_close`). Why that bound: the graph runs the
    int8 arithmetic as eager does (the same codes, exact int32 sums, the same rescale), and aot_eager's traced aten
    graph rounds a few fp32 operations around it in another order (seen: 1-2 ulps; dynamo alone, the second type:
    none). A code moved by such a difference (an activation at a rounding tie) would move a score by about a code
    step, 1/254 of its row's largest |value|: far outside the bound, so the check would see it. Inductor reorders
    more (fused reductions); its tokens are reported by benchmarks/int8_compile_probe.py."""
    if engine == "traced" and not TRACED_EXACT:
        pytest.skip("torch._int_mm is not exact here: the traced engine refuses")
    torch._dynamo.reset()
    model = copy.deepcopy(contract_model(name)).eval().quantize_int8(engine=engine)
    counter = Counter(backend)
    options = compiled_decoding(model, backend=counter)
    for mode in modes:
        eager = generate(model, mode, cache_implementation="static")
        assert len(torch.unique(eager.sequences)) >= 4, eager.sequences.tolist()
        compiled = generate(model, mode, **options)
        assert torch.equal(compiled.sequences, eager.sequences), (mode, compiled.sequences, eager.sequences)
        for step, (got, expected) in enumerate(zip(compiled.scores, eager.scores, strict=True)):
            assert_step_scores_close(got, expected, f"{name} {mode} step {step}")
        assert counter.compiled == (1 if mode == "greedy" else 2), (mode, counter.compiled)
    torch._dynamo.reset()


def test_a_copied_packed_layer_runs_compiled_after_its_first_eager_call():
    """The packed layers' operator finds a layer by its key buffer, registered by its eager calls: a copy of an int8
    model compiled before any eager call is a clear error; after one eager call the compiled forward (dynamo) gives
    the eager logits bit for bit (the same kernel on the same inputs, dynamo capturing the graph unchanged)."""
    torch._dynamo.reset()
    model = copy.deepcopy(contract_model("soft")).eval().quantize_int8()
    ids, mask = source_batch()
    decoder = torch.tensor([[model.config.decoder_start_token_id, 5, 9, 7]] * ids.shape[0])
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder)
    copied = copy.deepcopy(model)
    compiled = torch.compile(copied, fullgraph=True, backend="eager")
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"ran compiled before any eager call of it"):
        compiled(**inputs)
    with torch.no_grad():
        eager = copied(**inputs).logits
        assert torch.equal(compiled(**inputs).logits, eager) and torch.equal(model(**inputs).logits, eager)
    torch._dynamo.reset()


@needs_exact_int_mm
def test_compiled_int8_is_inference_only_and_not_saved(tmp_path):
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs()))
    with pytest.raises(ValueError, match=r"is for inference: call model.eval\(\) first"):
        model.quantize_int8(engine="traced")
    model.eval().pack_linears()
    model.quantize_int8(engine="traced")  # packed layers are unpacked first, then quantized
    assert traced_layers(model) and not any(isinstance(m, nn.Linear) for m in model.modules())
    for engine in ("traced", "fbgemm"):
        with pytest.raises(ValueError, match=r"already int8"):
            model.quantize_int8(engine=engine)
    with pytest.raises(ValueError, match=r"reload the fp32 checkpoint to train it"):
        model.train()
    with pytest.raises(ValueError, match=r"an int8 model \(quantize_int8\) is not saved"):
        model.save_pretrained(tmp_path)
    model.eval().to(torch.float32).float().cpu()  # moves that change nothing stay allowed
    for move in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double()):
        with pytest.raises(ValueError, match=r"take float32 inputs on the CPU, so it cannot move to torch."):
            move(model)
    assert traced_layers(model)["model.decoder.layers.0.ffn.module.fc1"].weight_int8.dtype == torch.int8


@pytest.mark.parametrize("engine", ["Traced", "compiled", ""])
def test_the_engine_error_names_the_traced_engine(engine):
    model = contract_model("soft").eval()
    with pytest.raises(ValueError, match=r"`engine`=.*allowed: \['fbgemm', 'onednn'\] .* or 'traced'"):
        model.quantize_int8(engine=engine)
    assert not model.is_int8


def test_the_traced_engine_refuses_where_int_mm_is_not_exact(monkeypatch):
    """The probe multiplies the largest codes (+-127 over 64 terms) in both layouts and compares with the exact
    integer products: a kernel whose 16-bit pair sums saturate (oneDNN without VNNI) fails it, and
    quantize_int8(engine="traced") then refuses, naming the engine and what is allowed."""
    def saturating(a, b):  # a shifted to u8 (+128), pairs of u8 x s8 products summed in int16 with saturation (as
        pairs = ((a.long() + 128)[:, :, None] * b.long()[None]).reshape(a.shape[0], -1, 2, b.shape[1]).sum(2)
        return (pairs.clamp(-2**15, 2**15 - 1).sum(1) - 128 * b.long().sum(0)).to(torch.int32)  # vpmaddubsw does)

    monkeypatch.delattr(int8_traced._int_mm_is_exact, "value", raising=False)
    monkeypatch.setattr(torch, "_int_mm", saturating)
    assert not int_mm_is_exact()
    with pytest.raises(ValueError, match=r"`engine`='traced' needs exact int8 products from torch._int_mm.*allowed "
                                         r"here: engine='fbgemm' or 'onednn'"):
        model = contract_model("soft", fit=False).eval()
        model.quantize_int8(engine="traced")
    assert not model.is_int8 and not traced_layers(model)  # refused before any change
    monkeypatch.delattr(int8_traced._int_mm_is_exact, "value")
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: (a.long() @ b.long()).to(torch.int32))
    assert int_mm_is_exact()
