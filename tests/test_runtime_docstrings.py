"""The runtime modules (``hf_hardattn/*.py``, shipped with saved models) say what the code does and why, never where
a figure came from: no issue numbers, no "stop N", no timings or speed ratios, no BLEU figures, no dates, no machine
names. Such figures go stale with the code; they live in benchmarks/ and docs/, which a docstring may point to."""

import re
from pathlib import Path

import pytest

import hf_hardattn

PACKAGE = Path(hf_hardattn.__file__).parent

# (what, pattern): each pattern is matched against every line of every runtime file
HISTORY = [
    ("an issue number", re.compile(r"\bissues?\s*#?\d+|(?<![\w&/#])#\d{2,}\b", re.IGNORECASE)),
    ('a "stop N"', re.compile(r"\bstop\s+\d+\b", re.IGNORECASE)),
    ("a timing", re.compile(r"\b\d+(\.\d+)?\s*(ms|µs|us|ns)\b")),
    ("a speed ratio", re.compile(r"(?<![<>=]\s)(?<![<>=\d.])\d+(\.\d+)?(\s*-\s*\d+(\.\d+)?)?x\b"  # not ">= 5.2x"
                                 r"|\b(faster|slower)\s+by\s+\d", re.IGNORECASE)),
    ("a BLEU figure", re.compile(r"\d+(\.\d+)?\s*(BLEU|chrF)\b|\b(BLEU|chrF)\b[^.\n]{0,30}?\d+\.\d+"
                                 r"|\b(BLEU|chrF)\s*(=|:|of)\s*\d")),
    ("a date", re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b20\d\d/[01]\d/[0-3]\d\b")),
    ("a machine named as evidence", re.compile(r"\b(EPYC|Xeon|H100|H200|A100|Zen\s?\d)\b")),
]
QUOTATION = re.compile(r'"[^"\n]*"')  # a passage quoted from a paper may give the paper's own BLEU figures


def history_in(line: str) -> list[str]:
    """What ``line`` holds of a measurement's history (the ``what`` of every pattern it matches)."""
    found = []
    for what, pattern in HISTORY:
        text = QUOTATION.sub('""', line) if what == "a BLEU figure" else line
        if pattern.search(text):
            found.append(what)
    return found


@pytest.mark.parametrize("line", [
    # (the run label put together: this file names none)
    "trained as in issue #53", "see Issue 44", "the default before #53", "measured at " + "st" + "op 58",
    "21 ms vs 4 ms per call", "254 vs 200 us", "(~6 us, 3% of the step)", "12.5µs a call",
    "1.8x faster than F.cross_entropy", "2-4x longer for 4 rows", "0.45-0.85x its speed", "3x slower",
    "faster by 2", "lowers hc-sa by 0.84 BLEU", "BLEU 34.15 against 33.77", "with BLEU = 30", "chrF of 61",
    "run on 2026-11-27", "2-core AMD EPYC (AVX2)", "one H200", "a Xeon host",
])
def test_each_kind_of_history_is_recognised(line):
    assert history_in(line), f"not flagged: {line!r}"


@pytest.mark.parametrize("line", [
    "P = softmax(QK^T / sqrt(d_k)) (Eq. 1-2)", "Eq. 11: argmax over the raw scores", "Table 3 row", "Sec. 3.2",
    "[B, H, Tq, D] queries over [B, H, Tk, D] keys", "batch x beams", "d_model 512, 8 heads, FFN 2048",
    "init_std: N(0, 0.02)", "embed_init_std: float | None = None  # comment", "DEFAULT_MAX_ROWS = 128",
    "s_j = max|w_j| / 127.5", "if self.d_model % heads:", "0x7f", "3x3 kernel", "sacrebleu BLEU and chrF",
    "1 / (1 - p) with probability 1 - p", "transformers 5.10.1 to 5.24", "AVX512 / AMX where the CPU has them",
    "# a comment", "x[..., 1:]", "transformers >= 5.2x refuses it", "a us-ascii name",
    "the paper's Figure 2: \"On En-Vi BLEU increases from 16.0 to 25.7\"",
])
def test_legitimate_content_is_not_flagged(line):
    assert not history_in(line), f"flagged: {line!r} as {history_in(line)}"


def history_lines(text: str) -> list[tuple[int, list[str]]]:
    """(line number, what) for each line of ``text`` that holds history, alone or joined to the next line (a figure
    wrapped at the end of a docstring or comment line: "lost 0.84" / "BLEU")."""
    lines = text.splitlines()
    alone = [history_in(line) for line in lines]
    found = []
    for number, line in enumerate(lines, 1):
        whats = alone[number - 1]
        if not whats and number < len(lines):  # what only the two lines together hold
            joined = line.rstrip() + " " + lines[number].strip().lstrip("#").strip()
            whats = [what for what in history_in(joined) if what not in alone[number]]
        if whats:
            found.append((number, whats))
    return found


def test_a_figure_wrapped_over_two_lines_is_found():
    text = 'def f():\n    """Chosen because the other init\n    lost 0.84\n    BLEU on Multi30k."""\n'
    assert history_lines(text) == [(3, ["a BLEU figure"])]
    assert history_lines("x = 1  # 21\n# ms per call\ny = 2\n") == [(1, ["a timing"])]


def test_runtime_files_carry_no_measurements_or_issue_numbers():
    files = sorted(PACKAGE.glob("*.py"))  # the runtime, not hf_hardattn/tools/
    assert len(files) > 10
    found = []
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines()
        found += [f"hf_hardattn/{path.name}:{number}: {', '.join(whats)}: {lines[number - 1].strip()[:100]}"
                  for number, whats in history_lines("\n".join(lines))]
    assert not found, ("runtime files say where a figure came from (keep the reason, move the figure to "
                       "benchmarks/ or docs/ and point there):\n" + "\n".join(found))


def test_pointers_to_benchmark_sections_name_existing_sections():
    """Where a docstring points to a figure (benchmarks/README.md, section "..."), the section is there: a heading of
    benchmarks/README.md that starts with the quoted words."""
    headings = [line.lstrip("#").strip() for line in (PACKAGE.parent / "benchmarks" / "README.md").read_text(
        encoding="utf-8").splitlines() if line.startswith("#")]
    pointer = re.compile(r'benchmarks/README\.md,? \(?section "([^"]+)"')
    pointers = [(path.name, section) for path in sorted(PACKAGE.glob("*.py"))
                for section in pointer.findall(re.sub(r"\s+", " ", path.read_text(encoding="utf-8")))]
    assert pointers  # the int8, packed-linear and initialisation defaults point there
    missing = [f"hf_hardattn/{name}: section {section!r}" for name, section in pointers
               if not any(heading.startswith(section) for heading in headings)]
    assert not missing, "no such section in benchmarks/README.md:\n" + "\n".join(missing)
