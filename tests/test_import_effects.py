"""What ``import hf_hardattn`` (then saving a model, then loading one as remote code) changes in transformers and in the
process: exactly the listed registrations, nothing else.

Reference: a fresh process snapshots transformers' pipeline registry (``SUPPORTED_TASKS``, ``PIPELINE_REGISTRY`` and the
registry object's own attributes, ``REMOVED_TASKS``), the attributes of ``Trainer``, ``Seq2SeqTrainer`` and other
classes models and pipelines run through, the top-level names of the transformers modules that hold them,
``sys.meta_path`` / ``sys.path_hooks``, the ``AttentionInterface`` / ``AttentionMaskInterface`` registries, the
``AutoConfig`` and every ``AutoModel*`` mapping, and the package folder's files, before and after each step; the
differences are compared with ``INTENDED`` (the list docs/usage.md gives). The remote-code load is transformers' own
(``get_class_from_dynamic_module``) of a saved soft model that decodes with hard retrieval, whose model file does not
import the kind's file: that file is read from the saved folder, and the folder transformers copied the code into gains
no file.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers.pipelines

import hf_hardattn
from hf_hardattn.registry import MODEL_TYPES, base_model_class, model_classes

REPO = Path(hf_hardattn.__file__).parent.parent

SCRIPT = r'''
import importlib.util, json, os, sys
import transformers, transformers.pipelines, transformers.trainer, transformers.trainer_seq2seq
import transformers.dynamic_module_utils
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.auto import configuration_auto, modeling_auto
from transformers.models.auto.auto_factory import _LazyAutoMapping

KEEP = []  # every object described stays alive, so that an id is never reused within the run
PACKAGE = importlib.util.find_spec("hf_hardattn").submodule_search_locations[0]
CLASSES = [transformers.Trainer, transformers.Seq2SeqTrainer, transformers.PreTrainedModel,
           transformers.GenerationMixin, transformers.PreTrainedConfig, transformers.Pipeline,
           transformers.pipelines.TextGenerationPipeline]
MODULES = ["transformers.pipelines", "transformers.pipelines.base", "transformers.trainer",
           "transformers.trainer_seq2seq", "transformers.modeling_utils", "transformers.generation.utils",
           "transformers.dynamic_module_utils", "transformers.masking_utils"]


def name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def described(value):
    """The object itself: where it is defined and which one it is."""
    KEEP.append(value)
    label = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"{getattr(value, '__module__', None) or type(value).__module__}.{label}@{id(value):x}"


def tasks(registry):
    return {task: f"{entry['impl'] if isinstance(entry['impl'], str) else name(entry['impl'])} "
                  f"pt={[name(c) for c in entry.get('pt', ())]} type={entry.get('type')}"
            for task, entry in registry.items()}


def snapshot():
    found = {"SUPPORTED_TASKS": tasks(transformers.pipelines.SUPPORTED_TASKS),
             "PIPELINE_REGISTRY": tasks(transformers.pipelines.PIPELINE_REGISTRY.supported_tasks),
             "PIPELINE_REGISTRY.task_aliases": dict(transformers.pipelines.PIPELINE_REGISTRY.task_aliases),
             "PIPELINE_REGISTRY attributes": {k: described(v) for k, v in
                                              vars(transformers.pipelines.PIPELINE_REGISTRY).items()},
             "REMOVED_TASKS": dict(getattr(transformers.pipelines, "REMOVED_TASKS", {})),
             "sys.meta_path": {str(i): described(f) for i, f in enumerate(sys.meta_path)},
             "sys.path_hooks": {str(i): described(h) for i, h in enumerate(sys.path_hooks)},
             "AttentionInterface": {k: described(v) for k, v in AttentionInterface._global_mapping.items()},
             "AttentionMaskInterface": {k: described(v) for k, v in AttentionMaskInterface._global_mapping.items()},
             "AutoConfig": {k: name(v) for k, v in configuration_auto.CONFIG_MAPPING._extra_content.items()},
             "package files": {os.path.relpath(os.path.join(root, f), PACKAGE): "" for root, _, files in
                               os.walk(PACKAGE) for f in files if "__pycache__" not in root}}
    for cls in CLASSES:
        found[name(cls)] = {k: described(v) for k, v in vars(cls).items()}
    for module in MODULES:  # (submodules bound on first import are not a change of behaviour)
        found[module] = {k: described(v) for k, v in vars(sys.modules[module]).items()
                         if not isinstance(v, type(sys))}
    for attribute, mapping in vars(modeling_auto).items():
        if isinstance(mapping, _LazyAutoMapping):
            found[attribute] = {name(k): name(v) if isinstance(v, type) else str(v)
                                for k, v in mapping._extra_content.items()}
    return found


def difference(old, new):
    out = {}
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section, {}), new.get(section, {})
        changes = {"added": {k: b[k] for k in sorted(b.keys() - a.keys())},
                   "removed": {k: a[k] for k in sorted(a.keys() - b.keys())},
                   "changed": {k: [a[k], b[k]] for k in sorted(a.keys() & b.keys()) if a[k] != b[k]}}
        changes = {k: v for k, v in changes.items() if v}
        if changes:
            out[section] = changes
    return out


work = sys.argv[1]
result, last = {}, snapshot()
import hf_hardattn
from hf_hardattn import SoftTransformerConfig, SoftTransformerForConditionalGeneration

now = snapshot()
result["import"], last = difference(last, now), now
folder = os.path.join(work, "soft_hard_cross")
config = SoftTransformerConfig(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1,
                               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                               decoder_ffn_dim=32, max_position_embeddings=32, cross_attention="hard_retrieval")
SoftTransformerForConditionalGeneration(config).save_pretrained(folder)
now = snapshot()
result["save"], last = difference(last, now), now

# transformers' remote-code path (what AutoModelForSeq2SeqLM takes where the package is not installed)
reference = json.load(open(os.path.join(folder, "config.json")))["auto_map"]["AutoModelForSeq2SeqLM"]
remote_class = transformers.dynamic_module_utils.get_class_from_dynamic_module(reference, folder)
copied = os.path.dirname(sys.modules[remote_class.__module__].__file__)
files_before = sorted(os.listdir(copied))
model = remote_class.from_pretrained(folder)
kinds = {type(m).__name__: type(m).__module__ for m in model.modules()}
now = snapshot()
result["remote load"] = difference(last, now)
result["remote"] = dict(model_module=type(model).__module__, kinds=kinds, files_before=files_before,
                        files_after=sorted(os.listdir(copied)),
                        kind_file=sys.modules[kinds["HardRetrievalAttention"]].__file__)
print("RESULT" + json.dumps(result))
'''


def intended():
    """The changes ``import hf_hardattn`` is meant to make (docs/usage.md, "What importing hf_hardattn changes")."""
    classes = [model_classes(model_type) for model_type in MODEL_TYPES]

    def name(cls):
        return f"{cls.__module__}.{cls.__qualname__}"

    translation = ("hf_hardattn.pipelines.TranslationPipeline "
                   "pt=['transformers.models.auto.modeling_auto.AutoModelForSeq2SeqLM'] type=text")
    # REMOVED_TASKS (transformers 5.24 on; absent from older 5.x releases, where translation was never removed)
    removed = {"REMOVED_TASKS": {"removed": {"translation"}}} if hasattr(transformers.pipelines, "REMOVED_TASKS") else {}
    return removed | {
        "AutoConfig": {"added": {config.model_type: name(config) for config, _ in classes}},
        # AutoModelForSeq2SeqLM's mapping
        "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING": {"added": {name(config): name(model) for config, model in classes}},
        # AutoModel's mapping: the bare encoder-decoder of each type (the full model's `.model`)
        "MODEL_MAPPING": {"added": {name(config): name(base_model_class(config.model_type)) for config, _ in classes}},
        "SUPPORTED_TASKS": {"added": {"translation": translation}},
        "PIPELINE_REGISTRY": {"added": {"translation": translation}},  # (the same dict as SUPPORTED_TASKS)
        # the registry's lookup, which also reads transformers 4's names translation_XX_to_YY
        "PIPELINE_REGISTRY attributes": {"added": {"check_task"}},
        "AttentionInterface": {"added": {"hard_retrieval", "hard_retrieval_cross", "hard_retrieval_all"}},
        "AttentionMaskInterface": {"added": {"hard_retrieval", "hard_retrieval_cross", "hard_retrieval_all"}},
    }


def comparable(changes):
    """``changes`` with the registries whose values are fresh functions (attention) or messages (removed tasks)
    reduced to their keys."""
    out = {}
    for section, kinds in changes.items():
        reduced = ("REMOVED_TASKS", "AttentionInterface", "AttentionMaskInterface", "PIPELINE_REGISTRY attributes")
        out[section] = {kind: set(entries) if section in reduced else entries
                        for kind, entries in kinds.items()}
    return out


def run_snapshots(tmp_path, pythonpath=None):
    """The fresh process's result; ``pythonpath`` first on its path (the package of another tree)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
               HF_MODULES_CACHE=str(tmp_path / "modules_cache"), PYTHONPATH=str(pythonpath or REPO))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT"):])


def check_effects(result):
    assert comparable(result["import"]) == comparable(intended())
    assert result["save"] == {}, "saving a model changed the process"
    assert result["remote load"] == {}, "loading remote code changed more than transformers' own loading"
    remote = result["remote"]
    package = remote["model_module"].rpartition(".")[0]
    assert package.startswith("transformers_modules.") and remote["kinds"]["SoftAttention"] == f"{package}.layers"
    # the kind's module belongs to the model's package, read from the saved folder; transformers' copy is unchanged
    assert remote["kinds"]["HardRetrievalAttention"] == f"{package}.hard_retrieval"
    assert Path(remote["kind_file"]).name == "hard_retrieval.py"
    assert "hard_retrieval.py" not in remote["files_before"]
    assert remote["files_after"] == remote["files_before"]


@pytest.fixture(scope="module")
def effects(tmp_path_factory):
    return run_snapshots(tmp_path_factory.mktemp("import_effects"))


def test_importing_the_package_makes_only_the_listed_registrations(effects):
    assert comparable(effects["import"]) == comparable(intended()), json.dumps(effects["import"], indent=1)


def test_saving_and_remote_code_loading_change_nothing_more(effects):
    check_effects(effects)


def test_the_remote_kind_file_is_the_saved_folders_copy(effects):
    kind_file = Path(effects["remote"]["kind_file"])
    assert kind_file.parent.name == "soft_hard_cross" and kind_file.is_file()
    assert kind_file.read_text() == (REPO / "hf_hardattn" / "hard_retrieval.py").read_text()
