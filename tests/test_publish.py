"""``hf-hardattn publish``: the upload folder equals a local save plus the card's run metrics and command, it is
validated in a fresh process without the package, the push is one commit of exactly those files (mocked HfApi), and
offline or broken inputs are refused with one line and nothing pushed."""

import json
import os

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file
from transformers import MarianConfig, MarianMTModel

import hf_hardattn.tools.cli as cli
from common import randomize, tiny_kwargs, toy_tokenizer
from hf_hardattn import HardRetrievalConfig, HardRetrievalForConditionalGeneration
from hf_hardattn_cli.command import main as cli_main
from test_pipelines_hub import hub  # noqa: F401  (the recording HfApi fixture)


@pytest.fixture
def saved(tmp_path):
    model = randomize(HardRetrievalForConditionalGeneration(HardRetrievalConfig(**tiny_kwargs())))
    model.save_pretrained(tmp_path / "model", tokenizer=toy_tokenizer())
    score = tmp_path / "score.json"
    score.write_text(json.dumps([{"name": "BLEU", "score": 12.34, "signature": "nrefs:1|tok:13a"}]))
    return model, tmp_path / "model", score


def test_dry_run_builds_and_validates_the_folder(saved, tmp_path, capsys):
    model, folder, score = saved
    out = tmp_path / "upload"
    assert cli_main(["publish", str(folder), "me/tiny", "--dry-run", str(out), "--results", str(score),
                     "--command", "hf-hardattn train --model-type hard_retrieval_transformer ...",
                     "--sentence", "t5 t6 t7"]) == 0
    printed = capsys.readouterr().out
    assert "validated" in printed and "nothing pushed" in printed
    files = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "modeling_hardattn.py", "tokenizer.json", "README.md"} <= files
    weights = load_file(out / "model.safetensors")
    state = model.state_dict()
    assert all(torch.equal(tensor, state[key]) for key, tensor in weights.items())
    card = (out / "README.md").read_text()
    assert "| BLEU | 12.34 (nrefs:1\\|tok:13a) |" in card  # the signature's | escaped: one table cell
    assert "hf-hardattn train --model-type hard_retrieval_transformer ..." in card


def test_push_is_one_commit_of_the_validated_files(saved, hub, monkeypatch, tmp_path):  # noqa: F811
    _, folder, score = saved
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    # validate_folder is recorded, not run: its fresh process on this folder and sentence is the dry run's above (the
    # same call before the push / dry-run branch); a failing one refuses the push (test_refusals_...)
    validated = []
    monkeypatch.setattr(cli, "validate_folder", lambda staging, model, tokenizer, sentence: validated.append(
        (sorted(os.listdir(staging)), sentence)))
    assert cli_main(["publish", str(folder), "me/tiny", "--results", str(score), "--commit-message", "v1",
                     "--private", "--sentence", "t5 t6 t7"]) == 0
    assert [repo["repo_id"] for repo in hub.repos] == ["me/tiny"] and hub.repos[0]["private"] is True
    (commit,) = hub.commits
    assert commit["commit_message"] == "v1"
    assert validated == [(sorted(commit["files"]), "t5 t6 t7")]  # validated before the push: what it committed
    out = tmp_path / "same"
    cli_main(["publish", str(folder), "me/tiny", "--results", str(score), "--dry-run", str(out)])
    assert set(commit["files"]) == set(os.listdir(out))
    assert commit["files"]["README.md"] == (out / "README.md").read_bytes()


def test_refusals_are_one_line_and_push_nothing(saved, hub, monkeypatch, tmp_path, capsys):  # noqa: F811
    _, folder, _ = saved
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert cli_main(["publish", str(folder), "me/tiny"]) == 2
    assert "offline: HF_HUB_OFFLINE is set" in capsys.readouterr().err
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    marian = tmp_path / "marian"
    MarianMTModel(MarianConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                               decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=40,
                               pad_token_id=0, decoder_start_token_id=0)).save_pretrained(marian)
    toy_tokenizer().save_pretrained(marian)
    assert cli_main(["publish", str(marian), "me/m"]) == 2
    assert "not an hf_hardattn model" in capsys.readouterr().err.splitlines()[-1]
    monkeypatch.setattr(cli, "VALIDATE_SCRIPT", "raise SystemExit('broken remote code')")
    assert cli_main(["publish", str(folder), "me/tiny"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "does not load as remote code in a fresh process: broken remote code" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli_main(["publish", str(folder), "me/tiny", "--results", str(bad)]) == 2
    assert "--results=" in capsys.readouterr().err
    assert hub.commits == []
