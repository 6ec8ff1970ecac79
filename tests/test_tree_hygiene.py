"""The tree speaks of the project: no tracked file names a folder of one machine or a run label (a numbered stop), no
current file names an issue number (the dated record, benchmarks/LOG.md, benchmarks/history/ and the recorded JSON
results, keeps them); every
current result under benchmarks/results/ is linked from the benchmarks README (or docs/results.md), every results
link in the docs points at a file that exists, and the run scripts take their folders as arguments or from the
environment."""

import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

# a folder of one machine (a checkout or an output folder under /work, /root or /home) or a run label
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root|home)/\w")
RUN_LABEL = re.compile(r"\bstop \d+\b", re.IGNORECASE)
# an issue number in prose ("issue #53", "issues 40") or in a heading's anchor ("#initialisation-issue-53-h200")
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+\b|\bissue-\d+\b", re.IGNORECASE)
# a number standing alone after "#" ("(#42)", "issues #42 / #44"), not an anchor ("README.md#3-results"), an HTML
# entity ("&#39;") or a shell's "$#"; an output folder recorded inside a command ("...-issue42-eq1fixed") is data
ISSUE_REFERENCE = re.compile(r"(?<![\w&#/.$-])#\d+\b")
# a path in a docs link: results/NAME or history/NAME, up to the first character a file name here does not use
RESULT_LINK = re.compile(r"(?:benchmarks/)?(?:results|history)/[\w./*{},-]*")
# an absolute path in a shell script, apart from the system's own files
ABSOLUTE = re.compile(r"(?<![\w.$})/-])/(?!dev/null\b|proc/|usr/bin/env\b)\w[\w.-]*")


def tracked_text_files():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in names.decode().split("\0"):
        path = os.path.join(ROOT, name)
        if not name or not os.path.isfile(path):
            continue
        with open(path, "rb") as handle:
            data = handle.read()
        if b"\0" in data:  # binary
            continue
        yield name, data.decode("utf-8", errors="replace")


def offending_lines(pattern, items):
    return [f"{name}:{number}: {line.strip()[:120]}" for name, text in items
            for number, line in enumerate(text.splitlines(), 1) if pattern.search(line)]


def test_the_patterns_catch_what_they_are_for():
    # the samples are put together here, so that this file itself names no such folder or label
    work, root, stop = "/" + "work", "/" + "root", "st" + "op"
    assert MACHINE_PATH.search(f"cd {work}/main && python x.py") and MACHINE_PATH.search(f"--output-dir {root}/runs")
    assert not MACHINE_PATH.search(f"benchmarks{work}/x and https://example.org/home/page")
    assert RUN_LABEL.search(f"({stop} 62, 2026-11-27)")
    assert not RUN_LABEL.search(f"{stop}s soft learning; the {stop} token")
    assert ISSUE_NUMBER.search("(issue #53; H200)") and ISSUE_NUMBER.search("README.md#init-issue-53-h200")
    assert ISSUE_NUMBER.search("Issue 50's target") and not ISSUE_NUMBER.search("an issue with #rows, tissue 4")
    assert ISSUE_REFERENCE.search("(the row before #42)") and ISSUE_REFERENCE.search("issues #42 / #44")
    assert ISSUE_REFERENCE.search("# worse, #53") and ISSUE_NUMBER.search("Issue #53 items 1-2")
    assert not ISSUE_REFERENCE.search("README.md#3-results &#39; $#1 # 4 heads, x#2, issues/#7")
    assert not ISSUE_NUMBER.search("--output-dir outputs/multi30k-cpu-fp32-1500steps-issue42-eq1fixed")
    assert not ISSUE_REFERENCE.search("--output-dir outputs/multi30k-cpu-fp32-1500steps-issue42-eq1fixed")
    assert ABSOLUTE.search("cp -r x /tmp/site") and ABSOLUTE.search("cd /opt/code")
    assert not ABSOLUTE.search("cp $d/x $OUT/y 2>/dev/null; grep x /proc/cpuinfo; cd ../../..; a=${RUNS}/z")


# the tests of these patterns, which must write out what they catch
PATTERN_TESTS = {"tests/test_tree_hygiene.py", "tests/test_runtime_docstrings.py"}


def test_no_tracked_file_names_a_machine_path_or_a_run_label():
    files = [(name, text) for name, text in tracked_text_files() if name not in PATTERN_TESTS]
    assert len(files) > 100  # the walk saw the tree
    found = offending_lines(MACHINE_PATH, files) + offending_lines(RUN_LABEL, files)
    assert not found, "lines naming a machine's folder or a run label:\n" + "\n".join(found)


def current_results():
    return sorted(name for name in os.listdir(RESULTS) if name != "ORIGINS.md")


def test_every_current_result_is_linked_from_the_benchmarks_readme():
    text = ""
    for doc in ("benchmarks/README.md", "docs/results.md"):
        with open(os.path.join(ROOT, doc)) as handle:
            text += handle.read()
    linked = set(re.findall(r"\]\((?:\.\./benchmarks/)?results/([^)/]+)/?\)", text))
    missing = [name for name in current_results() if name not in linked]
    assert current_results() and not missing, f"benchmarks/results/ entries with no link: {missing}"


def link_exists(path):
    """Whether a docs path names something in the tree: a file or folder, a glob (``*``, ``{a,b}``) or a stem the
    script completes (``--results benchmarks/results/NAME`` writes NAME.json). Upper-case words are placeholders."""
    full = os.path.join(ROOT, path if path.startswith("benchmarks/") else os.path.join("benchmarks", path))
    if re.search(r"[A-Z]{3,}|seedS\b", path):  # FOLDER, FILE, seedS: the command's placeholders
        return True
    pattern = re.sub(r"\{[^}]*\}", "*", full)
    return os.path.exists(full) or bool(glob.glob(pattern)) or bool(glob.glob(full + ".*"))


DOCS = ["README.md", "benchmarks/README.md", "benchmarks/results/ORIGINS.md", *sorted(
    os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, "docs", "*.md"))
    + glob.glob(os.path.join(ROOT, "model_cards", "*.md")))]


@pytest.mark.parametrize("doc", DOCS)
def test_every_results_link_points_to_a_file(doc):
    with open(os.path.join(ROOT, doc)) as handle:
        text = handle.read()
    paths = {match.group(0).rstrip(".,") for match in RESULT_LINK.finditer(text)}
    broken = sorted(path for path in paths if not link_exists(path))
    assert not broken, f"{doc} names results that do not exist: {broken}"


def test_the_run_scripts_take_their_folders_from_arguments_or_the_environment():
    scripts = glob.glob(os.path.join(ROOT, "benchmarks", "**", "*.sh"), recursive=True)
    assert len(scripts) >= 10
    items = []
    for path in scripts:
        with open(path) as handle:
            code = "\n".join(line.split("#", 1)[0] if not line.startswith("#!") else "" for line in handle)
        items.append((os.path.relpath(path, ROOT), code))
    found = offending_lines(ABSOLUTE, items)
    assert not found, "absolute paths in run scripts:\n" + "\n".join(found)


# the dated record and the recorded results, which keep the issue numbers they were run under
HISTORY = ("benchmarks/LOG.md", "benchmarks/history/")


def test_no_current_file_names_an_issue_number():
    """Code, tests, scripts, examples and docs say what a thing is or does ("the speed targets", "the int8 kernels",
    "the earlier GRU setting"); which issue asked for it is in benchmarks/LOG.md."""
    files = [(name, text) for name, text in tracked_text_files() if name not in PATTERN_TESTS
             and not name.startswith(HISTORY) and not name.endswith(".json")]
    assert len(files) > 100 and any(name.startswith("benchmarks/results/") for name, _ in files)
    found = list(dict.fromkeys(offending_lines(ISSUE_NUMBER, files) + offending_lines(ISSUE_REFERENCE, files)))
    assert not found, "issue numbers in current files:\n" + "\n".join(found)
