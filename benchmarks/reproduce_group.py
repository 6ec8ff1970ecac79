"""A comparison's rows for several seeds at once: one process per chain of rows, side by side, each in its own folder.

    python benchmarks/reproduce_group.py --recipe hard_retrieval --seeds 0 1 2 --runs outputs/group/hard_retrieval
    python benchmarks/reproduce_group.py --recipe hard_retrieval --rows soft hard_cross --seeds 0 1 2 --deadline 540 \
        --pack $OUT/results.tgz -- --threads 1 --quiet      # after --: passed to every reproduce.py process
    python benchmarks/reproduce_group.py --recipe hybrid --seeds 0 1 2 --jobs 2 -- --threads 1   # a 2-core CPU
    bash benchmarks/run_gpu_reproduce.sh                   # the same on a lent GPU, in one call (its header says how)

A chain is a trained row with the rows that need it (a row decoding its model differently, a KD row learning from
the soft teacher's translations), run by one ``benchmarks/reproduce.py`` process in that order; chains of every seed run
at once (or ``--jobs`` at a time, in the order of seeds, then chains: on a CPU, one per core with ``-- --threads 1``,
which trains more steps a minute than one process on every core; benchmarks/README.md), each in RUNS/sSEED-ROW with one
tokenizer per seed (trained here first, or copied from ``--tokenizer``), so that no two processes write one folder.
Each folder's ``reproduce_*.json`` is the row's result as the CPU runs write it (``benchmarks/tables.py`` pools the
files of one recipe, task, preset and machine). Every ``--pack-every`` seconds the results and logs so far go to
``--pack`` (a .tgz); at ``--deadline`` seconds the chains still running are stopped and named (the chains not started
yet too), never guessed. Exit status: 0 when every chain finished, 1 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time

from hf_hardattn.tools import reproduce

HERE = os.path.dirname(os.path.abspath(__file__))


def chains(task: str, recipe: str, rows: list[str] | None) -> list[list[str]]:
    """``rows`` (default: the recipe's rows for the task) as chains: each trained row with the wanted rows that need it
    (``source`` or a KD teacher, ``soft``; under mle_stage "row" the hybrid rows too, which train with the teacher's
    budget and which the Eq. 1 rows continue), the trained row first. A wanted row whose trained row is not wanted
    pulls it in, as ``reproduce.py`` would. Chains come in the order of their first row among ``rows``."""
    task_rows = {row.name: row for row in reproduce.rows_for(task)}
    if recipe != "today":
        task_rows = {n: r for n, r in task_rows.items() if n in reproduce.PAPER_RECIPES[recipe]["rows"]}
    wanted = list(rows) if rows else list(task_rows)
    unknown = [name for name in wanted if name not in task_rows]
    if unknown:
        raise ValueError(f"`rows` {unknown} are not rows of task {task!r} under recipe {recipe!r}; allowed: "
                         f"{list(task_rows)}.")

    def root(name):
        row = task_rows[name]
        if row.source is not None:
            return root(row.source)
        fields = reproduce.PAPER_RECIPES[recipe]["fields"] if recipe != "today" else {}
        return root("soft") if row.kd or reproduce.is_mle_row(fields.get("mle_stage"), name) else name

    out: dict[str, list[str]] = {}
    for name in wanted:
        chain = out.setdefault(root(name), [root(name)])
        if name not in chain:
            chain.append(name)
    return list(out.values())


def train_tokenizers(args, seeds, runs) -> dict[int, str]:
    """One tokenizer folder per seed (the nouns split depends on the seed; Multi30k's does not, so one serves all),
    trained as ``reproduce.py`` trains it, or ``args.tokenizer`` for every seed."""
    if args.tokenizer:
        return {seed: args.tokenizer for seed in seeds}
    recipe = reproduce.recipe_for(args.task, args.preset, args.recipe)
    folders = {}
    for seed in seeds:
        key = 0 if args.task == "multi30k" else seed
        folder = os.path.join(runs, f"tokenizer-{args.task}-s{key}")
        if not os.path.isdir(folder):
            train, _ = reproduce.load_task(args.task, recipe, args.data, key)
            reproduce.train_tokenizer(train, **recipe.tokenizer).save_pretrained(folder)
        folders[seed] = folder
    return folders


def command(args, seed, chain, folder) -> list[str]:
    argv = [sys.executable, os.path.join(HERE, "reproduce.py"), "--task", args.task, "--preset", args.preset,
            "--recipe", args.recipe, "--seed", str(seed), "--rows", *chain, "--output-dir", folder]
    return argv + (["--data", args.data] if args.data else []) + list(args.extra)


def pack(runs, target):
    """The results files and logs under ``runs`` into the .tgz ``target`` (written beside, then renamed)."""
    files = sorted(glob.glob(os.path.join(runs, "*", "reproduce_*.json")) + glob.glob(os.path.join(runs, "*", "*.log")))
    with tarfile.open(target + ".tmp", "w:gz") as tar:
        for path in files:
            tar.add(path, arcname=os.path.relpath(path, runs))
    os.replace(target + ".tmp", target)


def stop(process):
    """SIGTERM to the process group, SIGKILL after 10 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run(args) -> int:
    start = time.monotonic()
    groups = chains(args.task, args.recipe, args.rows)
    os.makedirs(args.runs, exist_ok=True)
    tokenizers = train_tokenizers(args, args.seeds, args.runs)
    jobs = []
    for seed in args.seeds:
        for chain in groups:
            folder = os.path.join(args.runs, f"s{seed}-{chain[0]}")
            if not os.path.isdir(os.path.join(folder, "tokenizer")):
                shutil.copytree(tokenizers[seed], os.path.join(folder, "tokenizer"))
            jobs.append(dict(seed=seed, chain=chain, folder=folder, process=None, log=None))

    def start_next():  # the first chain not started yet, while fewer than --jobs run
        waiting = [job for job in jobs if job["process"] is None]
        running = sum(job["process"] is not None and job["process"].poll() is None for job in jobs)
        if waiting and running < (args.jobs or len(jobs)):
            job = waiting[0]
            job["log"] = open(os.path.join(job["folder"], "run.log"), "w")
            argv = command(args, job["seed"], job["chain"], job["folder"])
            print(f"[{job['seed']} {' '.join(job['chain'])}] {' '.join(argv[1:])}", flush=True)
            job["process"] = subprocess.Popen(argv, stdout=job["log"], stderr=subprocess.STDOUT, start_new_session=True)
            return True
        return False

    while start_next():
        pass
    last_pack = time.monotonic()
    while any(job["process"] is None or job["process"].poll() is None for job in jobs):
        if time.monotonic() - start > args.deadline:
            break
        time.sleep(min(1.0, args.pack_every))
        while start_next():
            pass
        if args.pack and time.monotonic() - last_pack >= args.pack_every:
            pack(args.runs, args.pack)
            last_pack = time.monotonic()
            running = sum(job["process"] is not None and job["process"].poll() is None for job in jobs)
            print(f"t={time.monotonic() - start:.0f}s running {running} of {len(jobs)}", flush=True)
    for job in jobs:
        if job["process"] is not None:
            stop(job["process"])
            job["log"].close()
    if args.pack:
        pack(args.runs, args.pack)
    print(f"after {time.monotonic() - start:.0f} s:")
    finished = True
    for job in jobs:
        code = None if job["process"] is None else job["process"].returncode
        state = ("not started before the deadline" if code is None else "done" if code == 0 else
                 "cut off at the deadline" if code in (-signal.SIGTERM, -signal.SIGKILL) else
                 f"failed (exit {code}; see {job['folder']}/run.log)")
        finished &= code == 0
        print(f"  seed {job['seed']} {' '.join(job['chain'])}: {state}")
    return 0 if finished else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=reproduce.TASKS, default="multi30k")
    parser.add_argument("--preset", choices=reproduce.PRESET_NAMES, default="cpu")
    parser.add_argument("--recipe", choices=reproduce.RECIPE_NAMES, default="hard_retrieval")
    parser.add_argument("--rows", nargs="+", default=None, help="default: the recipe's rows for the task")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--data", default=None, help="as reproduce.py's --data")
    parser.add_argument("--runs", default=os.path.join("outputs", "group"), help="one folder per seed and chain")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder for every row (default: train one)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="chains running at once (default: all); on a CPU, its cores with `-- --threads 1`")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="seconds; then running chains stop")
    parser.add_argument("--pack", default=None, metavar="FILE.tgz", help="results and logs so far, refreshed")
    parser.add_argument("--pack-every", type=float, default=20.0, help="seconds between packs (default 20)")
    parser.add_argument("extra", nargs="*", help="after --: more reproduce.py arguments for every process")
    args = parser.parse_args(argv)
    for name in ("deadline", "pack_every"):
        if not getattr(args, name) > 0:
            raise ValueError(f"`--{name.replace('_', '-')}` must be > 0, got {getattr(args, name)!r}.")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"`--jobs` must be >= 1 (chains running at once), got {args.jobs!r}.")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
