"""Generation: the cached absorbed MLA decode against the full-recompute forward, the low-latency decode
of an EP group against one process, the packed experts' masked GEMM, sampling, streaming, the CLI
against transformers' generate on the exported checkpoint, and its refusals of bad input."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from model.args import ModelArgs
from model.kv_cache import KVCache
from model.moe import RoutedExperts
from model.transformer import DeepSeekV3
from model.weights import save_weights
from moe_train.data.tokenizers import ByteTokenizer
from moe_train.generate.cli import TextStream, main as generate_main
from moe_train.generate.sampling import next_token
from parallel.dispatch.alltoall import AllToAllDispatcher
from parallel.dispatch.low_latency import LowLatencyExchange
from parallel.dispatch.low_latency_experts import LowLatencyExperts
from parallel.dispatch.simulated import SimulatedEPGroup
from tests.unit._tiny_checkpoint import TINY, write_tiny_checkpoint


def draw_seed(what: str) -> int:
    seed = random.randrange(2**31)
    print(f"{what}: seed {seed}")
    return seed


def full_recompute_logits(model: DeepSeekV3, ids: torch.Tensor) -> torch.Tensor:
    """The independent reference: the training forward over the whole prefix, for every position."""
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("variant", [dict(), dict(rope_type="yarn"), dict(q_lora_rank=None)])
def test_cached_absorbed_decode_equals_full_recompute(variant):
    seed = draw_seed(f"decode {variant}")
    torch.manual_seed(seed)
    args = ModelArgs(init_method_std=0.1, mtp_num_layers=0, **variant)
    model = DeepSeekV3(args).eval()
    prefill = int(torch.randint(1, 6, ()))
    ids = torch.randint(0, args.vocab_size, (2, prefill + 7))
    cache = KVCache(args, 2, ids.shape[1])
    with torch.no_grad():  # a prefill, a chunk of 3 after it (the causal mask inside the absorbed form), then singles
        steps = [model(ids[:, :prefill], cache=cache).logits, model(ids[:, prefill:prefill + 3], cache=cache).logits]
        steps += [model(ids[:, t:t + 1], cache=cache).logits for t in range(prefill + 3, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full_recompute_logits(model, ids), rtol=1e-5, atol=2e-5)


def rank_model(full: DeepSeekV3, dispatcher: AllToAllDispatcher) -> DeepSeekV3:
    """This rank's EP model: `full`'s weights with only the experts the dispatcher gives it."""
    model = DeepSeekV3(full.args, dispatcher).eval()
    first = {name: m.first_expert for name, m in model.named_modules() if isinstance(m, RoutedExperts)}
    state = {}
    for name, tensor in full.state_dict().items():
        owner = next((prefix for prefix in first if name.startswith(prefix + ".")), None)
        local = model.state_dict()[name].shape[0] if owner else 0
        state[name] = tensor[first[owner]:first[owner] + local] if owner else tensor
    model.load_state_dict(state)
    return model


def test_low_latency_decode_of_an_ep_group_equals_one_process():
    """Two simulated EP ranks with different prompts: prefill through the all-to-all dispatcher, decode
    through the low-latency exchange (tokens of each rank reach the other's experts), float32 throughout."""
    seed = draw_seed("ep decode")
    torch.manual_seed(seed)
    args = ModelArgs(init_method_std=0.1, mtp_num_layers=0, num_moe_experts=8, moe_router_topk=3)
    full = DeepSeekV3(args).eval()
    ids = torch.randint(0, args.vocab_size, (2, 3, 9))  # [rank, batch, positions]
    group = SimulatedEPGroup(2, 2)

    def rank_logits(rank, comms):
        model = rank_model(full, AllToAllDispatcher(comms.ep, args.num_moe_experts, 2))
        exchange = LowLatencyExperts(LowLatencyExchange(comms.ep), args.num_moe_experts, max_tokens=3)
        cache = KVCache(args, 3, 9)
        with torch.no_grad():
            steps = [model(ids[rank, :, :4], cache=cache).logits]
            steps += [model(ids[rank, :, t:t + 1], cache=cache, exchange=exchange).logits for t in range(4, 9)]
        return torch.cat(steps, dim=1)

    for rank, logits in enumerate(group.run(rank_logits)):
        torch.testing.assert_close(logits, full_recompute_logits(full, ids[rank]), rtol=1e-5, atol=2e-5)


def test_packed_experts_compute_only_the_counted_rows():
    """Rows past count[e] hold NaN (DeepEP leaves them uninitialized): a GEMM over them would spread it."""
    seed = draw_seed("packed experts")
    torch.manual_seed(seed)
    experts = RoutedExperts(4, 16, 8, 0.2)
    count = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    packed = torch.full((4, 6, 16), float("nan"))
    for e, n in enumerate(count.tolist()):
        packed[e, :n] = torch.randn(n, 16)
    with torch.no_grad():
        out = experts.forward_packed(packed, count)
        for e, n in enumerate(count.tolist()):
            rows = packed[e, :n]
            idx = torch.full((n, 1), e)
            per_expert = [n if other == e else 0 for other in range(4)]
            expected = experts(rows, idx, torch.ones(n, 1), per_expert)  # the dispatch path, one expert per row
            torch.testing.assert_close(out[e, :n], expected, rtol=1e-5, atol=1e-6)
            assert (out[e, n:] == 0).all()


def test_nucleus_sampling_draws_from_the_renormalized_top_p_set():
    seed = draw_seed("sampling")
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    probs = torch.softmax(logits / 0.7, 0)
    keep = 3  # the smallest prefix of the sorted probabilities reaching top_p
    top_p = float(probs[:keep].sum()) - 1e-3
    expected = torch.zeros(5)
    expected[:keep] = probs[:keep] / probs[:keep].sum()
    generator = torch.Generator().manual_seed(seed)
    draws = torch.tensor([next_token(logits, 0.7, top_p, generator) for _ in range(4000)])
    frequencies = torch.bincount(draws, minlength=5) / 4000
    assert (frequencies - expected).abs().max() < 0.03, frequencies
    assert next_token(logits, 0.0, 0.5, generator) == 0
    again = torch.Generator().manual_seed(seed)
    assert [next_token(logits, 0.7, top_p, again) for _ in range(4000)] == draws.tolist()


def test_text_stream_holds_back_an_incomplete_character(capsys):
    import sys
    stream = TextStream(ByteTokenizer(), sys.stdout)
    shown = []
    for byte in "aé".encode():
        stream.add(byte)
        shown.append(capsys.readouterr().out)
    stream.finish()
    assert shown == ["a", "", "é"] and capsys.readouterr().out == "\n"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate") / "checkpoints"
    seed = draw_seed("tiny checkpoint")
    return root, write_tiny_checkpoint(root, seed)


def run_cli(capsys, root, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what earlier steps printed
    status = generate_main(["--config", str(TINY), "--checkpoint", str(root), *extra])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_greedy_output_equals_transformers_generate_on_the_export(tmp_path, capsys, tiny_checkpoint):
    transformers = pytest.importorskip("transformers")
    from moe_train.checkpoint.hf import main as hf_cli

    root, model = tiny_checkpoint
    status, out, err = run_cli(capsys, root / "iter_0000003", "--prompt", "The expert router", "--max-new-tokens",
                               "16", "--temperature", "0", "--json")
    assert status == 0, err
    result = json.loads(out.splitlines()[-1])
    tokenizer = ByteTokenizer()
    assert result["prompt_ids"] == tokenizer.encode("The expert router")
    assert result["text"] == tokenizer.decode(result["output_ids"])

    save_weights(model, tmp_path / "native")
    assert hf_cli(["export", str(tmp_path / "native"), str(tmp_path / "hf")]) == 0
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    prompt = torch.tensor([result["prompt_ids"]])
    expected = hf.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=tokenizer.eod_id,
                           pad_token_id=tokenizer.eod_id, suppress_tokens=list(range(tokenizer.vocab_size, 1024)))
    assert result["output_ids"] == expected[0, prompt.shape[1]:].tolist()

    status, out, _ = run_cli(capsys, root, "--prompt", "The expert router", "--max-new-tokens", "16",
                             "--temperature", "0")
    assert status == 0 and out == "The expert router" + result["text"] + "\n"


@pytest.mark.parametrize("extra, message", [
    (["--checkpoint", "nowhere"], "--checkpoint: nowhere does not exist"),
    (["--set", "model.num_layers=3"], "model.num_layers: config 3 vs checkpoint 4"),
    (["--prompt", "x" * 4090], "--prompt: 4090 tokens + --max-new-tokens 8 exceed model.max_position_embeddings=4096"),
    (["--temperature", "-1"], "--temperature: must be a finite number >= 0"),
    (["--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (["--set", "parallel.ep=2"], "parallel.ep: generation spreads the experts over all 1 process(es)"),
    (["--set", "model.hidden_sise=3"], "model.hidden_sise: unknown key (did you mean 'hidden_size'?)"),
])
def test_bad_input_exits_2_with_one_line_naming_it(capsys, tiny_checkpoint, extra, message):
    root, _ = tiny_checkpoint
    args = ["--checkpoint", str(root), "--prompt", "hi", "--max-new-tokens", "8", *extra]
    status = generate_main(["--config", str(TINY), *args])
    err = capsys.readouterr().err
    assert status == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_checkpoint_without_config_file_is_checked_by_shape(tmp_path, capsys, tiny_checkpoint):
    root, _ = tiny_checkpoint
    import shutil
    folder = tmp_path / "iter_0000003"
    shutil.copytree(root / "iter_0000003", folder)
    (folder / "config.yaml").unlink()
    status, _, err = run_cli(capsys, folder, "--prompt", "hi", "--set", "model.moe_ffn_hidden_size=16")
    assert status == 2 and "shape mismatch" in err and len(err.strip().splitlines()) == 1, err


def copy_with_config(root: Path, tmp_path: Path, **changes: dict) -> Path:
    """The tiny checkpoint's iteration folder with its config.yaml's sections updated by `changes`."""
    import shutil

    import yaml

    folder = tmp_path / "iter_0000003"
    shutil.copytree(root / "iter_0000003", folder)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    for section, values in changes.items():
        config[section].update(values)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def generate_json(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = generate_main([*args, "--prompt", "The expert router", "--max-new-tokens", "8", "--temperature", "0",
                            "--json"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_without_config_the_checkpoint_config_is_read_and_its_training_layout_dropped(tmp_path, capsys,
                                                                                      tiny_checkpoint):
    root, _ = tiny_checkpoint
    status, expected, err = generate_json(capsys, "--config", str(TINY), "--checkpoint", str(root))
    assert status == 0, err
    folder = copy_with_config(root, tmp_path, parallel={"pp": 2, "ep": 2, "schedule": "1f1b"})
    status, out, err = generate_json(capsys, "--checkpoint", str(folder))
    assert status == 0 and out == expected, err


def test_config_overrides_the_checkpoint_config(tmp_path, capsys, tiny_checkpoint):
    root, _ = tiny_checkpoint
    folder = copy_with_config(root, tmp_path, data={"tokenizer": str(tmp_path / "gone.json")})
    status, _, err = generate_json(capsys, "--checkpoint", str(folder))
    assert status == 2 and "gone.json" in err and len(err.strip().splitlines()) == 1, err  # read from the checkpoint
    status, _, err = generate_json(capsys, "--checkpoint", str(folder), "--config", str(TINY))
    assert status == 0, err
    status, _, err = generate_json(capsys, "--checkpoint", str(folder), "--set", "data.tokenizer=byte")
    assert status == 0, err


def test_without_config_a_checkpoint_without_config_file_is_refused_in_one_line(tmp_path, capsys, tiny_checkpoint):
    root, _ = tiny_checkpoint
    folder = copy_with_config(root, tmp_path)
    (folder / "config.yaml").unlink()
    status, _, err = generate_json(capsys, "--checkpoint", str(folder))
    assert status == 2 and f"{folder} holds no config.yaml" in err and len(err.strip().splitlines()) == 1, err
