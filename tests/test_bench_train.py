"""`benchmarks/bench_train.py` on a tiny CPU case: the JSON people and scripts compare runs by, and its numbers; and
the documented command's argument parsing and set-up at its real crop (224), without running the network there."""

import json
import math

import pytest
import torch

from benchmarks import bench_train, smoke
from benchmarks.published import train as published
from infosieve_fast.data.splits import gcd_split

TINY = [
    "--device", "cpu", "--backbone", "vit_tiny_patch16_224", "--backbone-kwargs", '{"img_size": 32}',
    "--image-size", "40", "--crop", "32", "--proj-out-dim", "256", "--n-classes", "4", "--steps", "2", "--warmup", "1",
]  # fmt: skip
EPOCH = [
    "--epoch", "--epoch-variants", "fast_default,fast_all", "--n-train", "32", "--n-test", "12",
    "--feature-batch", "16", "--published-feature-batch", "8", "--as-released-subset", "12",
]  # fmt: skip
VARIANTS = ["--variants", "published_fp32,published_bf16,fast_default,fast_eager,fast_all,fast_graph"]
README_COMMAND = "--device cpu --backbone vit_tiny_patch16_224 --batch 8 --steps 20 --warmup 3 --variants " \
                 "published_fp32,fast_default".split()  # fmt: skip
GPU_CHECK_COMMAND = ["--device", "cpu", "--epoch", "--epoch-variants", "fast_default,fast_all", *VARIANTS]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "train.json"
    out = bench_train.main([*TINY, *VARIANTS, "--batch", "8", *EPOCH, "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))  # the file is what was printed
    return out


def test_report_names_its_provenance_and_leads_with_the_default_against_its_fairest_baseline(report):
    assert report["commit"] == "unknown" or len(report["commit"]) == 40
    assert isinstance(report["dirty"], bool) and len(report["tree_hash"]) == 64
    assert report["device"].startswith("cpu")
    assert list(report["step"]["variants"]) == [
        "fast_default",
        "published_bf16",
        "published_fp32",
        "fast_eager",
        "fast_all",
        "fast_graph",
    ]
    first = list(report["summary"])[:3]
    assert first == ["default_variant", "step_speedup_vs_published_bf16", "peak_memory_ratio_vs_published_bf16"]
    assert report["summary"]["default_variant"] == "fast_default"


def test_cuda_only_variants_are_skipped_on_the_cpu_with_the_reason(report):
    for entry in (report["step"]["variants"]["fast_all"], report["epoch"]["fast_all"]):
        assert "CUDA" in entry["skipped"] and "torch.compile" in entry["skipped"]
    assert "CUDA graph" in report["step"]["variants"]["fast_graph"]["skipped"]
    assert report["summary"]["fastest_epoch_variant"] == "fast_default"
    for entry in (report["step"]["variants"]["fast_default"], report["epoch"]["fast_default"]):
        assert entry["compile"] == "eager" and "CPU" in entry["compile_reason"] and entry["seconds_compile"] == 0.0


def test_every_summary_ratio_is_its_numerator_over_its_denominator(report):
    """Each ratio names two report paths; following them by hand gives its value, and an epoch ratio's two paths
    name the same variant's epoch entry."""
    v, e = report["step"]["variants"], report["epoch"]["fast_default"]
    s = report["summary"]
    assert s["step_speedup_vs_published_bf16"] == {
        "value": v["published_bf16"]["ms_per_step"] / v["fast_default"]["ms_per_step"],
        "numerator": "step.variants.published_bf16.ms_per_step",
        "denominator": "step.variants.fast_default.ms_per_step",
    }
    assert s["epoch_speedup_vs_published_minimal"]["value"] == (
        e["published_epoch_minimal"]["seconds"] / e["epoch_seconds"]
    )
    assert s["epoch_speedup_vs_published_as_released"]["value"] == (
        e["published_epoch_as_released"]["seconds"] / e["epoch_with_checkpoint_seconds"]
    )
    ratios = {k: r for k, r in s.items() if isinstance(r, dict)}
    assert len(ratios) == 11  # 4 step + 2 epoch ratios of the default, 3 + 2 of the fastest variants
    for name, r in ratios.items():
        num, den = (json_path(report, r[side]) for side in ("numerator", "denominator"))
        assert r["value"] == (num / den if num and den else None), name
        if r["numerator"].startswith("epoch."):
            assert r["numerator"].split(".")[1] == r["denominator"].split(".")[1] == "fast_default", name
    assert s["peak_memory_ratio_vs_published_fp32"]["value"] is None  # no allocator statistics on the CPU


def json_path(report: dict, path: str):
    head, *rest = path.split(".")
    return json_path(report[head], ".".join(rest)) if rest else report[head]


def test_step_numbers_and_both_mfus(report):
    v, flops = report["step"]["variants"], report["step"]["flops_per_step"]
    for name in ("fast_default", "published_bf16", "published_fp32"):
        r = v[name]
        assert 0 < r["ms_per_step_min"] <= r["ms_per_step"] <= r["ms_per_step_max"], name
        assert r["images_per_s"] == pytest.approx(8 / (r["ms_per_step"] / 1e3)), name
        assert math.isfinite(r["last_loss"]), name
        rate = flops / (r["ms_per_step"] / 1e3)
        assert r["mfu_measured_gemm"] == pytest.approx(rate / (report["bf16_gemm_tflops"] * 1e12)), name
        assert r["mfu_datasheet"] is None, name  # no datasheet peak for a CPU
    assert report["bf16_datasheet_tflops"] is None
    assert report["bf16_datasheet_source"] == "NVIDIA datasheet, dense, no sparsity"


def test_fast_epoch_runs_every_step_and_adds_its_checkpoint(report):
    e = report["epoch"]["fast_default"]
    assert e["steps"] == 32 // 8
    assert e["epoch_with_checkpoint_seconds"] == e["epoch_seconds"] + e["checkpoint_seconds"]
    assert e["checkpoint_seconds"] > 0 and set(e["phase_seconds"]) == {"features", "kmeans", "steps"}
    assert report["summary"]["projected_200_epochs_minutes"] == pytest.approx(200 * e["epoch_seconds"] / 60)


def test_the_200_epoch_projection_overlaps_each_checkpoint_write_with_the_next_epoch(report):
    """By default training waits for the host snapshot only; the write runs during the next epoch, so an epoch's cycle
    is the snapshot plus the longer of the epoch and the write."""
    e = report["epoch"]["fast_default"]
    snapshot, write = e["checkpoint_snapshot_seconds"], e["checkpoint_write_seconds"]
    assert snapshot > 0 and write > 0
    assert e["epoch_cycle_seconds"] == pytest.approx(snapshot + max(e["epoch_seconds"], write))
    assert report["summary"]["projected_200_epochs_with_checkpoint_minutes"] == pytest.approx(
        200 * e["epoch_cycle_seconds"] / 60
    )


def test_fast_epoch_times_an_evaluation_recording_then_replaying_the_test_view_tokens(report):
    """The split ViT's frozen prefix keeps no running statistics, so the first evaluation keeps its tokens (in RAM on
    the CPU) and the second replays them."""
    e = report["epoch"]["fast_default"]
    assert e["token_cache"] == {"train": "cpu"}
    assert e["evaluation_seconds"] > 0 and e["evaluation_replay_seconds"] > 0


def test_published_epochs_project_exactly_what_they_say(report):
    """Minimal: every step measured, the k-means phase x 10 / 1 restart. As released (--as-released-subset 12 of 32
    train and 12 test images): 1 of 4 steps, 12 of 32 and 12 of 12 images, each phase scaled by its factor."""
    e = report["epoch"]["fast_default"]
    minimal, released = e["published_epoch_minimal"], e["published_epoch_as_released"]
    assert minimal["steps_measured"] == 4 and minimal["subset_images"] is None
    assert minimal["projection_factors"] == {"kmeans": 10.0}
    assert released["steps_measured"] == 1 and released["subset_images"] == 12
    assert released["projection_factors"] == {"features": 32 / 12, "steps": 4.0, "kmeans": 10.0}
    assert set(released["phase_seconds"]) == {
        "features", "kmeans", "scoring", "code_kmeans", "steps", "test_features", "test_kmeans", "saves",
    }  # fmt: skip
    for epoch in (minimal, released):
        measured, factors = epoch["phase_seconds_measured"], epoch["projection_factors"]
        assert epoch["phase_seconds"] == pytest.approx({k: s * factors.get(k, 1.0) for k, s in measured.items()})
        extra = sum(epoch["phase_seconds"].values()) - sum(measured.values())
        assert epoch["seconds"] == pytest.approx(epoch["measured_seconds"] + extra)
        assert epoch["projected_200_epochs_minutes"] == pytest.approx(200 * epoch["seconds"] / 60)
    assert set(released["step_log"]) == set(published.StepLog.TERMS)
    assert set(released["accuracies"]) == {"train", "codes", "test_0", "test_1", "test_2"}


def test_stand_in_features_have_the_class_structure_and_are_seeded():
    """Every stand-in row lies nearest its own class's mean (the train set's means for the test rows too), rows are
    unit vectors, and the same seed gives the same features."""
    args = bench_train.parse_args([*TINY, "--n-train", "32", "--n-test", "12", "--stand-in-noise", "0.1"])
    data = bench_train.epoch_data(args, args.device)
    one, two = (bench_train.stand_in_features(args, data, 192, 40) for _ in range(2))
    assert torch.equal(one.train, two.train) and torch.equal(one.codes, two.codes) and torch.equal(one.test, two.test)
    assert one.train.shape == (32, 192) and one.codes.shape == (32, 40) and one.test.shape == (12, 192)
    for feats, targets, ref in ((one.train, data.targets, one.train), (one.codes, data.targets, one.codes),
                                (one.test, data.test_targets, one.train)):  # fmt: skip
        torch.testing.assert_close(feats.norm(dim=1), torch.ones(len(feats)))
        means = torch.stack([ref[data.targets == c].mean(0) for c in range(4)])
        assert torch.equal(torch.cdist(feats, means).argmin(1), targets)
    labelled, _ = gcd_split((torch.arange(32) % 4).numpy(), [0, 1], 0.5, 0)  # the GCD split's labelled subset
    assert torch.equal(data.labelled, torch.from_numpy(labelled))


def test_step_flops_are_counted_from_the_model(report):
    """Every matmul of the step scales with the rows it sees, so twice the batch is about twice the FLOPs (the N x N
    contrastive Grams are the only super-linear part, and tiny here)."""
    args = bench_train.parse_args([*TINY, "--batch", "16"])
    batch, pseudo, n_old = bench_train.step_batch(args, args.device)
    double = bench_train.count_step_flops(args, args.device, batch, pseudo, n_old)
    assert double / report["step"]["flops_per_step"] == pytest.approx(2.0, rel=0.02)


# ---------------------------------------------------------------------------------------- the documented command
def test_documented_command_sets_up_every_variant_at_crop_224():
    """README's CPU command: parsed, and each variant's models and config built for 224-pixel crops of 256-pixel
    images (the set-up that once stopped on a placeholder data source's image size), without running a step."""
    args = bench_train.parse_args(README_COMMAND)
    assert (args.crop, args.image_size, args.batch, args.variants) == (224, 256, 8, ["published_fp32", "fast_default"])
    batch, pseudo, n_old = bench_train.step_batch(args, args.device)
    assert batch.images.shape == (8, 3, 256, 256)
    for overrides in bench_train.FAST_VARIANTS.values():
        assert bench_train.fast_config(args, overrides).data.crop_size == 224
    for variant in args.variants:
        step, finish, details = bench_train.step_functions(args, args.device, variant, batch, pseudo, n_old)
        assert callable(step) and callable(finish)
        fields = details()
        assert fields == (
            {}
            if variant.startswith("published")
            else {
                "compile": "eager",
                "compile_reason": fields["compile_reason"],
                "seconds_compile": 0.0,
                "cuda_graph": "eager",
                "cuda_graph_reason": "train.cuda_graph=off",
                "cuda_graph_captures": 0,
                "seconds_cuda_graph_capture": 0.0,
            }
        )


def test_smoke_size_keeps_what_a_command_sets(monkeypatch):
    """Smoke size: 2 steps after 1 warm-up step; the sizes a command leaves at their defaults shrink, those it sets
    stay, and a named backbone keeps its crop."""
    monkeypatch.setenv(smoke.ENV, "1")
    readme = bench_train.parse_args(README_COMMAND)
    assert (readme.steps, readme.warmup, readme.batch) == (2, 1, 8)
    assert (readme.backbone, readme.crop, readme.image_size) == ("vit_tiny_patch16_224", 224, 256)
    assert (readme.proj_out_dim, readme.n_classes) == (256, 8)
    gpu = bench_train.parse_args(GPU_CHECK_COMMAND)
    assert (gpu.backbone, gpu.backbone_kwargs, gpu.crop, gpu.image_size) == ("vit_tiny_patch16_224", {"img_size": 32},
                                                                              32, 40)  # fmt: skip
    assert (gpu.batch, gpu.n_train, gpu.n_test) == (8, 32, 16)


@pytest.mark.parametrize(("argv", "message"), [
    (["--crop", "300"], "--crop 300 is larger than the stored --image-size 256: raise --image-size"),
    (["--epoch", "--n-train", "100"], "--n-train 100 holds no full batch of --batch 128"),
    (["--variants", "fast_turbo"], "unknown variant(s) ['fast_turbo']"),
    (["--epoch-variants", "published_fp32"], "--epoch-variants takes fast variants only"),
    (["--backbone-kwargs", "img_size=32"], "--backbone-kwargs must be a JSON dict"),
    (["--as-released-subset", "0"], "--as-released-subset must be >= 1 image"),
])  # fmt: skip
def test_bad_flags_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("entry", [bench_train.test_published_step_speed, bench_train.test_fast_step_speed])
def test_the_pytest_benchmark_entry_points_run(entry):
    """`pytest benchmarks/bench_train.py` (the module's docstring): each entry point times one step and checks its
    loss; a stand-in for pytest-benchmark's fixture calls the step, counted."""
    calls = []
    entry(lambda step: calls.append(step()))
    assert len(calls) == 1
