"""benchmarks/tools/check_doc_numbers.py: every performance number in README.md and docs/ is in a committed result file.

The matcher is tested on hand-made docs and result files whose outcomes are worked out by hand below; the last tests
run the check over the real docs and benchmarks/results/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.tools import check_doc_numbers as cdn


def _verdicts(tmp_path: Path, doc: str, results: dict[str, object]) -> list[cdn.Verdict]:
    """Check one Markdown text against result files written into a fresh results folder."""
    folder = tmp_path / "results"
    folder.mkdir()
    for name, content in results.items():
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    path = tmp_path / "doc.md"
    path.write_text(doc)
    return cdn.check([path], folder, root=tmp_path)


def _outcomes(verdicts: list[cdn.Verdict]) -> list[tuple[str, str]]:
    """(number as written, "found" | "unmatched" | "exempt") in doc order."""
    return [(v.number.text, "exempt" if v.number.exempt else "found" if v.found_in else "unmatched") for v in verdicts]


def test_a_value_matches_at_the_precision_written_and_not_beyond(tmp_path):
    step = {"ms_per_step": 43.058929443359375, "eager": {"ms": 5.994992017745972}}
    doc = "Default 43.1 ms, not 43.0 ms nor 43.2 ms; 43.06 ms but not 43.05 ms. Eager 5.99 ms, not 6.00 ms.\n"
    assert _outcomes(_verdicts(tmp_path, doc, {"train.json": step})) == [
        ("43.1 ms", "found"),
        ("43.0 ms", "unmatched"),
        ("43.2 ms", "unmatched"),
        ("43.06 ms", "found"),
        ("43.05 ms", "unmatched"),
        ("5.99 ms", "found"),
        ("6.00 ms", "unmatched"),
    ]


def test_units_are_converted_explicitly(tmp_path):
    # 0.5912 s = 591.2 ms; 570 s = 9.5 min; 4.5339 GiB = 4,868.2 MB = 4,642.7 MiB; 0.3793 GiB in bytes = 407,273,472
    results = {
        "r.json": {"seconds": 0.5912, "epoch_minutes": 9.5, "peak_memory_gib": 4.5339, "bf16_gemm_tflops": 774.66},
        "t.json": {"train_seconds": 570.0, "peak_bytes_beyond_features": 407273472},
    }
    doc = (
        "Times 0.59 s, 591 ms, 592 ms, 9.5 min, 9 min 30 s, 570 s and 9.6 min.\n"
        "Memory 4.53 GiB, 4,868 MB, 4,643 MiB, 4,868 MiB, 0.38 GiB, 407 MB and 388 MiB.\n"
        "GEMM 775 TFLOPS, 774.7 TFLOP/s, 774.6 TFLOP/s.\n"
    )
    assert _outcomes(_verdicts(tmp_path, doc, results)) == [
        ("0.59 s", "found"),
        ("591 ms", "found"),
        ("592 ms", "unmatched"),
        ("9.5 min", "found"),
        ("9 min 30 s", "found"),
        ("570 s", "found"),
        ("9.6 min", "unmatched"),
        ("4.53 GiB", "found"),
        ("4,868 MB", "found"),
        ("4,643 MiB", "found"),
        ("4,868 MiB", "unmatched"),
        ("0.38 GiB", "found"),
        ("407 MB", "found"),
        ("388 MiB", "found"),
        ("775 TFLOPS", "found"),
        ("774.7 TFLOP/s", "found"),
        ("774.6 TFLOP/s", "unmatched"),
    ]


def test_json_keys_name_their_units_and_overrides_correct_them():
    assert cdn.key_unit("ms_per_step_min", "x.json") == "ms"
    assert cdn.key_unit("setup_and_first_step_s", "x.json") == "s"
    assert cdn.key_unit("projected_200_epochs_minutes", "x.json") == "min"
    assert cdn.key_unit("images_per_cpu_s", "x.json") == "images/s"
    assert cdn.key_unit("decode_augment_images_per_s_per_core", "x.json") == "images/s"
    assert cdn.key_unit("gb_per_s", "x.json") == "GB/s"
    assert cdn.key_unit("step_speedup_vs_published_fp32", "x.json") == "×"
    assert cdn.key_unit("eager_over_fused_time", "x.json") == "×"
    assert cdn.key_unit("fastest_step_mfu", "x.json") == "fraction"
    assert cdn.key_unit("loadavg_at_start", "x.json") is None
    assert cdn.key_unit("n_iter", "x.json") is None
    # bench_stream.py stores /proc's kB / 1024 under *_mb: MiB in its result file, MB elsewhere
    assert cdn.key_unit("rss_mb", "stream_cpu.json") == "MiB"
    assert cdn.key_unit("mb", "decode_cpu.json") == "MiB"  # its shards' size: bytes / 2**20
    assert cdn.key_unit("rss_mb", "other.json") == "MB"


def test_units_inherited_from_a_parent_key_or_a_unit_field(tmp_path):
    results = {
        "epoch.json": {"phase_seconds": {"features": 0.688}, "settings": {"batch_s": 0.7}},
        "loader.json": {
            "unit": "views/s (two per image)",
            "stream": 2567.3,
            "rounds": [{"stream": 2570.8}],
            "machine": {"cpus": 2},
        },
    }
    doc = "Features 0.69 s; batch 0.70 s. Stream 2,567 views/s, 2,571 views/s; 2 views/s.\n"
    # settings are inputs, skipped; the unit field reaches its object's numbers and its lists' records, not `machine`
    assert _outcomes(_verdicts(tmp_path, doc, results)) == [
        ("0.69 s", "found"),
        ("0.70 s", "unmatched"),
        ("2,567 views/s", "found"),
        ("2,571 views/s", "found"),
        ("2 views/s", "unmatched"),
    ]


def test_text_results_give_their_numbers_with_units(tmp_path):
    summary = "bench_train step + epoch: ok (144 s)\n2 passed in 10.81s\n[ 45%] progress\n"
    doc = "The step check took 144 s, the tests 10.8 s, 11 s. MFU 45%.\n"
    assert _outcomes(_verdicts(tmp_path, doc, {"summary.txt": summary})) == [
        ("144 s", "found"),
        ("10.8 s", "found"),
        ("11 s", "found"),
        ("45%", "unmatched"),
    ]


def test_ratios_stored_or_as_a_quotient_within_one_file(tmp_path):
    # 290.5 / 43.06 = 6.746 and 47.5089 rounds to 48, not 47
    results = {
        "train.json": {"a": {"ms_per_step": 290.5}, "b": {"ms_per_step": 43.06}, "speedup": 47.5089},
        "other.json": {"seconds": 10.0},
        "third.json": {"seconds": 2.0},
    }
    doc = "Steps 6.7× and 6.75× faster, not 6.8×; 48×, not 47×; 5× only across files; 6.7x faster.\n"
    assert _outcomes(_verdicts(tmp_path, doc, results)) == [
        ("6.7×", "found"),
        ("6.75×", "found"),
        ("6.8×", "unmatched"),
        ("48×", "found"),
        ("47×", "unmatched"),
        ("5×", "unmatched"),
        ("6.7x", "found"),
    ]


def test_a_quotient_names_the_two_values(tmp_path):
    verdicts = _verdicts(tmp_path, "6.75× faster\n", {"train.json": {"a_ms": 290.5, "b_ms": 43.06}})
    assert verdicts[0].found_in == "train.json: a_ms / b_ms"


def test_targets_bounds_and_datasheets_are_exempt_and_nothing_else(tmp_path):
    doc = (
        "Target: ≤ 10 s and ≥ 1.5× published; a target of 5×; the 20× target; datasheet: 989 TFLOP/s.\n"
        "It took 10 s, 5× faster, at 989 TFLOP/s.\n"
    )
    assert _outcomes(_verdicts(tmp_path, doc, {"r.json": {"seconds": 3.0}})) == [
        ("10 s", "exempt"),
        ("1.5×", "exempt"),
        ("5×", "exempt"),
        ("20×", "exempt"),
        ("989 TFLOP/s", "exempt"),
        ("10 s", "unmatched"),
        ("5×", "unmatched"),
        ("989 TFLOP/s", "unmatched"),
    ]


def test_approximate_integers_drop_their_trailing_zeros_only(tmp_path):
    results = {"r.json": {"seconds_for_n_init": 10455.928, "balanced_seconds": 1568.838}}
    doc = "About 10,460 s, ~1,570 s; exactly 10,460 s, 1,570 s, 1,569 s.\n"
    assert _outcomes(_verdicts(tmp_path, doc, results)) == [
        ("10,460 s", "found"),
        ("1,570 s", "found"),
        ("10,460 s", "unmatched"),
        ("1,570 s", "unmatched"),
        ("1,569 s", "found"),
    ]


def test_what_is_not_a_performance_number(tmp_path):
    doc = (
        "6k × 768 features, 8×8 images, 1 restart ×10, 2 ranks × 2 workers, 36×36, `--budget-s 45 s`, 46 steps,\n"
        "5.9% of the rows, 22 KB per image, `a command that runs\n"
        "on for 12 s` into the next line.\n"
        "```bash\n"
        "python bench.py  # 12 s\n"
        "```\n"
    )
    assert _verdicts(tmp_path, doc, {"r.json": {"seconds": 1.0}}) == []


def test_tables_lists_and_joined_numbers_take_the_unit_they_show(tmp_path):
    results = {
        "train.json": {
            "ms_per_step": 290.5,
            "images_per_s": 441.0,
            "mfu": 0.0538,
            "other_ms": 60.18,
            "epoch_seconds": 23.45,
            "published_epoch_seconds": 24.19,
            "features_s": 4.87,
        }
    }
    doc = (
        "| variant | ms/step | images/s | MFU | × published |\n"
        "|---|---|---|---|---|\n"
        "| published, fp32 | 290.5 | 441 | 5.4% | 4.83 |\n"
        "\n"
        "| what | where | result |\n"
        "|---|---|---|\n"
        "| epoch s | this CPU (load average 2.4–4.1) | 23.4–24.2 |\n"
        "\n"
        "Features 4.87 / 23.45 s.\n"
        "\n"
        "- **MFU.** Target: ≥ 40%.\n"
        "  - Met by published (5.4%).\n"
        "- **Memory.** At the cost of 8% of the step time.\n"
    )
    assert _outcomes(_verdicts(tmp_path, doc, results)) == [
        ("290.5 ms", "found"),
        ("441 images/s", "found"),
        ("5.4%", "found"),
        ("4.83 ×", "found"),
        ("23.4 s", "found"),
        ("24.2 s", "found"),
        ("4.87 s", "found"),
        ("23.45 s", "found"),
        ("40%", "exempt"),
        ("5.4%", "found"),
    ]


def test_a_number_is_looked_up_in_the_files_its_line_block_or_section_names(tmp_path):
    results = {"gpu.json": {"seconds": 0.9748}, "cpu.json": {"seconds": 0.98}}
    doc = (
        "# GPU\n"
        "Results in `benchmarks/results/gpu.json`:\n"
        "- 0.97 s and 0.98 s.\n"
        "\n"
        "Here 0.98 s (cpu.json) and 0.97 s.\n"
        "\n"
        "# Nothing named\n"
        "Anywhere: 0.98 s.\n"
    )
    verdicts = _verdicts(tmp_path, doc, results)
    # the list takes its block's file; a line naming a file is held to it alone, even inside the section of another
    assert _outcomes(verdicts) == [
        ("0.97 s", "found"),
        ("0.98 s", "unmatched"),
        ("0.98 s", "found"),
        ("0.97 s", "unmatched"),
        ("0.98 s", "found"),
    ]
    assert [v.number.named_files for v in verdicts] == [("gpu.json",)] * 2 + [("cpu.json",)] * 2 + [()]


def test_brace_names_expand_to_the_files_that_exist():
    known = {"nvidia-h200-tests.txt", "nvidia-h200-demo.txt", "loader_cpu.json"}
    line = "(`benchmarks/results/nvidia-h200-{tests,resume,demo}.txt`, `loader_cpu.json`, `metrics.json`)"
    assert cdn.named_result_files(line, known) == ("nvidia-h200-tests.txt", "nvidia-h200-demo.txt", "loader_cpu.json")


def test_the_command_lists_each_unmatched_number_with_its_line_and_why(tmp_path, capsys):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "r.json").write_text(json.dumps({"ms_per_step": 43.06}))
    doc = tmp_path / "doc.md"
    doc.write_text("Intro.\n\nIt took 43.1 ms, then 44.0 ms.\n")
    assert cdn.main([str(doc), "--results", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "doc.md:3: '44.0 ms' (time): UNMATCHED" in out
    assert "nearest time value: 43.06 ms (r.json: ms_per_step)" in out
    assert "43.1 ms" not in out
    doc.write_text("It took 43.1 ms.\n")
    assert cdn.main([str(doc), "--results", str(folder)]) == 0


def test_a_broken_result_file_is_named(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        cdn.load_results(folder)


def test_every_performance_number_in_readme_and_docs_is_in_a_committed_result_file():
    verdicts = cdn.check()
    missing = cdn.unmatched(verdicts)
    assert not missing, "performance numbers without a result file:\n" + "\n".join(map(cdn.describe, missing))
    assert any(v.found_in for v in verdicts)  # the docs do quote results: an extractor that finds nothing fails here
