"""The tokenizer saved with a model (``save_pretrained(folder, tokenizer=...)``) loads with ``AutoTokenizer`` at once,
with no ``[y/N]`` prompt, for every model type: in a fresh process without hf_hardattn (``trust_remote_code=True``, as
the card's snippet passes it) and in one that imported hf_hardattn (no flag).

Why the flag without the package: transformers' ``AutoTokenizer.from_pretrained`` reads the folder's model config
through ``AutoConfig`` before its tokenizer config, and ``AutoConfig`` asks before it runs the ``auto_map`` code of a
model type it does not know (15 s, then it falls back to a plain config). No tokenizer file changes that; the folder's
``auto_map`` is what lets ``AutoModelForSeq2SeqLM`` load it as remote code.

Reference: the toy tokenizer the folders were saved with, its ids for the same text. The fresh processes keep stdin
open, so a prompt would wait its 15 s and fail the time bound.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import tiny_kwargs, toy_tokenizer
from hf_hardattn.registry import MODEL_TYPES, model_classes

REPO = Path(__file__).resolve().parent.parent
TEXT = "t5 t9 t13 </s>"
SCRIPT = r'''
import json, sys, time
mode, folders = sys.argv[1], json.loads(sys.argv[2])
if mode == "without package":
    sys.modules["hf_hardattn"] = None  # a user without the package: the folder's remote code only
    kwargs = {"trust_remote_code": True}
else:
    import hf_hardattn  # noqa: F401  (registers the model types)
    kwargs = {}
from transformers import AutoTokenizer

result = {}
for name, folder in folders.items():
    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    result[name] = dict(seconds=time.time() - started, ids=tokenizer(TEXT)["input_ids"], cls=type(tokenizer).__name__)
print("RESULT" + json.dumps(result))
'''.replace("TEXT", repr(TEXT))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizer_folders")
    saved = {}
    for model_type in MODEL_TYPES:
        config_class, model_class = model_classes(model_type)
        rnn = dict(decoder_layers=1, rnn_hidden_size=32) if MODEL_TYPES[model_type].rnn_decoder else {}
        torch.manual_seed(0)
        model_class(config_class(**tiny_kwargs(**rnn))).save_pretrained(root / model_type, tokenizer=toy_tokenizer())
        saved[model_type] = str(root / model_type)
    return saved


@pytest.mark.parametrize("mode", ["without package", "with package"])
def test_saved_tokenizer_loads_at_once_without_a_prompt(mode, folders, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", HF_MODULES_CACHE=str(tmp_path / "modules"),
               PYTHONPATH="" if mode == "without package" else str(REPO))
    workdir = tmp_path / "fresh"  # an empty folder: the project is not on the path by accident
    workdir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, json.dumps(folders)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir)
    try:
        output, _ = proc.communicate(timeout=240)  # (stdin stays open until then: a prompt would wait)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert "[y/N]" not in output and "model of type ``" not in output, output[-3000:]
    result = json.loads(output.split("RESULT", 1)[1].splitlines()[0])
    expected = toy_tokenizer()(TEXT)["input_ids"]
    assert set(result) == set(MODEL_TYPES)
    for model_type, loaded in result.items():
        assert loaded["ids"] == expected, model_type
        # a prompt waits 15 s; the first load without the package also imports the folder's code (2-6 s on 2 cores)
        assert loaded["seconds"] < 12, (model_type, loaded)
