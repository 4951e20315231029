"""Training from a Hugging Face folder and exporting a training checkpoint, on one process; transformers
is the reference (its own weights, logits, greedy generation and tokenizer loading). The 4-process
variant (ep 2, pp 2) is tests/distributed/test_hf_distributed.py."""
import json
from pathlib import Path

import pytest
import torch

from moe_train.checkpoint.hf import main as hf_cli
from model.transformer import DeepSeekV3
from moe_train.checkpoint.dcp import iteration_dir, load_checkpoint, save_checkpoint
from moe_train.config import load_config
from moe_train.data.tokenizers import ByteTokenizer, load_tokenizer
from moe_train.checkpoint.hf_tokenizer import tokenizer_files
from moe_train.train import Trainer, main as train_main, read_metrics

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "moe_train/configs/tiny.yaml"
TEXT = "héllo wörld\n\tdef f(x): return x  # <|endoftext|> 日本"


def base_overrides(tmp_path: Path, name: str) -> list[str]:
    return [f"logging.dir={tmp_path / name}", f"data.cache_dir={tmp_path / 'cache'}", "data.demo_max_bytes=100000",
            "logging.tensorboard=false", "train.seq_length=32", "train.global_batch_size=4", "train.steps=2"]


def transformers_model(path: Path, seed: int):
    """A tiny DeepSeek-V3 made and saved by transformers; norm eps and routed scaling differ from tiny.yaml."""
    print(f"seed {seed}")
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=4,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=1.5, rms_norm_eps=1e-5,
        initializer_range=0.1)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    model.save_pretrained(path)
    return model


def native_checkpoint(hf_model, config, root: Path) -> None:
    """The transformers model's in-memory weights (experts packed as ours) renamed to ours, saved with DCP."""
    state = {}
    for name, tensor in hf_model.state_dict().items():
        ours = name.removeprefix("model.")
        state[ours + ".weight" if ours.endswith(("experts.gate_up_proj", "experts.down_proj")) else ours] = tensor
    model = DeepSeekV3(config.model)
    model.load_state_dict(state)
    save_checkpoint(root, 0, model, None, {}, keep=1)


def first_losses(config) -> list[dict[str, float]]:
    trainer = Trainer(config)
    return read_metrics([trainer.train_step() for _ in range(2)])


def test_training_starts_from_transformers_weights_with_the_native_losses(tmp_path, capsys):
    hf_model = transformers_model(tmp_path / "hf", seed=21)
    start = [f"checkpoint.resume={tmp_path / 'hf'}", "checkpoint.weights_only=true"]
    argv = ["--config", str(TINY)] + [a for o in base_overrides(tmp_path, "refused") + start for a in ("--set", o)]
    assert train_main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    error = errors[0]
    for key in ("model.norm_epsilon", "model.moe_router_topk_scaling_factor", "model.mtp_num_layers",
                "model.init_method_std"):
        assert key in error, error
    adopt = error.split("to adopt the HF config: ")[1].split()[1::2]
    from_hf = first_losses(load_config(TINY, base_overrides(tmp_path, "hf_run") + adopt + start))
    native = load_config(TINY, base_overrides(tmp_path, "native_run") + adopt +
                         [f"checkpoint.resume={tmp_path / 'native'}", "checkpoint.weights_only=true"])
    native_checkpoint(hf_model, native, tmp_path / "native")
    reference = first_losses(native)
    print(f"first loss from HF {from_hf[0]['loss']}, from the native checkpoint {reference[0]['loss']}")
    for got, want in zip(from_hf, reference):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]


def greedy(model: DeepSeekV3, ids: torch.Tensor, new_tokens: int, eos: int) -> list[int]:
    """Our greedy decoding without a cache (the reference for transformers' generate, which has one)."""
    ids = ids.clone()
    with torch.no_grad():
        for _ in range(new_tokens):
            token = model(ids).logits[:, -1].argmax(-1)
            ids = torch.cat([ids, token[:, None]], dim=1)
            if token.item() == eos:
                break
    return ids[0].tolist()


def check_export(checkpoint: Path, hf_dir: Path, seed: int) -> None:
    """`hf_dir` (exported from `checkpoint`) loads in transformers with our logits, greedy output and tokenizer."""
    config = load_config(checkpoint / "config.yaml")
    ours = DeepSeekV3(config.model).eval()
    load_checkpoint(checkpoint, ours, weights_only=True)
    back, info = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir, attn_implementation="eager",
                                                                   output_loading_info=True)
    back.eval()
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert {k.split(".")[2] for k in info["unexpected_keys"]} <= {str(config.model.num_layers)}  # MTP, see README
    print(f"seed {seed}")
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        difference = (back(ids).logits - ours(ids).logits).abs().max().item()
    print(f"max |logit difference| {difference:.2e}")
    assert difference <= 1e-4
    eos = json.loads((hf_dir / "config.json").read_text())["eos_token_id"]
    assert eos == ByteTokenizer.eod_id == json.loads((hf_dir / "generation_config.json").read_text())["eos_token_id"]
    generated = back.generate(ids[:1, :8], max_new_tokens=12, do_sample=False, pad_token_id=eos)
    assert generated[0].tolist() == greedy(ours, ids[:1, :8], 12, eos)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.encode(TEXT) == ByteTokenizer().encode(TEXT) and tokenizer.eos_token_id == eos


def test_export_from_a_training_checkpoint_loads_in_transformers(tmp_path):
    config = load_config(TINY, base_overrides(tmp_path, "run") + ["checkpoint.resume=none"])
    trainer = Trainer(config)
    read_metrics([trainer.train_step() for _ in range(2)])
    trainer.save()
    assert hf_cli(["export", str(config.checkpoint_dir), str(tmp_path / "hf")]) == 0  # the root: its latest step
    check_export(iteration_dir(config.checkpoint_dir, 2), tmp_path / "hf", seed=31)


@pytest.mark.parametrize("kind", ["byte", "tokenizer.json"])
def test_auto_tokenizer_encodes_like_ours(tmp_path, kind):
    spec = "byte"
    if kind != "byte":
        from tokenizers import Tokenizer, models, pre_tokenizers
        tok = Tokenizer(models.WordLevel({"[UNK]": 0, "def": 1, "return": 2, "<|endoftext|>": 3}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        spec = str(tmp_path / "tokenizer.json")
        tok.save(spec)
    files, eod = tokenizer_files(spec, 1024, 4096)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    ours = load_tokenizer(spec)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert theirs.encode(TEXT) == ours.encode(TEXT) and theirs.eos_token_id == eod == ours.eod_id


def test_export_refuses_a_folder_that_is_no_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert hf_cli(["export", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and "empty: not a training checkpoint" in out
