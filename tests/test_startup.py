"""Start-up of the hf-hardattn command: `--help`, `--version`, every light subcommand's `--help` and `score` load
neither the Trainer, datasets, the data / tokenizer / training tooling nor any transformers model's code
(``transformers.models.*`` but the Auto classes'); train, distill and reproduce load their own modules for their
`--help` (their options are defined there). Checked on ``sys.modules`` of a fresh process (a module that
``lazy_import`` named but nothing has read counts as not loaded), not on time.

What stays: ``import hf_hardattn`` registers every model type with AutoConfig / AutoModelForSeq2SeqLM, which needs
torch, transformers' Auto classes and the package's model files.
"""

import json
import subprocess
import sys

import pytest

PROBE = r'''
import importlib.util, json, sys
argv = sys.argv[1:]
from hf_hardattn.tools.cli import main
try:
    status = main(argv)
except SystemExit as stop:
    status = stop.code
loaded = [name for name, module in list(sys.modules.items())
          if not isinstance(module, importlib.util._LazyModule)]
print("LOADED" + json.dumps(dict(status=status, modules=loaded)))
'''

HEAVY_TOOLS = ("data", "distill", "reproduce", "tokenization", "train_cli", "trainer_card", "training", "metrics")


BASELINE = r'''
import importlib.util, json, sys
import transformers.pipelines
print("LOADED" + json.dumps(dict(status=0, modules=[name for name, module in list(sys.modules.items())
                                                    if not isinstance(module, importlib.util._LazyModule)])))
'''


@pytest.fixture(scope="module")
def transformers_own(tmp_path_factory):
    """What ``import transformers.pipelines`` loads by itself (the translation task's registration needs it): on
    transformers 5.10 its image processors (``transformers.models.*.image_processing_*``), on 5.24 none. Not ours."""
    proc = subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True,
                          cwd=tmp_path_factory.mktemp("baseline"), timeout=300)
    assert "LOADED" in proc.stdout, proc.stderr[-2000:]
    return set(json.loads(proc.stdout.split("LOADED", 1)[1])["modules"])


def loaded(argv, cwd):
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=cwd,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert "LOADED" in proc.stdout, proc.stderr[-2000:]
    return json.loads(proc.stdout.split("LOADED", 1)[1])


def heavy(modules):
    return sorted(name for name in modules
                  if name in ("datasets", "transformers.trainer", "matplotlib", "evaluate")
                  or (name.startswith("transformers.models.") and name.split(".")[2] not in ("auto", "encoder_decoder"))
                  or (name.startswith("hf_hardattn.tools.") and name.split(".")[2] in HEAVY_TOOLS))


@pytest.mark.parametrize("argv", [["--help"], ["--version"]] + [[command, "--help"] for command in
                                  ("demo", "tokenizer", "convert", "translate", "score", "publish", "plot")])
def test_help_loads_no_model_code_nor_trainer(argv, tmp_path, transformers_own):
    result = loaded(argv, tmp_path)
    assert result["status"] == 0
    assert heavy(set(result["modules"]) - transformers_own) == []


def test_score_loads_no_model_code_nor_trainer(tmp_path, transformers_own):
    (tmp_path / "hyp").write_text("a small house\n")
    (tmp_path / "ref").write_text("a small house\n")
    result = loaded(["score", "hyp", "ref"], tmp_path)
    assert result["status"] == 0
    assert heavy(set(result["modules"]) - transformers_own) == []


def test_the_check_sees_a_heavy_import(tmp_path):
    """distill's --help loads the training tooling (its options live in distill, which imports the Trainer): the
    check reports it."""
    result = loaded(["distill", "--help"], tmp_path)
    assert {"hf_hardattn.tools.training", "transformers.trainer"} <= set(heavy(result["modules"]))


def test_version_names_the_package_torch_and_transformers(capsys):
    from importlib.metadata import version

    from hf_hardattn.tools.cli import main
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hf-hardattn {version('hf-hardattn')} ")
    assert f"torch {version('torch')}" in out and f"transformers {version('transformers')}" in out
