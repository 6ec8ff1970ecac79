"""The ``translation`` pipeline task for any encoder-decoder model: hf_hardattn's and transformers' own (MarianMTModel).

transformers 5 has no ``translation`` task (later 5.x releases list it as removed, earlier ones do not know it), yet
the model cards advertise ``pipeline_tag: translation``. ``import hf_hardattn`` calls :func:`register`, which registers
:class:`TranslationPipeline`, a thin pipeline over ``generate()``, under that name with
``transformers.pipelines.PIPELINE_REGISTRY``. Its output is that of transformers 4's translation pipeline:
``[{"translation_text": ...}]`` per input. The language-pair names of transformers 4, ``translation_XX_to_YY``, name
the same task with ``src_lang="XX"`` and ``tgt_lang="YY"`` (:func:`check_task`). No other task is touched.

Tooling: a model's save_pretrained does not copy it. A pipeline's own save_pretrained does, as transformers does for
every registered pipeline (the saved config then names it, and loading that folder as a pipeline takes
trust_remote_code=True), so it imports transformers only.
"""

import re

import transformers
from transformers import AutoModelForSeq2SeqLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

TASK = "translation"
LANGUAGE_PAIR = re.compile(r"translation_([^_]+)_to_([^_]+)")  # transformers 4's task names, e.g. translation_en_to_de


def language_pair(task) -> tuple | None:
    """(source, target) language of a task name ``translation_XX_to_YY``, else None."""
    match = LANGUAGE_PAIR.fullmatch(task) if isinstance(task, str) else None
    return match.groups() if match else None


class TranslationPipeline(Pipeline):
    """Translate texts with an encoder-decoder model: ``tokenizer(text)`` -> ``model.generate`` -> ``decode``.

    Call it with a text or a list of texts; every other keyword goes to ``generate()`` as given (``num_beams``,
    ``max_new_tokens``, ``num_return_sequences``, ``generation_config``, ...), whether passed when the pipeline is
    built or when it is called, on every transformers release alike. Pipeline keywords: ``batch_size``,
    ``truncation`` (tokenizer truncation), ``return_tensors`` (token ids instead of text),
    ``clean_up_tokenization_spaces`` (decoding), ``src_lang`` / ``tgt_lang`` (default: those of a task named
    ``translation_XX_to_YY``): as in transformers 4, they go to a tokenizer that takes them (multilingual ones with
    ``_build_translation_inputs``: M2M100, mBART, NLLB); a tokenizer of one language pair (Marian's, this package's)
    ignores them.

    Returns, per text, a list with one dict per returned sequence: ``{"translation_text": str}``, or
    ``{"translation_token_ids": tensor}`` with ``return_tensors=True``. For a list of texts that each get one
    sequence, the list of those dicts (transformers 4's convention).
    """

    _load_processor = False
    _load_image_processor = False
    _load_video_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def __init__(self, model, *args, **kwargs):
        if not getattr(model.config, "is_encoder_decoder", False):
            raise ValueError(f"The {TASK!r} pipeline needs an encoder-decoder (seq2seq) model; "
                             f"model={type(model).__name__} is not one (config.is_encoder_decoder is not True).")
        super().__init__(model, *args, **kwargs)
        if self.tokenizer is None:
            raise ValueError(f"The {TASK!r} pipeline needs a tokenizer: pass tokenizer=..., or save one with the "
                             f"model (model.save_pretrained(path, tokenizer=tokenizer)).")
        # batched sources are padded by the tokenizer's side; encoders with absolute positions read them right-padded
        # (transformers' text-generation pipeline sets the side it needs, "left", the same way)
        self.tokenizer.padding_side = "right"

    def _sanitize_parameters(self, truncation=None, return_tensors=None, clean_up_tokenization_spaces=None,
                             src_lang=None, tgt_lang=None, **generate_kwargs):
        # Generation parameters go to generate() untouched: transformers' own set-up of generation parameters for
        # pipelines (_pipeline_calls_generate) differs between 5.10 and 5.24, so the pipeline stays out of it.
        preprocess = {} if truncation is None else {"truncation": truncation}
        pair = language_pair(getattr(self, "task", None)) or (None, None)
        for key, value, default in (("src_lang", src_lang, pair[0]), ("tgt_lang", tgt_lang, pair[1])):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"`{key}` must be a language code (str), got {value!r}")
            if (value or default) is not None:
                preprocess[key] = value or default
        postprocess = {}
        if return_tensors is not None:
            if not isinstance(return_tensors, bool):
                raise ValueError(f"`return_tensors` must be True or False, got {return_tensors!r}")
            postprocess["return_tensors"] = return_tensors
        if clean_up_tokenization_spaces is not None:
            postprocess["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        return preprocess, generate_kwargs, postprocess

    def __call__(self, inputs, **kwargs):
        """Translate ``inputs`` (a text, or a list of texts); see the class docstring for keywords and output."""
        result = super().__call__(inputs, **kwargs)
        if isinstance(inputs, list) and all(len(records) == 1 for records in result):
            return [records[0] for records in result]
        return result

    def preprocess(self, text, truncation=False, src_lang=None, tgt_lang=None):
        if not isinstance(text, str):
            raise ValueError(f"The {TASK!r} pipeline translates a str or a list of str; got an input of type "
                             f"{type(text).__name__}: {text!r}")
        if (src_lang or tgt_lang) and hasattr(self.tokenizer, "_build_translation_inputs"):
            # a multilingual tokenizer: it sets the source language and names the target's first token
            # (``forced_bos_token_id``, passed on to generate())
            return self.tokenizer._build_translation_inputs(text, return_tensors="pt", truncation=truncation,
                                                            src_lang=src_lang, tgt_lang=tgt_lang)
        inputs = self.tokenizer(text, truncation=truncation, return_tensors="pt")
        inputs.pop("token_type_ids", None)  # tokenizers may add it; generate() would refuse it
        return inputs

    def _forward(self, model_inputs, **generate_kwargs):
        sources = model_inputs["input_ids"].shape[0]
        output_ids = self.model.generate(**model_inputs, **generate_kwargs)
        # one row per source, holding its returned sequences (num_return_sequences), so batches split per source
        return {"output_ids": output_ids.reshape(sources, -1, output_ids.shape[-1])}

    def postprocess(self, model_outputs, return_tensors=False, clean_up_tokenization_spaces=False):
        if return_tensors:
            return [{f"{TASK}_token_ids": ids} for ids in model_outputs["output_ids"][0]]
        return [{f"{TASK}_text": self.tokenizer.decode(ids, skip_special_tokens=True,
                                                       clean_up_tokenization_spaces=clean_up_tokenization_spaces)}
                for ids in model_outputs["output_ids"][0]]


def check_task(task: str) -> tuple:
    """``PIPELINE_REGISTRY.check_task`` with transformers 4's language-pair names: ``translation_XX_to_YY`` is the
    ``translation`` task with the options ``(XX, YY)``; every other name is transformers' own lookup. ``pipeline()``
    hands the pipeline the name as given, from which it takes ``src_lang`` / ``tgt_lang``."""
    lookup = type(PIPELINE_REGISTRY).check_task  # (the class's method: installing this twice changes nothing)
    pair = language_pair(task)
    if pair is None:
        return lookup(PIPELINE_REGISTRY, task)
    _, targeted_task, _ = lookup(PIPELINE_REGISTRY, TASK)
    return TASK, targeted_task, pair


def register():
    """Register the ``translation`` task and its language-pair names (idempotent), and nothing else.

    ``transformers.pipelines.pipeline`` refuses a name listed in ``REMOVED_TASKS`` before it looks at the registry
    (``_resolve_deprecated_task``; the one way around it, a model config's ``custom_pipelines``, needs
    ``trust_remote_code`` and a saved folder), so the ``translation`` entry, and only it, leaves that table: the other
    removed tasks (``summarization``, ``text2text-generation``, ...) keep transformers' error. The registry's lookup
    becomes :func:`check_task` (an attribute of the ``PIPELINE_REGISTRY`` object), so that ``translation_XX_to_YY``
    names the ``translation`` task, as in transformers 4."""
    removed = getattr(transformers.pipelines, "REMOVED_TASKS", None)  # absent from older 5.x releases
    if removed is not None:
        removed.pop(TASK, None)
    PIPELINE_REGISTRY.check_task = check_task
    if PIPELINE_REGISTRY.supported_tasks.get(TASK, {}).get("impl") is not TranslationPipeline:
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=TranslationPipeline, pt_model=AutoModelForSeq2SeqLM,
                                            type="text")
