"""Crash-safe model folders: atomic saves, weight checksums, file-naming load errors.

* :func:`atomic_folder` - a save writes into a fresh sibling folder (``.NAME.saving-PID-XXXX``) that then replaces
  ``NAME`` in one step: a process killed at any point leaves ``NAME`` holding either the old or the new complete
  model. Files of the old folder that the save does not write (notes, a tokenizer saved earlier, results) are carried
  over as hard links. The replacement is an atomic exchange (Linux ``renameat2(RENAME_EXCHANGE)``); where that is
  missing, two renames, with an instant between them where ``NAME`` is absent and the old model sits in
  ``.NAME.old-PID-XXXX``. Protects against a killed process, not a power cut (files are not fsynced).
* :func:`write_checksums` / :func:`verify_folder` - the sha256 of every safetensors file, stored beside it in
  ``hardattn_checksums.json`` and checked when the folder is loaded (safetensors has no checksum of its own, so
  flipped bytes in the data would otherwise load silently); a truncated or malformed safetensors file is reported by
  name whether or not a checksum was stored.

Runtime code shipped with saved models (``trust_remote_code``): flat, standard library only.
"""

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import struct
import sys

CHECKSUM_FILE = "hardattn_checksums.json"
_STAGING, _OLD = "saving", "old"


class CorruptFileError(OSError):
    """A model file that is truncated, malformed or differs from the checksum stored when it was saved."""


# ----------------------------------------------------------------------------------------------------------------
# atomic folder replacement
# ----------------------------------------------------------------------------------------------------------------
def _sibling(parent: str, name: str, kind: str) -> str:
    """Create and return an empty folder ``.{name}.{kind}-{pid}-{random}`` in ``parent`` (mode from the umask)."""
    while True:
        path = os.path.join(parent, f".{name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(parent: str, name: str):
    """Delete the staging / old folders of ``name`` that an earlier save left behind when its process was killed
    (those of processes still running are left alone). An old folder whose ``name`` is missing (a kill between the
    two renames of the fallback) is renamed back to ``name``."""
    pattern = re.compile(rf"^\.{re.escape(name)}\.({_STAGING}|{_OLD})-(\d+)-[0-9a-f]+$")
    final = os.path.join(parent, name)
    for entry in sorted(os.listdir(parent)):
        match = pattern.match(entry)
        if not match or (int(match.group(2)) != os.getpid() and _alive(int(match.group(2)))):
            continue
        path = os.path.join(parent, entry)
        if match.group(1) == _OLD and not os.path.lexists(final):
            os.rename(path, final)  # killed between the two renames of the fallback: the old model goes back
        else:
            shutil.rmtree(path, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without renameat2 (glibc < 2.28, musl)
        return False
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if function(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):  # filesystem or kernel without it
        return False
    raise OSError(error, os.strerror(error), b)


def _link_or_copy(source: str, target: str):
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)


def carry_over(old: str, new: str, drop=lambda name: False):
    """Hard-link (or copy) into ``new`` every entry of ``old`` that ``new`` does not have, except those ``drop``
    names (stale weight shards). The old folder is left untouched."""
    for entry in os.listdir(old):
        source, target = os.path.join(old, entry), os.path.join(new, entry)
        if os.path.lexists(target) or drop(entry):
            continue
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(source, target)


def replace_folder(staging: str, final: str, drop=lambda name: False):
    """Make the complete folder ``staging`` the folder ``final`` in one step (see the module docstring)."""
    if not os.path.lexists(final):
        os.rename(staging, final)
        return
    carry_over(final, staging, drop)
    if _exchange(staging, final):
        shutil.rmtree(staging, ignore_errors=True)  # (now the old folder)
        return
    parent, name = os.path.split(final)
    old = _sibling(parent, name, _OLD)
    os.rmdir(old)
    os.rename(final, old)
    os.rename(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def _add_variant(name: str, variant) -> str:  # transformers' naming: model.safetensors -> model.{variant}.safetensors
    if not variant:
        return name
    parts = name.split(".")
    return ".".join(parts[:-1] + [variant] + parts[-1:])


def stale_weights(variant=None):
    """For :func:`carry_over`: the weight files of an earlier save (of the same ``variant``) that a new save did not
    rewrite: the single file, the shard index and ``-0000k-of-0000n`` shards. transformers removes the stale shards
    only; an old single file left beside a new sharded save would be loaded instead of it."""
    weights = _add_variant("model.safetensors", variant)
    index = _add_variant("model.safetensors.index.json", variant)
    shard = re.compile(rf"^{re.escape(weights[: -len('.safetensors')])}-\d{{5}}-of-\d{{5}}\.safetensors$")
    return lambda name: name in (weights, index) or shard.match(name) is not None


def target_folder(save_directory) -> str:
    """The absolute folder a save into ``save_directory`` replaces (a symlinked folder: its target)."""
    final = os.path.realpath(os.path.abspath(os.fspath(save_directory)))
    if os.path.exists(final) and not os.path.isdir(final):
        raise NotADirectoryError(f"`save_directory` {os.fspath(save_directory)!r} is a file; allowed: a folder "
                                 f"(existing or not).")
    return final


@contextlib.contextmanager
def atomic_folder(save_directory, drop=lambda name: False):
    """Yield a new empty staging folder beside ``save_directory``; when the block ends without an exception, the
    staging folder (plus the old folder's other files, except those ``drop`` names) becomes ``save_directory`` in one
    step. On an exception the staging folder is removed and ``save_directory`` is left as it was."""
    final = target_folder(save_directory)
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    remove_leftovers(parent, name)
    staging = _sibling(parent, name, _STAGING)
    try:
        if os.path.isdir(final):
            os.chmod(staging, stat.S_IMODE(os.stat(final).st_mode))
        yield staging
        replace_folder(staging, final, drop)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_json_atomic(path: str, data):
    """Write JSON to ``path`` through a temporary file and ``os.replace`` (never a half-written file)."""
    temporary = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def write_text_atomic(path: str, text: str):
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str, data: bytes):
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``."""
    temporary = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


# ----------------------------------------------------------------------------------------------------------------
# checksums and safetensors sanity
# ----------------------------------------------------------------------------------------------------------------
def sha256_file(path: str, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def _weight_files(folder: str) -> list:
    return sorted(entry for entry in os.listdir(folder)
                  if entry.endswith(".safetensors") and os.path.isfile(os.path.join(folder, entry)))


def write_checksums(folder: str) -> dict:
    """Store the sha256 of every safetensors file of ``folder`` in ``folder/hardattn_checksums.json``."""
    files = {name: sha256_file(os.path.join(folder, name)) for name in _weight_files(folder)}
    write_json_atomic(os.path.join(folder, CHECKSUM_FILE), {"algorithm": "sha256", "files": files})
    return files


def safetensors_problem(path: str) -> str | None:
    """Why the safetensors file ``path`` is malformed (header unreadable, or a size that differs from the one its
    header gives: truncated or extended), or None. Reads the header only."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"it has {size} bytes, fewer than the 8-byte header length (truncated)"
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > size - 8:
            return f"its header length says {header_size} bytes but the file has {size} (truncated or not safetensors)"
        try:
            header = json.loads(handle.read(header_size))
            end = max([entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"], default=0)
        except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError) as error:
            return f"its header is not valid safetensors JSON ({type(error).__name__}: {error})"
    expected = 8 + header_size + end
    if size != expected:
        return f"it has {size} bytes but its header describes {expected} ({'truncated' if size < expected else 'extra bytes'})"
    return None


def verify_folder(folder: str, checksums: bool = True):
    """Raise :class:`CorruptFileError` naming the file if a safetensors file of ``folder`` is malformed, or (with
    ``checksums``) differs from, or is missing against, the sha256 that ``hardattn_checksums.json`` recorded."""
    for name in _weight_files(folder):
        problem = safetensors_problem(os.path.join(folder, name))
        if problem:
            raise CorruptFileError(f"{os.path.join(folder, name)} is corrupt: {problem}. Save the model again or "
                                   f"restore the file from a copy.")
    sidecar = os.path.join(folder, CHECKSUM_FILE)
    if not checksums or not os.path.isfile(sidecar):
        return
    try:
        with open(sidecar, encoding="utf-8") as handle:
            recorded = json.load(handle)["files"]
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptFileError(f"{sidecar} is not a valid checksum file ({error}); delete it to load without "
                               f"checksums.") from None
    for name, expected in recorded.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CorruptFileError(
                f"{path} is missing: {CHECKSUM_FILE} lists it as part of this model. Restore the file from a copy (or "
                f"save the model again); if the weights were re-saved into other files on purpose, delete "
                f"{CHECKSUM_FILE} (or pass verify_checksums=False to from_pretrained).")
        actual = sha256_file(path)
        if actual != expected:
            raise CorruptFileError(
                f"{path} is corrupt: its sha256 {actual[:16]}... differs from {expected[:16]}... recorded in "
                f"{CHECKSUM_FILE} when it was saved. Restore the file from a copy; if it was replaced on purpose, "
                f"delete {CHECKSUM_FILE} (or pass verify_checksums=False to from_pretrained).")


__all__ = ["CHECKSUM_FILE", "CorruptFileError", "atomic_folder", "write_checksums", "verify_folder",
           "safetensors_problem", "stale_weights", "write_json_atomic", "write_text_atomic", "target_folder"]
