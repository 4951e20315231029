// Host-only probe of validate_internode and the region sizes (ep_config.h, ep_internode.h) for the CPU
// tests: reads lines
//   channels nvl_chunk nvl_capacity rdma_chunk rdma_capacity nodes gpus_per_node hidden_bytes topk local_experts
// from stdin and prints, per line, "OK <RDMA bytes> <NVLink bytes>" (for the larger of the dispatch record
// with FP8 scales and a float32 combine record of the same width) or "ERR <message>".
#include <algorithm>
#include <iostream>

#include "../ep_internode.h"

int main() {
    ep::InternodeConfig cfg;
    int nodes, gpus, hidden_bytes, topk, local_experts;
    while (std::cin >> cfg.num_channels >> cfg.nvl_chunk >> cfg.nvl_capacity >> cfg.rdma_chunk >> cfg.rdma_capacity >>
           nodes >> gpus >> hidden_bytes >> topk >> local_experts) {
        const char* error = ep::validate_internode(cfg, nodes, gpus, hidden_bytes, topk, local_experts);
        if (error != nullptr) {
            std::cout << "ERR " << error << "\n";
            continue;
        }
        const int record = std::max(ep::internode_dispatch_record(hidden_bytes, hidden_bytes / ep::kFp8BlockSize, topk).bytes,
                                    ep::combine_record(2 * hidden_bytes, topk).bytes);
        const ep::InternodeLayout l = ep::make_internode_layout(cfg, nodes, gpus, record);
        std::cout << "OK " << l.rdma.total << " " << l.nvl.total << "\n";
    }
    return 0;
}
