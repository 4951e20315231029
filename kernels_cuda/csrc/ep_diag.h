// Timeout diagnostics shared by device and host code: role ids and the host-mapped ErrorRecord.
#pragma once

namespace ep {

enum Role : int {
    kRoleBarrier = 1,
    kRoleDispatchSender = 2,
    kRoleDispatchReceiver = 3,
    kRoleCombineSender = 4,
    kRoleCombineReceiver = 5,
    kRoleCombineKeeper = 6,
};

// Host-mapped; written once by the first spin that times out. Read by Runtime.error_record().
struct ErrorRecord {
    int code;  // 0: none, 1: timeout
    int role;
    int rank;
    int channel;
    int peer;
    int head;
    int tail;
    int expected;
};

}  // namespace ep
