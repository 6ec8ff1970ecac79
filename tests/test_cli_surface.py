"""The hf-hardattn command as a whole: every subcommand documents every option in --help, and bad input to each
ends with one line on stderr and exit status 2 (not a traceback). An option naming the registry's names (plot's
--role, convert's and train's --model-type) takes any string in the front's parser; the command refuses a bad one
before any work (here: before the model folder is read)."""

import argparse
import warnings

import pytest

from hf_hardattn import SoftTransformerConfig, SoftTransformerForConditionalGeneration
from hf_hardattn.tools.tokenization import train_tokenizer
from hf_hardattn_cli.command import build_parser, main


def subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_option_of_every_subcommand_has_help():
    commands = subparsers()
    assert {"demo", "tokenizer", "distill", "convert", "reproduce", "train", "translate", "score", "publish",
            "plot"} <= set(commands)
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, sub in commands.items() for action in sub._actions
               if not isinstance(action, argparse._HelpAction) and not action.help
               and not (action.option_strings == [] and action.metavar)]
    # positionals documented by their metavar and description are allowed; options need their own help
    assert not [m for m in missing if " -" in m], missing


@pytest.mark.parametrize("argv, expected", [
    (["tokenizer", "--files", "/no/such/file", "--out", "OUT"], "--files: not found"),
    (["distill", "--teacher", "/no/such/model", "--data", "/no", "--split", "train", "--out", "OUT"], "--teacher="),
    (["reproduce", "--task", "nouns", "--preset", "tiny", "--minutes", "0"], "`--minutes` must be > 0"),
    (["convert", "/no/such/model", "OUT", "--model-type", "soft_transformer"], "/no/such/model"),
    (["translate", "/no/such/model", "-i", "/no/such/file"], "--input="),
    (["score", "/no/such/hyp", "/no/such/ref"], "HYP="),
    (["plot", "/no/such/model", "--source", "x", "--out", "OUT"], "MODEL="),
    (["plot", "/no/such/model", "--source", "x", "--role", "crosss"], "--role='crosss' is not an attention role"),
    (["publish", "/no/such/model", "me/x", "--dry-run", "OUT"], "MODEL="),
    (["train", "--train", "/no/such/prefix", "--source-lang", "en", "--target-lang", "de", "--model-type",
      "soft_transformer", "--output-dir", "OUT", "--max-steps", "1", "--tokenizer", "/no/tok"], "--train:"),
])
def test_bad_input_is_one_line_and_status_2(argv, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"hf-hardattn {argv[0]}: error:") and expected in err[-1], err[-3:]
    assert "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("extra, expected", [
    (["--model-type", "no_such_transformer"], "--model-type='no_such_transformer' is not an hf_hardattn model type"),
    (["--model-type", "soft_transformer", "--set", "cross_atention=soft"], "did you mean `cross_attention`"),
    (["--model-type", "soft_transformer", "--set", "d_model=-4"], "d_model"),
    (["--model-type", "soft_transformer", "--gaussian-preset", "hc-sa"], "--gaussian-preset='hc-sa' applies to"),
    (["--model-type", "gaussian_transformer", "--gaussian-preset", "hc-all", "--set", "dropuot=0.1"], "did you mean `dropout`"),
])
def test_train_checks_every_argument_before_any_work(extra, expected, tmp_path, capsys, monkeypatch):
    """A bad model type or config field ends `train` before a tokenizer is trained: no OUT folder is made."""
    monkeypatch.chdir(tmp_path)
    for lang, text in (("en", "a small house\n"), ("de", "ein kleines Haus\n")):
        (tmp_path / f"train.{lang}").write_text(text * 20)
    argv = ["train", "--train", "train", "--source-lang", "en", "--target-lang", "de", "--output-dir", "OUT",
            "--max-steps", "1", "--tokenizer-kind", "char", "--vocab-size", "40"] + extra
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hf-hardattn train: error:") and expected in err[-1], err[-3:]
    assert not (tmp_path / "OUT").exists()


def test_plot_labels_a_control_character_without_a_font_warning(tmp_path, capsys):
    """A byte-level piece that decodes to a control character (here the target's \\x05) is labelled as its escape:
    matplotlib has no glyph for it and warned "Glyph 5 missing from font(s)" at every save."""
    tokenizer = train_tokenizer(["Ein Hund l\u00e4uft.\x05"] * 20, kind="bpe", vocab_size=300, min_frequency=1)
    config = SoftTransformerConfig(vocab_size=len(tokenizer), d_model=16, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                   decoder_ffn_dim=32, pad_token_id=tokenizer.pad_token_id,
                                   bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                   decoder_start_token_id=tokenizer.bos_token_id)
    SoftTransformerForConditionalGeneration(config).save_pretrained(tmp_path / "soft", tokenizer=tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert main(["plot", str(tmp_path / "soft"), "--source", "Ein Hund", "--target", "Hund\x05",
                     "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "soft_cross.png").is_file()
