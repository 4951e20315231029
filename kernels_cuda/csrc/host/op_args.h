// The typed boundary between kernels_cuda's Python engines and the host runtimes: one struct per rank
// of a launch (`...Rank`: a RankArgs, rank_args.h, around the kernel's own per-rank parameter struct)
// and one per op (`...Op`: the settings all its ranks share), bound by ArgClass (arg_class.h) so that
// Python builds them with keywords. What intranode and internode name alike is bound here once (the
// dispatch and combine payloads, the launch and op settings), and the settings are copied into the
// kernels' parameter blocks (params/*.h) by one function each. The structs of each runtime are bound
// next to it (bindings.cpp, internode_runtime.cpp, low_latency_runtime.cpp).
#pragma once
#include <torch/extension.h>

#include <cstdint>

#include "arg_class.h"

// An op's settings (`...Op`), made of the parts below: each part binds its own fields.
template <typename... Parts>
struct OpArgs : Parts... {
    static void bind(py::module_& m, const char* name) {
        ArgClass<OpArgs> c(m, name);
        (Parts::bind(c), ...);
    }
};

// What every op has: its channels and the kernels' spin budget.
struct LaunchSettings {
    int num_channels = 0;
    int64_t timeout_cycles = 0;

    template <typename T>
    static void bind(ArgClass<T>& c) {
        c.value("num_channels", &LaunchSettings::num_channels).value("timeout_cycles", &LaunchSettings::timeout_cycles);
    }
};

// A fresh dispatch's notify: the experts the per-expert counts cover.
struct ExpertCounts {
    int num_experts = 0;
    int expert_alignment = 1;

    template <typename T>
    static void bind(ArgClass<T>& c) {
        c.value("num_experts", &ExpertCounts::num_experts).value("expert_alignment", &ExpertCounts::expert_alignment);
    }
};

// A cached notify: before a combine it also rewrites the handle's head tables (negative heads).
struct HeadRewrite {
    bool rewrite_heads = false;

    template <typename T>
    static void bind(ArgClass<T>& c) {
        c.value("rewrite_heads", &HeadRewrite::rewrite_heads);
    }
};

struct DispatchSettings {
    int hidden_bytes = 0;
    int num_scales = 0;
    int num_topk = 0;
    int num_experts = 0;
    int num_worst_tokens = 0;
    int stalled_rank = -1;  // test hook: this rank's blocks exit at once

    template <typename T>
    static void bind(ArgClass<T>& c) {
        using S = DispatchSettings;
        c.value("hidden_bytes", &S::hidden_bytes).value("num_scales", &S::num_scales);
        c.value("num_topk", &S::num_topk).value("num_experts", &S::num_experts);
        c.value("num_worst_tokens", &S::num_worst_tokens).value("stalled_rank", &S::stalled_rank);
    }
};

struct CombineSettings {
    int hidden_bytes = 0;
    int num_topk = 0;
    int stalled_rank = -1;
    bool float32 = false;  // else bfloat16 rows

    template <typename T>
    static void bind(ArgClass<T>& c) {
        using S = CombineSettings;
        c.value("hidden_bytes", &S::hidden_bytes).value("num_topk", &S::num_topk).value("float32", &S::float32);
        c.value("stalled_rank", &S::stalled_rank);
    }
};

// The intranode rings (ep::IntranodeConfig besides the channels).
struct IntranodeRings {
    int capacity = 0;
    int chunk = 0;

    template <typename T>
    static void bind(ArgClass<T>& c) {
        c.value("capacity", &IntranodeRings::capacity).value("chunk", &IntranodeRings::chunk);
    }
};

// The internode rings (ep::InternodeConfig besides the channels).
struct InternodeRings {
    int nvl_chunk = 0;
    int nvl_capacity = 0;
    int rdma_chunk = 0;
    int rdma_capacity = 0;

    template <typename T>
    static void bind(ArgClass<T>& c) {
        using S = InternodeRings;
        c.value("nvl_chunk", &S::nvl_chunk).value("nvl_capacity", &S::nvl_capacity);
        c.value("rdma_chunk", &S::rdma_chunk).value("rdma_capacity", &S::rdma_capacity);
    }
};

// A notify rank's host-only field: whether its kernel publishes the receive counts (the runtime's
// host-mapped counters).
struct CountPublishing {
    bool publish_counts = true;  // false for a num_worst_tokens dispatch, which allocates without them
};

// Which rank, and how many tokens it sends (intranode and low-latency kernels; an internode kernel
// takes its rank as a place in the world, ep::InternodePeers, which the runtime fills).
template <typename T>
void bind_rank_tokens(ArgClass<T>& c) {
    c.value("rank", &T::KernelArgs::rank).value("num_tokens", &T::KernelArgs::num_tokens);
}

// The payload fields of a kernel's per-rank dispatch arguments (ep::DispatchRankArgs,
// ep::InternodeDispatchRankArgs).
template <typename T>
void bind_dispatch_payload(ArgClass<T>& c) {
    using K = typename T::KernelArgs;
    c.tensor("x", &K::x).optional_tensor("x_scales", &K::x_scales);  // FP8 scales as int32 words, or None
    c.value("scale_token_stride", &K::scale_token_stride).value("scale_hidden_stride", &K::scale_hidden_stride);
    // topk_idx is None in a cached dispatch without top-k
    c.optional_tensor("topk_idx", &K::topk_idx).optional_tensor("topk_weights", &K::topk_weights);
    c.tensor("is_token_in_rank", &K::is_token_in_rank);
    c.tensor("recv_x", &K::recv_x).optional_tensor("recv_x_scales", &K::recv_x_scales);
    c.tensor("recv_src_idx", &K::recv_src_idx);
    c.optional_tensor("recv_topk_idx", &K::recv_topk_idx).optional_tensor("recv_topk_weights", &K::recv_topk_weights);
}

// Likewise for combine (ep::CombineRankArgs, ep::InternodeCombineRankArgs).
template <typename T>
void bind_combine_payload(ArgClass<T>& c) {
    using K = typename T::KernelArgs;
    c.tensor("x", &K::x).optional_tensor("topk_weights", &K::topk_weights);
    c.tensor("combined_x", &K::combined_x).optional_tensor("combined_topk_weights", &K::combined_topk_weights);
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
