"""The bare encoder-decoder of every model type through ``AutoModel`` (as ``MarianModel`` for ``MarianMTModel``).

A saved folder loads with ``AutoModel.from_pretrained`` as the type's bare class, with the package and as remote code
in a fresh process without it; that class is the full model's ``.model`` (one set of state-dict keys). Its outputs
are the full model's decoder states, in float64: the full model's output layer on the bare model's
``last_hidden_state`` gives the full model's logits (the beam-joint types: the mixture of the bare model's candidates,
written out here with ``logsumexp``, independently of the chunked kernel), the cache continues decoding as the full
model's, and hidden states and attention weights are the full model's.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModel

import hf_hardattn  # noqa: F401  (registers the model types)
from common import DECODER_INPUTS, JOINT_TYPES, TYPE_MODELS, TYPE_NAMES, WITHOUT_PACKAGE, randomize, source_batch
from hf_hardattn.beam_joint import BeamJointModelOutput
from hf_hardattn.caches import CACHE_FIELD
from hf_hardattn.registry import MODEL_TYPES, base_model_class


def saved(name, folder):
    """A randomised float64 model of type ``name`` (eval mode), saved in ``folder``."""
    torch.manual_seed(0)
    model = randomize(TYPE_MODELS[name]()).double().eval()
    model.save_pretrained(folder)
    return model


def reference_logits(full, bare_output, name):
    """The full model's logits from the bare model's output, written out: ``lm_head`` (+ ``final_logits_bias``) on
    the last hidden state; for beam-joint, log sum_k exp(log w_k + log_softmax(lm_head(h_k))) (Eq. 4-5)."""
    if name in JOINT_TYPES:
        assert isinstance(bare_output, BeamJointModelOutput) and "last_hidden_state" not in bare_output
        candidates = torch.log_softmax(full.lm_head(bare_output.candidate_hidden_states), dim=-1)  # [B, T, K, V]
        return torch.logsumexp(bare_output.candidate_log_weights.unsqueeze(-1) + candidates, dim=2)
    logits = full.lm_head(bare_output.last_hidden_state)
    return logits if full.final_logits_bias is None else logits + full.final_logits_bias


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_auto_model_loads_the_bare_model_whose_states_give_the_full_models_outputs(name, tmp_path):
    full = saved(name, tmp_path)
    model_type = full.config.model_type
    bare_class = base_model_class(model_type)
    assert type(full.model) is bare_class and bare_class.config_class is type(full.config)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"]["AutoModel"] == \
        f"{MODEL_TYPES[model_type].module}.{bare_class.__name__}"
    bare = AutoModel.from_pretrained(tmp_path).double().eval()
    assert type(bare) is bare_class
    assert bare.state_dict().keys() == {key.removeprefix("model.") for key in full.state_dict()
                                        if key.startswith("model.")}
    ids, mask = source_batch()
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=DECODER_INPUTS, use_cache=False,
                  output_attentions=True, output_hidden_states=True)
    with torch.no_grad():
        want, got = full(**inputs), bare(**inputs)
        torch.testing.assert_close(reference_logits(full, got, name), want.logits, rtol=1e-10, atol=1e-10)
    for field in ("encoder_last_hidden_state", "encoder_hidden_states", "encoder_attentions", "decoder_hidden_states",
                  "decoder_attentions", "cross_attentions"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-12, atol=1e-12, msg=field)
    if name not in JOINT_TYPES:  # the last decoder hidden state is the output layer's input
        torch.testing.assert_close(got.last_hidden_state, want.decoder_hidden_states[-1], rtol=1e-12, atol=1e-12)
    assert isinstance(bare(**inputs, return_dict=False), tuple)


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_the_bare_models_cache_continues_decoding_as_the_full_model(name, tmp_path):
    """Two steps through the bare model's cache give the states of one uncached call on both tokens."""
    full = saved(name, tmp_path)
    bare = full.model
    ids, mask = source_batch()
    with torch.no_grad():
        encoder_outputs = bare.encoder(ids, mask, return_dict=True)
        whole = bare(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=DECODER_INPUTS[:, :3],
                     use_cache=False)
        first = bare(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=DECODER_INPUTS[:, :2],
                     use_cache=True)
        cache = getattr(first, CACHE_FIELD)
        assert cache is not None and cache.get_seq_length() == 2
        step = bare(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=DECODER_INPUTS[:, 2:3],
                    cache=cache, use_cache=True)
        full_step = full(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=DECODER_INPUTS[:, :3],
                         use_cache=False)
    want = reference_logits(full, whole, name)
    torch.testing.assert_close(reference_logits(full, step, name), want[:, 2:3], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(want, full_step.logits, rtol=1e-10, atol=1e-10)


REMOTE = WITHOUT_PACKAGE + textwrap.dedent(
    """
    import torch
    from transformers import AutoModel
    ids, mask, dec = (torch.tensor(x) for x in json.loads(sys.argv[3]))
    result = {}
    for folder in sorted(os.listdir(sys.argv[2])):
        model = AutoModel.from_pretrained(os.path.join(sys.argv[2], folder), trust_remote_code=True).double().eval()
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, use_cache=False)
        result[folder] = {"class": type(model).__name__, "module": type(model).__module__,
                          "outputs": {key: value.tolist() for key, value in out.items()
                                      if isinstance(value, torch.Tensor)}}
    print("RESULT" + json.dumps(result))
    """
)


def test_auto_model_loads_every_bare_model_as_remote_code_without_the_package(tmp_path):
    """A fresh process where hf_hardattn is not importable, offline: ``AutoModel.from_pretrained(folder,
    trust_remote_code=True)`` gives the type's bare class from the folder's code, with the outputs of here."""
    ids, mask = source_batch()
    here = {}
    for name in TYPE_NAMES:
        full = saved(name, tmp_path / "models" / name)
        with torch.no_grad():
            out = full.model(input_ids=ids, attention_mask=mask, decoder_input_ids=DECODER_INPUTS, use_cache=False)
        here[name] = (type(full.model).__name__, out)
    work = tmp_path / "fresh"
    work.mkdir()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(hf_hardattn.__file__)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="", HF_MODULES_CACHE=str(tmp_path / "modules_cache"))
    batch = json.dumps([ids.tolist(), mask.tolist(), DECODER_INPUTS.tolist()])
    run = subprocess.run([sys.executable, "-c", REMOTE, repo, str(tmp_path / "models"), batch], capture_output=True,
                         text=True, env=env, cwd=work, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT")]
    assert run.returncode == 0 and lines, run.stdout[-2000:] + run.stderr[-4000:]
    remote = json.loads(lines[-1][len("RESULT"):])
    assert sorted(remote) == TYPE_NAMES
    for name, (class_name, out) in here.items():
        assert remote[name]["class"] == class_name and remote[name]["module"].startswith("transformers_modules."), name
        got = remote[name]["outputs"]
        want = {key: value for key, value in out.items() if isinstance(value, torch.Tensor)}
        assert sorted(got) == sorted(want), name
        for key, value in want.items():
            torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64), value, rtol=1e-12, atol=1e-12,
                                       msg=f"{name} {key}")
