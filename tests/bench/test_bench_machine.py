"""The machine a benchmark ran on (:mod:`specdec.bench.machine`): the CPU's vector features read
from /proc/cpuinfo in one place (:func:`specdec.measurements.cpu_features`), the memory read speed,
each GGUF backend's one-token step, and the line the report prints above its table.

No test asserts a speed: the figures are checked for their fields, their units and being positive
and finite, and the report's line is compared exactly on a record written here.
"""

from __future__ import annotations

import math
import platform
import time

import pytest
from helpers import PACK

from specdec import measurements, packs
from specdec.backends import gguf as native
from specdec.bench import machine as bench_machine
from specdec.bench import report
from specdec.bench.markdown import machine_line
from specdec.measurements import CPU_FEATURES, cpu_features, cpu_flags

AVX512_VNNI_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni amx_tile
vmx flags\t: vnmi preemption_timer
bugs\t\t: spectre_v1

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu avx2
"""

AVX2_CPUINFO = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse2 avx fma f16c avx2 bmi2
"""

ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32
CPU implementer\t: 0x41
"""


@pytest.fixture(autouse=True)
def measured_afresh(monkeypatch):
    """Each test measures its own machine record (machine_record keeps one per process)."""
    monkeypatch.setattr(bench_machine, "_RECORDS", {})


def test_cpu_features_are_read_from_the_first_flags_line():
    features = cpu_features(AVX512_VNNI_CPUINFO)
    assert list(features) == list(CPU_FEATURES)
    assert {name for name, has in features.items() if has} == {
        "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
    assert features["avx_vnni"] is False
    assert "preemption_timer" not in cpu_flags(AVX512_VNNI_CPUINFO)  # "vmx flags" is another line
    assert {name for name, has in cpu_features(AVX2_CPUINFO).items() if has} == {"avx2", "fma", "f16c"}


def test_a_cpu_without_a_flags_line_has_unknown_features():
    assert cpu_flags(ARM_CPUINFO) == frozenset() and cpu_features(ARM_CPUINFO) is None
    assert cpu_features("") is None


def test_the_gguf_kernel_detects_what_cpuinfo_lists(monkeypatch):
    """The kernel detects the CPU itself (gguf_cpu_paths, its one detection); where /proc/cpuinfo
    lists flags, its AVX2 path runs exactly where they name AVX2, FMA and F16C."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the kernel's AVX2 path is for x86-64 CPUs")
    features = measurements.cpu_features()
    if features is None:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    try:
        paths = native.available_paths()
    except native.KernelUnavailable as err:
        pytest.skip(f"the kernel cannot be built here: {err}")
    assert ("avx2" in paths) == all(features[name] for name in ("avx2", "fma", "f16c"))
    monkeypatch.setattr(measurements, "_cpuinfo", lambda: AVX512_VNNI_CPUINFO)
    assert measurements.machine() == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"


def test_the_read_speed_is_a_positive_finite_figure_quickly():
    began = time.perf_counter()
    try:
        read = bench_machine.read_speed(1, mib=16, seconds=0.05)
    except bench_machine.ReadSpeedUnavailable as err:
        pytest.skip(f"no C compiler: {err}")
    assert time.perf_counter() - began < 30  # a compile the first time, then milliseconds
    assert set(read) == {"gb_per_s", "threads", "mib", "repeats"}
    assert read["threads"] == 1 and read["mib"] == 16 and read["repeats"] >= bench_machine.READ_REPEATS
    assert math.isfinite(read["gb_per_s"]) and read["gb_per_s"] > 0


def test_the_read_loop_reads_every_word():
    """The loop the speed is timed on sums the whole buffer, with any number of threads."""
    import ctypes

    import numpy as np

    try:
        lib = bench_machine._read_library()
    except bench_machine.ReadSpeedUnavailable as err:
        pytest.skip(f"no C compiler: {err}")
    words = np.zeros(1001, dtype=np.uint64)
    lib.specdec_fill_words(words.ctypes.data, words.size, 3)
    assert words.tolist() == list(range(1001))
    for threads in (1, 2, 3):
        assert lib.specdec_read_words(words.ctypes.data, words.size, threads) == 1000 * 1001 // 2
    assert isinstance(lib.specdec_read_words(ctypes.c_void_p(words.ctypes.data), 0, 1), int)


def test_the_machine_record_has_its_fields_without_a_target(monkeypatch):
    monkeypatch.setattr(bench_machine, "read_speed", lambda threads, mib: {
        "gb_per_s": 12.5, "threads": threads, "mib": mib, "repeats": 3})
    record = report.machine_record(2, None, why_no_target="no method runs a GGUF", read_mib=8)
    assert set(record) == {"cpu", "features", "memory_read", "one_row_step", "gguf_kernel_path"}
    assert record["cpu"] == measurements.machine() and record["features"] == cpu_features()
    assert record["memory_read"] == {"gb_per_s": 12.5, "threads": 2, "mib": 8, "repeats": 3}
    assert record["one_row_step"] == {"skipped": "no method runs a GGUF"}


def test_the_machine_record_is_measured_once_per_process_and_target(monkeypatch, tmp_path):
    reads = []
    monkeypatch.setattr(bench_machine, "read_speed", lambda threads, mib: reads.append(threads) or {
        "gb_per_s": 10.0 + len(reads), "threads": threads, "mib": mib, "repeats": 3})
    monkeypatch.setattr(bench_machine, "one_row_steps", lambda path, threads: {"model": path.name})
    first = bench_machine.machine_record(1, None, read_mib=8)
    first["memory_read"]["gb_per_s"] = -1.0  # a caller's change does not reach the kept record
    again = bench_machine.machine_record(1, None, read_mib=8)
    assert reads == [1] and again["memory_read"]["gb_per_s"] == 11.0
    assert bench_machine.machine_record(2, None, read_mib=8)["memory_read"]["gb_per_s"] == 12.0  # other threads
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    assert bench_machine.machine_record(1, target, read_mib=8)["one_row_step"] == {"model": "t.gguf"}
    assert reads == [1, 2, 1]
    bench_machine.machine_record(1, target, read_mib=8)
    target.write_bytes(b"GGUF, rewritten")  # another file at the same path: measured again
    bench_machine.machine_record(1, target, read_mib=8)
    assert reads == [1, 2, 1, 1]


def test_a_read_speed_that_cannot_be_measured_is_skipped_with_its_reason(monkeypatch):
    def unavailable(threads, mib):
        raise bench_machine.ReadSpeedUnavailable("no C compiler found (install gcc, or set CC)")

    monkeypatch.setattr(bench_machine, "read_speed", unavailable)
    record = bench_machine.machine_record(1, None)
    assert record["memory_read"] == {"skipped": "no C compiler found (install gcc, or set CC)"}
    from specdec.backends import gguf

    assert record["gguf_kernel_path"] in gguf.PATHS or record["gguf_kernel_path"].startswith("none (")


RECORD = {
    "cpu": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
    "features": cpu_features(AVX512_VNNI_CPUINFO),
    "memory_read": {"gb_per_s": 31.04, "threads": 2, "mib": 1024, "repeats": 12},
    "one_row_step": {"model": "qwen2.5-coder-1.5b.gguf", "threads": 2, "context": 32,
                     "ms": {"gguf": 35.02, "llamacpp": 35.96}, "skipped": {}},
}


def test_the_machine_line_says_the_features_the_read_speed_and_each_backends_step():
    assert machine_line(RECORD) == (
        "Machine: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz; AVX2, FMA, F16C, AVX-512F, AVX-512BW, AVX-512VL, "
        "AVX512-VNNI, AVX512-BF16 (not AVX-VNNI, AMX-INT8); memory read 31.0 GB/s (2 threads); one-token step on "
        "qwen2.5-coder-1.5b.gguf after 32 tokens (2 threads): specdec's GGUF kernel 35.0 ms, llama.cpp 36.0 ms.")
    assert machine_line({**RECORD, "gguf_kernel_path": "avx512vnni"}).endswith(
        "llama.cpp 36.0 ms; specdec's GGUF kernel on its avx512vnni path.")


def test_the_machine_line_says_what_was_not_measured():
    record = {"cpu": "AMD EPYC 7B12", "features": None, "memory_read": {"skipped": "no C compiler found"},
              "one_row_step": {"model": "m.gguf", "threads": 1, "context": 32, "ms": {"gguf": 60.0},
                               "skipped": {"llamacpp": "the llama.cpp binding is not installed"}}}
    assert machine_line(record) == (
        "Machine: AMD EPYC 7B12; vector features unknown; memory read speed not measured (no C compiler found); "
        "one-token step on m.gguf after 32 tokens (1 thread): specdec's GGUF kernel 60.0 ms, "
        "llama.cpp not timed (the llama.cpp binding is not installed).")
    assert machine_line({**record, "one_row_step": {"skipped": "no method runs a GGUF"}}).endswith(
        "; one-token step not timed (no method runs a GGUF).")
    assert machine_line(None) is None


def _data(environment):
    return {"settings": {"greedy": True, "temperature": 0.0, "max_new_tokens": 4, "repeats": 1},
            "prompts": [{"set": "humaneval"}], "methods": {}, "models": {"target": {"name": "t"}, "draft": None},
            "environment": environment}


def test_the_report_prints_the_machine_under_its_title():
    lines = report.markdown(_data({"dtype": "bfloat16", "machine": RECORD})).splitlines()
    assert lines[0].startswith("**target t") and lines[1] == ""
    assert lines[2] == machine_line(RECORD) and lines[3] == "" and lines[4].startswith("| method |")
    older = report.markdown(_data({"dtype": "bfloat16"})).splitlines()  # a run saved before the record
    assert older[2].startswith("| method |")


@pytest.mark.slow
def test_each_gguf_backend_steps_one_row_on_the_pack():
    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")
    from specdec.backends import choice, llamacpp

    path = packs.gguf_file(PACK, progress=False)
    steps = bench_machine.one_row_steps(path, 1)
    assert steps["model"] == path.name and steps["threads"] == 1 and steps["context"] == bench_machine.STEP_CONTEXT
    runs = {"gguf": choice.kernel_refusal(path) is None, "llamacpp": llamacpp.available()}
    assert set(steps["ms"]) == {name for name, ok in runs.items() if ok}
    assert set(steps["skipped"]) == {name for name, ok in runs.items() if not ok}
    assert all(math.isfinite(ms) and ms > 0 for ms in steps["ms"].values())
