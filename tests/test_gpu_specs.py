"""The GPU peak table: complete entries, right figures, and names that resolve to one card only."""

from __future__ import annotations

import dataclasses

import pytest

from gpuflow.gpu_specs import GPU_SPECS, PRECISIONS, GpuSpec, lookup_gpu

# Device names as torch.cuda.get_device_name() reports them, and the entry each must resolve to.
REAL_NAMES = {
    "NVIDIA A100-SXM4-80GB": "A100 SXM4 80GB",
    "NVIDIA A100-SXM4-40GB": "A100 SXM4 40GB",
    "NVIDIA A100-PCIE-40GB": "A100 PCIe 40GB",
    "NVIDIA A100 80GB PCIe": "A100 PCIe 80GB",
    "NVIDIA H100 80GB HBM3": "H100 SXM",
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA H200": "H200 SXM",
    "NVIDIA H200 NVL": "H200 NVL",
    "NVIDIA L4": "L4",
    "NVIDIA L40S": "L40S",
    "NVIDIA A10G": "A10G",
    "NVIDIA A10": "A10",
    "NVIDIA GeForce RTX 4090": "GeForce RTX 4090",
}

UNKNOWN_NAMES = [
    "NVIDIA GeForce GTX 1080",
    "Tesla T4",
    "AMD Instinct MI300X",
    "NVIDIA L40",  # a different card from the L40S, and deliberately not in the table
    "NVIDIA GH200 480GB",  # must not fall through to the H200 entry
    "NVIDIA A100-SXM4-40GB MIG 1g.5gb",  # a MIG slice has a fraction of the card's compute
    "NVIDIA GeForce RTX 4090 D",  # cut-down China variant
    "NVIDIA GeForce RTX 4090 Laptop GPU",  # a different, smaller die
    "NVIDIA A10-4Q",
    "",
]


def _spec(name: str) -> GpuSpec:
    (spec,) = [s for s in GPU_SPECS if s.name == name]
    return spec


def test_entry_names_are_unique() -> None:
    names = [spec.name for spec in GPU_SPECS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda s: s.name)
def test_entry_has_all_precisions_with_positive_peaks(spec: GpuSpec) -> None:
    assert set(spec.dense_tflops) == set(PRECISIONS) == {"fp32", "tf32", "bf16", "fp16"}
    assert all(value > 0 for value in spec.dense_tflops.values())
    assert spec.memory_gib > 0


@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda s: s.name)
def test_tensor_core_peaks_are_ordered(spec: GpuSpec) -> None:
    peaks = spec.dense_tflops
    assert peaks["bf16"] >= peaks["fp32"]
    assert peaks["bf16"] >= peaks["tf32"] >= peaks["fp32"]
    # Every card here runs fp16 and bf16 at one tensor-core rate.
    assert peaks["fp16"] == peaks["bf16"]


@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda s: s.name)
def test_entry_cites_a_url(spec: GpuSpec) -> None:
    assert "https://" in spec.source


@pytest.mark.parametrize(("device_name", "expected"), sorted(REAL_NAMES.items()))
def test_real_names_resolve_to_exactly_one_entry(device_name: str, expected: str) -> None:
    matching = [spec.name for spec in GPU_SPECS if spec.matches(device_name)]
    assert matching == [expected]
    spec = lookup_gpu(device_name)
    assert spec is not None
    assert spec.name == expected


@pytest.mark.parametrize("device_name", UNKNOWN_NAMES)
def test_unknown_names_return_none(device_name: str) -> None:
    assert lookup_gpu(device_name) is None


def test_every_entry_is_reachable_from_a_real_name() -> None:
    assert {spec.name for spec in GPU_SPECS} == set(REAL_NAMES.values())


def test_similar_names_do_not_cross_match() -> None:
    assert lookup_gpu("NVIDIA L40") is None
    assert lookup_gpu("NVIDIA L40S").name == "L40S"
    assert lookup_gpu("NVIDIA L4").name == "L4"
    a10 = lookup_gpu("NVIDIA A10")
    assert a10 is not None
    assert a10.name == "A10"
    assert a10 is not lookup_gpu("NVIDIA A10G")
    assert a10 is not lookup_gpu("NVIDIA A100-SXM4-80GB")
    assert lookup_gpu("NVIDIA H200 NVL").name == "H200 NVL"
    assert lookup_gpu("NVIDIA H200").name == "H200 SXM"


def test_lookup_tolerates_case_and_whitespace() -> None:
    spec = lookup_gpu("  nvidia   H100 80GB HBM3 ")
    assert spec is not None
    assert spec.name == "H100 SXM"


def test_a10g_is_not_given_the_a10s_tensor_rate() -> None:
    a10g, a10 = _spec("A10G").dense_tflops, _spec("A10").dense_tflops
    assert a10g["bf16"] == 70.0
    assert a10["bf16"] == 125.0
    assert a10g["fp32"] > a10["fp32"]  # more SMs and higher clock on the CUDA cores


def test_dense_figures_are_half_the_sparse_datasheet_figures() -> None:
    # Datasheet "with sparsity" figures: H100 SXM 1,979 / 989, H100 PCIe 1,513, L4 242, A100 624.
    assert _spec("H100 SXM").dense_tflops["bf16"] == 1979 / 2
    assert _spec("H100 SXM").dense_tflops["tf32"] == 989 / 2
    assert _spec("H100 PCIe").dense_tflops["bf16"] == 1513 / 2
    assert _spec("H100 NVL").dense_tflops["bf16"] == 1671 / 2
    assert _spec("L4").dense_tflops["bf16"] == 242 / 2
    assert _spec("A100 SXM4 80GB").dense_tflops["bf16"] == 624 / 2


def test_h200_sxm_matches_h100_sxm_compute_and_nvl_is_lower() -> None:
    h200, h200_nvl = _spec("H200 SXM"), _spec("H200 NVL")
    assert h200.dense_tflops == _spec("H100 SXM").dense_tflops
    assert h200.dense_tflops["bf16"] == pytest.approx(989, abs=1)
    assert h200.memory_gib == 141
    assert all(h200_nvl.dense_tflops[p] < h200.dense_tflops[p] for p in PRECISIONS)


def test_a100_variants_share_compute_but_not_memory() -> None:
    names = ["A100 SXM4 80GB", "A100 SXM4 40GB", "A100 PCIe 80GB", "A100 PCIe 40GB"]
    peaks = {tuple(sorted(_spec(n).dense_tflops.items())) for n in names}
    assert len(peaks) == 1
    assert {_spec(n).memory_gib for n in names} == {40.0, 80.0}


def test_rtx_4090_uses_fp32_accumulate_rate() -> None:
    assert _spec("GeForce RTX 4090").dense_tflops["fp16"] == 165.2  # not the 330.3 fp16-acc rate


def test_peak_flops_is_in_flops_per_second() -> None:
    spec = _spec("A100 SXM4 80GB")
    assert spec.peak_flops("bf16") == pytest.approx(312e12)
    with pytest.raises(KeyError):
        spec.peak_flops("fp8")


def test_specs_are_frozen() -> None:
    spec = _spec("L4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "L4 but faster"  # type: ignore[misc]


def test_malformed_entries_are_rejected() -> None:
    good = {"fp32": 1.0, "tf32": 2.0, "bf16": 4.0, "fp16": 4.0}
    with pytest.raises(ValueError, match="keys"):
        GpuSpec("X", (r"x",), {"fp32": 1.0, "bf16": 2.0}, 1.0, "https://example")
    with pytest.raises(ValueError, match="positive"):
        GpuSpec("X", (r"x",), {**good, "tf32": 0.0}, 1.0, "https://example")
    with pytest.raises(ValueError, match="pattern"):
        GpuSpec("X", (), good, 1.0, "https://example")


def test_cpu_half_precision_peak_is_never_below_fp32_and_old_probes_are_not_reused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without native bf16 units a CPU runs bf16 matmuls far below its fp32 rate (under
    2 GFLOP/s against ~60 on an AVX2 EPYC), yet a bf16 step's small matmuls can beat the
    probe's: against that probe MFU read 138%. A cache written by an older probe must not
    bring such a figure back."""
    from gpuflow import devices

    assert devices.cpu_peak("bf16").flops >= devices.cpu_peak("fp32").flops
    current = devices._cache_file("bf16", 1)
    monkeypatch.setattr(devices, "PROBE_REVISION", devices.PROBE_REVISION + 1)
    assert devices._cache_file("bf16", 1) != current
