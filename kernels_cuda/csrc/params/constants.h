// Constants shared by the kernels, the host code and the Python side.
// kernels_cuda/constants.py parses the `constexpr` lines below (one name = one integer per line),
// so the CPU protocol model and the config validation mirror use exactly these values.
#pragma once

namespace ep {

constexpr int kMaxRanks = 8;             // ranks of one NVLink domain handled by the intranode kernels
constexpr int kWarpSize = 32;
constexpr int kDispatchWarps = 24;       // warps of a dispatch block (sender SM and receiver SM alike)
constexpr int kCombineWarps = 24;        // warps of a combine block
constexpr int kCombineKeeperWarps = 1;   // combine receiver SM: warp 0 keeps the heads, the rest reduce
constexpr int kNotifyThreads = 256;
constexpr int kLayoutThreads = 256;
constexpr int kLayoutUnitsPerBlock = 32; // experts, ranks or nodes counted by one layout block
constexpr int kMaxTopk = 32;
constexpr int kMaxLocalExperts = 1024;
constexpr int kRecordAlign = 16;         // every ring record starts on a 16-byte boundary
constexpr int kBufferAlign = 128;        // every buffer region starts on a 128-byte boundary
constexpr int kFp8BlockSize = 128;       // one float scale per 128 FP8 channels
constexpr int kMaxChannels = 64;
// Internode (node-limited, two hops: RDMA between same-GPU-index peers, then NVLink inside the node).
constexpr int kMaxNvlPeers = 8;          // GPUs per node handled by the internode kernels
constexpr int kMaxRdmaPeers = 20;        // nodes (DeepEP's NUM_MAX_RDMA_PEERS); one lane per node in every role
constexpr int kRdmaSenderWarps = 7;      // dispatch: token-parallel RDMA sender warps (+1 coordinator)
constexpr int kRdmaReceiverWarps = 8;    // combine: token-parallel RDMA receiver warps (+1 head coordinator)
constexpr int kMaxEmulatedRanks = 20;    // nodes x GPUs of one emulated internode launch (e.g. 2x4, 4x4, 20x1)
// Dispatch block: sender SM = kRdmaSenderWarps senders + 1 coordinator + one NVLink receiver per GPU;
// the forwarder SM uses one forwarder per GPU + 1 coordinator of the same block size.
constexpr int kInternodeDispatchWarps = 16;
// Combine block: max(NVLink senders + RDMA receivers + 1 coordinator, one forwarder per node + 1 coordinator).
constexpr int kInternodeCombineWarps = 21;
constexpr int kRdmaMetaInts = 20;        // per (channel, node): node start/end + per-GPU start/end, padded to 16 B
constexpr long long kDefaultTimeoutCycles = 200000000000LL;  // ~100 s at 2 GHz

}  // namespace ep
