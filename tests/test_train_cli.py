"""``hf-hardattn train``: a run on the user's files gives a model whose scores are recomputed independently, the
best validation checkpoint is the one kept, early stopping stops, --resume after a lost checkpoint ends with the
uninterrupted run's weights, two torchrun processes equal one process with the doubled batch, pretrained Marian
folders are converted, and bad input is a one-line error."""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import sacrebleu
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, MarianConfig, MarianMTModel

from hf_hardattn.tools import train_cli
from hf_hardattn.tools.tokenization import train_tokenizer
from hf_hardattn.tools.training import machine, translate
from hf_hardattn_cli.command import main

os.environ["HF_HUB_OFFLINE"] = "1"
SIZES = ["--d-model", "32", "--encoder-layers", "1", "--decoder-layers", "1", "--heads", "2", "--ffn-dim", "64"]


def write_pairs(prefix, pairs):
    for index, lang in enumerate(("en", "de")):
        with open(f"{prefix}.{lang}", "w", encoding="utf-8") as handle:
            handle.write("".join(pair[index] + "\n" for pair in pairs))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A reversal task as en/de files (train 200, valid 16, small 16) and a char tokenizer saved beside."""
    folder = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    words = "a b c d e f g h".split()

    def pair():
        source = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
        return source, " ".join(reversed(source.split()))

    pairs = [pair() for _ in range(232)]
    write_pairs(folder / "train", pairs[:200])
    write_pairs(folder / "valid", pairs[200:216])
    write_pairs(folder / "small", pairs[216:])
    tokenizer = train_tokenizer([p for pair in pairs for p in pair], kind="char", min_frequency=1)
    tokenizer.save_pretrained(folder / "tok")
    return folder


def train(data, out, *extra, tokenizer=True):
    argv = ["train", "--train", str(data / "train"), "--source-lang", "en", "--target-lang", "de",
            "--model-type", "hard_retrieval_transformer", *SIZES, "--output-dir", str(out), "--quiet", "--threads",
            "1", "--warmup-steps", "10", "--learning-rate", "0.005", "--batch-size", "32"]
    if tokenizer:
        argv += ["--tokenizer", str(data / "tok")]
    return main(argv + list(extra))


def test_train_writes_a_model_whose_test_bleu_recomputes(data, tmp_path):
    out = tmp_path / "run"
    assert train(data, out, "--max-steps", "30", "--test", str(data / "valid"), "--num-beams", "2") == 0
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 30 and results["model_type"] == "hard_retrieval_transformer"
    assert (results["precision"], results["seed"]) == ("fp32", 0)
    assert {k: results["machine"][k] for k in ("cpu", "torch", "threads")} == {"cpu": machine()["cpu"],
                                                                               "torch": torch.__version__, "threads": 1}
    model = AutoModelForSeq2SeqLM.from_pretrained(out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    sources = (data / "valid.en").read_text().splitlines()
    references = (data / "valid.de").read_text().splitlines()
    hypotheses = translate(model, tokenizer, sources, num_beams=2)
    assert (out / "test.hyp").read_text().splitlines() == hypotheses
    assert results["test_bleu"] == round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2)
    card = (out / "model" / "README.md").read_text()
    assert "test_bleu" in card and "hf-hardattn train --train" in card
    # generate() without arguments decodes as the run scored it (beam --num-beams), not cut at transformers' 20
    assert (model.generation_config.num_beams, model.generation_config.max_length) == (2, 512)
    assert results["command"].startswith("hf-hardattn train --train")


def test_best_validation_checkpoint_is_kept_and_early_stopping_stops(data, tmp_path):
    out = tmp_path / "run"
    assert train(data, out, "--max-steps", "40", "--validation", str(data / "valid"), "--eval-steps", "10",
                 "--num-beams", "1") == 0
    results = json.loads((out / "results.json").read_text())
    state = json.loads((out / "trainer" / "checkpoint-40" / "trainer_state.json").read_text())
    scores = {entry["step"]: entry["eval_bleu"] for entry in state["log_history"] if "eval_bleu" in entry}
    assert sorted(scores) == [10, 20, 30, 40]
    best_step = max(scores, key=lambda step: (scores[step], -step))  # the Trainer keeps the first of equal bests
    assert results["best_validation_bleu"] == pytest.approx(scores[best_step])
    assert results["best_checkpoint"].endswith(f"checkpoint-{best_step}")
    final = load_file(out / "model" / "model.safetensors")
    best = load_file(out / "trainer" / f"checkpoint-{best_step}" / "model.safetensors")
    assert all(torch.equal(final[key], best[key]) for key in best)
    # early stopping: a learning rate too small to change BLEU stops after PATIENCE evaluations without a gain
    flat = tmp_path / "flat"
    assert train(data, flat, "--max-steps", "100", "--validation", str(data / "valid"), "--eval-steps", "5",
                 "--early-stopping", "2", "--num-beams", "1", "--learning-rate", "1e-12") == 0
    assert json.loads((flat / "results.json").read_text())["steps"] == 15  # evaluations at 5 (best), 10, 15


def test_resume_after_a_lost_checkpoint_ends_with_the_uninterrupted_weights(data, tmp_path):
    out = tmp_path / "run"
    assert train(data, out, "--max-steps", "12", "--save-steps", "4") == 0
    uninterrupted = load_file(out / "model" / "model.safetensors")
    shutil.rmtree(out / "trainer" / "checkpoint-12")  # as if the run had been killed after step 8's checkpoint
    shutil.rmtree(out / "model")
    os.makedirs(out / "trainer" / "checkpoint-12")  # a half-written checkpoint: must be skipped, not resumed
    assert train(data, out, "--max-steps", "12", "--save-steps", "4", "--resume") == 0
    resumed = load_file(out / "model" / "model.safetensors")
    assert all(torch.allclose(resumed[key], uninterrupted[key], atol=1e-6) for key in uninterrupted)


def test_sigkill_mid_run_then_resume_ends_with_the_uninterrupted_weights(data, tmp_path):
    """`hf-hardattn train` killed with SIGKILL once its step-6 checkpoint exists (the kill lands mid-run, often mid-save
    of a later checkpoint), then rerun with --resume: the final weights equal an uninterrupted run's."""
    import signal
    import time

    def command(out, *extra):
        return [sys.executable, "-m", "hf_hardattn", "train", "--train", str(data / "train"), "--source-lang", "en",
                "--target-lang", "de", "--model-type", "hard_retrieval_transformer", *SIZES, "--output-dir", str(out),
                "--quiet", "--threads", "1", "--warmup-steps", "10", "--learning-rate", "0.005", "--batch-size", "32",
                "--tokenizer", str(data / "tok"), "--max-steps", "24", "--save-steps", "2", *extra]

    env = dict(os.environ, OMP_NUM_THREADS="1")
    # the uninterrupted run beside the killed one (one thread each; its output is only read at the end)
    with open(tmp_path / "straight.log", "w") as log:
        straight = subprocess.Popen(command(tmp_path / "straight"), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        out = tmp_path / "killed"
        child = subprocess.Popen(command(out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.time() + 300
        while not (out / "trainer" / "checkpoint-6" / "trainer_state.json").exists() and child.poll() is None:
            assert time.time() < deadline
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert not (out / "model").exists()  # killed before the end
        resumed = subprocess.run(command(out, "--resume"), capture_output=True, text=True, env=env, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert straight.wait(timeout=600) == 0, (tmp_path / "straight.log").read_text()[-2000:]
    finally:
        if straight.poll() is None:  # (a failure above: not left running)
            straight.kill()
            straight.wait()
    want = load_file(tmp_path / "straight" / "model" / "model.safetensors")
    got = load_file(out / "model" / "model.safetensors")
    assert all(torch.equal(got[key], want[key]) for key in want)


LAUNCHERS = {  # on a CPU machine both start 2 processes (gloo); `accelerate launch --cpu` starts only one
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"],
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
}


# run in a launched process: `hf-hardattn` with the model cast to float64 before training (the CLI has no dtype flag)
FLOAT64_MAIN = """import sys
from hf_hardattn.tools import train_cli
from hf_hardattn_cli.command import main
build = train_cli.build_model
train_cli.build_model = lambda *args, **kwargs: (lambda made: (made[0].double(), made[1]))(build(*args, **kwargs))
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_two_processes_equal_one_process_with_the_doubled_batch(data, tmp_path, launcher, monkeypatch):
    """One Adam step over the whole 16-pair set in both runs (gloo DDP averages the gradients of the two halves of 8),
    in float64, every weight compared.

    Bound: Adam's first step is lr g / (|g| + eps) (m^ = g, v^ = g^2), whose derivative in g is eps / (|g| + eps)^2
    <= 1 / eps: two gradients dg apart move a weight at most lr |dg| / eps apart, whatever g is (gradient clipping
    rescales g by one common factor, which this ratio does not see). The two runs reduce the same float64 products in
    another order and other GEMM shapes: |dg| <= K u sum|terms| with u = 2^-53, K <= 500 (128 target tokens, inner
    dimensions <= 64) and sum|terms| <= 1 (a mean loss's softmax gradients, each <= 1 / tokens, times activations of
    order 1): |dg| <= 6e-14, so |dw| <= 0.01 * 6e-14 / 1e-9 = 6e-7 < atol 1e-6. The loss takes its softmax in fp32
    (loss.py): float64 logits 1e-16 apart give the same fp32 value unless one lies within that of an fp32 rounding
    boundary (about 2^-29 per logit, ~10^-5 for the ~3,000 logits here). In fp32 the same bound is lr 1e-7 / eps: two
    runs could step a weight with a near-zero gradient by +-lr (the key projections' biases, whose gradient is zero in
    exact arithmetic, always did); several steps would feed such a flip into every later gradient."""
    common = ["--train", str(data / "small"), "--source-lang", "en", "--target-lang", "de", "--model-type",
              "soft_transformer", *SIZES, "--dropout", "0", "--tokenizer", str(data / "tok"), "--max-steps", "1",
              "--warmup-steps", "0", "--learning-rate", "0.01", "--quiet", "--threads", "1",
              # N(0, d^-1/2) embeddings: with the type's default N(0, 0.02) the first step's logits are nearly uniform
              # and many gradients nearly cancel; this test is about splitting the batch, not the init
              "--set", "embed_init_std=null"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = tmp_path / "float64_main.py"
    script.write_text(FLOAT64_MAIN)
    two = subprocess.run([*LAUNCHERS[launcher], str(script), "train", *common, "--batch-size", "8", "--output-dir",
                          str(tmp_path / "ddp")], capture_output=True, text=True, env=env, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    build = train_cli.build_model
    monkeypatch.setattr(train_cli, "build_model", lambda *args, **kwargs: (lambda made: (made[0].double(), made[1]))(
        build(*args, **kwargs)))
    assert main(["train", *common, "--batch-size", "16", "--output-dir", str(tmp_path / "one")]) == 0
    monkeypatch.setattr(train_cli, "build_model", build)
    assert main(["train", *common, "--batch-size", "16", "--learning-rate", "1e-30",
                 "--output-dir", str(tmp_path / "start")]) == 0  # the initial weights (a step of ~1e-30)
    ddp = load_file(tmp_path / "ddp" / "model" / "model.safetensors")
    one = load_file(tmp_path / "one" / "model" / "model.safetensors")
    start = load_file(tmp_path / "start" / "model" / "model.safetensors")
    assert ddp.keys() == one.keys() and all(tensor.dtype == torch.float64 for tensor in one.values())
    for name, tensor in one.items():
        assert torch.allclose(tensor, ddp[name], rtol=0, atol=1e-6), (name, (tensor - ddp[name]).abs().max())
    # the step is not degenerate: most weights moved by about lr (|g| >> eps), so the comparison sees the gradients'
    # signs; a process that stepped on its own half's gradient would differ by 2 lr wherever the halves disagree
    moved = torch.cat([(one[name] - start[name].double()).abs().flatten() for name in one if name in start])
    assert (moved > 0.005).float().mean() > 0.5, (moved > 0.005).float().mean()
    results = json.loads((tmp_path / "ddp" / "results.json").read_text())
    assert results["steps"] == 1 and results["processes"] == 2


END_PROCESSES = """import sys
import torch.distributed as dist
from hf_hardattn.tools.training import end_processes
end_processes(5)  # no process group: a no-op
print("before", end="")  # buffered (stdout is a pipe): end_processes must flush it
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
end_processes(3)
print("after")
"""


def test_end_processes_flushes_and_ends_a_multi_process_run_with_its_status(tmp_path):
    """The last step of `train` in every process of a multi-process run: a barrier, the output flushed, the process
    ended with the given status without the interpreter's teardown (no-op without a process group)."""
    script = tmp_path / "end.py"
    script.write_text(END_PROCESSES)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}  # stdout block-buffered
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert (proc.returncode, proc.stdout) == (3, "before"), proc.stderr[-2000:]


def launcher_env(monkeypatch, *flags):
    """The environment accelerate's own launcher gives its child for ``accelerate launch FLAGS -m hf_hardattn train``
    (its argument parser, checks and env preparation, no default config file read)."""
    from accelerate.commands import launch
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    monkeypatch.setattr(launch, "default_config_file", "/nonexistent/accelerate.yaml")
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    args, _, _ = launch._validate_launch_command(launch.launch_command_parser().parse_args(
        [*flags, "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_hardattn",
         "train"]))
    if args.multi_gpu:  # torchrun then adds WORLD_SIZE, RANK, ... for each process it starts
        return dict(prepare_multi_gpu_env(args), WORLD_SIZE=str(args.num_processes))
    return prepare_simple_launcher_cmd_env(args)[1]


@pytest.mark.parametrize("flags, refused", [
    (["--cpu", "--num_processes", "2"], True),
    (["--num_processes", "3"], True),  # no --multi_gpu, no GPUs: the simple launcher too
    (["--cpu", "--num_processes", "1"], False),
    (["--cpu"], False),
    (["--multi_gpu", "--num_processes", "2"], False),
])
def test_an_accelerate_launch_that_starts_fewer_processes_is_refused(monkeypatch, flags, refused):
    from hf_hardattn.tools.training import check_processes_started

    if "--multi_gpu" not in flags and torch.cuda.device_count() > 1:
        pytest.skip("accelerate turns on --multi_gpu itself where it sees several GPUs")
    env = launcher_env(monkeypatch, *flags)
    if not refused:
        check_processes_started(env)
        return
    with pytest.raises(ValueError, match=r"accelerate launch --multi_gpu --num_processes N -m hf_hardattn train"):
        check_processes_started(env)


def test_accelerate_launch_cpu_with_two_processes_is_refused_end_to_end(data, tmp_path):
    """A real ``accelerate launch --cpu --num_processes 2``: one process starts and refuses before any work."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_hardattn", "train", "--train",
         str(data / "small"), "--source-lang", "en", "--target-lang", "de", "--model-type", "soft_transformer",
         *SIZES, "--tokenizer", str(data / "tok"), "--max-steps", "1", "--output-dir", str(out), "--quiet"],
        capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS="1"), timeout=300)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if "hf-hardattn train: error:" in line]
    assert len(errors) == 1, run.stderr[-3000:]  # one process, one error line
    assert "`accelerate launch --multi_gpu --num_processes N -m hf_hardattn train ...`" in errors[0]
    assert "`torchrun --nproc_per_node N -m hf_hardattn train ...`" in errors[0]
    assert not out.exists()  # refused before any work


def test_init_from_a_marian_folder_converts_it(data, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(data / "tok")
    marian = MarianMTModel(MarianConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id,
                                        decoder_start_token_id=tokenizer.bos_token_id, max_position_embeddings=64))
    marian.save_pretrained(tmp_path / "marian")
    tokenizer.save_pretrained(tmp_path / "marian")
    out = tmp_path / "run"
    assert main(["train", "--train", str(data / "train"), "--source-lang", "en", "--target-lang", "de",
                 "--model-type", "hard_retrieval_transformer", "--init-from", str(tmp_path / "marian"),
                 "--output-dir", str(out), "--max-steps", "2", "--quiet", "--threads", "1", "--max-length", "60"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["origin"] == "converted from marian" and results["tokenizer"] == str(tmp_path / "marian")
    model = AutoModelForSeq2SeqLM.from_pretrained(out / "model")
    assert model.config.d_model == 16
    # the source sets neither: the run's beam (--num-beams, default 4) and the position table's length
    assert (model.generation_config.num_beams, model.generation_config.max_length) == (4, 64)


def test_sizes_from_yaml_config_flags_and_set_in_that_order(data, tmp_path):
    (tmp_path / "model.yaml").write_text("d_model: 48\nencoder_layers: 2\ndecoder_layers: 1\n"
                                         "encoder_attention_heads: 4\ndecoder_attention_heads: 4\n"
                                         "encoder_ffn_dim: 40\ndecoder_ffn_dim: 40\ndropout: 0.3\n")
    out = tmp_path / "run"
    assert main(["train", "--train", str(data / "small"), "--source-lang", "en", "--target-lang", "de", "--model-type",
                 "recurrent_transformer", "--config", str(tmp_path / "model.yaml"), "--dropout", "0.2", "--set",
                 "recurrent_variant=\"coverage\"", "--set", "dropout=0.1", "--tokenizer", str(data / "tok"),
                 "--output-dir", str(out), "--max-steps", "1", "--quiet", "--threads", "1"]) == 0
    config = json.loads((out / "model" / "config.json").read_text())
    assert (config["d_model"], config["encoder_layers"], config["encoder_ffn_dim"]) == (48, 2, 40)
    assert config["dropout"] == 0.1 and config["recurrent_variant"] == "coverage"  # --set last


@pytest.mark.parametrize("case", ["no data", "eval without validation", "bad type", "too long", "length > positions",
                                  "no length", "bad config", "vocab below bpe's", "fp16 on a cpu", "bf16 and fp16"])
def test_bad_input_is_a_one_line_error(data, tmp_path, case, capsys, monkeypatch):
    (tmp_path / "bad.json").write_text("[1, 2]")
    extra = {"no data": ["--max-steps", "1", "--train", str(tmp_path / "none")],
             "eval without validation": ["--max-steps", "1", "--eval-steps", "5"],
             "bad type": ["--max-steps", "1", "--model-type", "softer"],
             "too long": ["--max-steps", "1", "--max-length", "5"],
             "length > positions": ["--max-steps", "1", "--max-length", "5000"],
             "no length": [],
             "bad config": ["--max-steps", "1", "--config", str(tmp_path / "bad.json")],
             "vocab below bpe's": ["--max-steps", "1", "--vocab-size", "100"],
             "fp16 on a cpu": ["--max-steps", "1", "--fp16"],
             "bf16 and fp16": ["--max-steps", "1", "--fp16", "--bf16"]}[case]
    if case == "fp16 on a cpu":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (where a GPU is: as on a CPU)
    if case == "bf16 and fp16":  # argparse: exit status 2 and the options named
        with pytest.raises(SystemExit) as exit_info:
            train(data, tmp_path / "out", *extra)
        assert exit_info.value.code == 2
        assert "argument --bf16: not allowed with argument --fp16" in capsys.readouterr().err
        return
    assert train(data, tmp_path / "out", *extra, tokenizer=case != "vocab below bpe's") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hf-hardattn train: error:")
    assert {"no data": "--train:", "eval without validation": "--eval-steps needs --validation",
            "bad type": "--model-type='softer'", "too long": "longer than --max-length=5",
            "length > positions": "max_position_embeddings", "no length": "--max-steps, --minutes or --epochs",
            "bad config": "must hold a mapping", "vocab below bpe's": "--vocab-size=100 is below 260",
            "fp16 on a cpu": "`--fp16` asks for fp16 mixed precision"}[case] in err
    if case == "fp16 on a cpu":
        assert not (tmp_path / "out").exists()  # refused before any work
