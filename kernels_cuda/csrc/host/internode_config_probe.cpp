// Host-only probe of validate_internode (ep_config.h) for the CPU tests: reads lines
//   channels nvl_chunk nvl_capacity rdma_chunk rdma_capacity nodes gpus_per_node hidden_bytes topk local_experts
// from stdin and prints, per line, "OK" or "ERR <message>".
#include <iostream>
#include <string>

#include "../ep_config.h"

int main() {
    ep::InternodeConfig cfg;
    int nodes, gpus, hidden_bytes, topk, local_experts;
    while (std::cin >> cfg.num_channels >> cfg.nvl_chunk >> cfg.nvl_capacity >> cfg.rdma_chunk >> cfg.rdma_capacity >>
           nodes >> gpus >> hidden_bytes >> topk >> local_experts) {
        const char* error = ep::validate_internode(cfg, nodes, gpus, hidden_bytes, topk, local_experts);
        std::cout << (error == nullptr ? "OK" : std::string("ERR ") + error) << "\n";
    }
    return 0;
}
