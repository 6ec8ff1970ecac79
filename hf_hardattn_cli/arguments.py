"""What every command shares and the front needs before the package loads: the error that ends a command with a
one-line message, and the argument types of the options. Light (argparse only), as the rest of the front; the
package's own command helpers (a model folder's check, lazy imports, running offline) are in
:mod:`hf_hardattn.tools.arguments`."""

import argparse


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


__all__ = ["CommandError", "positive_float", "positive_int"]
