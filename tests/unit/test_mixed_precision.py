"""`train.precision=bf16` as Megatron does it (parallel.mixed_precision): bf16 parameters, so a forward
casts no weight, and fp32 main grads that sum the micro-batches' gradients, through autograd and
through the pipeline's split backward (B, then W)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.router import Router
from model.transformer import DeepSeekV3
from moe_train.config import load_config
from parallel.data_parallel import build_buffers
from parallel.mixed_precision import zero_grad_buffers
from parallel.zero import DistributedOptimizer
from parallel.pipeline.ir import ActionKind
from parallel.pipeline.wgrad import SplitGemmOps, WeightGradStore
from tests.unit.live_memory import LiveStorage

TINY = load_config("moe_train/configs/tiny.yaml").model
SEED = 11


def tiny_model(gemms=None, bf16: bool = True) -> DeepSeekV3:
    print(f"seed {SEED}")
    torch.manual_seed(SEED)
    model = DeepSeekV3(TINY, gemms=gemms).train()
    if bf16:
        build_buffers(model, None, torch.bfloat16, shard=False)
    return model


def micro_batches(count: int, batch: int = 2, seq: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(SEED + 1)
    rows = [torch.randint(0, TINY.vocab_size, (batch, seq + 1), generator=gen) for _ in range(count)]
    return [(r[:, :-1], r[:, 1:]) for r in rows]


class ParameterCasts(TorchDispatchMode):
    """Names of the parameters an op copies into another dtype (`_to_copy`: autocast's weight casts)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.names = {p.data_ptr(): n for n, p in model.named_parameters()}  # parameters share a bucket's storage
        self.cast: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.names:
            self.cast.add(self.names[args[0].data_ptr()])
        return func(*args, **(kwargs or {}))


def test_a_bf16_forward_casts_no_weight_and_keeps_no_weight_copies():
    """The bf16 model's forward casts only the router gate weights (to fp32, [experts, d]: the router
    computes in fp32); bf16 autocast over the same fp32 weights casts every Linear and expert weight
    and keeps each copy for the backward, so it keeps at least their bf16 bytes more (live_memory)."""
    (ids, labels), = micro_batches(1)
    bf16 = tiny_model()
    with ParameterCasts(bf16) as casts, LiveStorage() as memory:
        out = bf16(ids, labels, aux_grad_scale=1.0)
        kept = memory.live()
    routers = {f"{name}.weight" for name, m in bf16.named_modules() if isinstance(m, Router)}
    assert casts.cast == routers
    fp32 = tiny_model(bf16=False)
    with ParameterCasts(fp32) as autocast_casts, LiveStorage() as memory:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_out = fp32(ids, labels, aux_grad_scale=1.0)
        autocast_kept = memory.live()
    copied = {n: p for n, p in fp32.named_parameters() if n in autocast_casts.cast and n not in routers}
    weight_copies = sum(2 * p.numel() for p in copied.values())
    print(f"kept by the forward: bf16 parameters {kept} B, autocast {autocast_kept} B "
          f"({len(copied)} weights cast, {weight_copies} B of bf16 copies)")
    assert len(copied) > 10 and autocast_kept - kept >= weight_copies
    del out, autocast_out


@pytest.mark.parametrize("split", [False, True], ids=["autograd", "split-B-W"])
def test_main_grads_are_fp32_sums_of_the_micro_batches(split):
    """Per parameter the fp32 main grad after three micro-batches is exactly the fp32 sum, in order, of
    each micro-batch's gradient alone; `.grad` stays None (autograd's bf16 gradient is folded in and freed).
    Split: the head, which the MTP uses too, gets two W closures per micro-batch, each added on its own
    (autograd adds the two in bf16 first), so its sum is associated otherwise: fp32 rounding apart."""
    store = WeightGradStore()
    model = tiny_model(SplitGemmOps(store) if split else None)
    batches = micro_batches(3)

    def backward(mbs: list[int]) -> None:
        outs = [(mb, model(*batches[mb], aux_grad_scale=1.0).loss) for mb in mbs]
        for mb, loss in outs:
            with store.scope(0, mb, ActionKind.B) if split else torch.enable_grad():
                loss.backward()
        for mb, _ in outs if split else []:
            store.run_w(0, mb)

    alone = []
    for mb in range(3):
        zero_grad_buffers(model.parameters())
        backward([mb])
        alone.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
    zero_grad_buffers(model.parameters())
    backward([0, 1, 2])
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16 and param.main_grad.dtype == torch.float32 and param.grad is None, name
        expected = torch.zeros_like(param.main_grad)
        for grads in alone:
            expected += grads[name]
        if split and name == "lm_head.weight":
            torch.testing.assert_close(param.main_grad, expected, rtol=1e-6, atol=1e-9)
        else:
            assert torch.equal(param.main_grad, expected), name
        assert param.main_grad.grad_fn is None, name
    assert any(alone[0][n].any() for n in alone[0])


def test_the_optimizer_steps_fp32_main_params_and_rounds_them_into_the_bf16_params():
    """Any AdamW-like optimizer gets plain fp32 tensors whose `.grad` is the main grad: the main params
    equal an fp32 AdamW's step on the same gradients, and the bf16 params are their rounding."""
    model = tiny_model(bf16=False)
    reference = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    make = lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True)  # noqa: E731
    buffers = build_buffers(model, None, torch.bfloat16, shard=False)
    optimizer = DistributedOptimizer(buffers, [{"params": list(model.parameters())}], make)
    expected = make([{"params": list(reference.values())}])
    gen = torch.Generator().manual_seed(SEED)
    for param in model.parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=gen))
    for name, param in model.named_parameters():
        reference[name].grad = param.main_grad.clone()
    optimizer.step()
    expected.step()
    for name, param in model.named_parameters():
        main = param.main_piece.main.view(param.shape)
        assert main.dtype == torch.float32 and torch.equal(main, reference[name].detach()), name
        assert torch.equal(param.detach(), reference[name].detach().bfloat16()), name


def test_a_hugging_face_start_fills_the_main_params_and_export_writes_them(tmp_path):
    """bf16 training from an HF folder: the fp32 main parameters are the folder's values exactly, the bf16
    parameters their rounding; a checkpoint exported to HF holds the fp32 main parameters."""
    from safetensors.torch import load_file

    from moe_train.checkpoint.hf import save_hf_checkpoint
    from moe_train.checkpoint.hf_export import export
    from moe_train.train import Trainer

    source = tiny_model(bf16=False)
    with torch.no_grad():
        for param in source.parameters():
            param.normal_(0, 0.02, generator=torch.Generator().manual_seed(SEED))
    save_hf_checkpoint(source, tmp_path / "hf")
    trainer = Trainer(load_config("moe_train/configs/tiny.yaml", [
        f"logging.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", "data.demo_max_bytes=200000",
        "logging.tensorboard=false", "train.precision=bf16", f"checkpoint.resume={tmp_path / 'hf'}",
        "checkpoint.weights_only=true"]))
    expected = dict(source.named_parameters())
    mains = trainer.optimizer.master_weights()
    assert mains.keys() == expected.keys()
    assert all(torch.equal(main.view(expected[name].shape), expected[name].detach()) for name, main in mains.items())
    assert all(torch.equal(p.detach(), expected[n].detach().bfloat16()) for n, p in trainer.model.named_parameters())
    trainer.train_step()
    export(trainer.save(), tmp_path / "out")
    exported = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()}
    head = trainer.optimizer.master_weights()["lm_head.weight"]
    assert head.dtype == torch.float32 and torch.equal(exported["lm_head.weight"].view(-1), head)
    trainer.logger.close()
