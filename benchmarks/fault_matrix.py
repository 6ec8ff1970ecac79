"""Fault and bad-input matrix (training arguments, corrupt weights, a killed save, diverging recurrent
context, NaN scores in generate for every contract model, all-ignored batches): one line per case and the counts.

clear = an error whose message names the parameter or the file; deep = another exception; silent = no error and a
wrong result (or an ignored argument); ok = the correct result. Run with a source tree as the argument (to compare
a branch with an older tree, e.g. one from `git archive main`):

    OMP_NUM_THREADS=1 python benchmarks/fault_matrix.py .
"""
import multiprocessing, os, random, signal, sys, tempfile, traceback, json
root = os.path.abspath(sys.argv[1])
sys.path[:0] = [root, os.path.join(root, "tests")]
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
torch.set_num_threads(1)
import datasets
import transformers
from transformers import AutoModelForSeq2SeqLM
from transformers.utils import logging as tlog
tlog.set_verbosity_error()
from common import (CONTRACT_MODELS, EOS, VOCAB, contract_model, generate_kwargs, randomize, source_batch, tiny_kwargs,
                    toy_tokenizer)
import hf_hardattn as h
print("package", h.__file__, "transformers", transformers.__version__)
from hf_hardattn.tools.training import train_seq2seq

rows = []
def record(group, case, outcome, detail=""):
    rows.append((group, case, outcome))
    print(f"{group:10} {case:46} {outcome:7} {detail[:150]}", flush=True)

def classify(fn, needles, silent_check=None):
    try:
        result = fn()
    except Exception as error:  # noqa
        msg = f"{type(error).__name__}: {error}"
        return ("clear" if any(n in str(error) for n in needles) else "deep"), msg.replace("\n", " ")
    if silent_check is not None:
        bad = silent_check(result)
        return ("silent" if bad else "ok"), str(bad or "")
    return "silent", "no error"

tmp = tempfile.mkdtemp(prefix="faults_matrix_")
rng = random.Random(0)
data = datasets.Dataset.from_list([{"input_ids": (s := [rng.randrange(4, VOCAB) for _ in range(5)]) + [EOS],
                                    "attention_mask": [1] * 6, "labels": s[::-1] + [EOS]} for _ in range(16)])
tok = toy_tokenizer()
def soft():
    torch.manual_seed(0)
    return h.SoftTransformerForConditionalGeneration(h.SoftTransformerConfig(**tiny_kwargs()))
RUN = dict(max_steps=2, batch_size=8, warmup_steps=1, progress=False, logging_steps=1)
n = [0]
def out():
    n[0] += 1
    return os.path.join(tmp, f"run{n[0]}")

# -- train_seq2seq arguments
def ckpts(d):
    return [] if not os.path.isdir(d) else sorted(x for x in os.listdir(d) if x.startswith("checkpoint-"))
d = out(); record("train", "save_steps=1 writes checkpoints", *classify(lambda: train_seq2seq(soft(), tok, data, output_dir=d, save_steps=1, **RUN), ["save_steps"], lambda t: None if ckpts(d) else "no checkpoint written"))
d = out(); record("train", "save_strategy='steps', save_steps=1", *classify(lambda: train_seq2seq(soft(), tok, data, output_dir=d, save_strategy="steps", save_steps=1, **RUN), ["___"], lambda t: None if ckpts(d) else "no checkpoint written"))
d = out(); record("train", "report_to='none'", *classify(lambda: train_seq2seq(soft(), tok, data, output_dir=d, report_to="none", **RUN), ["___"], lambda t: None))
d = out(); record("train", "resume_from_checkpoint=True, no checkpoint", *classify(lambda: train_seq2seq(soft(), tok, data, output_dir=d, resume_from_checkpoint=True, **RUN), ["resume_from_checkpoint"], lambda t: "ignored: trained from step 0"))
d = out(); record("train", "resume_from_checkpoint=3", *classify(lambda: train_seq2seq(soft(), tok, data, output_dir=d, resume_from_checkpoint=3, **RUN), ["resume_from_checkpoint"], lambda t: "ignored"))
d = out(); record("train", "resume_from_checkpoint='/missing'", *classify(lambda: train_seq2seq(soft(), tok, data, output_dir=d, resume_from_checkpoint="/missing/ckpt", **RUN), ["resume_from_checkpoint", "/missing/ckpt"], lambda t: "ignored"))
d = out(); record("train", "train_ds empty", *classify(lambda: train_seq2seq(soft(), tok, data.select([]), output_dir=d, **RUN), ["train_ds"], lambda t: "trained on nothing"))
d = out(); record("train", "eval_ds empty (eval_steps=1)", *classify(lambda: train_seq2seq(soft(), tok, data, data.select([]), output_dir=d, eval_steps=1, **RUN), ["eval_ds"], lambda t: "evaluated on nothing"))
d = out(); record("train", "save_step=5 (misspelled field)", *classify(lambda: train_seq2seq(soft(), tok, data, output_dir=d, save_step=5, **RUN), ["save_step"], lambda t: "ignored"))
d = out(); record("train", "per_device_train_batch_size=4", *classify(lambda: train_seq2seq(soft(), tok, data, output_dir=d, per_device_train_batch_size=4, **RUN), ["batch_size`", "own `batch_size"], lambda t: None))
d = out(); record("train", "save_steps=5, save_strategy='no'", *classify(lambda: train_seq2seq(soft(), tok, data, output_dir=d, save_steps=5, save_strategy="no", **RUN), ["`save_strategy`"], lambda t: "save_steps ignored"))

# -- corrupt weight files
model = randomize(soft())
def corrupt(kind):
    folder = os.path.join(tmp, f"m_{kind}")
    model.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    raw = bytearray(open(path, "rb").read())
    if kind == "flipped":
        raw[-16] ^= 1
    elif kind == "truncated":
        raw = raw[:-100]
    elif kind == "header":
        raw = raw[:8] + b"{not json" + raw[17:]
    open(path, "wb").write(bytes(raw))
    loaded = AutoModelForSeq2SeqLM.from_pretrained(folder)
    return loaded
def differs(loaded):
    a, b = loaded.state_dict(), model.state_dict()
    return next((f"loaded, {k} differs" for k in a if not torch.equal(a[k], b[k])), None)
for kind in ("flipped", "truncated", "header"):
    record("corrupt", f"model.safetensors {kind}", *classify(lambda: corrupt(kind), ["model.safetensors"], differs))

# -- save_pretrained killed while writing the weights into the existing folder
def child(folder):
    import transformers.modeling_utils as mu
    from safetensors.torch import save as sbytes
    def save_file(tensors, filename, metadata=None):
        data = sbytes(tensors, metadata)
        open(filename, "wb").write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    mu.safe_save_file = save_file
    randomize(soft(), seed=1).save_pretrained(folder)
folder = os.path.join(tmp, "killed")
model.save_pretrained(folder)
p = multiprocessing.get_context("fork").Process(target=child, args=(folder,)); p.start(); p.join()
record("kill", "save_pretrained killed mid-weights", *classify(lambda: AutoModelForSeq2SeqLM.from_pretrained(folder), ["model.safetensors"], lambda m: differs(m)))

# -- recurrent expand_1/expand_2 with large weights (std 1): the carried context diverges
dec = torch.tensor([[1, 5, 9, 7, 30, 12, 8, 8, 22, 4, 6, 17], [1, 8, 8, 22, 4, 6, 11, 5, 9, 7, 30, 12]])
for variant in ("expand_1", "expand_2"):
    def run():
        torch.manual_seed(0)
        m = randomize(h.RecurrentForConditionalGeneration(h.RecurrentConfig(**tiny_kwargs(recurrent_variant=variant))), std=1.0)
        ids, mask = source_batch()
        with torch.no_grad():
            full = m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        return full
    record("recurrent", f"{variant} weights std 1, forward", *classify(run, [variant], lambda l: f"no error; logits max {l.abs().max():.3g}, finite={bool(torch.isfinite(l).all())}"))

# -- NaN scores in generate, every contract model type
for name in CONTRACT_MODELS:
    for mode in ("greedy", "beam", "sample"):
        def run():
            m = contract_model(name, fit=False)
            with torch.no_grad():
                m.get_output_embeddings().weight[VOCAB - 1] = float("nan")
            ids, mask = source_batch()
            torch.manual_seed(0)
            return m.generate(input_ids=ids, attention_mask=mask, **generate_kwargs(mode))
        record("nan", f"{name} {mode}", *classify(run, ["NaN"], lambda s: "emitted tokens after NaN scores"))

# -- all-ignored batches
for name in CONTRACT_MODELS:
    def run():
        m = contract_model(name, fit=False).train()
        ids, mask = source_batch()
        loss = m(input_ids=ids, attention_mask=mask, labels=torch.full((2, 5), -100)).loss
        loss.backward()
        return loss, m
    def bad(r):
        loss, m = r
        g = [p.grad for p in m.parameters() if p.grad is not None]
        return None if loss.item() == 0 and all(torch.equal(x, torch.zeros_like(x)) for x in g) else f"loss {loss.item()}"
    record("ignored", f"{name} all labels -100", *classify(run, ["labels"], bad))
from hf_hardattn.hybrid import kd_loss
def kd():
    s = torch.randn(2, 5, VOCAB, requires_grad=True)
    loss = kd_loss(s, torch.randn(2, 5, VOCAB), torch.full((2, 5), -100), 1.0); loss.backward(); return loss, s
record("ignored", "kd_loss all labels -100", *classify(kd, ["labels"], lambda r: None if r[0].item() == 0 and torch.equal(r[1].grad, torch.zeros_like(r[1].grad)) else f"loss {r[0].item()}"))

from collections import Counter
print("COUNTS", dict(Counter(o for _, _, o in rows)), "of", len(rows))
for g in dict.fromkeys(r[0] for r in rows):
    print("  ", g, dict(Counter(o for gg, _, o in rows if gg == g)))

import shutil
shutil.rmtree(tmp, ignore_errors=True)
