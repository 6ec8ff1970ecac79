"""``python -m hf_hardattn ...`` = the ``hf-hardattn`` command (see :mod:`hf_hardattn.tools.cli`)."""

from .tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
