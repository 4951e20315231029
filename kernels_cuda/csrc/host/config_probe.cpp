// Host-only probe of the configuration checks and buffer sizes (params/config.h,
// params/internode_layout.h) for the CPU tests, which compare its answers with kernels_cuda/config.py.
// Reads lines from stdin and prints one answer per line, "OK <sizes>" or "ERR <message>":
//   config_probe intranode: channels chunk capacity ranks hidden_bytes topk local_experts buffer_bytes
//                           -> OK <buffer bytes needed>
//   config_probe internode: channels nvl_chunk nvl_capacity rdma_chunk rdma_capacity nodes gpus_per_node
//                           hidden_bytes topk local_experts
//                           -> OK <RDMA bytes> <NVLink bytes> (for the larger of the dispatch record
//                              with FP8 scales and a float32 combine record of the same width)
#include <algorithm>
#include <iostream>
#include <string>

#include "params/internode_layout.h"

namespace {

void probe_intranode() {
    ep::IntranodeConfig cfg;
    int ranks, hidden_bytes, topk, local_experts;
    long long buffer;
    while (std::cin >> cfg.num_channels >> cfg.num_max_send_tokens >> cfg.num_max_recv_tokens >> ranks >> hidden_bytes >>
           topk >> local_experts >> buffer) {
        if (const char* error = ep::validate_intranode(cfg, ranks, hidden_bytes, topk, local_experts, buffer)) {
            std::cout << "ERR " << error << "\n";
            continue;
        }
        const int record = ep::dispatch_record(hidden_bytes, hidden_bytes / ep::kFp8BlockSize, topk).bytes;
        std::cout << "OK " << ep::make_buffer_layout(ranks, cfg.num_channels, cfg.num_max_recv_tokens, record).total << "\n";
    }
}

void probe_internode() {
    ep::InternodeConfig cfg;
    int nodes, gpus, hidden_bytes, topk, local_experts;
    while (std::cin >> cfg.num_channels >> cfg.nvl_chunk >> cfg.nvl_capacity >> cfg.rdma_chunk >> cfg.rdma_capacity >>
           nodes >> gpus >> hidden_bytes >> topk >> local_experts) {
        if (const char* error = ep::validate_internode(cfg, nodes, gpus, hidden_bytes, topk, local_experts)) {
            std::cout << "ERR " << error << "\n";
            continue;
        }
        const int record = std::max(ep::internode_dispatch_record(hidden_bytes, hidden_bytes / ep::kFp8BlockSize, topk).bytes,
                                    ep::combine_record(2 * hidden_bytes, topk).bytes);
        const ep::InternodeLayout l = ep::make_internode_layout(cfg, nodes, gpus, record);
        std::cout << "OK " << l.rdma.total << " " << l.nvl.total << "\n";
    }
}

}  // namespace

int main(int argc, char** argv) {
    const std::string mode = argc == 2 ? argv[1] : "";
    if (mode == "intranode") {
        probe_intranode();
    } else if (mode == "internode") {
        probe_internode();
    } else {
        std::cerr << "usage: config_probe intranode|internode < lines\n";
        return 2;
    }
    return 0;
}
