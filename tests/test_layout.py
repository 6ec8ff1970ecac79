"""The package's own layout: runtime apart from tooling, no import circle, short files, no reach into
another module's private names, one registry of attention kinds, roles and model types, and saved folders that carry
the files their config uses. Each check reads the source files (``ast``), so it holds for every module, imports inside
functions included. The command's front ``hf_hardattn_cli`` (outside the package, so that it starts without it; its
imports are checked by tests/test_startup.py) is held to the two rules that concern it too: no second list of the
registry's names, and imports that name the defining module."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_hardattn
from common import check_remote_code, fitted, tiny_kwargs
from hf_hardattn.registry import KINDS, MODEL_TYPES, ROLES, model_classes

PACKAGE = Path(hf_hardattn.__file__).parent
REPO = PACKAGE.parent
FRONT = REPO / "hf_hardattn_cli"  # the command's front
REGISTRATIONS = {"pipelines.py", "attention_interface.py"}  # the package's two registrations with transformers
PACKAGE_ONLY = {"__init__.py", "__main__.py"}  # never shipped: a saved model is loaded without the package
MAX_LINES = 1000


def modules(root=PACKAGE):
    """Dotted module name -> path, for every .py file of the package (subpackages included)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def is_package(name, known):
    return any(other.startswith(name + ".") for other in known)


def imports(name, path, known):
    """The package modules that module ``name`` imports, anywhere in the file: [(line, imported module, names)]."""
    tree = ast.parse(path.read_text())
    base = name if is_package(name, known) else name.rpartition(".")[0]  # the package relative imports start from
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.append((node.lineno, alias.name, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base.split(".")
                parent = parent[:len(parent) - node.level + 1]
                target = ".".join(parent + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in known:
                continue
            for alias in node.names:  # `from . import x`: the submodule x where there is one
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub, []) if sub in known else (node.lineno, target, [alias.name]))
    return found


def import_graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}, known


def find_cycle(graph):
    """One import circle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for _, target, _ in graph[node]:
            if target == node:
                continue
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in graph:
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_circle_counting_imports_inside_functions():
    graph, _ = import_graph()
    assert len(graph) > 30  # every module of the package, tools included
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    # the check finds a circle where there is one: the skeleton importing a paper file that subclasses it
    mutant = dict(graph)
    mutant["hf_hardattn.modeling_hardattn"] = graph["hf_hardattn.modeling_hardattn"] + [(0, "hf_hardattn.gaussian", [])]
    assert find_cycle(mutant) is not None


DEFERRED = {  # the imports allowed inside a function, and why
    "matplotlib": "heavy, for the plots only", "matplotlib.pyplot": "heavy, for the plots only",
    "yaml": "optional (PyYAML), for YAML configs only",
    "torch.ao.quantization": "deprecated module: imported where its warning is silenced (quantize_int8)",
    "transformers.models.bart.modeling_bart": "a whole model's code, only as a fallback (attention_interface)",
}


def imports_inside_functions(path):
    inside = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import):
                    inside += [f"{path.name}:{sub.lineno} {a.name}" for a in sub.names if a.name not in DEFERRED]
                elif isinstance(sub, ast.ImportFrom) and (sub.level or sub.module not in DEFERRED):
                    inside.append(f"{path.name}:{sub.lineno} from {'.' * sub.level}{sub.module or ''}")
    return inside


def test_imports_sit_at_the_top_but_heavy_optional_ones(tmp_path):
    assert [hit for path in modules().values() for hit in imports_inside_functions(path)] == []
    mutant = tmp_path / "mutant.py"
    mutant.write_text("def f():\n    from .training import translate\n    import json\n")
    assert len(imports_inside_functions(mutant)) == 2


NOT_IMPORTED = {  # declared dependencies no module of the package imports, each with why it is declared
    "accelerate": "transformers' Trainer (hf-hardattn train) refuses to start without it",
    "safetensors": "the weights format of every saved folder, read and written through transformers",
}


def declared_dependencies(pyproject):
    """The distribution names of pyproject.toml's [project] dependencies, normalised (PEP 503)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    with open(pyproject, "rb") as handle:
        declared = tomllib.load(handle)["project"]["dependencies"]
    return {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]).lower() for spec in declared}


def imported_distributions(root=PACKAGE):
    """The distributions (normalised names) whose top-level modules the package imports anywhere (importlib.metadata's
    map of import names to distributions)."""
    from importlib.metadata import packages_distributions

    owners, found = packages_distributions(), set()
    for path in modules(root).values():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
            for name in names:
                found.update(re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(name.partition(".")[0], []))
    return found


def test_every_declared_dependency_is_imported_or_says_why(tmp_path):
    """No dependency that nothing uses (e.g. a declared package that no module imports)."""
    unused = declared_dependencies(REPO / "pyproject.toml") - imported_distributions() - set(NOT_IMPORTED)
    assert unused == set()
    mutant = tmp_path / "pyproject.toml"
    mutant.write_text('[project]\ndependencies = ["torch>=2", "Zstandard", "german_nouns"]\n')
    assert declared_dependencies(mutant) == {"torch", "zstandard", "german-nouns"}
    assert declared_dependencies(mutant) - imported_distributions() == {"zstandard"}


def test_no_file_over_1000_lines():
    files = list(PACKAGE.rglob("*.py")) + list((REPO / "tests").glob("*.py"))
    assert len(files) > 50
    long = {str(path.relative_to(REPO)): n for path in files if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def private_reaches(graph, known):
    """`from .x import _name` of a package module, and `module._name` where `module` names a package module."""
    found = []
    for name, edges in graph.items():
        tree = ast.parse(known[name].read_text())
        aliases = {}  # local name -> package module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") and \
                            any(line == node.lineno for line, _, _ in edges):
                        found.append(f"{name}:{node.lineno} imports {alias.name}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    local = alias.asname or alias.name
                    for line, target, names in edges:
                        if line == node.lineno and (target.endswith("." + alias.name) or target == alias.name):
                            aliases[local] = target
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{name}:{node.lineno} reads {node.value.id}.{node.attr}")
    return found


def test_no_reach_into_another_modules_private_names():
    graph, known = import_graph()
    assert private_reaches(graph, known) == []
    # able to fail: the reach into data's private reader that cli had
    source = (known["hf_hardattn.tools.cli"].read_text() + "\nfrom . import data as data_module\n"
              "x = data_module._read_lines('-')\nfrom .data import _WORD\n")
    mutant_path = known["hf_hardattn.tools.cli"].with_name("cli_mutant.py")
    try:
        mutant_path.write_text(source)
        graph, known = import_graph()
        found = private_reaches(graph, known)
        assert any("data_module._read_lines" in f for f in found) and any("imports _WORD" in f for f in found), found
    finally:
        mutant_path.unlink()


# A paper's own rule on which kinds it takes, not a list of the kinds: beam-joint's layers after the joint layer
# attend to the soft history ('soft' or 'none').
RULES = {("beam_joint.py", frozenset({"soft", "none"}))}


def literal_names(path, names, least=2):
    """Literal tuples / lists / sets / dict keys of ``path`` that hold ``least`` or more of ``names``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, (ast.Tuple, ast.List,
                                                                                             ast.Set)) else []
        strings = {item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)}
        hit = frozenset(strings & set(names))
        if len(hit) >= least and (path.name, hit) not in RULES:
            found.append(f"{path.name}:{node.lineno} {sorted(hit)}")
    return found


# kinds and model types: no two of them listed together; roles: no second list of all of them (subsets of roles, such
# as the roles a stock-model implementation makes hard, are data)
@pytest.mark.parametrize("what, names, least", [("attention kinds", list(KINDS), 2),
                                                ("model types", list(MODEL_TYPES), 2),
                                                ("roles", list(ROLES), len(ROLES))])
def test_the_registry_is_the_only_list_of_kinds_roles_and_model_types(what, names, least, tmp_path):
    files = [path for path in PACKAGE.rglob("*.py") if path.name != "registry.py"] + list(FRONT.glob("*.py"))
    assert len(files) > 30 and FRONT / "command.py" in files
    found = [hit for path in files for hit in literal_names(path, names, least)]
    assert not found, f"{what} listed outside registry.py: {found}"
    mutant = tmp_path / "mutant.py"
    mutant.write_text(f"CHOICES = {tuple(names[:least])!r}\nif x in {set(names[-least:])!r}: pass\n")
    assert len(literal_names(mutant, names, least)) == 2


def test_every_kind_and_model_type_resolves_from_its_one_entry():
    """A reader finds a kind's code from its entry: the file and class it names."""
    for name, kind in KINDS.items():
        if kind.module is None:
            continue
        cls = hf_hardattn.registry.attention_class(name)
        assert cls.__module__ == f"hf_hardattn.{kind.module}" and cls.__name__ == kind.class_name
        assert set(kind.roles) <= set(ROLES)
    for model_type in MODEL_TYPES:
        config_class, model_class = model_classes(model_type)
        assert config_class.model_type == model_type and model_class.config_class is config_class
        assert hf_hardattn.MODEL_CLASSES[config_class] is model_class
        assert getattr(hf_hardattn, config_class.__name__) is config_class  # the public names
        assert getattr(hf_hardattn, model_class.__name__) is model_class


def tiny_model(model_type, **overrides):
    config_class, model_class = model_classes(model_type)
    kwargs = tiny_kwargs(**overrides)
    if model_type in ("hybrid_transformer", "beam_joint_rnn"):
        kwargs.update(decoder_layers=1, rnn_hidden_size=16)
    if model_type == "beam_joint_transformer" or model_type == "beam_joint_rnn":
        kwargs.update(joint_k=2)
    return model_class(config_class(**kwargs))


def saved_code(model, folder):
    model.save_pretrained(folder)
    return {name for name in os.listdir(folder) if name.endswith(".py")}


def test_runtime_folder_is_what_saved_models_carry_and_the_registrations(tmp_path):
    carried = {}
    for model_type in MODEL_TYPES:
        torch.manual_seed(0)
        carried[model_type] = saved_code(tiny_model(model_type), tmp_path / model_type)
    runtime = {path.name for path in PACKAGE.glob("*.py")}
    assert runtime == set().union(*carried.values()) | REGISTRATIONS | PACKAGE_ONLY, \
        sorted(runtime ^ (set().union(*carried.values()) | REGISTRATIONS | PACKAGE_ONLY))
    assert not (REGISTRATIONS | PACKAGE_ONLY) & set().union(*carried.values())
    # each model type carries the files its config uses: its own file and what it imports, no other paper's
    papers = {entry.module for entry in MODEL_TYPES.values()} | {k.module for k in KINDS.values() if k.module} - {"layers"}
    for model_type, files in carried.items():
        own = {f"{MODEL_TYPES[model_type].module}.py"} | ({"hybrid.py"} if model_type.startswith("beam_joint") else set())
        assert {f"{p}.py" for p in papers} & files == own, (model_type, sorted(files))


def test_a_saved_folder_carries_the_files_of_the_kinds_its_config_uses(tmp_path):
    """A soft model carries no paper file; decoding with other kinds, it carries theirs (and loads as remote code)."""
    assert not {"gaussian.py", "recurrent.py", "hard_retrieval.py"} & saved_code(tiny_model("soft_transformer"),
                                                                                  tmp_path / "soft")
    mixed = tiny_model("soft_transformer", cross_attention=["recurrent", "hard_retrieval"],
                       encoder_attention=["gaussian", "soft"])
    files = saved_code(mixed, tmp_path / "mixed")
    assert {"gaussian.py", "recurrent.py", "hard_retrieval.py"} <= files and "hybrid.py" not in files
    config = json.loads((tmp_path / "mixed" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForSeq2SeqLM"] == "soft.SoftTransformerForConditionalGeneration"


def test_a_kind_outside_its_model_types_file_loads_as_remote_code(tmp_path):
    """soft.py imports no hard_retrieval.py: loaded as remote code, the kind's file comes from the saved folder."""
    torch.manual_seed(0)
    check_remote_code(fitted(tiny_model("soft_transformer", cross_attention="hard_retrieval")), tmp_path)


def test_every_module_has_one_import_path():
    """Each module imports by the path the tree shows, and only by it: no import hook, no module registered under a
    second name, no old top-level path of a tool module, and no module exporting a class or function it only
    imports (the package's ``__init__``, the public surface, excepted)."""
    import importlib
    import inspect

    code = ("import sys, hf_hardattn, hf_hardattn.tools.cli; "
            "print([type(f).__module__ for f in sys.meta_path if 'hf_hardattn' in type(f).__module__]); "
            "print([k for k, m in list(sys.modules.items())"
            " if k.startswith('hf_hardattn') and getattr(m, '__name__', k) != k])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["[]", "[]"], out.stdout + out.stderr[-2000:]
    tools = sorted(p.stem for p in (PACKAGE / "tools").glob("*.py") if p.stem != "__init__")
    assert "training" in tools and "convert" in tools
    for name in tools:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"hf_hardattn.{name}")
    assert callable(hf_hardattn.convert) and hf_hardattn.convert is importlib.import_module(
        "hf_hardattn.tools.convert").convert  # the function, a public name of the package
    modules = [f"hf_hardattn.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")]
    modules += [f"hf_hardattn.tools.{name}" for name in tools]
    for name in modules:
        module = importlib.import_module(name)
        for exported in getattr(module, "__all__", ()):
            value = getattr(module, exported)
            if inspect.isclass(value) or inspect.isfunction(value):
                assert value.__module__ == name, f"{name} exports {exported}, defined in {value.__module__}"


def test_every_import_names_the_module_that_defines_it():
    """`from hf_hardattn.X import name` (and the package's relative imports) name the module that defines a class or
    function, not one that merely imports it: the tree uses one path per name. The package's ``__init__`` (the public
    surface, ``from hf_hardattn import ...``) is the one exception."""
    import importlib
    import inspect

    roots = [PACKAGE, FRONT, REPO / "tests", REPO / "benchmarks", REPO / "examples", REPO / "model_cards"]
    wrong = []
    for path in (p for root in roots for p in root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.module is None and not node.level:
                continue
            if node.level:
                if not (path.is_relative_to(PACKAGE) or path.is_relative_to(FRONT)):
                    continue
                base = package.split(".")
                module = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module
            if not module.startswith(("hf_hardattn.", "hf_hardattn_cli.")) or module.endswith("__init__"):
                continue
            try:
                imported = importlib.import_module(module)
            except ModuleNotFoundError:
                continue  # a saved folder's copy, imported by the remote-code tests
            for alias in node.names:
                value = getattr(imported, alias.name, None)
                if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ != module:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno} {alias.name} from {module}, "
                                 f"defined in {value.__module__}")
    assert not wrong, "\n".join(wrong)


def test_importing_the_command_line_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    code = "import os, hf_hardattn.tools.cli; print(os.environ.get('HF_HUB_OFFLINE'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.stdout.strip() == "None", out.stderr[-2000:]


def test_readme_layout_names_existing_files():
    """The README's layout section names files that exist."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    for name in re.findall(r"`([\w/]+\.py)`", section):
        candidates = [REPO / name, PACKAGE / name, PACKAGE / "tools" / name, REPO / "benchmarks" / name,
                      REPO / "examples" / name]
        assert any(path.is_file() for path in candidates), name
