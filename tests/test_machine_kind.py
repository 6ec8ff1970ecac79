"""benchmarks/machine_kind.py: the CPU kind a benchmark's default result file is named for (epyc_avx2, epyc_avx512,
intel_amx, ...), so that results from two machines never share a name."""

import argparse
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)

from machine_kind import default_output, machine_kind  # noqa: E402


def test_the_kinds_the_project_names():
    assert machine_kind("AMD EPYC 7B13", {"avx2"}, "AVX2") == "epyc_avx2"
    assert machine_kind("AMD EPYC", {"avx512f", "avx512_bf16"}, "AVX512") == "epyc_avx512"
    assert machine_kind("Intel(R) Xeon(R) Platinum 8481C", {"avx512f", "amx_tile", "amx_bf16"}, "AVX512") == "intel_amx"
    assert machine_kind("Intel(R) Xeon(R) CPU @ 2.20GHz", {"avx512f"}, "AVX512") == "intel_avx512"
    assert machine_kind("Neoverse-N1", set(), "DEFAULT") == "neoverse_n1_default"


def test_default_output_names_the_results_folder_and_this_machine():
    path = default_output("decode_speed")
    assert os.path.dirname(path) == os.path.join(os.path.abspath(BENCHMARKS), "results")
    assert os.path.basename(path) == f"decode_speed_{machine_kind()}.json"
    assert machine_kind() and "/" not in machine_kind()


def test_train_speed_default_output_carries_the_kind():
    from train_speed import output_path
    kind = machine_kind()
    assert os.path.basename(output_path(argparse.Namespace(output=None, bf16=True), "train_speed")) \
        == f"train_speed_bf16_{kind}.json"
    assert output_path(argparse.Namespace(output="x.json", bf16=False), "train_speed") == "x.json"
