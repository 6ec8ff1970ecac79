"""What the commands share: the error that ends a command with a one-line message, the argument types of their options,
and running a command offline unless told otherwise."""

import argparse
import contextlib
import json
import os

import huggingface_hub


class CommandError(Exception):
    """Bad input to a command: main() prints ``hf-hardattn COMMAND: error: MESSAGE`` and exits with status 2."""


def positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


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


__all__ = ["CommandError", "assignment", "offline_by_default", "positive_float", "positive_int"]
