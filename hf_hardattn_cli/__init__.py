"""The front of the ``hf-hardattn`` command, outside the package ``hf_hardattn`` so that it starts in about a second.

Importing any ``hf_hardattn.X`` runs ``hf_hardattn/__init__``, which registers every model type with transformers'
Auto classes and so loads torch, transformers and every model file (seconds). The console script therefore names
:func:`hf_hardattn_cli.command.main`: this package holds the argument parser of every subcommand whose options are
light, ``--version`` (the installed distributions' metadata) and ``score`` (sacrebleu only), and imports the package
(``hf_hardattn.tools.cli``, where the other commands are implemented) only when such a command runs. It imports
nothing of ``hf_hardattn``, torch or transformers at its top (``tests/test_startup.py`` checks ``sys.modules`` of a
fresh process).

* :mod:`hf_hardattn_cli.command`: the parser, the dispatch, ``score`` and the text files of ``translate`` / ``score``.
* :mod:`hf_hardattn_cli.arguments`: the error that ends a command with one line, and the options' argument types.
* :mod:`hf_hardattn_cli.scores`: corpus BLEU and chrF, the one scoring function of the package and the command.
"""
