"""The tooling of hf_hardattn, apart from the runtime (the package's top level, what a saved model carries): the
``hf-hardattn`` command (``cli``, ``train_cli``), training (``training``, ``distill``), the reproduction table
(``reproduce``), data and tokenizers (``data``, ``tokenization``), attention plots (``plot``) and the conversion of
pretrained checkpoints (``convert``).

These modules lived at the package's top level before; their old paths (``hf_hardattn.training``, ...) stay
importable, as the very same module objects (:func:`keep_old_paths`).
"""

import importlib
import importlib.abc
import importlib.util
import sys

MODULES = ("cli", "convert", "data", "distill", "plot", "reproduce", "tokenization", "train_cli", "training")


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``{package}.{name}`` (a module of MODULES) as ``{package}.tools.{name}``: the same module object, not a
    copy, so that monkeypatching either path reaches both; ``python -m {package}.{name}`` runs the tool."""

    def __init__(self, package: str):
        self.package = package

    def target(self, fullname: str) -> str | None:
        parent, _, name = fullname.rpartition(".")
        return f"{self.package}.tools.{name}" if parent == self.package and name in MODULES else None

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if self.target(fullname) else None

    def create_module(self, spec):
        module = importlib.import_module(self.target(spec.name))
        self._spec = module.__spec__  # the import system sets the alias's spec on it: put the module's own back
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec

    def get_code(self, fullname):  # (runpy: python -m)
        return compile(f"import runpy\nrunpy.run_module({self.target(fullname)!r}, run_name='__main__', "
                       f"alter_sys=True)\n", f"<{fullname}>", "exec")


def keep_old_paths(package: str):
    """Make ``{package}.{name}`` import ``{package}.tools.{name}`` for every tool module (idempotent)."""
    if not any(isinstance(finder, _OldPaths) and finder.package == package for finder in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths(package))  # before the path finders: no stale file of an old install wins


__all__ = ["MODULES", "keep_old_paths"]
