// Device error diagnostics shared by device and host code: role ids and the host-mapped ErrorRecord.
#pragma once

namespace ep {

enum Role : int {
    kRoleBarrier = 1,
    kRoleDispatchSender = 2,
    kRoleDispatchReceiver = 3,
    kRoleCombineSender = 4,
    kRoleCombineReceiver = 5,
    kRoleCombineKeeper = 6,
    // internode
    kRoleRailBarrier = 7,
    kRoleNodeBarrier = 8,
    kRoleRdmaSender = 9,             // dispatch: waiting for room in a node's RDMA ring
    kRoleRdmaSenderCoordinator = 10,
    kRoleForwarderMeta = 11,         // dispatch forwarder: waiting for a node's channel meta
    kRoleForwarderNvlRoom = 12,      // dispatch forwarder: waiting for room in the NVLink ring
    kRoleForwarderRdmaData = 13,     // dispatch forwarder: waiting for RDMA records
    kRoleForwarderCoordinator = 14,
    kRoleNvlReceiver = 15,
    kRoleCombineNvlSender = 16,
    kRoleCombineForwarderRdmaRoom = 17,
    kRoleCombineForwarderNvlData = 18,
    kRoleCombineNvlCoordinator = 19,
    kRoleCombineRdmaReceiver = 20,
    kRoleCombineRdmaCoordinator = 21,
    // low-latency
    kRoleLowLatencyDispatchSender = 22,    // an expert's owner: waiting for this rank's copies to it, or the clean
    kRoleLowLatencyDispatchReceiver = 23,  // waiting for a source's count for a local expert
    kRoleLowLatencyCombineSender = 24,     // waiting for this op's clean of the next half
    kRoleLowLatencyCombineReceiver = 25,   // waiting for an expert's flag
};

// Host-mapped; written once by the first spin that times out. Read by Runtime.error_record().
struct ErrorRecord {
    int code;  // 0: none, 1: timeout, 2: more rows than num_worst_tokens (tail = rows, expected = limit),
               // -1: being written (the kernel stopped before the record was complete)
    int role;
    int rank;
    int channel;
    int peer;
    int head;
    int tail;
    int expected;
};

}  // namespace ep
