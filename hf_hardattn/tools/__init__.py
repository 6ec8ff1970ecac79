"""The tooling of hf_hardattn, apart from the runtime (the package's top level, what a saved model carries): the
``hf-hardattn`` commands' implementations (``cli``, ``train_cli``, ``arguments``; the command's parsers, ``--version``
and ``score`` live in the front ``hf_hardattn_cli``, outside the package, so that they start without torch), training (``training``, ``trainer_card``, ``distill``),
the reproduction table (``reproduce``), data and tokenizers (``data``, ``tokenization``), attention plots (``plot``) and
the conversion of pretrained checkpoints (``convert``). Each is imported by its path here: ``hf_hardattn.tools.training``,
...
"""
