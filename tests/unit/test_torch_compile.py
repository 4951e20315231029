"""`train.compile`: compiled training gives the eager losses; `model` falls back to regions where
the grouped expert GEMMs cannot be traced (fp32), saying why."""
from pathlib import Path

import pytest
import torch

from model.attention import MLA
from model.layers import RMSNorm, SwiGLU
from moe_train.config import load_config
from moe_train.runtime import compile_model
from moe_train.train import Trainer
from parallel.mixed_precision import current_grad

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


# Tiny model cut to 2 layers (dense, MoE) plus MTP, so compiling stays short.
TWO_LAYERS = ("model.num_layers=2",)
# Whole-model compile takes long on a CPU (graph breaks at the data-dependent MoE shapes, recompiles
# per layer type and dtype): one MoE layer, no MTP.
ONE_MOE_LAYER = ("model.num_layers=1", "model.first_k_dense_replace=0", "model.mtp_num_layers=0")


def tiny_trainer(tmp_path: Path, cache_dir: str, compile_mode: str, precision: str,
                 shape: tuple[str, ...] = TWO_LAYERS) -> Trainer:
    """2 micro-batches and a large balance-loss weight, so the balance-loss gradient (scaled by
    1/micro-batches in backward) counts."""
    config = load_config(ROOT / "moe_train/configs/tiny.yaml", [
        *shape, "model.moe_aux_loss_coeff=0.1", "train.global_batch_size=8", "train.micro_batch_size=4",
        f"train.steps={STEPS}", f"train.compile={compile_mode}", f"train.precision={precision}", "train.threads=2",
        f"data.cache_dir={cache_dir}", "data.demo_max_bytes=400000", f"logging.dir={tmp_path / compile_mode}",
        "logging.tensorboard=false", "checkpoint.resume=none"])
    print(f"seed {config.train.seed}")
    return Trainer(config)


def losses(trainer: Trainer) -> list[list[float]]:
    """[loss, lm_loss, mtp_loss, aux_loss] of each step."""
    trainer.model.train()
    steps = [trainer.train_step() for _ in range(STEPS)]
    return [[s["loss"], s["lm_loss"], s["mtp_loss"], s["aux_loss"]] for s in steps]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus_cache"))


def compiled(module: torch.nn.Module) -> bool:
    return module._compiled_call_impl is not None


def gradient_errors(trainer: Trainer, reference: Trainer) -> dict[str, float]:
    """|g - g_ref| / |g_ref| per parameter, for the next global batch (2 micro-batches: the balance
    loss gets the gradient 1/2 in backward, which a compiled backward must not freeze at 1; that
    would change the router's gradient by about 100%)."""
    trainer.compute_gradients()
    reference.compute_gradients()
    expected = dict(reference.model.named_parameters())
    return {name: ((current_grad(p) - current_grad(expected[name])).norm() / current_grad(expected[name]).norm()).item()
            for name, p in trainer.model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("compile_mode,precision,shape,loss_tol,grad_tol", [
    ("regions", "fp32", TWO_LAYERS, 1e-5, 1e-4),
    ("model", "bf16", ONE_MOE_LAYER, 2e-3, 0.1),
], ids=["regions-fp32", "model-bf16"])
def test_compiled_training_gives_the_eager_losses(tmp_path, cache_dir, compile_mode, precision, shape, loss_tol,
                                                  grad_tol):
    trainer = tiny_trainer(tmp_path, cache_dir, compile_mode, precision, shape)
    assert trainer.compiled.startswith(compile_mode)
    eager = tiny_trainer(tmp_path, cache_dir, "none", precision, shape)
    got, expected = losses(trainer), losses(eager)
    print(f"{compile_mode} {precision}: compiled {got}, eager {expected}")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=loss_tol, atol=loss_tol)
    errors = gradient_errors(trainer, eager)
    print(f"largest gradient errors: {sorted(errors.items(), key=lambda e: -e[1])[:3]}")
    assert max(errors.values()) < grad_tol


def test_regions_are_attention_mlp_and_norm_modules(tmp_path, cache_dir):
    model = tiny_trainer(tmp_path, cache_dir, "none", "fp32").model
    assert not any(compiled(m) for m in model.modules())
    keys = list(model.state_dict())
    assert compile_model(model, "regions", "fp32").startswith("regions")
    regions = [m for m in model.modules() if isinstance(m, (MLA, SwiGLU, RMSNorm))]
    assert regions and all(compiled(m) for m in regions)
    assert not any(compiled(m) for m in model.modules() if not isinstance(m, (MLA, SwiGLU, RMSNorm)))
    assert list(model.state_dict()) == keys  # compiled in place: checkpoints keep their names


def test_model_falls_back_to_regions_with_fp32_grouped_gemms_and_logs_why(tmp_path, cache_dir, capsys):
    capsys.readouterr()
    trainer = tiny_trainer(tmp_path, cache_dir, "model", "fp32")
    logged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("torch.compile:")]
    assert logged == [f"torch.compile: {trainer.compiled}"]
    assert "fell back to regions" in logged[0] and "Expected inputs of BF16 type" in logged[0]
    assert not compiled(trainer.model) and all(compiled(m) for m in trainer.model.modules() if isinstance(m, MLA))
