"""The `translation` pipeline (hf_hardattn/pipelines.py) and Hub publishing (push_to_hub / save_pretrained).

References: the pipeline against `tokenizer.decode(model.generate(...))` by hand, one source at a time; batched calls
against those; pushes against a mocked `HfApi` that records what one commit would upload, compared with a local
save and the card rendered directly.
"""

import inspect
import os
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForSeq2SeqLM, GPT2Config, GPT2LMHeadModel, MarianConfig, MarianMTModel, pipeline

from common import BOS, EOS, PAD, VOCAB, as_float64, fitted, randomize, tiny_kwargs, toy_tokenizer
from hf_hardattn import (BeamJointRNNConfig, BeamJointRNNForConditionalGeneration, BeamJointTransformerConfig,
                         BeamJointTransformerForConditionalGeneration, GaussianConfig,
                         GaussianForConditionalGeneration, HardRetrievalConfig, HardRetrievalForConditionalGeneration,
                         HybridConfig, HybridForConditionalGeneration, RecurrentConfig,
                         RecurrentForConditionalGeneration, SoftTransformerConfig,
                         SoftTransformerForConditionalGeneration, TranslationPipeline)
from hf_hardattn.model_card import render_model_card

RNN_KW = dict(decoder_layers=1, rnn_hidden_size=32)
MODELS = {
    "soft": lambda: SoftTransformerForConditionalGeneration(SoftTransformerConfig(**tiny_kwargs())),
    "hard_retrieval": lambda: HardRetrievalForConditionalGeneration(HardRetrievalConfig(**tiny_kwargs())),
    "gaussian": lambda: GaussianForConditionalGeneration(GaussianConfig.preset("hc-sa", **tiny_kwargs())),
    "hybrid": lambda: HybridForConditionalGeneration(HybridConfig(**tiny_kwargs(**RNN_KW))),
    "recurrent": lambda: RecurrentForConditionalGeneration(RecurrentConfig(**tiny_kwargs())),
    "beam_joint_transformer": lambda: BeamJointTransformerForConditionalGeneration(
        BeamJointTransformerConfig(**tiny_kwargs())),
    "beam_joint_rnn": lambda: BeamJointRNNForConditionalGeneration(BeamJointRNNConfig(**tiny_kwargs(**RNN_KW))),
    "marian": lambda: MarianMTModel(MarianConfig(**tiny_kwargs())),
}
# four sources of different lengths (toy tokenizer: word i is token i), so that batches of 2 are padded
TEXTS = ["t5 t9 t13 t17 t21 </s>", "t7 t11 </s>", "t30 t31 t32 t33 </s>", "t12 t24 t36 t8 t16 t20 t28 </s>"]
FORCED = dict(max_new_tokens=6, min_new_tokens=6)


def by_hand(model, tokenizer, text, **generate_kwargs):
    """The reference: the texts of generate() on one source, decoded without special tokens."""
    output = model.generate(**tokenizer([text], return_tensors="pt"), **generate_kwargs)
    return tokenizer.batch_decode(output, skip_special_tokens=True)


@pytest.fixture(scope="module")
def fitted_soft():
    """Outputs that depend on the source (the reversal task), so a batch that mixed up rows would show. Fitted in fp32,
    then float64: the tests compare a padded batch with each source alone (two code paths), exact text, which fp32
    rounding could flip at a near tie (see common.as_float64)."""
    torch.manual_seed(0)
    return as_float64(fitted(MODELS["soft"]()))


def varied_model(name, tokenizer, seeds=range(20)):
    """A randomized float64 model of type ``name`` and its by-hand outputs for TEXTS: the first seed whose two sources
    in each batch of 2 decode differently (so a batch that mixed up or misaligned rows would show). Searched on this
    CPU's random weights, not assumed of a fixed seed; float64, so that the padded batch and the source alone (two
    code paths) agree to ~1e-12 and no rounding decides a near tie between them. Fixed tables (Marian's sinusoidal
    positions, which loading rebuilds) keep their values."""
    tried = {}
    for seed in seeds:
        torch.manual_seed(seed)
        model = MODELS[name]()
        fixed = {key: p.detach().clone() for key, p in model.named_parameters() if not p.requires_grad}
        model = randomize(model, seed=seed)
        with torch.no_grad():
            for key, p in model.named_parameters():
                if key in fixed:
                    p.copy_(fixed[key])
        model = model.double()
        expected = [by_hand(model, tokenizer, text, **FORCED)[0] for text in TEXTS]
        if expected[0] != expected[1] and expected[2] != expected[3]:
            return model, expected
        tried[seed] = expected
    raise AssertionError(f"no seed in {seeds} gives a {name} model whose sources decode differently within each batch "
                         f"of 2, batching could not be checked: {tried}")


@pytest.mark.usefixtures("one_thread")  # tiny models: much faster on one thread when the cores are shared
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.numerics
def test_translation_pipeline_equals_generate_by_hand_one_by_one_and_batched(name):
    tokenizer = toy_tokenizer()
    model, expected = varied_model(name, tokenizer)
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    assert isinstance(translator, TranslationPipeline)
    assert translator(TEXTS[0], **FORCED) == [{"translation_text": expected[0]}]
    for batch_size in (1, 2):
        assert translator(TEXTS, batch_size=batch_size, **FORCED) == [{"translation_text": t} for t in expected]


@pytest.mark.numerics
def test_returned_sequences_grouped_per_source_at_call_or_at_init(fitted_soft):
    tokenizer = toy_tokenizer()
    beam = dict(num_beams=3, num_return_sequences=2, **FORCED)
    expected = [[{"translation_text": t} for t in by_hand(fitted_soft, tokenizer, text, **beam)] for text in TEXTS]
    assert len({str(e) for e in expected}) == len(TEXTS)
    translator = pipeline("translation", model=fitted_soft, tokenizer=tokenizer)
    assert translator(TEXTS, batch_size=2, **beam) == expected
    assert translator(TEXTS[1], **beam) == expected[1]
    built_with = pipeline("translation", model=fitted_soft, tokenizer=tokenizer, batch_size=2, **beam)
    assert built_with(TEXTS) == expected


@pytest.mark.numerics
def test_token_ids_equal_generate(fitted_soft):
    tokenizer = toy_tokenizer()
    translator = pipeline("translation", model=fitted_soft, tokenizer=tokenizer)
    for batch_size in (1, 2):
        result = translator(TEXTS, batch_size=batch_size, return_tensors=True, max_new_tokens=8)
        for text, record in zip(TEXTS, result):
            expected = fitted_soft.generate(**tokenizer([text], return_tensors="pt"), max_new_tokens=8)[0]
            ids = record["translation_token_ids"]  # a batch pads shorter outputs at the end
            assert torch.equal(ids[: len(expected)], expected) and set(ids[len(expected):].tolist()) <= {PAD}


@pytest.mark.numerics
def test_a_left_padding_tokenizer_batches_like_one_by_one(fitted_soft):
    """Encoder positions are absolute: left-padded sources would move them. The pipeline pads on the right."""
    tokenizer = toy_tokenizer()
    expected = [{"translation_text": by_hand(fitted_soft, tokenizer, text, **FORCED)[0]} for text in TEXTS]
    tokenizer.padding_side = "left"
    assert pipeline("translation", model=fitted_soft, tokenizer=tokenizer)(TEXTS, batch_size=2, **FORCED) == expected


@pytest.mark.parametrize("name", ["soft", "marian"])
def test_translation_pipeline_from_a_saved_folder(name, tmp_path):
    tokenizer = toy_tokenizer()
    model, _ = varied_model(name, tokenizer)  # float64: saved and loaded as such
    if name == "marian":
        model.save_pretrained(tmp_path)
        tokenizer.save_pretrained(tmp_path)
    else:
        model.save_pretrained(tmp_path, tokenizer=tokenizer)
    # the reference decodes the saved weights (loaded anew: what the pipeline reads)
    saved = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    expected = [{"translation_text": by_hand(saved, tokenizer, text, **FORCED)[0]} for text in TEXTS]
    assert len({e["translation_text"] for e in expected[:2]}) == 2, expected  # batching could be checked
    translator = pipeline("translation", model=str(tmp_path))
    assert type(translator.model) is type(model) and translator.model.dtype == saved.dtype == torch.float64
    assert translator(TEXTS, batch_size=2, **FORCED) == expected


def test_only_the_translation_task_changes_and_the_other_removed_tasks_keep_their_error():
    """transformers' own text-generation pipeline serves a decoder-only model as before; the removed tasks other than
    translation are still refused with transformers' message."""
    import transformers.pipelines
    from transformers.pipelines.text_generation import TextGenerationPipeline

    tokenizer = toy_tokenizer()
    gpt2 = randomize(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                                bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)))
    greedy = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    expected = gpt2.generate(**tokenizer(["t5 t9"], return_tensors="pt"), **greedy)[0]  # the prompt, continued
    generator = pipeline("text-generation", model=gpt2, tokenizer=tokenizer)
    assert type(generator) is TextGenerationPipeline
    (generated,) = generator("t5 t9", return_tensors=True, **greedy)
    assert torch.equal(torch.as_tensor(generated["generated_token_ids"]), expected)
    if hasattr(transformers.pipelines, "REMOVED_TASKS"):  # (later 5.x releases)
        with pytest.raises(KeyError, match="The task summarization has been removed from transformers"):
            pipeline("summarization", model=MODELS["soft"](), tokenizer=tokenizer)


class LanguageTokenizer:
    """A multilingual tokenizer's translation hook (as M2M100's): records the languages it is given and tokenizes as
    the toy tokenizer, naming the target language's first token (token 7 for "de", 8 otherwise)."""

    def __init__(self):
        self.inner, self.calls = toy_tokenizer(), []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _build_translation_inputs(self, text, src_lang, tgt_lang, **kwargs):
        self.calls.append((src_lang, tgt_lang))
        inputs = self.inner(text, **kwargs)
        inputs["forced_bos_token_id"] = 7 if tgt_lang == "de" else 8
        return inputs


def test_language_pair_task_names_translate_as_translation(fitted_soft):
    """transformers 4's task names ``translation_XX_to_YY``: the translation pipeline, outputs equal generate() by hand;
    the languages reach a tokenizer that takes them (a call's src_lang / tgt_lang replace the name's) and its target
    token reaches generate(); a tokenizer of one language pair ignores them. Other names keep transformers' error."""
    tokenizer = toy_tokenizer()
    expected = [{"translation_text": by_hand(fitted_soft, tokenizer, text, **FORCED)[0]} for text in TEXTS]
    translator = pipeline("translation_en_to_de", model=fitted_soft, tokenizer=tokenizer)
    assert type(translator) is TranslationPipeline
    assert translator(TEXTS, batch_size=2, **FORCED) == expected

    languages = LanguageTokenizer()
    translator = pipeline("translation_en_to_de", model=fitted_soft, tokenizer=languages)
    (got,) = translator(TEXTS[0], return_tensors=True, **FORCED)
    first = got["translation_token_ids"][1]  # after the decoder start token
    assert languages.calls == [("en", "de")] and first == 7
    (got,) = translator(TEXTS[0], return_tensors=True, src_lang="fr", tgt_lang="it", **FORCED)
    assert languages.calls[-1] == ("fr", "it") and got["translation_token_ids"][1] == 8
    with pytest.raises(ValueError, match=r"`tgt_lang` must be a language code \(str\), got 5"):
        translator(TEXTS[0], tgt_lang=5)
    for name in ("translation_en", "translation_en_to_de_x", "translation_to_de"):
        with pytest.raises(KeyError, match=f"Unknown task {name}"):
            pipeline(name, model=fitted_soft, tokenizer=tokenizer)


def test_translation_pipeline_bad_input():
    tokenizer, model = toy_tokenizer(), MODELS["soft"]()
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"translates a str or a list of str; got an input of type list: \[5, 9\]"):
        translator([[5, 9]])
    with pytest.raises(ValueError, match=r"`return_tensors` must be True or False, got 'yes'"):
        translator(TEXTS[0], return_tensors="yes")
    with pytest.raises(ValueError, match=r"needs a tokenizer: pass tokenizer="):
        TranslationPipeline(model=model)
    with pytest.raises(ValueError, match=r"needs an encoder-decoder.*model=GPT2LMHeadModel"):
        pipeline("translation", model=GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2)),
                 tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# Hub publishing
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def hub(monkeypatch):
    """HfApi with create_repo / create_branch / create_commit replaced: each call is checked against the real
    method's signature and recorded (a commit with the bytes of its files); nothing leaves the machine."""
    record = SimpleNamespace(repos=[], branches=[], commits=[])

    def fake(name, log, result):
        real = getattr(HfApi, name)

        def method(self, *args, **kwargs):
            call = inspect.signature(real).bind(self, *args, **kwargs).arguments
            call.pop("self")
            for operation in call.pop("operations", ()):
                with open(operation.path_or_fileobj, "rb") as handle:
                    call.setdefault("files", {})[operation.path_in_repo] = handle.read()
            log.append(call)
            return result(call)

        monkeypatch.setattr(HfApi, name, method)

    fake("create_repo", record.repos, lambda call: SimpleNamespace(repo_id=call["repo_id"]))
    fake("create_branch", record.branches, lambda call: None)
    fake("create_commit", record.commits, lambda call: SimpleNamespace(commit_message=call["commit_message"]))
    return record


def saved_files(folder):
    return {name: (folder / name).read_bytes() for name in os.listdir(folder)}


def check_weights(model, safetensors_bytes):
    weights = load_safetensors(safetensors_bytes)
    state = model.state_dict()
    assert weights and all(torch.equal(tensor, state[key]) for key, tensor in weights.items())


def test_push_to_hub_uploads_weights_code_tokenizer_and_our_card_in_one_commit(hub, tmp_path):
    model, tokenizer = randomize(MODELS["soft"]()), toy_tokenizer()
    # the local reference: what saving the model and the tokenizer writes
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    local = saved_files(tmp_path)
    assert {"model.safetensors", "config.json", "modeling_hardattn.py", "tokenizer.json", "README.md"} <= set(local)

    result = model.push_to_hub("someone/tiny-soft", tokenizer=tokenizer, commit_message="first version",
                               commit_description="tiny", private=True, create_pr=True, revision="dev")
    assert hub.repos == [dict(repo_id="someone/tiny-soft", private=True, token=None, exist_ok=True)]
    assert hub.branches == [dict(repo_id="someone/tiny-soft", branch="dev", token=None, exist_ok=True)]
    (commit,) = hub.commits
    assert result.commit_message == commit["commit_message"] == "first version"
    assert (commit["commit_description"], commit["create_pr"], commit["revision"]) == ("tiny", True, "dev")
    files = commit.pop("files")
    assert set(files) == set(local)
    assert files["README.md"].decode() == render_model_card(model, repo_id="someone/tiny-soft")  # snippets load it
    assert "someone/tiny-soft" not in local["README.md"].decode()
    check_weights(model, files["model.safetensors"])
    assert {name: data for name, data in files.items() if name not in ("model.safetensors", "README.md")} == {
        name: data for name, data in local.items() if name not in ("model.safetensors", "README.md")}


def test_push_to_hub_without_tokenizer_and_with_tags(hub):
    model = randomize(MODELS["hybrid"]())
    model.add_model_tags(["distilled"])
    model.push_to_hub("someone/tiny-hybrid", tags="mine")
    (commit,) = hub.commits
    assert commit["commit_message"] == "Upload HybridForConditionalGeneration"  # transformers' default for the name
    assert not any(name.startswith("tokenizer") for name in commit["files"])
    pushed = ModelCard(commit["files"]["README.md"].decode())
    ours = ModelCard(render_model_card(model, repo_id="someone/tiny-hybrid"))
    assert pushed.text == ours.text
    assert pushed.data.tags == ours.data.tags + ["distilled", "mine"]
    assert pushed.data.pipeline_tag == "translation"


def test_save_pretrained_push_to_hub_pushes_what_it_writes_with_the_commit_arguments(hub, tmp_path):
    model, tokenizer = randomize(MODELS["gaussian"]()), toy_tokenizer()
    folder = tmp_path / "tiny-gaussian"
    folder.mkdir()
    (folder / "notes.txt").write_text("written before, not by this save")
    model.save_pretrained(folder, push_to_hub=True, tokenizer=tokenizer, commit_message="trained", create_pr=True,
                          commit_description="3 steps", private=False, token="hf_fake")
    assert hub.repos == [dict(repo_id="tiny-gaussian", private=False, token="hf_fake", exist_ok=True)]  # folder name
    (commit,) = hub.commits
    files = commit.pop("files")
    assert commit == dict(repo_id="tiny-gaussian", commit_message="trained", commit_description="3 steps",
                          token="hf_fake", create_pr=True, revision=None)
    local = saved_files(folder)
    assert set(files) == set(local) - {"notes.txt"}
    assert all(files[name] == local[name] for name in files)
    assert files["README.md"].decode() == render_model_card(model, repo_id="tiny-gaussian")
    assert "tokenizer.json" in files


def test_save_pretrained_refuses_a_tokenizer_without_save_pretrained(tmp_path):
    with pytest.raises(TypeError, match=r"`tokenizer` must be a tokenizer with save_pretrained\(\), got dict"):
        MODELS["soft"]().save_pretrained(tmp_path, tokenizer={"t5": 5})
    assert not (tmp_path / "model.safetensors").exists()
