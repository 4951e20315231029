// Host-only probe of ep_config.h for the CPU tests: reads lines
//   channels chunk capacity ranks hidden_bytes topk local_experts buffer_bytes
// from stdin and prints, per line, "OK <buffer bytes needed>" or "ERR <message>".
#include <iostream>

#include "../ep_config.h"

int main() {
    ep::IntranodeConfig cfg;
    int ranks, hidden_bytes, topk, local_experts;
    long long buffer;
    while (std::cin >> cfg.num_channels >> cfg.num_max_send_tokens >> cfg.num_max_recv_tokens >> ranks >> hidden_bytes >>
           topk >> local_experts >> buffer) {
        const char* error = ep::validate_intranode(cfg, ranks, hidden_bytes, topk, local_experts, buffer);
        if (error != nullptr) {
            std::cout << "ERR " << error << "\n";
            continue;
        }
        const int record = ep::dispatch_record(hidden_bytes, hidden_bytes / ep::kFp8BlockSize, topk).bytes;
        std::cout << "OK " << ep::make_buffer_layout(ranks, cfg.num_channels, cfg.num_max_recv_tokens, record).total << "\n";
    }
    return 0;
}
