"""Hard retrieval as a registered transformers attention implementation ("hard_retrieval" & co.) of stock MarianMTModel
and BartForConditionalGeneration, against independent references:

* inference: a naive per-head loop (argmax of q . k over the visible keys -> that value row) run inside the same
  model through a test-only attention implementation, with roles told by module identity and masks built from the
  test's own 2D inputs (not from transformers' mask functions);
* the encoder: the stock model's output (sdpa) and attention weights (eager);
* training: the draws against P = softmax(q k^T * scaling) written out here; hard_retrieval.py's own
  HardRetrievalAttention (sampled_retrieval: sample_indices + the HardRetrieval autograd function) for the draws, the
  outputs and the gradients, under the same seed;
* generate(): the KV cache against no cache, and a padded batch against each sentence alone.
"""

import copy

import pytest
import torch
from transformers import (AttentionInterface, BartConfig, BartForConditionalGeneration, MarianConfig,
                          MarianMTModel)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

import hf_hardattn  # noqa: F401  (registers the implementations)
from hf_hardattn.attention_interface import attention_role
from hf_hardattn.hard_retrieval import HardRetrievalAttention, HardRetrievalConfig

PAD, BOS, EOS = 0, 1, 2
STD = 0.5
# The roles each registered name makes hard (the paper's Table 3 rows), written out here, not read from the package
HARD_ROLES = {"hard_retrieval": ("decoder", "cross"), "hard_retrieval_cross": ("cross",),
              "hard_retrieval_all": ("encoder", "decoder", "cross")}
MODELS = {"marian": (MarianConfig, MarianMTModel), "bart": (BartConfig, BartForConditionalGeneration)}


def tiny(name, seed=0, dtype=torch.float64, **overrides):
    config_class, model_class = MODELS[name]
    kwargs = dict(vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=PAD, bos_token_id=BOS,
                  eos_token_id=EOS, decoder_start_token_id=BOS, forced_eos_token_id=None)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_class(config_class(**kwargs))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights far from uniform attention; Marian keeps its sinusoidal (unsaved) positions
        for param_name, param in model.named_parameters():
            if "embed_positions" in param_name and name == "marian":
                continue
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * STD)
            elif "norm" not in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval().to(dtype)


def roles_by_identity(model):
    """Role of every attention module, from where it sits in the model (not from its flags)."""
    base = model.model
    roles = {id(layer.self_attn): "encoder" for layer in base.encoder.layers}
    for layer in base.decoder.layers:
        roles[id(layer.self_attn)], roles[id(layer.encoder_attn)] = "decoder", "cross"
    return roles


def batch():
    """Source right-padded in row 1; decoder inputs right-padded in row 0 (decoder_attention_mask 0 there)."""
    src = torch.tensor([[5, 9, 13, 17, 21, 25, EOS], [7, 11, 19, 23, EOS, PAD, PAD]])
    dec = torch.tensor([[BOS, 6, 10, 14, PAD], [BOS, 8, 12, 16, 20]])
    dec_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    return dict(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=dec,
                decoder_attention_mask=dec_mask)


class Reference:
    """Test-only attention implementations sharing one state: the model's roles (by identity), the hard roles and the
    2D padding masks of the current batch."""

    roles, hard, src_mask, dec_mask, native = {}, (), None, None, {}

    @classmethod
    def visible(cls, role, batch_size, tq, tk):
        """[B, 1, Tq, Tk] bool: who may attend to whom, from the 2D inputs (decoder queries are the last Tq of Tk)."""
        if role == "decoder":
            causal = torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None]
            vis = causal[None] & cls.dec_mask[:batch_size, None, :tk].bool()
        else:
            vis = cls.src_mask[:batch_size, None, :tk].bool().expand(batch_size, tq, tk)
        return vis[:, None]

    @classmethod
    def naive(cls, module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """Eval reference: hard roles by a per-head loop over the visible keys, soft roles by softmax written out."""
        role = cls.roles[id(module)]
        batch_size, heads, tq, dim = q.shape
        vis = cls.visible(role, batch_size, tq, k.shape[2])
        if role not in cls.hard:
            scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~vis, float("-inf"))
            weights = torch.softmax(scores, -1)
            return (weights @ v).transpose(1, 2), weights
        out = torch.zeros_like(q)
        weights = torch.zeros(batch_size, heads, tq, k.shape[2], dtype=q.dtype)
        for b in range(batch_size):
            for h in range(heads):
                for i in range(tq):
                    keys = [j for j in range(k.shape[2]) if vis[b, 0, i, j]]
                    if not keys:  # a padding row: not compared
                        continue
                    best = max(keys, key=lambda j: float(q[b, h, i] @ k[b, h, j]))  # Eq. 11, raw scores
                    out[b, h, i], weights[b, h, i, best] = v[b, h, best], 1.0
        return out.transpose(1, 2), weights

    @classmethod
    def native_training(cls, module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """Training reference: hard roles by hard_retrieval.py's HardRetrievalAttention (sampling, dropout, the
        straight-through HardRetrieval function), soft roles by transformers' sdpa, masks from the 2D inputs."""
        role = cls.roles[id(module)]
        vis = cls.visible(role, q.shape[0], q.shape[2], k.shape[2])
        if role not in cls.hard:
            return sdpa_attention_forward(module, q, k, v, vis, dropout=dropout, scaling=scaling)
        native = cls.native[id(module)]
        native.train(module.training)
        out, weights = native.attend_with_weights(q, k, v, vis, causal=False)
        return out.transpose(1, 2), weights

    @classmethod
    def setup(cls, model, variant, inputs):
        cls.roles, cls.hard = roles_by_identity(model), HARD_ROLES[variant]
        cls.src_mask, cls.dec_mask = inputs["attention_mask"], inputs["decoder_attention_mask"]
        config = model.config
        native_config = HardRetrievalConfig(vocab_size=config.vocab_size, d_model=config.d_model,
                                            encoder_attention_heads=config.encoder_attention_heads,
                                            decoder_attention_heads=config.decoder_attention_heads,
                                            attention_dropout=config.attention_dropout)
        cls.native = {key: HardRetrievalAttention(native_config, role, 0) for key, role in cls.roles.items()}


AttentionInterface.register("_test_naive_hard", Reference.naive)
AttentionInterface.register("_test_native_training", Reference.native_training)


def forward(model, implementation, inputs, **kwargs):
    model.set_attn_implementation(implementation)
    return model(**inputs, **kwargs)


# --- registration and roles -------------------------------------------------------------------------------------


def test_every_variant_is_registered_with_attention_and_mask_interfaces():
    for name in HARD_ROLES:
        assert name in AttentionInterface._global_mapping and name in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("name", MODELS)
def test_role_rule_reads_module_flags(name):
    model = tiny(name)
    by_flags = {id(m): attention_role(m) for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "q_proj")}
    assert by_flags == roles_by_identity(model)
    with pytest.raises(ValueError, match="cannot tell"):
        attention_role(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", MODELS)
def test_from_pretrained_and_set_attn_implementation(name, tmp_path):
    model = tiny(name)
    model.save_pretrained(tmp_path)
    loaded = MODELS[name][1].from_pretrained(tmp_path, attn_implementation="hard_retrieval", dtype=torch.float64)
    assert loaded.config._attn_implementation == "hard_retrieval"
    inputs = batch()
    with torch.no_grad():
        from_load = loaded.eval()(**inputs).logits
        set_later = forward(model, "hard_retrieval", inputs).logits
        stock = forward(model, "sdpa", inputs).logits
    assert torch.allclose(from_load, set_later, atol=1e-12, rtol=0)  # (stock sdpa differs by ~1e-15 after loading too)
    assert not torch.allclose(set_later, stock, atol=1e-3)


# --- inference against the naive loop ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("variant", HARD_ROLES)
def test_inference_equals_naive_per_head_loop(name, variant):
    model, inputs = tiny(name), batch()
    Reference.setup(model, variant, inputs)
    with torch.no_grad():
        ours = forward(model, variant, inputs, output_attentions=True)
        ref = forward(model, "_test_naive_hard", inputs, output_attentions=True)
    with torch.no_grad():  # without output_attentions the soft roles run sdpa rather than eager
        fused = forward(model, variant, inputs)
    real = inputs["decoder_attention_mask"].bool()  # padding rows of the decoder are not compared
    assert torch.allclose(ours.logits[real], ref.logits[real], atol=1e-10, rtol=0)
    assert torch.allclose(fused.logits[real], ref.logits[real], atol=1e-10, rtol=0)
    for kind in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        for got, expected in zip(getattr(ours, kind), getattr(ref, kind), strict=True):
            rows = torch.ones_like(got, dtype=torch.bool)
            if kind != "encoder_attentions":
                rows = real[:, None, :, None].expand_as(got)
            assert torch.allclose(got[rows], expected[rows], atol=1e-10, rtol=0), kind
    for role in ("encoder", "decoder", "cross"):
        for got in getattr(ours, f"{role}_attentions"):  # one-hot exactly where hard
            one_hot = set(got.unique().tolist()) == {0.0, 1.0} and bool(torch.all(got.sum(-1) == 1))
            assert one_hot == (role in HARD_ROLES[variant]), role


@pytest.mark.parametrize("name", MODELS)
def test_encoder_left_soft_equals_stock_model(name):
    model, inputs = tiny(name), batch()
    with torch.no_grad():
        for variant in ("hard_retrieval", "hard_retrieval_cross"):
            ours = forward(model, variant, inputs).encoder_last_hidden_state
            assert torch.equal(ours, forward(model, "sdpa", inputs).encoder_last_hidden_state)
            ours = forward(model, variant, inputs, output_attentions=True)
            stock = forward(model, "eager", inputs, output_attentions=True)
            assert torch.equal(ours.encoder_last_hidden_state, stock.encoder_last_hidden_state)
            for got, expected in zip(ours.encoder_attentions, stock.encoder_attentions, strict=True):
                assert torch.equal(got, expected)
        hard_encoder = forward(model, "hard_retrieval_all", inputs).encoder_last_hidden_state
        assert not torch.allclose(hard_encoder, forward(model, "sdpa", inputs).encoder_last_hidden_state, atol=1e-3)


def test_mask_formats_bool_additive_and_implicit_causal_agree():
    """What a caller may hand the function as a ready mask: bool, additive float (0 / dtype minimum), or None for
    decoder self-attention (causal, the queries being the last Tq keys)."""
    model = tiny("marian")
    module = model.model.decoder.layers[0].self_attn
    function = AttentionInterface._global_mapping["hard_retrieval"]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64) for t in (3, 6, 6))
    causal = torch.arange(6)[None, :] <= torch.arange(3, 6)[:, None]
    bool_mask = causal[None, None].expand(2, 1, 3, 6)
    additive = torch.zeros(bool_mask.shape, dtype=torch.float64).masked_fill(~bool_mask, torch.finfo(torch.float64).min)
    outs = [function(module, q, k, v, m, scaling=module.scaling)[0] for m in (bool_mask, additive, None)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    full = function(module, q, k, v, torch.ones_like(bool_mask), scaling=module.scaling)[0]
    assert not torch.equal(outs[0], full)  # the mask matters for these scores


# --- training against hard_retrieval.py -------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["decoder", "cross"])
def test_training_draws_outputs_and_gradients_equal_hard_retrieval_module(role):
    """Under one seed: the same sampled indices (drawn from P, attention dropout then dropping retrieved rows), outputs
    and straight-through gradients (sampled_retrieval) as hard_retrieval.py's HardRetrievalAttention."""
    model = tiny("marian", attention_dropout=0.3).train()
    layer = model.model.decoder.layers[0]
    module = layer.self_attn if role == "decoder" else layer.encoder_attn
    native = HardRetrievalAttention(HardRetrievalConfig(d_model=32, decoder_attention_heads=4, attention_dropout=0.3),
                                    role, 0).train()
    function = AttentionInterface._global_mapping["hard_retrieval"]
    g = torch.Generator().manual_seed(4)
    tq, tk = (6, 6) if role == "decoder" else (6, 7)
    q, k, v = (torch.randn(3, 4, t, 8, generator=g, dtype=torch.float64) for t in (tq, tk, tk))
    mask = torch.ones(3, 1, tq, tk, dtype=torch.bool)
    mask[1, ..., tk - 2:] = False  # padding
    if role == "decoder":
        mask &= torch.ones(tq, tk, dtype=torch.bool).tril()
    grad_out = torch.randn(3, 4, tq, 8, generator=g, dtype=torch.float64)
    results = []
    for run in ("ours", "native"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(11)
        if run == "ours":
            out, weights = function(module, *leaves, mask, scaling=module.scaling, dropout=module.dropout,
                                    output_attentions=True)
            out = out.transpose(1, 2)
        else:
            out, weights = native.attend_with_weights(*leaves, mask, causal=False)
        grads = torch.autograd.grad((out * grad_out).sum(), leaves)
        results.append((out, weights, grads))
    (out, weights, grads), (ref_out, ref_weights, ref_grads) = results
    assert torch.equal(weights, ref_weights) and torch.equal(out, ref_out)
    for got, expected in zip(grads, ref_grads):
        assert torch.equal(got, expected)
    assert all(g.abs().sum() > 0 for g in grads)  # straight-through reaches queries and keys too
    assert not weights[~mask.expand_as(weights)].any()  # never a masked key
    model.eval()
    with torch.no_grad():
        argmax = function(module, q, k, v, mask, scaling=module.scaling, output_attentions=True)[1]
    assert not torch.equal(weights, argmax)  # training samples, inference takes the argmax
    torch.manual_seed(11)
    model.train()
    kept, no_dropout = function(module, q, k, v, mask, scaling=module.scaling, dropout=0.0, output_attentions=True)
    assert torch.equal(weights, no_dropout)  # attention dropout acts after the draw: the same keys are drawn
    assert not torch.equal(out, kept.transpose(1, 2))  # and then drops some of the retrieved rows


def test_training_draws_follow_the_softmax_of_the_scaled_scores_written_out():
    """The registered function's training draws follow P = softmax(q k^T * scaling) (Eq. 1-2, 4-5), written out here,
    with the scaling transformers passes (not the module's 1 / sqrt(d_k)) over the visible keys; a query row with no
    visible key draws over all of its keys. Scores chosen so that another scale, a missing softmax or an argmax would
    each fail; counts against P by Pearson's chi-square at p = 0.001."""
    model = tiny("marian", dtype=torch.float32).train()
    module = model.model.decoder.layers[0].encoder_attn
    function = AttentionInterface._global_mapping["hard_retrieval"]
    rows, heads, dim, scaling = 20_000, 4, 8, 0.7
    k = torch.zeros(rows, heads, 5, dim)
    k[..., 0] = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    q = torch.zeros(rows, heads, 1, dim)
    q[..., 0] = 1.0
    v = (torch.arange(5.0) + 1).view(1, 1, 5, 1).expand(rows, heads, 5, dim)  # value row i holds i + 1
    mask = torch.ones(rows, 1, 1, 5, dtype=torch.bool)
    mask[: rows // 2, ..., 3] = False  # first half: key 3 hidden
    mask[rows // 2:] = False  # second half: no visible key
    torch.manual_seed(3)
    out, _ = function(module, q, k, v, mask, scaling=scaling, dropout=0.0)
    drawn = out[:, 0, :, 0].round().long() - 1  # [rows, heads]
    scores = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64) * scaling
    for part, hidden in ((drawn[: rows // 2], [3]), (drawn[rows // 2:], [])):
        probs = torch.softmax(scores.masked_fill(torch.isin(torch.arange(5), torch.tensor(hidden)), -torch.inf), -1)
        counts = torch.bincount(part.flatten(), minlength=5).double()
        expected = probs * counts.sum()
        assert (counts[probs == 0] == 0).all(), counts
        chi2 = (((counts - expected) ** 2)[probs > 0] / expected[probs > 0]).sum().item()
        assert chi2 < {3: 16.27, 4: 18.47}[int((probs > 0).sum()) - 1], (chi2, counts.tolist(), probs.tolist())


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("variant", ["hard_retrieval", "hard_retrieval_all"])
def test_training_step_equals_native_hard_retrieval_reference(name, variant):
    """A whole fine-tuning step (dropout, attention dropout, labels): loss and every parameter gradient equal those of
    the same model whose hard roles run hard_retrieval.py's module and whose soft roles run sdpa, with roles by module
    identity and masks from the 2D inputs."""
    model, inputs = tiny(name, dropout=0.1, attention_dropout=0.2), batch()
    inputs["labels"] = inputs["decoder_input_ids"].masked_fill(inputs["decoder_attention_mask"] == 0, -100)
    Reference.setup(model, variant, inputs)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for implementation in (variant, "_test_native_training"):
        torch.manual_seed(5)
        loss = forward(model, implementation, inputs).loss
        results.append((loss, torch.autograd.grad(loss, params, allow_unused=True)))
    (loss, grads), (ref_loss, ref_grads) = results
    assert torch.isfinite(loss) and torch.allclose(loss, ref_loss, atol=1e-12, rtol=0)
    for got, expected in zip(grads, ref_grads):
        assert (got is None) == (expected is None)
        if got is not None:
            assert torch.allclose(got, expected, atol=1e-12, rtol=0)
    torch.manual_seed(6)  # another seed draws other keys: the comparison above saw sampling, not a fixed path
    assert not torch.allclose(forward(model, variant, inputs).loss, loss)


def test_training_with_a_fully_masked_query_row_stays_finite():
    """A left-padded decoder mask leaves the first query row with no visible key: its draw is over all keys
    (hard_retrieval.py's softmax would give NaN there); the loss over the real tokens is finite."""
    model, inputs = tiny("marian", attention_dropout=0.1), batch()
    inputs["decoder_attention_mask"] = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    inputs["labels"] = inputs["decoder_input_ids"].masked_fill(inputs["decoder_attention_mask"] == 0, -100)
    model.train()
    loss = forward(model, "hard_retrieval", inputs).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --- generate() ---------------------------------------------------------------------------------------------------


def _generate(model, ids, mask, mode, use_cache, **kwargs):
    extra = dict(num_beams=4, num_return_sequences=2) if mode == "beam" else {}
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          use_cache=use_cache, return_dict_in_generate=True, output_scores=True, **extra, **kwargs)


_GENERATE_MODELS = {}
GENERATE_SEEDS = range(20)


def generate_model(name):
    """The tiny float64 model (hard_retrieval set) of the first seed whose decoding of batch() could show a bug: in
    greedy and in beam search, at least 4 distinct tokens, and other tokens than sdpa gives. Searched here, on this
    CPU's random weights (torch's normal sampling rounds differently per CPU kind), not assumed of a fixed seed.
    Built once: do not modify it."""
    if name not in _GENERATE_MODELS:
        inputs = batch()
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        tried = {}
        for seed in GENERATE_SEEDS:
            model = tiny(name, seed=seed)
            stock = {mode: _generate(model, ids, mask, mode, True).sequences for mode in ("greedy", "beam")}
            model.set_attn_implementation("hard_retrieval")
            hard = {mode: _generate(model, ids, mask, mode, True).sequences for mode in ("greedy", "beam")}
            tried[seed] = {mode: len(hard[mode].unique()) for mode in hard}
            if all(len(hard[m].unique()) >= 4 and not torch.equal(hard[m], stock[m]) for m in hard):
                _GENERATE_MODELS[name] = model
                break
        assert name in _GENERATE_MODELS, (f"no seed in {GENERATE_SEEDS} gives {name} weights whose hard-retrieval "
                                          f"decoding has >= 4 distinct tokens and differs from sdpa's (distinct "
                                          f"tokens per seed: {tried}): the cache and batching checks could not fail")
    return _GENERATE_MODELS[name]


@pytest.mark.usefixtures("one_thread")  # tiny models: much faster on one thread when the cores are shared
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_generate_cache_equals_no_cache_and_padded_batch_equals_alone(name, mode):
    model = copy.deepcopy(generate_model(name))  # hard_retrieval set; varied output, unlike sdpa's (searched)
    inputs = batch()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    cached, uncached = (_generate(model, ids, mask, mode, use_cache) for use_cache in (True, False))
    # (>= 4 distinct tokens and other tokens than sdpa's: chosen so by generate_model's search, not asserted again)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores, strict=True):
        assert torch.allclose(a, b, atol=1e-9)
    per_row = cached.sequences.shape[0] // ids.shape[0]
    # the two sentences decode differently, so the comparison with each alone below sees rows mixed in the batch
    assert not torch.equal(cached.sequences[:per_row], cached.sequences[per_row:])
    for i in range(ids.shape[0]):
        length = int(mask[i].sum())
        alone = _generate(model, ids[i:i + 1, :length], mask[i:i + 1, :length], mode, True).sequences
        assert torch.equal(alone, cached.sequences[i * per_row:(i + 1) * per_row])


def test_generate_output_attentions_under_the_cache_equal_one_full_forward():
    model = tiny("marian")
    model.set_attn_implementation("hard_retrieval")
    inputs = batch()
    out = _generate(model, inputs["input_ids"], inputs["attention_mask"], "greedy", True, output_attentions=True)
    with torch.no_grad():
        source = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        full = forward(model, "hard_retrieval", dict(source, decoder_input_ids=out.sequences[:, :-1]),
                       output_attentions=True)
    for step, layers in enumerate(out.cross_attentions):  # step t's weights = row t of one full forward's
        for layer, weights in enumerate(layers):
            assert torch.equal(weights[:, :, -1], full.cross_attentions[layer][:, :, step])
    for step, layers in enumerate(out.decoder_attentions):
        for layer, weights in enumerate(layers):
            assert torch.equal(weights[:, :, -1], full.decoder_attentions[layer][:, :, step, :weights.shape[-1]])


# ----------------------------------------------------------------------------------------------------------------
# The registered implementation == the same checkpoint converted to hard_retrieval_transformer
# ----------------------------------------------------------------------------------------------------------------
CONVERTED_TYPES = {"hard_retrieval": {}, "hard_retrieval_cross": {"decoder_attention": "soft"},
                   "hard_retrieval_all": {"encoder_attention": "hard_retrieval"}}


@pytest.mark.parametrize("variant", list(CONVERTED_TYPES))
@pytest.mark.parametrize("name", MODELS)
def test_registered_implementation_equals_the_converted_model(name, variant, monkeypatch):
    """The same checkpoint run by transformers' model with the registered implementation and converted to
    hard_retrieval_transformer (hf_hardattn.tools.convert, hard in the same roles): the same logits at inference (float64),
    the same greedy and beam-4 tokens, and in training, with the converted model given the indices the stock model
    sampled (transformers' layer-drop draws move the random stream on some releases), the same loss and gradients."""
    import hf_hardattn.hard_retrieval as module

    stock = tiny(name)
    stock.set_attn_implementation(variant)
    converted = hf_hardattn.convert(stock, "hard_retrieval_transformer", **CONVERTED_TYPES[variant]).eval()
    inputs = batch()
    with torch.no_grad():
        torch.testing.assert_close(converted(**inputs).logits, stock(**inputs).logits, rtol=0, atol=1e-10)
    src = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=8,
               min_new_tokens=8)
    for beams in (1, 4):
        assert torch.equal(converted.generate(**src, num_beams=beams), stock.generate(**src, num_beams=beams))

    drawn, sample = [], module.sample_indices

    def record(probs):
        drawn.append(sample(probs))
        return drawn[-1]

    replay = iter(drawn)
    labels = torch.tensor([[6, 10, 14, 18, EOS], [8, 12, EOS, -100, -100]])
    results = {}
    for key, model in (("stock", stock), ("converted", converted)):
        monkeypatch.setattr(module, "sample_indices", record if key == "stock" else lambda probs: next(replay))
        model.train()
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels)
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 40), labels.reshape(-1))  # one loss for both
        loss.backward()
        results[key] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad()
        model.eval()
    assert len(drawn) == 2 * len(HARD_ROLES[variant])  # one draw per hard layer (2 layers per role)
    assert next(replay, None) is None  # the converted model used every one of them
    torch.testing.assert_close(results["converted"][0], results["stock"][0], rtol=0, atol=1e-10)
    shared_stock = results["stock"][1]["model.shared.weight"]
    torch.testing.assert_close(results["converted"][1]["model.shared.weight"], shared_stock, rtol=0, atol=1e-10)
