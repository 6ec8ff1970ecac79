"""quantize_int8(): every linear layer of every model type (except those a model reads by weight) becomes
torch's dynamic int8 linear, and each one computes exactly what the quantisation written out by hand computes; the
error against fp32 stays inside the bound that rounding allows, per layer and, as stated, for the whole fixed soft
model; decoding with the cache follows decoding without it; training and saving the int8 model are refused."""

import copy

import pytest
import torch
from torch import nn

from common import CONTRACT_MODELS, contract_model, decode_step_by_step, decoding_batch, source_batch, tiny_kwargs
from hf_hardattn import SoftTransformerConfig, SoftTransformerForConditionalGeneration
from hf_hardattn.int8 import INT8_ENGINES
from hf_hardattn.packed_linear import Int8Linear

pytestmark = pytest.mark.numerics  # CPU-dependent rounding: .ci/run runs these under other kernels too


def quantized_linears(model):
    """The int8 layers: torch's dynamic int8 Linear, as ``packed_linear.Int8Linear`` (its shorter call path)."""
    layers = {name: module for name, module in model.named_modules()
              if isinstance(module, torch.ao.nn.quantized.dynamic.Linear)}
    assert all(type(module) is Int8Linear for module in layers.values()), {type(m) for m in layers.values()}
    return layers


def fp32_linears(model):
    return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def fp32_greedy(model, ids, mask, steps=10):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                          do_sample=False)


def log_probs(model, ids, mask, decoder_ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits.float().log_softmax(-1)


def near_half(values, tolerance=1e-4):
    """Where ``values`` (a value over its scale) lies within ``tolerance`` of a rounding boundary k + 1/2: there the
    kernel's float32 arithmetic (a product with 1 / s, another order of operations) may round to the other integer.
    Away from them it cannot: the two computations differ by a few ulps of |v| <= 128, about 1e-5."""
    return ((values - values.floor()) - 0.5).abs() < tolerance


def hand_int8_linear(x, weight, bias):
    """torch's dynamic int8 linear (fbgemm) written out: weights int8 with one symmetric scale per output row,
    s_j = max|w_j| / 127.5, q = round(w * (1 / s_j)); the input quantised as a whole to 7-bit unsigned integers with
    s_x = (max(x, 0) - min(x, 0)) / 127 (0.1 for an all-zero input) and the zero point (from the end with the smaller
    error) rounded; products accumulated exactly (float64 here), bias added in fp32.

    Also returns the slack the kernel is allowed against this emulation, in quantisation steps of the actual scales:
    an input element at a rounding tie may land one step (s_x) away, which moves output j by s_x |w~_jk|; a weight at
    a tie moves it by s_w_j |x~_k|; and the kernel converts the int32 sum to float32 (a few ulps of the terms' sum)."""
    x, weight = x.detach().float(), weight.detach().float()
    scale_w = weight.abs().amax(1) / 127.5
    q_w = torch.clamp(torch.round(weight * (1 / scale_w)[:, None]), -128, 127)
    low, high = torch.clamp(x.min(), max=0), torch.clamp(x.max(), min=0)
    scale_x = (high - low) / 127
    scale_x = torch.where(scale_x == 0, 0.1, scale_x)  # an all-zero input (a zero initial state): fbgemm's 0.1
    from_min, from_max = -low / scale_x, 127 - high / scale_x
    zero = torch.round(from_min if (low / scale_x).abs() < 127 + (high / scale_x).abs() else from_max).clamp(0, 127)
    q_x = torch.clamp(torch.round(x / scale_x) + zero, 0, 127)
    x_hat = (q_x - zero).double() * scale_x.double()
    w_hat = q_w.double() * scale_w.double()[:, None]
    out = x_hat @ w_hat.T
    bias = torch.zeros(weight.shape[0], dtype=torch.float64) if bias is None else bias.detach().double()
    tie_x, tie_w = near_half(x / scale_x).double(), near_half(weight * (1 / scale_w)[:, None]).double()
    slack = (scale_x.double() * (tie_x @ w_hat.abs().T) + (x_hat.abs() + scale_x.double()) @ (tie_w * scale_w.double()[:, None]).T
             + 8 * torch.finfo(torch.float32).eps * (x_hat.abs() @ w_hat.abs().T + bias.abs()))
    return out + bias, scale_x.double(), scale_w.double(), slack


ENGINES = [name for name in INT8_ENGINES if name in torch.backends.quantized.supported_engines]


def torchs_dynamic_linear(linear, engine="fbgemm"):
    """torch's own dynamic int8 Linear for an fp32 ``linear``, packed for ``engine`` (the reference of the tests
    below)."""
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return quantize_dynamic(nn.Sequential(linear), {nn.Linear: per_channel_dynamic_qconfig},
                                    dtype=torch.qint8)[0]
    finally:
        torch.backends.quantized.engine = previous


def test_both_int8_engines_are_there():
    """fbgemm and oneDNN ship in torch's x86 builds (so no engine test below is left out)."""
    assert ENGINES == list(INT8_ENGINES), torch.backends.quantized.supported_engines


@pytest.mark.parametrize("engine", [None, *ENGINES])
def test_quantize_int8_packs_for_the_named_engine_on_every_cpu(engine, monkeypatch):
    """Every layer quantize_int8 makes is packed for the named engine (fbgemm when none is named), whatever
    `torch.backends.quantized.engine` says (set to the other engine here; the "x86" engine would choose per CPU),
    which it leaves as it was; and it returns, bit for bit, what torch's dynamic Linear packed for that engine returns
    from the same fp32 layer. (The engines' outputs differ in the last bits on the CPUs seen, but that is no
    guarantee: the engine at packing time is recorded where torch packs.)"""
    from torch.ao.nn.quantized.modules.linear import LinearPackedParams

    reference = contract_model("soft").eval()
    expected_engine = engine or "fbgemm"
    packed_under, pack = [], LinearPackedParams.set_weight_bias
    monkeypatch.setattr(LinearPackedParams, "set_weight_bias", lambda self, weight, bias: (
        packed_under.append(torch.backends.quantized.engine), pack(self, weight, bias))[1])
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = next(name for name in ENGINES if name != expected_engine)
    try:
        model = copy.deepcopy(reference)
        model = model.quantize_int8() if engine is None else model.quantize_int8(engine=engine)
        assert torch.backends.quantized.engine != expected_engine
    finally:
        torch.backends.quantized.engine = previous
    monkeypatch.undo()
    layers = quantized_linears(model)
    assert layers and len(packed_under) >= len(layers) and set(packed_under) == {expected_engine}, packed_under
    for name, layer in layers.items():
        torchs = torchs_dynamic_linear(copy.deepcopy(reference.get_submodule(name)), expected_engine)
        x = 3 * torch.randn(2, 5, layer.in_features)
        assert torch.equal(layer(x), torchs(x)), name


@pytest.mark.parametrize("engine", ["x86", "qnnpack", "FBGEMM", None])
def test_quantize_int8_names_the_engines_it_takes(engine):
    model = contract_model("soft").eval()
    with pytest.raises(ValueError, match=r"`engine`=.*allowed: \['fbgemm', 'onednn'\]"):
        model.quantize_int8(engine=engine)
    assert not model.is_int8 and not quantized_linears(model)


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_is_torchs_dynamic_linear_bit_for_bit(bias):
    """`Int8Linear` (the shorter call path quantize_int8 swaps in) returns what torch's dynamic int8 Linear returns for
    the same packed weights, bit for bit, on [N, d] and [B, T, d] inputs; it takes only that layer."""
    torchs = torchs_dynamic_linear(nn.Linear(48, 20, bias=bias))
    ours = Int8Linear.swap_into(copy.deepcopy(torchs))
    assert type(torchs) is torch.ao.nn.quantized.dynamic.Linear and type(ours) is Int8Linear
    for x in (torch.randn(5, 48), 3 * torch.randn(2, 7, 48)):
        expected = torchs(x)
        assert torch.equal(ours(x), expected) and expected.shape == (*x.shape[:-1], 20)
    with pytest.raises(TypeError, match="takes torch's dynamic int8 Linear"):
        Int8Linear.swap_into(nn.Linear(4, 4))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_every_layer_computes_the_hand_quantisation(name, engine):
    """Each int8 layer of every type, packed for either engine, on the inputs it sees in a forward pass, equals the
    quantisation by hand (so the weights are per output channel, the activation 7-bit per tensor, nothing else is
    approximated: fbgemm and oneDNN quantise alike and differ in rounding only), and its error
    against the fp32 layer is inside what rounding allows: |x.w - x~.w~| <= s_x |w|_1 + (s_w / 2) |x|_1
    + K s_x s_w / 2 (activation rounding, clipping included, <= s_x; weight rounding <= s_w / 2). Every linear layer
    is int8 except the declared ones (the hybrid's GRU/LSTM gate projections, an nn.Linear subclass, included)."""
    reference = contract_model(name).eval()
    model = copy.deepcopy(reference)
    before = fp32_linears(model)
    assert model.quantize_int8(engine=engine) is model
    kept, quantized = fp32_linears(model), quantized_linears(model)
    assert set(kept) == {n for n in before if n.endswith(model.INT8_KEEP)} and set(kept) | set(quantized) == set(before)
    seen = {}

    def keep_first(layer_name):
        def hook(module, args, out):
            seen.setdefault(layer_name, (args[0], out))  # returns None: the output is left as it is
        return hook

    hooks = [module.register_forward_hook(keep_first(n)) for n, module in quantized.items()]
    ids, mask = source_batch()
    log_probs(model, ids, mask, fp32_greedy(reference, ids, mask)[:, :-1])
    for hook in hooks:
        hook.remove()
    assert set(seen) == set(quantized), set(quantized) - set(seen)  # every int8 layer ran
    for layer_name, (x, out) in seen.items():
        layer = before[layer_name]
        expected, scale_x, scale_w, slack = hand_int8_linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.bias)
        got = out.reshape(expected.shape).double()
        assert ((got - expected).abs() <= slack).all(), (layer_name, ((got - expected).abs() - slack).max().item())
        x64, w64 = x.reshape(-1, x.shape[-1]).double(), layer.weight.detach().double()
        exact = x64 @ w64.T + (0 if layer.bias is None else layer.bias.detach().double())
        bound = (scale_x * w64.abs().sum(1) + x64.abs().sum(1, keepdim=True) * scale_w / 2
                 + x64.shape[1] * scale_x * scale_w / 2)
        assert ((got - exact).abs() <= bound * (1 + 1e-6)).all(), layer_name


# The stated bound for the fixed soft model of the contract tests, derived from the quantisation steps, not observed.
# int8 rounds each input element of a call to one step s_x of that call and each weight to the step s_w_j of its
# output row; as a model of that rounding, independent errors uniform in +-s/2 (variance s^2 / 12). To first order a
# next-token probability p moves by sum over the int8 layers of (dp/dx) . dx + (dp/dW) . dW, whose standard deviation
# sigma follows from the float64 model's gradients (`int8_probability_sigma`). The model is calibrated: |dp| / sigma
# measured rms 0.94 (full forward) / 0.89 (cached steps), at most 3.7 / 2.9 over 1,352 probabilities (AVX2 EPYC; 0.95 /
# 0.89 under ATEN_CPU_CAPABILITY=default).
# Asserted: every |dp| <= SIGMAS sigma (a normal tail of 2e-9 each) and the rms of |dp| / sigma inside CALIBRATED
# (errors far larger, or far smaller, than the steps make would mean another computation than int8 rounding).
SIGMAS = 6.0
CALIBRATED = (0.5, 2.0)
FLOOR = 1e-6  # fp32 rounding of the probabilities themselves, where sigma is ~0 (p ~ 0 or 1)
# Types whose output chooses (hard retrieval's argmax over keys, beam-joint's top-K): a small score change may pick
# another key, a jump that no first-order model of the rounding describes (|dp| / sigma rms 9 on hard retrieval).
CHOOSING = ("hard_retrieval", "beam_joint_transformer", "beam_joint_rnn", "beam_joint_rnn_bahdanau")


def int8_probability_sigma(reference, int8_model, ids, mask, decoder_ids, rounding=("input", "weight"), chunk=400,
                           of=None):
    """The standard deviation [B, T, V] of every next-token probability of the int8 model around the fp32 model's, to
    first order, under the rounding model above: the input of each int8 layer of ``int8_model`` gets an error of
    variance s_x^2 / 12 per element (s_x = (max(x, 0) - min(x, 0)) / 127 of that call's whole input, as fbgemm's 7-bit
    per-tensor quantisation), its weight one of variance s_w_j^2 / 12 (s_w_j = max|w_j| / 127.5, per output row),
    the same for all of the layer's calls (an RNN's steps). The full forward's steps: a cached step quantises a
    subset of those rows, so its steps are no larger. ``rounding=("input",)``: the inputs' share alone. For types whose
    output is differentiable in every layer's (not hard retrieval's argmax or beam-joint's top-K: CHOOSING); for those,
    the sigma with the float64 model's choices held fixed (valid where int8 chooses as it does). ``of``: a function of
    the float64 model returning, from one forward pass, other values whose sigma is wanted (the selection scores)."""
    int8_layers = set(quantized_linears(int8_model))
    model = copy.deepcopy(reference).double()
    errors, variances, weight_errors = [], [], {}

    def input_and_weight_errors(module, args):
        x = args[0]
        low, high = x.detach().min().clamp(max=0), x.detach().max().clamp(min=0)
        step_x = (high - low) / 127
        step_x = torch.where(step_x == 0, 0.1, step_x)  # fbgemm's scale for an all-zero input
        if module not in weight_errors:  # one rounded weight for all of a layer's calls (an RNN's steps)
            step_w = module.weight.detach().abs().amax(1, keepdim=True) / 127.5
            weight_errors[module] = torch.zeros_like(module.weight, requires_grad=True)
            errors.append(weight_errors[module])
            variances.append((step_w**2 / 12).expand_as(module.weight) * ("weight" in rounding))
        error_x = torch.zeros_like(x, requires_grad=True)  # each call quantises its own input
        errors.append(error_x)
        variances.append(step_x**2 / 12 * ("input" in rounding))
        return (x + error_x,)

    def add_weight_error(module, args, out):  # the rounded weight's share alone (a tied weight's other uses stay)
        return out + nn.functional.linear(args[0], weight_errors[module])

    hooks = [hook for name, module in model.named_modules() if name in int8_layers
             for hook in (module.register_forward_pre_hook(input_and_weight_errors),
                          module.register_forward_hook(add_weight_error))]
    if of is None:
        probabilities = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits.softmax(-1)
    else:
        probabilities = of(model)
    for hook in hooks:
        hook.remove()
    assert len(weight_errors) == len(int8_layers), "every int8 layer runs in the forward pass"
    flat = probabilities.reshape(-1)
    one_hot = torch.eye(flat.numel(), dtype=flat.dtype)
    variance = torch.zeros_like(flat)
    for start in range(0, flat.numel(), chunk):
        grads = torch.autograd.grad(flat, errors, grad_outputs=one_hot[start : start + chunk], retain_graph=True,
                                    is_grads_batched=True, allow_unused=True)  # one gradient per probability
        for grad, var in zip(grads, variances):  # (None: a call whose output no logit uses, an RNN's last gates)
            if grad is not None:
                variance[start : start + chunk] += (grad.square() * var).flatten(1).sum(1)
    return variance.sqrt().reshape(probabilities.shape).float()


def assert_errors_match_the_rounding(error, sigma, path=""):
    """Every probability error within SIGMAS sigma, and the errors of the size the steps make (rms of |dp| / sigma over
    the probabilities that int8 rounding moves measurably inside CALIBRATED)."""
    assert (error <= SIGMAS * sigma + FLOOR).all(), (path, (error / sigma).max().item())
    counted = sigma > 1e-4
    rms = (error[counted] / sigma[counted]).square().mean().sqrt().item()
    assert CALIBRATED[0] <= rms <= CALIBRATED[1], (path, rms)


def sources_with_clear_margins(reference, count=4, pool=64, margin=0.16, steps_needed=10):
    """``count`` sources (ids, mask, and per source that number of steps) out of ``pool`` random ones on which fp32
    greedy decoding has the most steps whose top-2 probability margin (EOS left out: min_new_tokens keeps generate()
    from choosing it) exceeds ``margin`` before the first that does not: chosen, not left to how one CPU rounds the
    fitted model, so that the token check below has steps to compare."""
    ids = torch.randint(5, 30, (pool, 7), generator=torch.Generator().manual_seed(0))
    ids[:, -1] = reference.config.eos_token_id
    mask = torch.ones_like(ids)
    greedy = fp32_greedy(reference, ids, mask)
    p = log_probs(reference, ids, mask, greedy[:, :-1]).exp()
    top = p.index_fill(-1, torch.tensor([reference.config.eos_token_id]), -1.0).topk(2, -1).values
    clear_steps = (top[..., 0] - top[..., 1] > margin).long().cumprod(1).sum(1)
    chosen = clear_steps.argsort(descending=True, stable=True)[:count]
    assert clear_steps[chosen].sum() >= steps_needed, (
        f"the fixed soft model decodes no {count} of {pool} sources with {steps_needed} clear greedy steps: "
        f"{clear_steps.tolist()}; is it still fitted (common.contract_model)?")
    return ids[chosen], mask[chosen], clear_steps[chosen]


@pytest.mark.parametrize("engine", ENGINES)
def test_stated_error_bound_and_greedy_tokens_on_the_fixed_soft_model(engine):
    """On the fixed soft model and 4 sources (chosen for clear fp32 margins): every int8 next-token probability, of the
    full forward and of the cached steps, within SIGMAS sigma of fp32's on fp32's greedy output (sigma derived from
    the quantisation steps), the errors of the size the steps predict (rms of |dp| / sigma); so wherever fp32's top-2
    probability margin over every other token exceeds their two bounds the int8 argmax is fp32's, and int8 greedy
    decoding (generate) keeps fp32's tokens up to the first step whose margins do not allow it. The number of such
    steps is not left to the CPU: the sources were chosen with >= 10 steps of fp32 top-2 margin > 0.16, and where
    every bound there is below 0.08 (asserted: the premise) each of those steps is one of them. Either engine."""
    reference = contract_model("soft").eval()
    model = copy.deepcopy(reference).quantize_int8(engine=engine)
    ids, mask, selected = sources_with_clear_margins(reference)
    greedy = fp32_greedy(reference, ids, mask)
    expected, got = log_probs(reference, ids, mask, greedy[:, :-1]), log_probs(model, ids, mask, greedy[:, :-1])
    with torch.no_grad():
        stepped = decode_step_by_step(model, greedy[:, :-1], input_ids=ids, attention_mask=mask)[0].log_softmax(-1)
    sigma = int8_probability_sigma(reference, model, ids, mask, greedy[:, :-1])
    for path, log_p in (("full forward", got), ("cached steps", stepped)):
        assert_errors_match_the_rounding((log_p.exp() - expected.exp()).abs(), sigma, path)
    bound = SIGMAS * sigma + FLOOR  # no probability moves more

    def without_eos(log_p):  # min_new_tokens keeps generate() from choosing EOS: it competes with no token here
        return log_p.exp().index_fill(-1, torch.tensor([model.config.eos_token_id]), -1.0)

    p = without_eos(expected)
    top = p.argmax(-1, keepdim=True)
    room = p.gather(-1, top) - bound.gather(-1, top) - (p + bound)  # top-1's lowest minus each other's highest
    clear = (room.scatter(-1, top, 1.0) > 0).all(-1)  # (int8's argmax is fp32's there: implied by the bound above)
    int8_greedy = fp32_greedy(model, ids, mask)
    allowed = clear.long().cumprod(1).sum(1)  # per source: the steps before its first unclear margin
    steps = torch.arange(bound.shape[1])[None, :] < selected[:, None]  # the selection's clear steps, per source
    assert bound.amax(-1)[steps].max() < 0.16 / 2, bound.amax(-1)  # premise: a margin > 0.16 beats two bounds
    assert (allowed >= selected).all(), (allowed.tolist(), selected.tolist())  # so those steps are allowed
    for row, steps in enumerate(allowed.tolist()):  # position 0 is the start token, step t predicts position t + 1
        assert torch.equal(int8_greedy[row, : steps + 1], greedy[row, : steps + 1]), row


def total_variation(log_p, log_q):
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


# A cached step quantises the activations of one position, the full forward those of all positions at once (other
# scales): their next-token distributions differ by int8 noise, and where a hard choice (hard retrieval's argmax,
# beam-joint's top-K) flips between the two, one position may differ much (log-probabilities by 4, total variation
# 0.25, seen on beam_joint_rnn). So the bound is on the mean total variation over positions: seen at most 0.015 on
# every type and CPU kind, against 0.2-0.6 for a cache that loses the past (the negative control below). For smooth
# types also derived, per probability: |p_step - p_full| / (sqrt(2) sigma of the inputs' rounding) measured at most
# 1.42-3.37 (rms 0.40-0.79: a step's scales are smaller) over the nine, 483-2903 for the forgetful cache.
CACHE_MEAN_TV = 0.05


def decode_forgetting_the_past(model, decoder_ids, **inputs):
    """Negative control: each step gets a fresh cache, as a cache that kept nothing would."""
    steps = [model(**inputs, decoder_input_ids=decoder_ids[:, t : t + 1], use_cache=True).logits
             for t in range(decoder_ids.shape[1])]
    return torch.cat(steps, 1)


def forgetful_tv(model, ids, mask):
    """Per source: the mean total variation between a forgetful cache's next-token distributions and the full
    forward's, on the model's greedy output."""
    decoder_ids = fp32_greedy(model, ids, mask)[:, :-1]
    with torch.no_grad():
        forgetful = decode_forgetting_the_past(model, decoder_ids, input_ids=ids, attention_mask=mask).float()
    return total_variation(forgetful.log_softmax(-1), log_probs(model, ids, mask, decoder_ids)).mean(-1)


def past_dependent_batch(model, size=2, candidates=16, tries=6):
    """``size`` sources whose int8 output depends on the past, by construction: of `decoding_batch()`'s first
    ``candidates`` sentences, the longest where a cache that forgets the past moves the mean total variation
    (`forgetful_tv`) above 4 x CACHE_MEAN_TV, checked again as the batch that is returned (a sentence's int8 outputs
    depend on the others', which share the activation scales: one failing there gives way to the next candidate).
    As many sentences as `source_batch()` (the smooth types' sigma costs time per sentence); the longest, as the
    fitted model is surest while it reverses the source. A model fitted on the reversal task can nearly ignore the
    past on some sources (the next token follows from the current one when the source has no repeats): on
    `source_batch()` the hard-retrieval model's forgetful cache read a mean total variation of 0.17 (AVX2 EPYC) and
    0.06 under MKL's and oneDNN's SSE kernels, against the check's own threshold of 0.05."""
    ids, mask = decoding_batch(extra=candidates - 2)
    tv, lengths = forgetful_tv(model, ids, mask).tolist(), mask.sum(1).tolist()
    ranked = [i for i in sorted(range(len(tv)), key=lambda i: (-lengths[i], -tv[i])) if tv[i] > 4 * CACHE_MEAN_TV]
    for _ in range(tries):
        assert len(ranked) >= size, (f"fewer than {size} of {candidates} sources make the fitted model's output depend "
                                     f"on the past (per-source mean total variation of a forgetful cache, all "
                                     f"{candidates} together: {[round(x, 3) for x in tv]}; needed above "
                                     f"{4 * CACHE_MEAN_TV}): raise `candidates`")
        rows = ranked[:size]
        width = max(lengths[row] for row in rows)
        chosen = ids[rows, :width], mask[rows, :width]
        passes = forgetful_tv(model, *chosen) > 4 * CACHE_MEAN_TV
        if passes.all():
            return chosen
        ranked = [row for row, ok in zip(rows, passes.tolist()) if ok] + ranked[size:]
    raise AssertionError(f"no {size} past-dependent sources in {tries} tries: raise `tries` or `candidates`")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_int8_decoding_with_the_cache_follows_the_full_forward(name, engine):
    """int8 cached steps against the int8 full forward: mean total variation within CACHE_MEAN_TV (a forgetful cache
    is caught), and for smooth types every probability within SIGMAS sqrt(2) sigma of the inputs' rounding (the
    weights' is the same in both paths; the forgetful cache breaks it too); generate()'s greedy tokens are the argmax
    of the cached steps, exactly (the same computation; against the full forward, tokens may flip where int8 noise
    exceeds a margin, and the total variation bounds that); int8 beam search returns its best beam's score as the sum
    of the log-probabilities it chose its tokens by (its own steps, batch of beams: a re-stepped batch of other rows
    has other activation scales). Sources: `past_dependent_batch`, chosen so that a forgetful cache's mean total
    variation exceeds 4 x CACHE_MEAN_TV on this batch (the negative control, asserted there). Either engine."""
    model = copy.deepcopy(contract_model(name)).eval().quantize_int8(engine=engine)
    ids, mask = past_dependent_batch(model)
    decoder_ids = fp32_greedy(model, ids, mask)[:, :-1]
    full = log_probs(model, ids, mask, decoder_ids)
    with torch.no_grad():
        stepped = decode_step_by_step(model, decoder_ids, input_ids=ids, attention_mask=mask)[0].float()
        forgetful = decode_forgetting_the_past(model, decoder_ids, input_ids=ids, attention_mask=mask).float()
    assert total_variation(stepped.log_softmax(-1), full).mean() <= CACHE_MEAN_TV
    if name not in CHOOSING:  # derived: the two paths share the rounded weights, their inputs are rounded apart, each
        sigma = int8_probability_sigma(contract_model(name).eval(), model, ids, mask, decoder_ids,
                                       rounding=("input",))  # with at most the full forward's steps
        gap = (stepped.softmax(-1) - full.exp()).abs()
        assert (gap <= SIGMAS * 2**0.5 * sigma + FLOOR).all(), (gap / sigma).max().item()
        assert ((forgetful.softmax(-1) - full.exp()).abs() > SIGMAS * 2**0.5 * sigma + FLOOR).any()
    allowed = stepped.clone()  # generate()'s greedy steps are these cached steps (same batch, same cache contents)
    allowed[..., model.config.eos_token_id] = float("-inf")  # min_new_tokens keeps generate() from choosing EOS
    assert torch.equal(decoder_ids[:, 1:], allowed.argmax(-1)[:, :-1])
    with torch.no_grad():  # beam search: the returned score is the sum (length_penalty 0) of its chosen steps' scores
        beam = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, num_beams=3,
                              length_penalty=0.0, return_dict_in_generate=True, output_scores=True)
    chosen = model.compute_transition_scores(beam.sequences, beam.scores, beam.beam_indices, normalize_logits=False)
    # the same fp32 numbers summed in another order: 6 terms, within 6 eps of the sum of their magnitudes (gamma_6)
    slack = 6 * torch.finfo(torch.float32).eps * chosen.abs().sum(1)
    assert ((beam.sequences_scores - chosen.sum(1)).abs() <= slack).all(), (beam.sequences_scores, chosen)
    assert (chosen < 0).all() and (chosen > float("-inf")).all()  # log-probabilities of real choices


def recorded_choices(run, forced=None):
    """Run ``run()`` recording every choice a CHOOSING type makes: hard retrieval's argmax over the raw masked scores
    (Eq. 11) and beam-joint's top-K of log P_t(a) (Eq. 5), as (scores [..., Tq, Tk], chosen indices [..., Tq, k]) in
    call order. ``forced``: such a record of another run; each call then returns that run's choice (its scores still
    its own, a top-K's weights gathered from them and renormalised as the model does) instead of its own, which is
    recorded. Returns (what ``run`` returns, the record)."""
    from hf_hardattn import beam_joint, hard_retrieval
    from hf_hardattn.hard_retrieval import masked_scores

    record, argmax, top_k = [], hard_retrieval.inference_indices, beam_joint.select_candidates

    def choose_by_argmax(q, k, mask, causal):
        index = argmax(q, k, mask, causal)
        record.append((masked_scores(q @ k.transpose(-1, -2), mask, causal), index[..., None]))
        return index if forced is None else forced[len(record) - 1][1][..., 0]

    def choose_top_k(log_p, k, full_joint, renormalize):
        log_w, index = top_k(log_p, k, full_joint, renormalize)
        record.append((log_p, index))
        if forced is None:
            return log_w, index
        index = forced[len(record) - 1][1]
        log_w = log_p.gather(-1, index)
        return (log_w - torch.logsumexp(log_w, -1, keepdim=True) if renormalize else log_w), index

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hard_retrieval, "inference_indices", choose_by_argmax)
        patch.setattr(beam_joint, "select_candidates", choose_top_k)
        out = run()
    assert record and (forced is None or len(record) == len(forced)), (len(record), forced and len(forced))
    return out, record


def choice_room(scores, index, bound=0.0):
    """Per choice [..., Tq]: the lowest chosen score minus the highest other one, each moved by ``bound`` against it
    (> 0: the same keys are chosen by any scores within ``bound`` of these)."""
    chosen = torch.zeros(scores.shape, dtype=torch.bool).scatter(-1, index, True)
    low = (scores - bound).masked_fill(~chosen, float("inf")).amin(-1)
    return low - (scores + bound).masked_fill(chosen, float("-inf")).amax(-1)


def same_choices(a, b):
    return torch.equal(a.sort(-1).values, b.sort(-1).values)


# Choosing types against fp32. The scores a choice is made on are smooth functions of the int8 layers as long as the
# earlier choices are the same, so the int8 model runs with fp32's choices (`recorded_choices(forced=...)`): then every
# score and every next-token probability is inside the first-order rounding model (SIGMAS sigma of the quantisation
# steps, sigma from the float64 model holding the same choices), at every position. Where fp32's choice is clear of the
# bounds on both (CHOICE_ROOM of room, scores within SIGMAS sigma + SCORE_FLOOR), int8's own choice is fp32's: implied
# by the score bound, and asserted. Not every position can qualify by its whole chain of choices: hard retrieval's
# 56 encoder choices per source have margins down to 0.04 against score bounds up to 1.5 (measured), so a flip
# upstream is expected and the comparison holds the choices instead. The count of clear choices is not left to the
# CPU: the sources are picked (`sources_with_clear_choices`) with MIN_CLEAR_CHOICES choices of fp32 margin above
# CHOICE_MARGIN, and where every score bound there is below CHOICE_MARGIN / 2 (asserted: the premise) each of them is
# clear. Score units, per type: hard retrieval's raw QK^T (|S| ~ 2-7), beam-joint's log P_t(a); each margin is about
# 3x the largest score bound of its type (hard retrieval 1.1-1.7, beam-joint 0.1-0.4).
CHOICE_MARGIN = {"hard_retrieval": 4.0, "beam_joint_transformer": 0.6, "beam_joint_rnn": 0.8,
                 "beam_joint_rnn_bahdanau": 0.3}
MIN_CLEAR_CHOICES = {"hard_retrieval": 80, "beam_joint_transformer": 4, "beam_joint_rnn": 4,
                     "beam_joint_rnn_bahdanau": 4}  # of 304 / 12 choices per 2 sources
SCORE_FLOOR = 1e-4  # relative: fp32 rounding of a score itself (FP32_PATHS_RTOL, 3.1e-5 of the largest, is below it)


def sources_with_clear_choices(reference, kind, count=2, pool=64, length=7, decoder_length=6):
    """``count`` unpadded sources (ids, mask, decoder ids) out of ``pool`` random ones whose teacher-forced fp32 pass
    makes the most choices with margin (`choice_room`) above CHOICE_MARGIN[kind]; asserts MIN_CLEAR_CHOICES of them."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 30, (pool, length), generator=generator)
    ids[:, -1] = reference.config.eos_token_id
    decoder = torch.randint(5, 30, (pool, decoder_length), generator=generator)
    decoder[:, 0] = reference.config.decoder_start_token_id
    mask = torch.ones_like(ids)
    with torch.no_grad():
        _, record = recorded_choices(lambda: reference(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder))
    # 1% above the margin: a choice counted here is counted in the test's own (smaller) batch, whose fp32 rounding
    # differs from this one's by far less (FP32_PATHS_RTOL)
    clear = sum((choice_room(scores, index) > 1.01 * CHOICE_MARGIN[kind]).flatten(1).sum(1) for scores, index in record)
    chosen = clear.argsort(descending=True, stable=True)[:count]
    assert clear[chosen].sum() >= MIN_CLEAR_CHOICES[kind], (
        f"no {count} of {pool} sources give {MIN_CLEAR_CHOICES[kind]} fp32 choices of margin above "
        f"{CHOICE_MARGIN[kind]}: {clear.tolist()}; is the model still fitted (common.contract_model)?")
    return ids[chosen], mask[chosen], decoder[chosen]


def plain_joint_log_probs(hidden, log_weights, weight, *args, **kwargs):
    """Eq. 4-5 written out, log sum_k w_k softmax(W h_k): the beam-joint mixture (its factored kernel's backward takes
    no batched gradients) for the float64 model of the sigma."""
    return torch.logsumexp(log_weights[..., None] + (hidden @ weight.T).log_softmax(-1), dim=-2)


def flat_scores(record):
    """The finite scores of a record, flattened (masked keys, -inf, as 0: they are never chosen)."""
    scores = torch.cat([scores.flatten() for scores, _ in record])
    return torch.where(scores.isfinite(), scores, 0.0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_every_type_decodes_in_int8_close_to_fp32(name, engine):
    """Every type's int8 next-token probabilities against fp32 on a teacher-forced batch. Smooth types (every output
    a differentiable function of every int8 layer): within SIGMAS sigma of the quantisation-step model, errors of its
    size (rms of |dp| / sigma in CALIBRATED; measured 0.88-1.14 over the nine). Choosing types (see CHOICE_MARGIN):
    with fp32's choices held, every score a choice is made on and every probability within that model; int8's own
    choice is fp32's wherever fp32's margin clears both scores' bounds, on at least MIN_CLEAR_CHOICES choices (the
    sources' selection and the premise). A broken layer (wrong weights, wrong kept list) moves them far outside."""
    reference = contract_model(name).eval()
    model = copy.deepcopy(reference).quantize_int8(engine=engine)
    if name not in CHOOSING:
        ids, mask = source_batch()
        decoder = torch.tensor([[model.config.decoder_start_token_id, 5, 9, 7, 12, 6]] * ids.shape[0])
        expected, got = log_probs(reference, ids, mask, decoder), log_probs(model, ids, mask, decoder)
        sigma = int8_probability_sigma(reference, model, ids, mask, decoder)
        assert_errors_match_the_rounding((got.exp() - expected.exp()).abs(), sigma, name)
        return
    kind = name
    ids, mask, decoder = sources_with_clear_choices(reference, kind)  # choices of margin > 1.01 CHOICE_MARGIN
    expected, fp32 = recorded_choices(lambda: log_probs(reference, ids, mask, decoder))
    got, int8 = recorded_choices(lambda: log_probs(model, ids, mask, decoder), forced=fp32)
    records = {}

    def with_fp32_choices(what):  # the float64 model, holding fp32's choices; ``what``: its probabilities or scores
        def forward(model64):
            from hf_hardattn import beam_joint

            with pytest.MonkeyPatch.context() as patch:  # the mixture's plain form: batched gradients go through it
                patch.setattr(beam_joint, "joint_log_probs", plain_joint_log_probs)
                out, records[what] = recorded_choices(
                    lambda: model64(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder), forced=fp32)
            return out.logits.softmax(-1) if what == "probabilities" else flat_scores(records[what])
        return forward

    sigma = int8_probability_sigma(reference, model, ids, mask, decoder, of=with_fp32_choices("probabilities"))
    assert_errors_match_the_rounding((got.exp() - expected.exp()).abs(), sigma, (name, "probabilities"))
    score_sigma = int8_probability_sigma(reference, model, ids, mask, decoder, of=with_fp32_choices("scores"))
    fp32_scores = flat_scores(fp32)
    score_error = (flat_scores(int8) - fp32_scores).abs()
    floor = SCORE_FLOOR * fp32_scores.abs().max()
    assert_errors_match_the_rounding(score_error - floor, score_sigma, (name, "scores"))  # (floor: see SCORE_FLOOR)
    clear_choices, offset = 0, 0
    for (scores, index), (_, int8_index) in zip(fp32, int8):
        bound = (SIGMAS * score_sigma[offset : offset + scores.numel()] + floor).view(scores.shape)
        offset += scores.numel()
        margin = choice_room(scores, index)
        clear = choice_room(scores, index, bound) > 0  # int8's scores, within the bound, choose as fp32's
        selected = margin > CHOICE_MARGIN[kind]
        premise = bound.masked_fill(~selected[..., None], 0).amax()
        assert premise < CHOICE_MARGIN[kind] / 2, premise  # so every selected choice is clear
        assert clear[selected].all()
        assert same_choices(index[clear], int8_index[clear]), (index[clear], int8_index[clear])
        clear_choices += selected.sum().item()
    assert clear_choices >= MIN_CLEAR_CHOICES[kind], clear_choices  # the selection's, each clear


@pytest.mark.parametrize("name", ["beam_joint_transformer", "beam_joint_rnn", "beam_joint_rnn_bahdanau"])
def test_beam_joint_with_nothing_kept_calls_its_int8_layers(name):
    """With ``INT8_KEEP`` emptied, beam-joint's output layer and candidate readout are int8 too, and the model calls
    them rather than reading a weight they no longer have: its log-probabilities are Eq. 4-5 by hand on the int8
    output layer's own outputs for the candidates (log sum_k w_k softmax(z_k))."""
    model = copy.deepcopy(contract_model(name)).eval()
    model.INT8_KEEP = ()
    model.quantize_int8()
    layers = {"lm_head": model.lm_head, "readout": getattr(model.model.decoder, "readout_proj", None)}
    assert all(layer is None or layer in quantized_linears(model).values() for layer in layers.values())
    seen = {}

    def record(layer_name):
        def hook(module, args, out):
            seen.setdefault(layer_name, []).append(out)  # returns None: the output is left as it is
        return hook

    hooks = [layer.register_forward_hook(record(n)) for n, layer in layers.items() if layer is not None]
    ids, mask = source_batch()
    decoder = torch.tensor([[model.config.decoder_start_token_id, 5, 9, 7]] * ids.shape[0])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder)
    for hook in hooks:
        hook.remove()
    assert set(seen) == {n for n, layer in layers.items() if layer is not None}
    (logits,) = seen["lm_head"]  # once, on every candidate [B, T, K, V]
    with torch.no_grad():  # the attention beam's weights: the bare model's output
        log_w = model.model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder).candidate_log_weights
    expected = torch.logsumexp(log_w.float()[..., None] + logits.float().log_softmax(-1), dim=-2)
    assert torch.equal(out.logits, expected)


def test_int8_is_inference_only_and_not_saved(tmp_path):
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs()))
    with pytest.raises(ValueError, match=r"is for inference: call model.eval\(\) first"):
        model.quantize_int8()
    model.eval().pack_linears()
    model.quantize_int8()  # packed layers are unpacked first, then quantized
    assert quantized_linears(model) and not fp32_linears(model)
    with pytest.raises(ValueError, match=r"already int8"):
        model.quantize_int8()
    with pytest.raises(ValueError, match=r"reload the fp32 checkpoint to train it"):
        model.train()
    with pytest.raises(ValueError, match=r"an int8 model \(quantize_int8\) is not saved"):
        model.save_pretrained(tmp_path)
    model.eval()  # eval stays allowed
    model.to(torch.float32).float().cpu()  # so do moves that change nothing
    for move in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to(dtype=torch.float16)):
        with pytest.raises(ValueError, match=r"take float32 inputs on the CPU, so it cannot move to torch.(b)?float16"):
            move(model)


def test_a_bfloat16_model_is_not_quantized():
    model = SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs())).eval().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"needs an fp32 model on the CPU .*torch.bfloat16 on cpu"):
        model.quantize_int8()
    assert not getattr(model, "is_int8", False)
