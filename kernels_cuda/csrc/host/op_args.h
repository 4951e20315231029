// The typed boundary between kernels_cuda's Python engines and the host runtimes: one struct per rank
// of a launch (`...Rank`: its tensors) and one per op (`...Op`: the settings all its ranks share), bound
// by ArgClass (arg_class.h) so that Python builds them with keywords. What intranode and internode name
// alike is one struct here (the dispatch and combine payloads, the launch and op settings), bound and
// copied into the kernels' parameter blocks (params/*.h) by one function each. The op structs of each
// runtime are bound next to it (bindings.cpp, internode_runtime.cpp, low_latency_runtime.cpp).
#pragma once
#include <torch/extension.h>

#include <cstdint>

#include "arg_class.h"

// Every rank of a launch: which rank, and how many tokens it sends.
struct RankTokens {
    int rank = -1;
    int num_tokens = 0;
};

// The tensors of one rank's dispatch that intranode and internode name alike (see DispatchRankArgs).
struct DispatchPayload {
    at::Tensor x;
    at::Tensor x_scales;  // FP8 scales as int32 words; None without FP8
    int64_t scale_token_stride = 0;
    int64_t scale_hidden_stride = 0;
    at::Tensor topk_idx;      // None in a cached dispatch without top-k
    at::Tensor topk_weights;
    at::Tensor is_token_in_rank;
    at::Tensor recv_x;
    at::Tensor recv_x_scales;
    at::Tensor recv_src_idx;
    at::Tensor recv_topk_idx;
    at::Tensor recv_topk_weights;
};

// Likewise for combine (see CombineRankArgs).
struct CombinePayload {
    at::Tensor x;
    at::Tensor topk_weights;
    at::Tensor combined_x;
    at::Tensor combined_topk_weights;
};

// What every op has: its channels and the kernels' spin budget.
struct LaunchSettings {
    int num_channels = 0;
    int64_t timeout_cycles = 0;
};

// A fresh dispatch's notify: the experts the per-expert counts cover.
struct ExpertCounts {
    int num_experts = 0;
    int expert_alignment = 1;
};

// A cached notify: before a combine it also rewrites the handle's head tables (negative heads).
struct HeadRewrite {
    bool rewrite_heads = false;
};

struct DispatchSettings {
    int hidden_bytes = 0;
    int num_scales = 0;
    int num_topk = 0;
    int num_experts = 0;
    int num_worst_tokens = 0;
    int stalled_rank = -1;  // test hook: this rank's blocks exit at once
};

struct CombineSettings {
    int hidden_bytes = 0;
    int num_topk = 0;
    int stalled_rank = -1;
    bool float32 = false;  // else bfloat16 rows
};

// The intranode rings (ep::IntranodeConfig besides the channels).
struct IntranodeRings {
    int capacity = 0;
    int chunk = 0;
};

// The internode rings (ep::InternodeConfig besides the channels).
struct InternodeRings {
    int nvl_chunk = 0;
    int nvl_capacity = 0;
    int rdma_chunk = 0;
    int rdma_capacity = 0;
};

template <typename T>
void bind_rank_tokens(ArgClass<T>& c) {
    c.value("rank", &RankTokens::rank).value("num_tokens", &RankTokens::num_tokens);
}

template <typename T>
void bind_dispatch_payload(ArgClass<T>& c) {
    using D = DispatchPayload;
    c.tensor("x", &D::x)
        .optional_tensor("x_scales", &D::x_scales)
        .value("scale_token_stride", &D::scale_token_stride)
        .value("scale_hidden_stride", &D::scale_hidden_stride)
        .optional_tensor("topk_idx", &D::topk_idx)
        .optional_tensor("topk_weights", &D::topk_weights)
        .tensor("is_token_in_rank", &D::is_token_in_rank)
        .tensor("recv_x", &D::recv_x)
        .optional_tensor("recv_x_scales", &D::recv_x_scales)
        .tensor("recv_src_idx", &D::recv_src_idx)
        .optional_tensor("recv_topk_idx", &D::recv_topk_idx)
        .optional_tensor("recv_topk_weights", &D::recv_topk_weights);
}

template <typename T>
void bind_combine_payload(ArgClass<T>& c) {
    using D = CombinePayload;
    c.tensor("x", &D::x)
        .optional_tensor("topk_weights", &D::topk_weights)
        .tensor("combined_x", &D::combined_x)
        .optional_tensor("combined_topk_weights", &D::combined_topk_weights);
}

template <typename T>
void bind_launch_settings(ArgClass<T>& c) {
    c.value("num_channels", &LaunchSettings::num_channels).value("timeout_cycles", &LaunchSettings::timeout_cycles);
}

template <typename T>
void bind_expert_counts(ArgClass<T>& c) {
    c.value("num_experts", &ExpertCounts::num_experts).value("expert_alignment", &ExpertCounts::expert_alignment);
}

template <typename T>
void bind_head_rewrite(ArgClass<T>& c) {
    c.value("rewrite_heads", &HeadRewrite::rewrite_heads);
}

template <typename T>
void bind_dispatch_settings(ArgClass<T>& c) {
    using S = DispatchSettings;
    c.value("hidden_bytes", &S::hidden_bytes)
        .value("num_scales", &S::num_scales)
        .value("num_topk", &S::num_topk)
        .value("num_experts", &S::num_experts)
        .value("num_worst_tokens", &S::num_worst_tokens)
        .value("stalled_rank", &S::stalled_rank);
}

template <typename T>
void bind_combine_settings(ArgClass<T>& c) {
    using S = CombineSettings;
    c.value("hidden_bytes", &S::hidden_bytes)
        .value("num_topk", &S::num_topk)
        .value("stalled_rank", &S::stalled_rank)
        .value("float32", &S::float32);
}

template <typename T>
void bind_intranode_rings(ArgClass<T>& c) {
    c.value("capacity", &IntranodeRings::capacity).value("chunk", &IntranodeRings::chunk);
}

template <typename T>
void bind_internode_rings(ArgClass<T>& c) {
    using S = InternodeRings;
    c.value("nvl_chunk", &S::nvl_chunk)
        .value("nvl_capacity", &S::nvl_capacity)
        .value("rdma_chunk", &S::rdma_chunk)
        .value("rdma_capacity", &S::rdma_capacity);
}

// The payload fields of a kernel's per-rank dispatch arguments (ep::DispatchRankArgs,
// ep::InternodeDispatchRankArgs).
template <typename KernelArgs>
void fill_dispatch_payload(KernelArgs& a, const DispatchPayload& d) {
    a.x = data_of<void>(d.x);
    a.x_scales = data_of<float>(d.x_scales);
    a.scale_token_stride = d.scale_token_stride;
    a.scale_hidden_stride = d.scale_hidden_stride;
    a.topk_idx = data_of<int64_t>(d.topk_idx);
    a.topk_weights = data_of<float>(d.topk_weights);
    a.is_token_in_rank = data_of<bool>(d.is_token_in_rank);
    a.recv_x = data_of<void>(d.recv_x);
    a.recv_x_scales = data_of<float>(d.recv_x_scales);
    a.recv_src_idx = data_of<int>(d.recv_src_idx);
    a.recv_topk_idx = data_of<int64_t>(d.recv_topk_idx);
    a.recv_topk_weights = data_of<float>(d.recv_topk_weights);
}

// Likewise for combine (ep::CombineRankArgs, ep::InternodeCombineRankArgs).
template <typename KernelArgs>
void fill_combine_payload(KernelArgs& a, const CombinePayload& d) {
    a.x = data_of<void>(d.x);
    a.topk_weights = data_of<float>(d.topk_weights);
    a.combined_x = data_of<void>(d.combined_x);
    a.combined_topk_weights = data_of<float>(d.combined_topk_weights);
}

// The settings of a dispatch parameter block (ep::DispatchParams, ep::InternodeDispatchParams).
template <typename Params>
void fill_dispatch_settings(Params& p, const DispatchSettings& s) {
    p.hidden_int4 = s.hidden_bytes / 16;
    p.num_scales = s.num_scales;
    p.num_topk = s.num_topk;
    p.num_experts = s.num_experts;
    p.num_worst_tokens = s.num_worst_tokens;
    p.stalled_rank = s.stalled_rank;
}

// Likewise for combine (ep::CombineParams, ep::InternodeCombineParams).
template <typename Params>
void fill_combine_settings(Params& p, const CombineSettings& s) {
    p.hidden_int4 = s.hidden_bytes / 16;
    p.num_topk = s.num_topk;
    p.stalled_rank = s.stalled_rank;
}
