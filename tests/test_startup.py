"""Start-up of the hf-hardattn command: the console script's entry (``hf_hardattn_cli.command.main``, outside the
package) runs `--help`, `--version`, every light subcommand's `--help` and `score` without importing torch,
transformers or any module of ``hf_hardattn`` (whose ``__init__`` registers every model type: torch, transformers and
every model file, seconds). Checked on ``sys.modules`` of a fresh process, not on time. train, distill and reproduce
load their own modules for their `--help` (their options are defined there): those still work.

``python -m hf_hardattn`` imports the package first: it works (tests/test_tooling.py, the multi-process training
tests), slower.
"""

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

SCRIPT = "hf-hardattn"


def console_entry():
    """The ``module:function`` the installed console script names (the distribution's entry point)."""
    (entry,) = entry_points(group="console_scripts", name=SCRIPT)
    return entry.value


PROBE = r'''
import json, sys
from importlib.metadata import entry_points
(entry,) = entry_points(group="console_scripts", name="hf-hardattn")
main = entry.load()
try:
    status = main(sys.argv[1:])
except SystemExit as stop:
    status = stop.code
print("LOADED" + json.dumps(dict(status=status, modules=list(sys.modules))))
'''


def loaded(argv, cwd):
    """Exit status and ``sys.modules`` of a fresh process that ran the console script's function on ``argv``."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert "LOADED" in proc.stdout, proc.stderr[-2000:]
    return json.loads(proc.stdout.split("LOADED", 1)[1])


def heavy(modules):
    """torch, transformers and the package's own modules (not the front ``hf_hardattn_cli``)."""
    return sorted(name for name in modules if name.split(".")[0] in ("torch", "transformers", "hf_hardattn"))


def test_the_console_script_is_the_front_outside_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(os.path.dirname(__file__), os.pardir, "pyproject.toml"), "rb") as handle:
        declared = tomllib.load(handle)["project"]["scripts"][SCRIPT]
    assert console_entry() == declared, "the installed script is stale: pip install -e . again"
    assert declared.split(":")[0].split(".")[0] == "hf_hardattn_cli"


@pytest.mark.parametrize("argv", [["--help"], ["--version"]] + [[command, "--help"] for command in
                                  ("demo", "tokenizer", "convert", "translate", "score", "publish", "plot")])
def test_help_and_version_load_neither_torch_transformers_nor_the_package(argv, tmp_path):
    result = loaded(argv, tmp_path)
    assert result["status"] == 0
    assert heavy(result["modules"]) == []


def test_score_loads_neither_torch_transformers_nor_the_package(tmp_path):
    (tmp_path / "hyp").write_text("a small house\n")
    (tmp_path / "ref").write_text("a small house\n")
    result = loaded(["score", "hyp", "ref"], tmp_path)
    assert result["status"] == 0
    assert "sacrebleu" in result["modules"] and heavy(result["modules"]) == []


@pytest.mark.parametrize("command, option", [("train", "--model-type"), ("distill", "--teacher"),
                                             ("reproduce", "--preset")])
def test_the_heavy_subcommands_help_works_and_the_check_sees_their_imports(command, option, tmp_path):
    """train, distill and reproduce define their options in their own modules: their --help loads the package, and
    the check reports it."""
    proc = subprocess.run([sys.executable, "-c", PROBE, command, "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert option in proc.stdout, proc.stderr[-2000:]
    result = json.loads(proc.stdout.split("LOADED", 1)[1])
    assert result["status"] == 0
    assert {"torch", "transformers", f"hf_hardattn.tools.{command.replace('train', 'train_cli')}"} <= set(
        heavy(result["modules"]))


def test_the_installed_script_runs(tmp_path):
    """End to end: the ``hf-hardattn`` executable on PATH (what pip installed) prints its version and scores."""
    script = shutil.which(SCRIPT)
    if script is None:
        pytest.skip("the hf-hardattn script is not on PATH (pip install -e . installs it)")
    from importlib.metadata import version

    out = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith(f"hf-hardattn {version('hf-hardattn')} "), out.stderr
    (tmp_path / "hyp").write_text("the cat sat on the mat\n")
    (tmp_path / "ref").write_text("the cat sat on the mat\n")
    out = subprocess.run([script, "score", "hyp", "ref", "--json"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert [(row["name"], row["score"]) for row in json.loads(out.stdout)] == [("BLEU", 100.0), ("chrF2", 100.0)]


def test_version_names_the_package_torch_and_transformers(capsys):
    from importlib.metadata import version

    from hf_hardattn_cli.command import main
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hf-hardattn {version('hf-hardattn')} ")
    assert f"torch {version('torch')}" in out and f"transformers {version('transformers')}" in out
