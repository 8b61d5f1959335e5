"""Kernel time by kind: the kinds of kernel names seen on an H200 (ours and vLLM's encoder), the
report table, and a profiled CUDA graph replay on the GPU."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.common.kernel_time import KINDS, kernel_kind, kernel_table, kernel_time, kernel_times, summarise

# names as the profiler reported them for vllm_encoder_bench's systems (H200, torch 2.11, vLLM 0.26)
SEEN = {
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::Col": "attention",
    "void flash::prepare_varlen_num_blocks_kernel<16, false>(int, int, int, int const*, int con": "attention",
    "_varlen_forward": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x64x64_4x1x1_kernel0_0": "attention",
    "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN": "matmul",
    "nvjet_sm90_tst_256x152_64x4_1x2_h_bz_coopA_gelubias_TNT": "matmul",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "matmul",
    "_add_layer_norm": "norm",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float,": "norm",
    "triton_red_fused_native_layer_norm_view_0": "norm",
    # inductor's rotary embedding beside our attention op: named after it, but elementwise
    "triton_poi_fused__to_copy_add_cat_exact_attention_mul_neg_permute_select_slice_transpose_u": "elementwise",
    "triton_red_fused__to_copy_add_embedding_mul_sum_unsqueeze_0": "elementwise",
    "void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl(at::Tenso": "elementwise",
    "rotary_kernel": "elementwise",
    "Memcpy DtoD (Device -> Device)": "copy",
    "Memset (Device)": "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<at::native::(anonym": "copy",
    # as other models or settings name them
    "triton_tem_fused_addmm_0": "matmul",
    "triton_tem_fused_flex_attention_0": "attention",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",  # RMSNorm, decomposed by inductor
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>": "matmul",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16, float>": "attention",
    "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>": "elementwise",
    "some_new_kernel": "other",
}


@pytest.mark.parametrize("name", sorted(SEEN))
def test_kernel_kinds_of_names_seen_on_the_gpu(name):
    assert kernel_kind(name) == SEEN[name]
    assert kernel_kind(name) in KINDS


def record(wall, by_kind):
    return {
        "wall_ms": wall,
        "kernel_ms": sum(by_kind.values()),
        "kernels": 7,
        "by_kind_ms": {kind: by_kind.get(kind, 0.0) for kind in KINDS},
        "top": [],
    }


def test_the_table_has_a_row_per_profiled_system_and_a_column_per_kind():
    systems = {
        "ours": {"kernel_time": record(100.0, {"matmul": 40.0, "attention": 50.0, "norm": 5.0})},
        "vllm-tuned": {
            "kernel_time": record(120.0, {"matmul": 45.0, "attention": 52.0, "elementwise": 9.5}),
            "clocks": {"sm_mhz": 1655.5, "power_w": 540.2, "power_capped": 0.95, "samples": 40},
        },
        "vllm-eager": {"kernel_time": None},  # not profiled: no row
    }
    lines = kernel_table(systems).splitlines()
    assert lines[0].split(" | ")[3 : 3 + len(KINDS)] == list(KINDS)
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| ours", "| vllm-tuned"]
    cells = lines[3].strip("| ").split(" | ")
    assert cells[1:3] == ["120.0", "106.5"] and cells[3 + KINDS.index("elementwise")] == "9.5"
    assert lines[0].endswith("| kernels | SM MHz | W | power-capped |")
    assert lines[3].endswith("| 7 | 1655.5 | 540.2 | 95% |")  # its clocks
    assert lines[2].endswith("| 7 |  |  |  |")  # a system without samples: empty cells, not a short row
    assert len({line.count("|") for line in lines}) == 1
    assert kernel_table({"ours": {}}) == ""


def test_a_summary_sums_by_kind_and_ranks_kernels_with_their_launches():
    gemm, norm, rope = "nvjet_sm90_tst_192x192_bias_TNN", "_add_layer_norm", "triton_poi_fused_exact_attention_mul_neg"
    kernels = [(gemm, 2.0), (norm, 0.5), (gemm, 2.5), (rope, 0.25), (gemm, 1.5), (norm, 0.5)]
    summary = summarise(kernels, wall_ms=9.0, top=2)
    assert summary["wall_ms"] == 9.0 and summary["kernels"] == 6 and summary["kernel_ms"] == 7.25
    assert summary["by_kind_ms"] == {**dict.fromkeys(KINDS, 0.0), "matmul": 6.0, "norm": 1.0, "elementwise": 0.25}
    assert summary["top"] == [[gemm, 6.0, 3], [norm, 1.0, 2]]  # by ms, each with its launches; the rest cut
    with pytest.raises(RuntimeError, match="no CUDA kernels"):
        summarise([], wall_ms=1.0)


def test_kernel_time_refuses_a_device_without_cuda_kernels():
    with pytest.raises(ValueError, match="CUDA"):
        kernel_time(lambda: None, torch.device("cpu"))


@pytest.mark.gpu
def test_kernels_replayed_from_a_cuda_graph_are_counted_by_kind():
    device = torch.device("cuda")
    x = torch.randn(4096, 1152, device=device, dtype=torch.bfloat16)
    w = torch.randn(1152, 1152, device=device, dtype=torch.bfloat16)
    norm = torch.nn.LayerNorm(1152, device=device, dtype=torch.bfloat16)

    def forward():
        return norm(x @ w)

    forward()  # cuBLAS picks its kernels on the first call
    torch.cuda.synchronize()
    eager = kernel_time(forward, device)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        forward()  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    replayed = kernel_time(graph.replay, device)
    for result in (eager, replayed):
        assert result["by_kind_ms"]["matmul"] > 0 and result["by_kind_ms"]["norm"] > 0
        assert sum(launches for _, _, launches in result["top"]) == result["kernels"]  # a few kernels: all in top
    assert replayed["kernels"] == eager["kernels"]  # each of the graph's kernels, not one opaque launch


@pytest.mark.gpu
def test_a_pass_that_launches_no_kernels_is_an_error_not_an_empty_row():
    with pytest.raises(RuntimeError, match="no CUDA kernels"):
        kernel_time(lambda: torch.empty(8, device="cuda"), torch.device("cuda"))


def test_kernel_times_begin_no_pass_after_the_deadline():
    """The passes profiled before the time limit keep their rows; none is begun after it."""
    ran = []

    def measure(fn, device):
        fn()
        return {"by_kind_ms": {}}

    def slow(name):  # a pass that takes until past the deadline
        return lambda: (ran.append(name), time.sleep(0.3))

    passes = {"ours": slow("ours"), "vllm-tuned": slow("vllm-tuned")}
    done = kernel_times(passes, torch.device("cpu"), deadline=time.monotonic() + 0.1, measure=measure)
    assert ran == ["ours"] and list(done) == ["ours"]
    everything = kernel_times(passes, torch.device("cpu"), deadline=time.monotonic() + 60, measure=measure)
    assert list(everything) == ["ours", "vllm-tuned"]
    assert kernel_times(passes, torch.device("cpu"), deadline=time.monotonic() - 1, measure=measure) == {}
