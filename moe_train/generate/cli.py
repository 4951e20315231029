"""Sample from a training checkpoint: `python -m moe_train.generate --checkpoint CKPT [--config CONFIG]
--prompt TEXT [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--json] [--set k=v ...]`.

CKPT is a checkpoint root (its latest iteration) or an `iter_*` folder. The config is the one the
checkpoint holds (its config.yaml) unless `--config` names another. The prompt is encoded with
`data.tokenizer`, prefilled through the configured dispatcher and decoded token by token with the
KV cache and the low-latency exchange (`moe_train.generate.decoding`); MTP layers are not loaded. Under
torchrun with `parallel.ep` = the number of processes, each process holds and loads only its
experts, every process runs the same prompt, and rank 0's token is broadcast at each step. Output
(rank 0): the prompt and the continuation as text, streamed as tokens arrive, or with `--json` one
last line {"prompt_ids", "output_ids", "text" (of output_ids)}. Bad input exits 2 with one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable, TextIO

import torch
import torch.distributed as dist
import yaml

from model.transformer import DeepSeekV3
from moe_train.checkpoint.dcp import CheckpointError, checkpoint_folder, load_checkpoint
from moe_train.config import Config, ConfigError, load_config
from moe_train.data import DataError, load_tokenizer
from moe_train.data.tokenizers import Tokenizer
from moe_train.generate.decoding import generate_ids
from moe_train.runtime import device_type, select_device
from moe_train.generate.sampling import next_token
from moe_train.launch.exit_codes import EXIT_BAD_INPUT
from moe_train.preflight.start_up import choose_dispatcher, launched_processes, start_expert_parallel
from parallel.dispatch import DispatcherUnavailable, make_dispatcher
from parallel.dispatch.comm import ProcessGroupComm
from parallel.dispatch.low_latency import LowLatencyExchange
from parallel.dispatch.low_latency_experts import LowLatencyExperts
from parallel.dispatch.simulated import SimulatedEPGroup
from parallel.topology import Topology

TRAINING_ONLY_KEYS = ("recompute_modules", "recompute_granularity", "moe_aux_loss_coeff",
                      "moe_router_bias_update_rate", "mtp_loss_scaling_factor", "mtp_num_layers", "init_method_std")

# A checkpoint's config.yaml holds its training layout; generation has no pipeline stages and no FP8 dispatch.
GENERATION_LAYOUT = ("parallel.pp=1", "parallel.fp8_dispatch=false")


class BadInput(ValueError):
    """An option, prompt or checkpoint that cannot be generated from; the message is one line."""


@dataclasses.dataclass
class Options:
    prompt: str
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if not self.prompt:
            raise BadInput("--prompt: empty")
        if self.max_new_tokens < 1:
            raise BadInput(f"--max-new-tokens: must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise BadInput(f"--temperature: must be a finite number >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BadInput(f"--top-p: must be in (0, 1], got {self.top_p}")


def check_model_section(config: Config, folder: Path) -> None:
    """The config's model section must be the one the checkpoint was trained with (its config.yaml),
    up to keys that only training reads."""
    saved_file = folder / "config.yaml"
    if not saved_file.is_file():
        return  # no saved config: the tensor shapes are still checked on load
    saved = (yaml.safe_load(saved_file.read_text()) or {}).get("model", {})
    ours = dataclasses.asdict(config.model)
    differ = [f"model.{key}: config {ours[key]!r} vs checkpoint {saved[key]!r}" for key in ours
              if key in saved and key not in TRAINING_ONLY_KEYS and saved[key] != ours[key]]
    if differ:
        raise BadInput(f"--config: the model section differs from {saved_file}: " + "; ".join(differ))


def generation_config(config_file: str | None, folder: Path, overrides: list[str]) -> Config:
    """`config_file` with `overrides`, or without it the config the checkpoint was trained with, its training
    layout replaced by generation's (`GENERATION_LAYOUT`, every launched process in the EP group)."""
    if config_file is not None:
        return load_config(config_file, overrides)
    saved_file = folder / "config.yaml"
    if not saved_file.is_file():
        raise BadInput(f"--checkpoint: {folder} holds no config.yaml; name the config it was trained with "
                       "in --config")
    layout = [*GENERATION_LAYOUT, f"parallel.ep={launched_processes()}"]
    return load_config(saved_file, layout + overrides)


def prompt_ids(tokenizer: Tokenizer, config: Config, options: Options) -> list[int]:
    ids = tokenizer.encode(options.prompt)
    limit = config.model.max_position_embeddings
    if len(ids) + options.max_new_tokens > limit:
        raise BadInput(f"--prompt: {len(ids)} tokens + --max-new-tokens {options.max_new_tokens} exceed "
                       f"model.max_position_embeddings={limit}")
    if max(ids) >= config.model.vocab_size:
        raise BadInput(f"--prompt: token id {max(ids)} is outside model.vocab_size={config.model.vocab_size} "
                       f"(data.tokenizer={config.data.tokenizer})")
    return ids


def load_model(config: Config, folder: Path, topology: Topology | None) -> DeepSeekV3:
    """The model without MTP, this process's experts only, weights from `folder`, in eval mode."""
    device = select_device(config.train)
    dispatcher = make_dispatcher(choose_dispatcher(config, topology), topology, config.model.num_moe_experts,
                                 comm_sms=config.parallel.comm_sms, device=device.type)
    model = DeepSeekV3(dataclasses.replace(config.model, mtp_num_layers=0), dispatcher).to(device)
    load_checkpoint(folder, model, weights_only=True, partial=True,
                    process_group=None if topology is None else dist.group.WORLD)
    return model.eval()


def decode_exchange(config: Config, topology: Topology | None) -> LowLatencyExperts:
    """The low-latency exchange of the decode steps (one token per rank and step) over the EP group: the
    kernels' (`kernels_cuda.Buffer` in low-latency mode, bfloat16 rows) with `parallel.dispatcher=native`
    on several processes, else the pure-torch reference."""
    experts, tokens = config.model.num_moe_experts, 1
    if topology is None:
        return LowLatencyExperts(LowLatencyExchange(SimulatedEPGroup(1, 1).comms[0].ep), experts, tokens)
    if choose_dispatcher(config, topology) != "native":
        return LowLatencyExperts(LowLatencyExchange(ProcessGroupComm(topology.group("ep"))), experts, tokens)
    from kernels_cuda import Buffer

    ep, device = topology.ep, device_type(config.train)
    # The normal-mode regions are not used by the decode steps: the smallest the buffer takes.
    nvl, rdma = Buffer.get_buffer_size_hints(topology.ep_nodes, topology.ep_ranks_per_node, 16, 1)
    low_latency = Buffer.get_low_latency_rdma_size_hint(tokens, config.model.hidden_size, ep, experts)
    buffer = Buffer(topology.group("ep"), nvl, max(rdma, low_latency), ranks_per_node=topology.ep_ranks_per_node,
                    timeout_s=config.parallel.timeout_s, device=device, low_latency_mode=True)
    return LowLatencyExperts(buffer, experts, tokens, row_dtype=torch.bfloat16)


def chooser(options: Options, vocab: int, topology: Topology | None) -> Callable[[torch.Tensor], int]:
    """Logits -> the next token among the tokenizer's `vocab` ids (the rest of a padded embedding table
    are no tokens), rank 0's choice on every rank."""
    generator = torch.Generator().manual_seed(options.seed)

    def choose(logits: torch.Tensor) -> int:
        token = next_token(logits[:vocab].cpu(), options.temperature, options.top_p, generator)
        if topology is None:
            return token
        agreed = torch.tensor([token], device=topology.device)
        dist.broadcast(agreed, src=0)
        return int(agreed.item())

    return choose


def generate(config: Config, folder: Path, ids: list[int], options: Options, tokenizer: Tokenizer,
             topology: Topology | None, on_token: Callable[[int], None] = lambda token: None) -> list[int]:
    """The new tokens after prompt `ids`, ending at the tokenizer's end of document; `on_token` sees
    each as it is chosen. Every EP rank calls it."""
    model = load_model(config, folder, topology)
    tokens = generate_ids(model, ids, options.max_new_tokens, chooser(options, tokenizer.vocab_size, topology),
                          decode_exchange(config, topology), stop_id=tokenizer.eod_id)
    output = []
    for token in tokens:
        output.append(token)
        on_token(token)
    return output


class TextStream:
    """Prints the text of the tokens so far as they arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.shown = 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        self._show(self.tokenizer.decode(self.ids).rstrip("\ufffd"))

    def finish(self) -> None:
        self._show(self.tokenizer.decode(self.ids))
        self.out.write("\n")
        self.out.flush()

    def _show(self, text: str) -> None:
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = max(self.shown, len(text))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m moe_train.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a YAML config with the checkpoint's model section (default: the "
                                          "config.yaml the checkpoint holds)")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint root or an iter_* folder")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help='print {"prompt_ids", "output_ids", "text"} last')
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    return parser.parse_args(argv)


def one_line(error: BaseException) -> str:
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    args = parse_args(argv)
    out = out or sys.stdout
    options = Options(args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed)
    is_first = int(os.environ.get("RANK", "0")) == 0
    topology = None
    try:
        options.check()
        folder = checkpoint_folder(args.checkpoint, "--checkpoint")
        config = generation_config(args.config, folder, args.overrides)
        check_model_section(config, folder)
        tokenizer = load_tokenizer(config.data.tokenizer)
        ids = prompt_ids(tokenizer, config, options)
        topology = start_expert_parallel(config)
        stream = TextStream(tokenizer, out) if is_first and not args.json else None
        if stream is not None:
            out.write(options.prompt)
        output = generate(config, folder, ids, options, tokenizer, topology,
                          stream.add if stream else lambda token: None)
    except (BadInput, ConfigError, CheckpointError, DataError, DispatcherUnavailable) as err:
        if is_first:
            print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        if topology is not None:
            topology.destroy_groups()
            dist.destroy_process_group()
    if stream is not None:
        stream.finish()
    elif is_first:
        print(json.dumps({"prompt_ids": ids, "output_ids": output, "text": tokenizer.decode(output)}), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
