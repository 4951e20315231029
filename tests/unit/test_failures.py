"""A failed collective is told from other errors (parallel.failures), and the launcher's torchrun
passes the workers' own exit status on (moe_train.launch.torchrun). No random inputs are drawn."""
import signal

import pytest
import torch.distributed as dist

from moe_train.launch.exit_codes import EXIT_BAD_INPUT, EXIT_PEER_FAILED, EXIT_WRITE_FAILED
from moe_train.launch.torchrun import describe_failure, failure_status
from parallel.failures import collective_failure

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:56704. This is typically caused by a remote worker crashing. Check the logs of the "
               "remote worker before reporting an error. GLHF!")
GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv "
                "operation to complete")


@pytest.mark.parametrize("err, reason", [
    (RuntimeError(GLOO_CLOSED), "Connection closed by peer [127.0.0.1]:56704"),
    (RuntimeError(GLOO_TIMEOUT), "Timed out waiting 30000ms for recv operation to complete"),
    (dist.DistBackendError("NCCL communicator was aborted on rank 3.\nmore"), "NCCL communicator was aborted on rank 3"),
], ids=["gloo-peer-closed", "gloo-timeout", "dist-backend-error"])
def test_a_failed_collective_is_named_in_a_few_words(err, reason):
    assert collective_failure(err) == reason


@pytest.mark.parametrize("err", [RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x8)"),
                                 ValueError("Connection closed by peer"), KeyError("gloo")])
def test_other_errors_are_not_taken_for_a_failed_collective(err):
    assert collective_failure(err) is None


@pytest.mark.parametrize("codes, status", [
    ([EXIT_BAD_INPUT] * 4, EXIT_BAD_INPUT), ([EXIT_WRITE_FAILED], EXIT_WRITE_FAILED),
    ([EXIT_PEER_FAILED, -signal.SIGKILL, EXIT_PEER_FAILED], 1), ([EXIT_BAD_INPUT, EXIT_WRITE_FAILED], 1),
    ([1, 1], 1), ([-signal.SIGSEGV], 1)])
def test_the_launcher_passes_on_a_status_the_failed_workers_agree_on(codes, status):
    assert failure_status(codes) == status


def test_a_killed_worker_is_named_with_its_signal():
    assert describe_failure(2, 0, 123, -signal.SIGKILL) == "error: worker rank 2 (local rank 0, pid 123) was killed by SIGKILL"
    assert describe_failure(1, 1, 9, 1) == "error: worker rank 1 (local rank 1, pid 9) exited with status 1"
