"""Model cards written next to every saved hf_hardattn model (README.md with Hub metadata).

Runtime code shipped with saved models: flat, standard library and same-folder imports only.
"""

import json
import os

from huggingface_hub import EvalResult, ModelCardData

from .safe_io import write_text_atomic

RESULTS_FILE = "hardattn_results.json"  # optional: a variant's measured results, shown in the card
# key of RESULTS_FILE (and the ``metadata`` argument below) holding the card's Hub metadata: ModelCardData fields
# (language, license, datasets, base_model, tags, metrics, model_name) and ``eval_results``, a list of EvalResult
# fields (the model-index). Not shown in the results table.
CARD_METADATA = "card_metadata"
CARD_FIELDS = ("language", "license", "datasets", "base_model", "tags", "metrics", "model_name", "eval_results")
# an eval result on data that is not on the Hub (its ``dataset_type`` left None): the model-index's dataset.type is
# this prefix and the dataset's name, e.g. "local:valid", which no Hub dataset id can be (ids have no ":")
LOCAL_DATASET = "local:"
# the snippet's model location, replaced by the repo id when the card is written for a push
SNIPPET_PLACEHOLDER = "PATH_OR_REPO"
# pyproject.toml's lower bound (a test keeps the two equal). Releases before it copy only the direct relative imports
# of an auto_map file when remote code loads from a local folder; ours reach most files through modeling_hardattn.py.
MIN_TRANSFORMERS = "5.10.1"


def _kinds_table(config) -> str:
    rows = ["| role | kind per layer |", "| --- | --- |"]
    for role, field in (("encoder self-attention", "encoder_attention"), ("decoder self-attention", "decoder_attention"),
                        ("cross-attention", "cross_attention")):
        if hasattr(config, field):
            rows.append(f"| {role} | {getattr(config, field)} |")
    return "\n".join(rows)


def merge_metadata(*layers: dict | None) -> dict:
    """Card metadata of ``layers`` (later wins; tags are joined, in order, once each); unknown fields refused."""
    merged = {}
    for layer in layers:
        for key, value in (layer or {}).items():
            if key not in CARD_FIELDS:
                raise ValueError(f"card metadata: unknown field {key!r}; allowed: {', '.join(CARD_FIELDS)}.")
            if value is None or value == [] or value == "":
                continue
            if key in ("tags", "metrics"):
                value = list(dict.fromkeys(merged.get(key, []) + ([value] if isinstance(value, str) else
                                                                  list(value))))
            merged[key] = value
    return merged


def eval_result(row) -> EvalResult:
    """``row`` (EvalResult fields, or an EvalResult) as an EvalResult; a row on data that is not on the Hub leaves
    ``dataset_type`` out (or None) and gets ``LOCAL_DATASET`` + its ``dataset_name``, never a name the Hub would take
    for a dataset id."""
    if isinstance(row, EvalResult):
        return row
    row = dict(row)
    if row.get("dataset_type") is None:
        if not row.get("dataset_name"):
            raise ValueError(f"card metadata: eval result {row!r} has neither `dataset_type` (a Hub dataset id) nor "
                             f"`dataset_name`; allowed: a Hub id in dataset_type, or dataset_name alone for local "
                             f"data.")
        row["dataset_type"] = LOCAL_DATASET + str(row["dataset_name"])
    return EvalResult(**row)


def card_data(model, metadata: dict | None = None) -> ModelCardData:
    """The card's YAML header as huggingface_hub's ``ModelCardData`` (what the Hub validates): library, task and tags,
    plus ``metadata`` (see ``CARD_METADATA``); ``eval_results`` becomes the ``model-index`` named ``model_name``
    (default: the model type)."""
    metadata = merge_metadata(dict(tags=["hf_hardattn", model.config.model_type, "trust_remote_code"]), metadata)
    evals = [eval_result(row) for row in metadata.pop("eval_results", [])]
    model_name = metadata.pop("model_name", None) or model.config.model_type
    return ModelCardData(library_name="transformers", pipeline_tag="translation", eval_results=evals or None,
                         model_name=model_name if evals else None, **metadata)


def render_model_card(model, results: dict | None = None, metadata: dict | None = None, training: str | None = None,
                      repo_id: str | None = None) -> str:
    """README.md of ``model``: the YAML header (``card_data``: ``metadata`` over the results' ``CARD_METADATA``),
    description, architecture, usage (loading ``repo_id``, else the placeholder ``SNIPPET_PLACEHOLDER``), the
    ``results`` table (other keys than ``CARD_METADATA``), ``training`` (markdown sections, e.g. the Trainer's training
    procedure), citation."""
    results = dict(results or {})
    data = card_data(model, merge_metadata(results.pop(CARD_METADATA, None), metadata))
    config = model.config
    auto_map = getattr(config, "auto_map", None) or {}
    n_params = sum(p.numel() for p in model.parameters())
    fields = getattr(model, "card_size_fields", None) or [
        "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
        "encoder_ffn_dim", "decoder_ffn_dim", "vocab_size", "position_embedding", "normalize_before"]
    sizes = ", ".join(f"{f}={getattr(config, f)}" for f in fields if hasattr(config, f))
    roles = model.card_roles_table() if hasattr(model, "card_roles_table") else _kinds_table(config)
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# {model.card_title} ({config.model_type})",
        "",
        model.card_description.strip(),
        "",
        "## Architecture",
        "",
        f"- parameters: {n_params:,}",
        f"- sizes: {sizes}",
        "",
        roles,
        "",
        "## Usage",
        "",
        "```python",
        "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
        "",
        f'model = AutoModelForSeq2SeqLM.from_pretrained("{SNIPPET_PLACEHOLDER}", trust_remote_code=True)',
        # trust_remote_code: AutoTokenizer reads config.json, whose model type is remote code without hf_hardattn
        f'tokenizer = AutoTokenizer.from_pretrained("{SNIPPET_PLACEHOLDER}", trust_remote_code=True)',
        'batch = tokenizer(["A man is riding a bike."], return_tensors="pt")',
        "print(tokenizer.batch_decode(model.generate(**batch, num_beams=4, max_new_tokens=64), skip_special_tokens=True))",
        "```",
        "",
        "The modeling code is stored with the weights (`trust_remote_code=True`); with `pip install hf-hardattn` and "
        "`import hf_hardattn`, `AutoModelForSeq2SeqLM` resolves this model type without remote code. Either way "
        f"it requires `transformers>={MIN_TRANSFORMERS}`. On a CPU, "
        "`model.pack_linears()` decodes small batches faster (oneDNN-prepacked linear weights; parameters unchanged).",
        "",
        "`import hf_hardattn` also registers the `translation` pipeline task, which transformers 5 does not have "
        "(batches give the same translations as one text at a time):",
        "",
        "```python",
        "import hf_hardattn",
        "from transformers import pipeline",
        "",
        f'translator = pipeline("translation", model="{SNIPPET_PLACEHOLDER}")',
        'print(translator(["A man is riding a bike."], num_beams=4, max_new_tokens=64, batch_size=8))',
        '# [{"translation_text": "..."}]: one dict per text; generation keywords (num_beams, ...) go to generate()',
        "```",
        "",
        "Loaded as remote code without hf_hardattn, the model decodes with `generate()` as in the first example and "
        "`pack_linears()` works; `pipeline(\"translation\")` is not available (transformers 5 removed the task), and "
        "`pipeline(\"text-generation\")` does not translate: it reads the output as a continuation of the prompt.",
    ]
    if auto_map:
        lines += ["", f"Remote code entry points: `{json.dumps(auto_map)}`"]
    if results:
        lines += ["", "## Results", ""]
        if isinstance(results.get("table"), str):
            lines.append(results["table"])
        else:
            lines.append(metrics_table(results))
    if training:
        lines += ["", training.strip()]
    lines += ["", "## Citation", "", model.card_citation.strip(), ""]
    text = "\n".join(lines)
    return name_repo(text, repo_id) if repo_id else text


def name_repo(card: str, repo_id: str) -> str:
    """``card`` with its snippets loading ``repo_id`` in place of ``SNIPPET_PLACEHOLDER``."""
    return card.replace(json.dumps(SNIPPET_PLACEHOLDER), json.dumps(repo_id))


def table_cell(value) -> str:
    """``value`` as one markdown table cell: ``|`` escaped (sacrebleu's signatures hold some), one line."""
    return " ".join(str(value).split()).replace("|", "\\|")


def metrics_table(metrics: dict) -> str:
    """A markdown table of ``metrics`` (name -> value)."""
    return "\n".join(["| metric | value |", "| --- | --- |"] +
                     [f"| {table_cell(k)} | {table_cell(v)} |" for k, v in metrics.items()])


def write_model_card(model, save_directory, results: dict | None = None, metadata: dict | None = None,
                     training: str | None = None, repo_id: str | None = None) -> str:
    """Write README.md into ``save_directory``; results come from the argument or from ``hardattn_results.json``;
    ``metadata`` (``CARD_METADATA`` fields) goes over the results' own; ``training`` and ``repo_id`` as in
    ``render_model_card``."""
    path = os.path.join(str(save_directory), RESULTS_FILE)
    if results is None and os.path.exists(path):
        with open(path) as handle:
            results = json.load(handle)
    card = render_model_card(model, results, metadata, training, repo_id)
    write_text_atomic(os.path.join(str(save_directory), "README.md"), card)  # a kill never leaves half a card
    return card
