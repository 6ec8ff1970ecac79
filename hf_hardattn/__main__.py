"""``python -m hf_hardattn ...`` = the ``hf-hardattn`` command (:func:`hf_hardattn_cli.command.main`), as
``torchrun`` / ``accelerate launch -m hf_hardattn train`` run it.

Slower to start than the ``hf-hardattn`` script: ``-m hf_hardattn`` imports the package first (torch, transformers,
every model file), which the script's front (``hf_hardattn_cli``) does only for a command that needs it.
"""

from hf_hardattn_cli.command import main

if __name__ == "__main__":
    raise SystemExit(main())
