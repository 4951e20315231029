"""Data + expert parallel training equals the single-process run (tiny model, gloo, CPU).

Every rank builds the distributed trainer and, as the independent reference, a single-process
trainer on the same config; each step compares the global losses, every reduced gradient (expert
gradients against the matching slice of the reference) and the updated parameters.
"""
import random
from pathlib import Path
from unittest import mock

import pytest
import torch

import model.fp8
from moe_train.config import load_config
from moe_train.data import build_demo_corpus, load_tokenizer
from moe_train.optim import set_learning_rate
from moe_train.preflight.plan_traffic import communication_buffer_bytes
from moe_train.schedules import learning_rate
from moe_train.train import Trainer, read_metrics
from parallel.data_parallel import is_expert_parameter
from parallel.dispatch.base import COMBINE, DISPATCH
from parallel.flat_range import FlatRange
from parallel.mixed_precision import current_grad
from parallel.sharded_state import model_state
from parallel.topology import build_topology

ROOT = Path(__file__).resolve().parents[2]
DEMO_BYTES = 300_000


def tiny_config(cache_dir: str, run_dir: str, *extra: str):
    return load_config(ROOT / "moe_train/configs/tiny.yaml", [
        f"data.cache_dir={cache_dir}", f"data.demo_max_bytes={DEMO_BYTES}", f"logging.dir={run_dir}",
        "logging.tensorboard=false", "checkpoint.resume=none", "train.global_batch_size=8",
        "train.micro_batch_size=1", "train.steps=3", *extra])


def compare_with_single_process(ep: int, gpus_per_node: int, zero1: bool, cache_dir: str, run_dir: str,
                                *extra: str, shared: tuple[str, ...] = (), precision: str = "fp32") -> dict:
    """Worst differences of 3 steps to the single-process run in `precision` (bf16: main grads and bf16
    parameters); `extra` overrides apply to the distributed run, `shared` to both."""
    import torch.distributed as dist

    topology = build_topology(pp=1, ep=ep, gpus_per_node=gpus_per_node, timeout_s=60)
    try:
        config = tiny_config(cache_dir, run_dir, f"parallel.ep={ep}", f"parallel.zero1={str(zero1).lower()}",
                             f"train.precision={precision}", *extra, *shared)
        reference = Trainer(tiny_config(cache_dir, f"{run_dir}_ref{dist.get_rank()}",  # one log dir per rank
                                        f"train.precision={precision}", *shared))
        trainer = Trainer(config, topology)
        first_expert = {n: m.experts.first_expert for n, m in trainer.model.named_modules() if hasattr(m, "experts")}
        worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        for step in range(3):
            for t in (trainer, reference):
                set_learning_rate(t.optimizer, learning_rate(step, config.optim, config.train.steps))
            losses, ref_losses = read_metrics([trainer.compute_gradients(), reference.compute_gradients()])
            worst["loss"] = max(worst["loss"], max(abs(losses[k] - ref_losses[k]) / abs(ref_losses[k])
                                                   for k in ("loss", "lm_loss", "mtp_loss")))
            ref_params = dict(reference.model.named_parameters())
            for piece in trainer.optimizer.pieces:  # the range of each gradient this rank reduced (ZeRO-1: owns)
                name = piece.name
                expected = current_grad(ref_params[name])
                if is_expert_parameter(name):
                    start = first_expert[name.split(".experts.")[0]]
                    expected = expected[start:start + piece.param.shape[0]]
                scale = expected.abs().max().item() + 1e-12
                error = (piece.grad - expected.reshape(-1)[piece.start:piece.stop]).abs().max().item() / scale
                worst["grad"] = max(worst["grad"], error)
                if step == 0:
                    key = "first_grad_expert" if is_expert_parameter(name) else "first_grad_dense"
                    worst[key] = max(worst.get(key, 0.0), error)
            update, ref_update = read_metrics([trainer.apply_update(), reference.apply_update()])
            worst["grad_norm"] = abs(update["grad_norm"] - ref_update["grad_norm"]) / ref_update["grad_norm"]
            for name, param in trainer.model.named_parameters():
                expected = ref_params[name].data
                if is_expert_parameter(name):
                    start = first_expert[name.split(".experts.")[0]]
                    expected = expected[start:start + param.shape[0]]
                worst["param"] = max(worst["param"], (param.data - expected).abs().max().item())
        biases = [r.e_score_correction_bias for r in trainer.model.routers()]
        ref_biases = [r.e_score_correction_bias for r in reference.model.routers()]
        worst["bias"] = max((a - b).abs().max().item() for a, b in zip(biases, ref_biases))
        worst["moved_bias"] = max(b.abs().max().item() for b in ref_biases)
        dispatcher = trainer.model.moe_blocks()[0].dispatcher
        worst["dispatcher"] = type(dispatcher).__name__
        worst["traffic"] = dict(dispatcher.traffic.bytes)
        sizes = getattr(dispatcher, "_buffer_sizes", None)  # what the native dispatcher's buffer allocated
        worst["buffer_bytes"] = None if sizes is None else sizes.nvl_bytes + sizes.rdma_bytes
        worst["moment_dtypes"] = {str(v.dtype) for optimizer in (trainer.optimizer, reference.optimizer)
                                  for state in optimizer.state.values() for k, v in state.items() if k != "step"}
        return worst
    finally:
        topology.destroy_groups()
        dist.barrier()


@pytest.fixture(scope="module")
def corpus_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("corpus")
    build_demo_corpus(cache, load_tokenizer("byte"), max_bytes=DEMO_BYTES)
    return str(cache)


NATIVE = ("parallel.dispatcher=native", "parallel.comm_sms=4")  # the CPU emulation of the kernels, 2 channels


@pytest.mark.parametrize("world, ep, gpus_per_node, zero1, dispatcher, extra", [
    (4, 4, 2, True, "HierarchicalDispatcher", ()),
    (4, 2, 2, True, "AllToAllDispatcher", ()),
    (4, 2, 2, False, "AllToAllDispatcher", ()),
    (2, 2, 1, True, "HierarchicalDispatcher", ()),
    (4, 4, 2, True, "NativeDispatcher", NATIVE),   # the two-hop internode kernels, 2 nodes x 2
    (4, 4, 4, False, "NativeDispatcher", NATIVE),  # the intranode kernels, EP 4 in one node
    (4, 2, 2, True, "NativeDispatcher", NATIVE),   # the intranode kernels, EP 2 in each node, DP 2
], ids=["hierarchical-ep4-2x2", "alltoall-ep2", "alltoall-ep2-no-zero1", "hierarchical-ep2-2x1", "native-ep4-2x2",
        "native-ep4-1x4", "native-ep2-dp2"])
def test_dp_ep_training_equals_single_process(pools, corpus_cache, tmp_path, world, ep, gpus_per_node, zero1,
                                              dispatcher, extra, request):
    if extra:
        request.getfixturevalue("kernels_cpu")
    results = pools.get(world).run(compare_with_single_process, ep, gpus_per_node, zero1, corpus_cache,
                                   str(tmp_path / "run"), *extra, deadline_s=300)
    for rank, worst in enumerate(results):
        assert worst["dispatcher"] == dispatcher
        assert worst["loss"] < 1e-5, (rank, worst)
        assert worst["grad"] < 1e-5, (rank, worst)
        assert worst["grad_norm"] < 1e-5, (rank, worst)
        assert worst["param"] < 4e-5, (rank, worst)
        assert worst["moved_bias"] > 0 and worst["bias"] < 1e-7, (rank, worst)


def test_zero1_with_bf16_moments_equals_single_process(pools, corpus_cache, tmp_path):
    """ZeRO-1 over dp 2 (dense tensors over dp, experts over expert-dp), each owner stepping bf16 moments.

    The first step's gradients agree to their summation order (1e-6). A gradient that differs in its last
    bits can round a bf16 moment the other way, which moves that element's update by up to 2^-8 of it:
    the parameters stay within the fp32 layouts' 4e-5, and the later gradients, computed from them, as
    far (measured: 1.2e-5 after two steps)."""
    results = pools.get(2).run(compare_with_single_process, 1, 1, True, corpus_cache, str(tmp_path / "run"),
                               shared=("optim.moment_dtype=bf16",), deadline_s=300)
    for rank, worst in enumerate(results):
        assert worst["moment_dtypes"] == {"torch.bfloat16"}, (rank, worst)
        print(f"rank {rank}: {worst}")
        assert worst["first_grad_dense"] < 1e-6 and worst["first_grad_expert"] < 1e-6, (rank, worst)
        assert worst["loss"] < 1e-5 and worst["grad"] < 4e-5 and worst["grad_norm"] < 1e-5, (rank, worst)
        assert worst["param"] < 4e-5, (rank, worst)


FP8_DISPATCH = ("parallel.fp8_dispatch=true",)
WIDE = ("model.hidden_size=128",)  # the FP8 dispatch's scales cover 128 channels


@pytest.mark.parametrize("precision, extra, shared", [("bf16", (), ()), ("fp8", (), ()), ("fp8", FP8_DISPATCH, WIDE)],
                         ids=["bf16", "fp8", "fp8-dispatch"])
def test_low_precision_zero1_dp2_ep2_equals_single_process(pools, corpus_cache, tmp_path, precision, extra, shared):
    """bf16 parameters (and fp8: their weight GEMMs in FP8) on ZeRO-1 dp 2 x ep 2 against the one-process
    run in the same precision, three steps.

    Main grads are fp32 and reduced in fp32, so the first step's dense main grads agree as in fp32.
    An expert's weight gradient is one bf16-rounded grouped GEMM per micro-batch slot, and under EP
    that GEMM holds the rows of both dp ranks' micro-batches: one rounding of their sum instead of
    two, so the first expert grads agree to a bf16 ulp (2^-8 of the tensor's largest). From then on
    the bf16 parameters differ where the fp32 main parameters round apart, and AdamW's first steps
    move an element by about lr whatever its gradient's size, so an element with a near-zero gradient
    may step the other way: parameters within 2 lr per step plus a bf16 ulp of a norm weight (2^-7).
    Parameters that far apart can send a token to another expert, which turns that expert's sign-based
    bias update around (a difference of 2 x the update rate) and moves the last step's gradient norm
    by 2.1e-4 (measured, with the former all-reduce exchange too); the losses stay within 1.1e-5.

    fp8: the FP8 weight-gradient GEMM quantizes its operands in 128x1 tiles along the tokens, and under
    EP an expert's tiles hold both dp ranks' rows together, so its tiles and their scales differ from
    one process's: the first expert grads agree to E4M3's relative step, 2^-4 of the tensor's largest
    (measured 0.011), and the gradient norm to 4e-3 (measured 1.4e-3); losses within 4e-5 (measured).
    The pipeline's layouts meet the bf16 bounds in fp8 too (tests/distributed/test_pipeline_dp.py).
    With `parallel.fp8_dispatch` the rows travel as E4M3 with power-of-two scales, which the experts'
    forward GEMM's quantization reproduces exactly (model.fp8's dispatch boundary). Their weight
    gradients, though, take both operands through the FP8 exchange (the dispatched rows, the gradient
    the combine's backward sends) before quantizing them again in 128x1 tiles, where one process
    quantizes the exact values once: two E4M3 roundings, 2^-3 (measured 0.075), and the losses, which
    follow, within 2e-4 (measured 8.4e-5).
    """
    expert_bound, norm_bound, loss_bound = {"bf16": (2 ** -8, 1e-3, 1e-4), "fp8": (2 ** -4, 4e-3, 1e-4),
                                            "fp8-dispatch": (2 ** -3, 4e-3, 2e-4)}[
        precision + ("-dispatch" if extra else "")]
    results = pools.get(2).run(compare_with_single_process, 2, 1, True, corpus_cache, str(tmp_path / "run"), *extra,
                               shared=shared, precision=precision, deadline_s=300)
    optim = tiny_config(corpus_cache, str(tmp_path)).optim
    param_bound = 2 * sum(learning_rate(step, optim, 3) for step in range(3)) + 2 ** -7
    rate = tiny_config(corpus_cache, str(tmp_path)).model.moe_router_bias_update_rate
    for rank, worst in enumerate(results):
        print(f"{precision} rank {rank}: {worst}")
        assert worst["first_grad_dense"] < 1e-6, (rank, worst)
        assert worst["first_grad_expert"] < expert_bound, (rank, worst)
        assert worst["loss"] < loss_bound and worst["grad_norm"] < norm_bound, (rank, worst)
        assert worst["param"] < param_bound, (rank, worst)
        assert worst["moved_bias"] > 0 and worst["bias"] <= 2 * rate + 1e-7, (rank, worst)


@pytest.mark.parametrize("ep, gpus_per_node", [(4, 2), (4, 4)], ids=["2x2", "1x4"])
def test_native_counts_the_bytes_hierarchical_counts(pools, kernels_cpu, corpus_cache, tmp_path, ep, gpus_per_node):
    """The same three steps through the kernels and through the pure-torch two hops: the same bytes per
    direction and link on every rank."""
    runs = {name: pools.get(4).run(compare_with_single_process, ep, gpus_per_node, True, corpus_cache,
                                   str(tmp_path / name), *extra, deadline_s=300)
            for name, extra in [("native", NATIVE), ("hierarchical", ("parallel.dispatcher=hierarchical",))]}
    planned = communication_buffer_bytes(tiny_config(corpus_cache, str(tmp_path / "plan"), f"parallel.ep={ep}",
                                                     *NATIVE), gpus_per_node)
    for rank, (native, hierarchical) in enumerate(zip(runs["native"], runs["hierarchical"])):
        assert native["traffic"] == hierarchical["traffic"] and sum(native["traffic"].values()) > 0, rank
        assert native["loss"] < 1e-5 and hierarchical["loss"] < 1e-5, rank
        assert native["buffer_bytes"] == planned > 0, rank  # the planner's buffers column


def owned_ranges(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, torch.Tensor]]:
    """A rank's checkpoint entries as (first element, the values it holds, flat): a `FlatRange`'s range,
    or a whole tensor."""
    return {key: (t.start, t.values.clone()) if isinstance(t, FlatRange) else (0, t.detach().flatten().clone())
            for key, t in state.items()}


def assert_each_element_once(ranks: list[dict[str, tuple[int, torch.Tensor]]], shapes: dict[str, torch.Size]) -> None:
    """The ranks' ranges of each key in `shapes` cover its elements exactly once, and no other key is held."""
    for key, shape in shapes.items():
        covered = torch.zeros(shape.numel(), dtype=torch.int64)
        for held in ranks:
            if key in held:
                start, values = held[key]
                covered[start:start + values.numel()] += 1
        assert bool((covered == 1).all()), key
    assert {key for held in ranks for key in held} == set(shapes)


def train_and_save(ep: int, gpus_per_node: int, steps: int, cache_dir: str, run_dir: str,
                   decay: float) -> tuple[list[float], dict]:
    """Train `steps` steps with this layout from the checkpoint in run_dir (if any), then save; returns the
    losses and this rank's EMA tensors by checkpoint key (ZeRO-1: of the parameters it owns)."""
    import torch.distributed as dist

    topology = build_topology(pp=1, ep=ep, gpus_per_node=gpus_per_node, timeout_s=60)
    try:
        config = tiny_config(cache_dir, run_dir, f"parallel.ep={ep}", "checkpoint.resume=auto", "train.steps=4",
                             f"optim.ema_decay={decay}")
        trainer = Trainer(config, topology)
        losses = [m["loss"] for m in read_metrics([trainer.train_step() for _ in range(steps)])]
        trainer.save()
        trainer.ema.close()
        return losses, owned_ranges(trainer.ema_state())
    finally:
        topology.destroy_groups()
        dist.barrier()


@pytest.mark.parametrize("first, second", [((4, 4, 2), (2, 2, 1)), ((2, 2, 1), (4, 2, 2))],
                         ids=["dp4-ep4-to-dp2-ep2", "dp2-ep2-to-dp4-ep2"])
def test_checkpoint_resumes_with_another_layout(pools, corpus_cache, tmp_path, first, second):
    """The losses, and the EMA of the parameters (optim.ema_decay) on each layout: every parameter's EMA on
    exactly one rank (its ZeRO-1 owner), equal to the single-process EMA after the same steps."""
    decay = random.SystemRandom().uniform(0.5, 0.95)
    print(f"ema_decay={decay}")
    run_dir = str(tmp_path / "run")
    reference = Trainer(tiny_config(corpus_cache, str(tmp_path / "ref"), "train.steps=4", f"optim.ema_decay={decay}"))
    expected, expected_ema = [], []
    for _ in range(2):
        expected += [m["loss"] for m in read_metrics([reference.train_step() for _ in range(2)])]
        reference.ema.wait()
        # one process owns every whole tensor
        expected_ema.append({k: v.values.clone().view(v.shape) for k, v in reference.ema_state().items()})
    losses = []
    for (world, ep, per_node), want in zip((first, second), expected_ema):
        results = pools.get(world).run(train_and_save, ep, per_node, 2, corpus_cache, run_dir, decay, deadline_s=300)
        losses += results[0][0]
        assert_each_element_once([ema for _, ema in results], {k: v.shape for k, v in want.items()})
        worst = max((values - want[k].flatten()[start:start + values.numel()]).abs().max().item()
                    for _, ema in results for k, (start, values) in ema.items())
        lag = max((want[k] - v).abs().max().item() for k, v in model_state(reference.model).items() if k in want)
        print(f"{world} processes, ep {ep}: max |EMA - single-process EMA| = {worst:.3g}, EMA - weights {lag:.3g}")
        assert worst < 4e-5 < lag / 10
    assert losses == pytest.approx(expected, rel=1e-5)


def bf16_train(cache_dir: str, run_dir: str, steps: int, save_after: int | None) -> tuple[int, list[float], dict]:
    """bf16 on ZeRO-1 dp 2 x ep 2 from the latest checkpoint in run_dir (if any): `steps` steps, saving after
    `save_after` of them; returns the start step, the losses and the model keys this rank saved (fp32)."""
    import torch.distributed as dist

    topology = build_topology(pp=1, ep=2, gpus_per_node=1, timeout_s=60)
    try:
        config = tiny_config(cache_dir, run_dir, "parallel.ep=2", "checkpoint.resume=auto", "train.steps=4",
                             "train.precision=bf16")
        trainer = Trainer(config, topology)
        start, losses, saved = trainer.step, [], {}
        for step in range(steps):
            losses += [m["loss"] for m in read_metrics([trainer.train_step()])]
            if step + 1 == save_after:
                trainer.save()
                saved = owned_ranges(model_state(trainer.model))
        return start, losses, saved
    finally:
        topology.destroy_groups()
        dist.barrier()


def test_bf16_zero1_checkpoint_resumes_bit_exactly_and_on_one_process(pools, corpus_cache, tmp_path):
    """Each ZeRO-1 rank saves the fp32 main parameters of the ranges it owns: resuming on the same layout
    continues bit for bit, and one process loads the union, every element, equal to the owners' main params."""
    run_dir = str(tmp_path / "run")
    first = pools.get(2).run(bf16_train, corpus_cache, run_dir, 4, 2)
    resumed = pools.get(2).run(bf16_train, corpus_cache, run_dir, 2, None)
    for rank in range(2):
        assert resumed[rank][0] == 2 and resumed[rank][1] == first[rank][1][2:], rank
    single = Trainer(tiny_config(corpus_cache, str(tmp_path / "one"), "train.precision=bf16", "train.steps=4",
                                 f"checkpoint.resume={tmp_path / 'run' / 'checkpoints' / 'iter_0000002'}"))
    everything = owned_ranges(model_state(single.model))
    # the replicated router biases are written by both ranks, every parameter element by exactly one
    parameters = {k: v.shape for k, v in model_state(single.model).items() if "e_score_correction_bias" not in k}
    assert single.step == 2
    assert_each_element_once([{k: v for k, v in saved.items() if k in parameters} for _, _, saved in first], parameters)
    for _, _, saved in first:
        assert all(torch.equal(everything[key][1][start:start + value.numel()], value)
                   for key, (start, value) in saved.items())
    assert all(v.dtype == torch.float32 for _, v in everything.values() if v.is_floating_point())
    losses = [m["loss"] for m in read_metrics([single.train_step() for _ in range(2)])]
    assert losses == pytest.approx(first[0][1][2:], rel=1e-4)  # another layout: bf16 bounds as above


def exchange_bytes(ep: int, precision: str, zero1: bool, cache_dir: str, run_dir: str) -> dict:
    """A one-step training run on 4 processes; the bytes this rank's data-parallel exchange sent, the sizes
    that decide them, and what the run printed."""
    import contextlib
    import io

    import torch.distributed as dist

    topology = build_topology(pp=1, ep=ep, gpus_per_node=2, timeout_s=60)
    try:
        config = tiny_config(cache_dir, f"{run_dir}{dist.get_rank()}", f"parallel.ep={ep}", "train.steps=1",
                             f"train.precision={precision}", f"parallel.zero1={str(zero1).lower()}")
        trainer = Trainer(config, topology)
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert trainer.train() == 0
        named = list(trainer.model.named_parameters())
        return {"sent": dict(trainer.grads.buffers.sent_bytes), "dp": topology.dp, "expert_dp": topology.dp // ep,
                "printed": printed.getvalue(),
                "dense": sum(p.numel() for n, p in named if not is_expert_parameter(n)),
                "expert": sum(p.numel() for n, p in named if is_expert_parameter(n)),
                "buckets": len(trainer.grads.buffers.buckets)}
    finally:
        topology.destroy_groups()
        dist.barrier()


def _ring(members: int, nbytes: int, passes: int = 1) -> int:
    """What one rank sends in a ring collective over `nbytes`: (members - 1)/members of it per pass."""
    return passes * (members - 1) * nbytes // members


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_zero1_exchange_sends_at_most_two_thirds_of_all_reduce_plus_broadcast(pools, corpus_cache, tmp_path, precision):
    """ZeRO-1 on 4 processes (dp 4, ep 2: dense over dp 4, experts over expert-dp 2), one step: each rank
    sends a reduce-scatter of the fp32 gradients and an all-gather of the parameters, counted by the
    buffers, equal to the ring formula over the padded buckets, against an all-reduce of the gradients plus
    the owners' broadcast of the parameters (ZeRO-1 before): 0.6 of it with bf16 parameters, 2/3 plus
    the padding in fp32. Without ZeRO-1, an all-reduce alone. Rank 0's start-up line prints its bytes."""
    width = 2 if precision == "bf16" else 4
    runs = {zero1: pools.get(4).run(exchange_bytes, 2, precision, zero1, corpus_cache, str(tmp_path / str(zero1)),
                                    deadline_s=300) for zero1 in (True, False)}
    for rank, (sharded, plain) in enumerate(zip(runs[True], runs[False])):
        groups = [(sharded["dp"], sharded["dense"]), (sharded["expert_dp"], sharded["expert"])]
        assert sharded["buckets"] == 2  # one bucket per replica group at the default bucket size
        padded = [(members, -(-n // members) * members) for members, n in groups]
        assert sharded["sent"] == {"reduce_scatter": sum(_ring(m, 4 * n) for m, n in padded),
                                   "all_gather": sum(_ring(m, width * n) for m, n in padded)}, rank
        assert plain["sent"] == {"all_reduce": sum(_ring(m, 4 * n, passes=2) for m, n in groups)}, rank
        before = sum(_ring(m, 4 * n, passes=2) + _ring(m, width * n) for m, n in groups)
        ratio = sum(sharded["sent"].values()) / before
        print(f"rank {rank} ({precision}): ZeRO-1 sends {sum(sharded['sent'].values())} bytes per step, all-reduce + "
              f"broadcast {before}: {ratio:.4f}")
        assert ratio <= (0.6 if precision == "bf16" else 2 / 3) + 1e-3, rank
    mib = {kind: f"{size / 2 ** 20:.2f} MiB" for kind, size in runs[True][0]["sent"].items()}
    assert (f"data-parallel exchange: 2 buckets; rank 0 sends reduce-scatter {mib['reduce_scatter']}, all-gather "
            f"{mib['all_gather']} per step") in runs[True][0]["printed"]  # the start-up line, on rank 0


def dispatch_bytes(fp8_dispatch: bool, cache_dir: str, run_dir: str) -> dict:
    """One fp8 training step at DeepSeek-V3's hidden size on EP 2; the dispatcher's byte counters."""
    import torch.distributed as dist

    topology = build_topology(pp=1, ep=2, gpus_per_node=2, timeout_s=60)
    try:
        config = tiny_config(cache_dir, f"{run_dir}{dist.get_rank()}", "parallel.ep=2", "train.precision=fp8",
                             f"parallel.fp8_dispatch={str(fp8_dispatch).lower()}", "model.hidden_size=7168",
                             "model.num_layers=2", "model.mtp_num_layers=0", "train.global_batch_size=2",
                             "train.seq_length=32")
        trainer = Trainer(config, topology)
        trainer.train_step()
        traffic = trainer.model.moe_blocks()[0].dispatcher.traffic
        return {"bytes": dict(traffic.bytes), "rows": dict(traffic.rows), "topk": config.model.moe_router_topk}
    finally:
        topology.destroy_groups()
        dist.barrier()


def test_fp8_dispatch_sends_at_most_0_53_of_the_bf16_dispatch_bytes(pools, corpus_cache, tmp_path):
    """A real training step at hidden 7,168 (EP 2, one MoE layer): the dispatch direction (the forward's
    dispatch and the gradient the combine's backward sends) moves 7,168 + 56 x 4 bytes per row with the
    FP8 dispatch against 14,336 in bf16, plus the forward's top-k ids and weights: at most 0.53 of it;
    the combine direction is bf16 in both."""
    runs = {fp8: pools.get(2).run(dispatch_bytes, fp8, corpus_cache, str(tmp_path / str(fp8)), deadline_s=300)
            for fp8 in (True, False)}
    for rank, (fp8, bf16) in enumerate(zip(runs[True], runs[False])):
        dispatch = {name: sum(size for (direction, _), size in run["bytes"].items() if direction == DISPATCH)
                    for name, run in (("fp8", fp8), ("bf16", bf16))}
        combine = {name: sum(size for (direction, _), size in run["bytes"].items() if direction == COMBINE)
                   for name, run in (("fp8", fp8), ("bf16", bf16))}
        rows = sum(n for (direction, _), n in fp8["rows"].items() if direction == DISPATCH)
        assert fp8["rows"] == bf16["rows"] and rows > 0, rank  # the same routes
        ratio = dispatch["fp8"] / dispatch["bf16"]
        print(f"rank {rank}: dispatch {dispatch['fp8']} bytes with FP8 against {dispatch['bf16']} ({ratio:.4f}); "
              f"combine {combine['fp8']} and {combine['bf16']}")
        assert ratio <= 0.53, rank
        assert combine["fp8"] == combine["bf16"] > 0, rank
        metadata = dispatch["bf16"] - rows * 14336  # the forward dispatch's top-k ids and weights
        assert dispatch["fp8"] == rows * (7168 + 56 * 4) + metadata, rank


def test_native_fp8_dispatch_trains_as_the_pure_torch_fp8_dispatch(pools, kernels_cpu, corpus_cache, tmp_path):
    """parallel.fp8_dispatch through the kernels (CPU emulation, two-hop internode on 2 x 2) and through
    the pure-torch two hops, three fp8 steps each: the same bytes per direction and link on every rank,
    and the same losses and parameters: the kernels move the bytes the pure-torch backend moves. Against
    one process the losses stay within 4e-4 on this EP 4 layout (measured 2.0e-4; the weight gradients'
    two E4M3 roundings, above)."""
    fp8 = (*FP8_DISPATCH, *WIDE)
    runs = {name: pools.get(4).run(compare_with_single_process, 4, 2, True, corpus_cache, str(tmp_path / name),
                                   *extra, shared=WIDE, precision="fp8", deadline_s=300)
            for name, extra in [("native", (*NATIVE, *fp8)), ("hierarchical", ("parallel.dispatcher=hierarchical", *fp8))]}
    for rank, (native, hierarchical) in enumerate(zip(runs["native"], runs["hierarchical"])):
        print(f"rank {rank}: native {native['loss']:.3g}, hierarchical {hierarchical['loss']:.3g} from one process")
        assert native["dispatcher"] == "NativeDispatcher" and hierarchical["dispatcher"] == "HierarchicalDispatcher"
        assert native["traffic"] == hierarchical["traffic"] and sum(native["traffic"].values()) > 0, rank
        assert native["loss"] == hierarchical["loss"] < 4e-4, rank  # EP 4: measured 2.0e-4
        assert native["param"] == hierarchical["param"], rank


def gate_up_step(ep: int, gpus_per_node: int, cache_dir: str, run_dir: str, *extra: str) -> dict[bool, dict]:
    """One fp8 step with `parallel.fp8_dispatch`, twice from the same start: the routed experts' gate/up
    GEMMs taking the dispatched FP8 rows (True), and, with the GEMM dropping them, quantizing the
    dequantized rows again as before (False). Per run: the losses, the reduced gradients, what the
    gate/up GEMMs got (calls, calls given FP8 rows, whether those dequantize to the GEMM's bf16 input
    bit for bit, how often `quantize_1x128` quantized that input), and the combine handles, which the
    backward keeps, still holding FP8 rows after the step."""
    import torch.distributed as dist

    topology = build_topology(pp=1, ep=ep, gpus_per_node=gpus_per_node, timeout_s=60)
    grouped, quantize = model.fp8.Fp8GemmOps.grouped, model.fp8.quantize_1x128
    try:
        runs = {}
        for taken in (True, False):
            config = tiny_config(cache_dir, f"{run_dir}_{taken}", f"parallel.ep={ep}", "train.precision=fp8",
                                 "train.global_batch_size=4", *FP8_DISPATCH, *WIDE, *extra)
            trainer = Trainer(config, topology)
            inputs: list[tuple[torch.Tensor, model.fp8.Fp8Tensor | None]] = []
            for block in trainer.model.moe_blocks():
                block.experts.gate_up_proj.register_forward_pre_hook(lambda _, args: inputs.append((args[0], args[2])))
            quantized, handles = [], []
            dispatcher = trainer.model.moe_blocks()[0].dispatcher  # every MoE block's
            combine = dispatcher.combine

            def recording_combine(y: torch.Tensor, handle: object) -> torch.Tensor:
                handles.append(handle)
                return combine(y, handle)

            def counting_quantize(x: torch.Tensor, *args) -> model.fp8.Fp8Tensor:
                quantized.append(any(x.data_ptr() == rows.data_ptr() and x.shape == rows.shape for rows, _ in inputs))
                return quantize(x, *args)

            def dropping_rows(ops: model.fp8.Fp8GemmOps, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                              x_fp8: model.fp8.Fp8Tensor | None = None) -> torch.Tensor:
                return grouped(ops, x, weight, offsets)

            with mock.patch.object(model.fp8, "quantize_1x128", counting_quantize), \
                    mock.patch.object(model.fp8.Fp8GemmOps, "grouped", grouped if taken else dropping_rows), \
                    mock.patch.object(dispatcher, "combine", recording_combine):
                losses = read_metrics([trainer.compute_gradients()])[0]
            runs[taken] = {
                "losses": losses, "grads": {piece.name: piece.grad.clone() for piece in trainer.optimizer.pieces},
                "gate_up": len(inputs), "with_rows": sum(rows is not None for _, rows in inputs),
                "rows_match": all(torch.equal(model.fp8.dequantize(rows), x.float()) for x, rows in inputs),
                "quantized_inputs": sum(quantized), "combines": len(handles),
                "rows_left": sum(handle.fp8_rows is not None for handle in handles),
                "dispatcher": type(dispatcher).__name__}
        return runs
    finally:
        topology.destroy_groups()
        dist.barrier()


@pytest.mark.parametrize("dispatcher, gpus_per_node, extra", [
    ("AllToAllDispatcher", 2, ("parallel.dispatcher=alltoall",)),
    ("HierarchicalDispatcher", 1, ("parallel.dispatcher=hierarchical",)),  # two nodes of one rank
    ("NativeDispatcher", 2, NATIVE),  # the intranode kernels' CPU emulation
], ids=["alltoall", "hierarchical", "native"])
def test_gate_up_gemm_takes_the_dispatched_fp8_rows(pools, corpus_cache, tmp_path, dispatcher, gpus_per_node, extra,
                                                    request):
    """With `parallel.fp8_dispatch` on dp 2 x ep 2, the routed experts' gate/up GEMM takes the rows as the
    dispatch moved them (E4M3, power-of-two 1x128 scales, gathered per slot as the bf16 rows are) and
    never quantizes its input; losses and gradients are those of quantizing the dequantized rows again
    (model.fp8.Fp8GemmOps), bit for bit. No handle the combine keeps for the backward holds the rows."""
    if dispatcher == "NativeDispatcher":
        request.getfixturevalue("kernels_cpu")
    results = pools.get(2).run(gate_up_step, 2, gpus_per_node, corpus_cache, str(tmp_path / "run"), *extra,
                               deadline_s=300)
    for rank, runs in enumerate(results):
        taken, again = runs[True], runs[False]
        print(f"rank {rank}: loss {taken['losses']['loss']}, {taken['gate_up']} gate/up GEMMs, quantized inputs "
              f"{taken['quantized_inputs']} taking the rows, {again['quantized_inputs']} without")
        assert taken["dispatcher"] == again["dispatcher"] == dispatcher, rank
        assert taken["gate_up"] == taken["with_rows"] == again["gate_up"] > 0 and taken["rows_match"], rank
        assert taken["quantized_inputs"] == 0 and again["quantized_inputs"] == again["gate_up"], rank
        assert taken["combines"] == taken["gate_up"] and taken["rows_left"] == 0, rank
        assert taken["losses"] == again["losses"], rank
        assert taken["grads"].keys() == again["grads"].keys(), rank
        assert all(torch.equal(grad, again["grads"][name]) for name, grad in taken["grads"].items()), rank
