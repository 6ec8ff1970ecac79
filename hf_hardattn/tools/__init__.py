"""The tooling of hf_hardattn, apart from the runtime (the package's top level, what a saved model carries): the
``hf-hardattn`` command (``cli``, ``train_cli``, ``arguments``), training (``training``, ``trainer_card``, ``distill``),
the reproduction table (``reproduce``), data and tokenizers (``data``, ``tokenization``), attention plots (``plot``) and
the conversion of pretrained checkpoints (``convert``). Each is imported by its path here: ``hf_hardattn.tools.training``,
...
"""
