"""What the package's commands share: a model folder's check, the ``--set KEY=VALUE`` argument, lazy imports and running
a command offline unless told otherwise. The error that ends a command with a one-line message and the options'
argument types are in :mod:`hf_hardattn_cli.arguments`, the command's front, which parses before the package loads."""

import contextlib
import importlib.util
import json
import os
import sys

import huggingface_hub

from ..registry import MODEL_TYPES


def check_model_type(path, name: str = "MODEL"):
    """A local folder whose config.json lacks "model_type" is refused here, naming the file and the fix: transformers'
    Auto classes would otherwise stop at a remote-code prompt (a config with ``auto_map``) or at "Unrecognized
    model" before any code of this package runs. The type named by the config's ``architectures`` is suggested.
    Anything else (a Hub id, a folder without config.json, a config with its type) passes unchanged."""
    config = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(config):
        return
    try:
        with open(config, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise ValueError(f"{name}={os.fspath(path)!r}: {config} is not readable JSON ({error}).") from error
    if not isinstance(data, dict) or "model_type" in data:
        return
    architectures = data.get("architectures") or []
    guess = [kind for kind, entry in MODEL_TYPES.items() if entry.model_class in architectures]
    fix = (f'add "model_type": "{guess[0]}" (its "architectures" {architectures} name that type)' if guess else
           f'add its "model_type" (hf_hardattn types: {", ".join(MODEL_TYPES)}; or a transformers type such as '
           f'"marian")')
    raise ValueError(f'{name}={os.fspath(path)!r}: {config} has no "model_type", so transformers cannot tell which '
                     f"model it is{' (it would ask to run the folder' + chr(39) + 's own code instead)' if 'auto_map' in data else ''}; {fix}.")


def assignment(text):
    """``key=value`` -> (key, value): the value parsed as JSON (numbers, true/false, null, lists, quoted strings), or
    else taken as the string it is (``recurrent_variant=coverage``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def lazy_import(name: str):
    """The module ``name``, loaded when one of its attributes is first read (``importlib.util.LazyLoader``): a command
    module names at its top what it uses, and ``--help`` or a light command does not pay for the rest. Already
    imported: that module."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ImportError(f"lazy_import: no module named {name!r}")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    if parent:  # as the import system does: `package.child` reads the module (a later import finds it in sys.modules)
        setattr(importlib.import_module(parent), child, module)
    return module


@contextlib.contextmanager
def offline_by_default():
    """A command runs offline unless ``HF_HUB_OFFLINE`` is set (``HF_HUB_OFFLINE=0`` lets it reach the Hub): while it
    runs, and only then, ``HF_HUB_OFFLINE=1`` is in the environment (for the libraries and processes it starts) and
    in huggingface_hub's setting, which was read when huggingface_hub was imported."""
    if "HF_HUB_OFFLINE" in os.environ:
        yield
        return
    before = huggingface_hub.constants.HF_HUB_OFFLINE
    os.environ["HF_HUB_OFFLINE"] = "1"
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        os.environ.pop("HF_HUB_OFFLINE", None)
        huggingface_hub.constants.HF_HUB_OFFLINE = before


__all__ = ["assignment", "check_model_type", "lazy_import", "offline_by_default"]
