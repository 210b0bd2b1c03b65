"""tools/profile_bench_row.py's GPU time by kind of work: kernel names land in their kind (flash's names
contain "cutlass", CUTLASS's grouped GEMM contains "Gemm"), and the table's sums, ratios, the ratio each kind can
at most reach and the ceiling of the step follow from the kernels' times and the FLOP count."""

import importlib.util
import pathlib

SPEC = importlib.util.spec_from_file_location(
    "profile_bench_row", pathlib.Path(__file__).resolve().parents[1] / "tools" / "profile_bench_row.py")
profile_bench_row = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(profile_bench_row)

FLASH = ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<"
         "Flash_bwd_kernel_traits<256, 64, 64, cutlass::bfloat16_t>>")
GROUPED = ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9x"
           "INS_4gemm6kernel13GemmUniversalINS5_17GroupProblemShape")


def test_kernel_names_land_in_their_kind():
    kind_of = profile_bench_row.kind_of
    assert kind_of(FLASH).startswith("attention")
    assert kind_of(GROUPED).startswith("grouped GEMM")
    assert kind_of("nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NNN").startswith("dense GEMM")
    assert kind_of("chunk_gated_delta_rule_fwd_kernel_h_blockdim64").startswith("Gated DeltaNet")
    assert kind_of("causal_conv1d_bwd_kernel").startswith("Gated DeltaNet")
    assert kind_of("row_max_sumexp_kernel") == "vocabulary softmax"
    assert kind_of("void at::native::vectorized_gather_kernel<16, long>") == "gather, scatter, sort, top-k"
    assert kind_of("Memcpy DtoD (Device -> Device)") == "copies and fills"
    assert kind_of("row_norm_bwd").startswith("fused element-wise")
    assert kind_of("triton_red_fused__to_copy_mean_mul_pow_rsqrt_sum_1").startswith("fused element-wise")
    assert kind_of("void at::native::reduce_kernel<128, 4>") == "other elementwise and reductions"


def _rows(table):
    lines = table.split("\n\n")[0].splitlines()[2:]
    return {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in lines}


def test_kinds_table_sums_ratios_and_excess():
    shared = {FLASH: (1, 3000.0), "nvjet_a": (2, 10000.0), "causal_conv1d_fwd_kernel": (1, 1000.0)}
    unshared = {FLASH: (2, 6000.0), "nvjet_b": (4, 40000.0), "causal_conv1d_fwd_kernel": (2, 4000.0)}
    table = profile_bench_row.kinds_table(shared, unshared, 4.0)
    rows = _rows(table)  # without ratios every kind is held to S
    assert rows["attention (flash, cuDNN, merge)"] == ["3.0", "6.0", "2.00", "4.00", "1.5 |"]
    assert rows["dense GEMM (projections, output layer)"] == ["10.0", "40.0", "4.00", "4.00", "0.0 |"]
    assert rows["Gated DeltaNet and its conv (fla)"] == ["1.0", "4.0", "4.00", "4.00", "0.0 |"]
    assert rows["all"] == ["14.0", "50.0", "3.57", "4.00", "1.5 |"]
    assert table.endswith("every kind at its ratio: 12.5 ms shared, 4.00x")
    assert profile_bench_row.kinds_table({}, unshared, 4.0) == "no GPU kernels recorded"  # a profile without CUDA


def test_kinds_table_holds_each_kind_to_its_own_ratio_and_gives_the_ceiling():
    shared = {FLASH: (1, 3000.0), "nvjet_a": (2, 10000.0), "void at::native::reduce_kernel<128, 4>": (1, 2000.0)}
    unshared = {FLASH: (2, 6000.0), "nvjet_b": (4, 80000.0), "void at::native::reduce_kernel<128, 4>": (2, 8000.0)}
    ratios = {"attention (flash, cuDNN, merge)": 3.0, "dense GEMM (projections, output layer)": 10.0}
    table = profile_bench_row.kinds_table(shared, unshared, 4.0, ratios, flop_ratio=8.0)
    rows = _rows(table)
    assert rows["attention (flash, cuDNN, merge)"] == ["3.0", "6.0", "2.00", "3.00", "1.0 |"]
    assert rows["dense GEMM (projections, output layer)"] == ["10.0", "80.0", "8.00", "10.00", "2.0 |"]
    assert rows["other elementwise and reductions"] == ["2.0", "8.0", "4.00", "4.00", "0.0 |"]
    # at their ratios: 2 + 8 + 2 = 12 ms for 94 ms unshared: 7.83x, against 94 / 15 = 6.27x measured
    assert rows["all"] == ["15.0", "94.0", "6.27", "7.83", "3.0 |"]
    assert "every kind at its ratio: 12.0 ms shared, 7.83x = 0.98 F (measured 0.78 F, F = 8.00)\n" in table
    # the element-wise kind gone from both sides: 86 ms unshared over 13 ms shared, over the 10 ms at the ratios
    assert table.endswith("without the kinds held to S on either side: 13.0 ms shared, 6.62x = 0.83 F; "
                          "each kind at its ratio: 8.60x = 1.07 F")


def test_expected_ratios_come_from_the_flop_count_and_the_output_positions():
    flops = {"shared": {"dense": 10.0, "experts": 0.0, "attention": 2.0, "gdn": 1.0, "vision": 0.0},
             "unshared": {"dense": 80.0, "experts": 0.0, "attention": 12.0, "gdn": 4.0, "vision": 0.0}}
    ratios = profile_bench_row.expected_ratios(flops, {"shared": 100, "unshared": 500})
    assert ratios == {"dense GEMM (projections, output layer)": 8.0, "attention (flash, cuDNN, merge)": 6.0,
                      "Gated DeltaNet and its conv (fla)": 4.0, "vocabulary softmax": 5.0}
