"""Typed run configuration: dataclass sections, YAML loading, `--set` overrides, validation, dump.

Every problem is reported as a `ConfigError` naming the offending key (with a did-you-mean for
unknown keys) before any work starts; the CLI turns it into one message per problem and exit 2.
`moe_train.config.help` lists the keys for `--help`; the YAML files are in `moe_train/configs/`.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from model.args import SELECTIVE_RECOMPUTE, ModelArgs
from model.intervals import COUNT, NON_NEGATIVE, POSITIVE, POSITIVE_COUNT, PROBABILITY, Interval, interval_problems
from moe_train.data.blend import parse_blend
from parallel.adamw import BF16_BETA_LIMIT, MOMENT_DTYPES
from parallel.pipeline.builders import SCHEDULES
from parallel.pipeline.builders.zb_auto import parse_zb_costs
from parallel.pipeline.timeline import Costs

PRECISIONS = ("fp32", "bf16", "fp8")
COMPILE_MODES = ("none", "regions", "model")
DEVICES = ("auto", "cpu", "cuda")
DISPATCHERS = ("auto", "local", "alltoall", "hierarchical", "native", "deepep")
NATIVE_ALTERNATIVES = "use 'hierarchical' for an EP group across nodes, 'alltoall' or 'hierarchical' inside one node"
LR_SCHEDULES = ("constant", "cosine", "dsv3")
RESUME_HELP = "'auto', 'none' or a checkpoint path"
WANDB_MODES = ("offline", "online")
DEFAULT_VALID_FRACTION = 0.01


class ConfigError(ValueError):
    """One or more configuration problems, each as (dotted key, message)."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(f"{prefix}{key}: {message}" for key, message in problems))


@dataclass
class ParallelConfig:
    """Process layout and communication.

    Attributes:
        pp: pipeline-parallel stages
        ep: expert-parallel group size (inside data parallelism)
        gpus_per_node: processes per node for the topology (default: the local world size; smaller
            simulates nodes on CPU)
        dispatcher: token dispatcher: auto (local for ep 1, hierarchical when EP spans nodes, else
            alltoall; never native), local, alltoall, hierarchical, native or deepep
        zero1: shard the optimizer state and fp32 main parameters over data-parallel ranks (ZeRO-1, as
            Megatron's distributed optimizer: one reduce-scatter of the gradients and one all-gather of
            the parameters per step, instead of an all-reduce)
        grad_bucket_elements: parameters per data-parallel bucket (at least; Megatron's --ddp-bucket-size):
            a bucket's gradient reduction starts once all of its gradients are final
        timeout_s: seconds a collective may wait for its peers before the run fails
        schedule: pipeline schedule (see parallel.pipeline.builders.SCHEDULES)
        virtual_stages: model chunks per pipeline rank (interleaved schedules)
        pipeline_layout: Megatron layout string, e.g. "Et|(tt|)*30mL"
        first_stage_layers: without a layout: decoder layers on the first stage
        last_stage_layers: without a layout: decoder layers on the last stage
        comm_sms: SMs the native dispatch/combine kernels may use (2 per channel)
        fp8_dispatch: the MoE dispatch payload, and the gradient the combine's backward sends, travel in
            FP8 E4M3 with a power-of-two scale per token and 128 channels (DeepSeek-V3 §3.3.3; the combine
            stays bf16); needs train.precision=fp8, parallel.ep > 1 and a hidden size divisible by 128
        overlap: FB actions (dualpipe, dualpipev, combined-1f1b) interleave halves to hide all-to-alls
        nproc_per_node: processes per node for the launcher (default: 1 on CPU)
        zb_memory_limit: zb-auto: live activations per rank, in stage micro-batches (default 2*pp-1)
        zb_costs: zb-auto: "f,b,w[,comm]" per stage and micro-batch (default: measured by the trainer over
            its first zb_measure_steps steps, run as zb-h1; the planner then assumes 1,1,1,0)
        zb_measure_steps: zb-auto without zb_costs: warm-up steps (zb-h1) whose F, B and W times give the
            costs; the first is not timed
    """

    pp: int = 1
    ep: int = 1
    gpus_per_node: Optional[int] = None
    dispatcher: str = "auto"
    zero1: bool = True
    grad_bucket_elements: int = 40_000_000
    timeout_s: float = 300.0
    schedule: str = "1f1b"
    virtual_stages: int = 1
    pipeline_layout: Optional[str] = None
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    comm_sms: int = 20
    fp8_dispatch: bool = False
    overlap: bool = True
    nproc_per_node: Optional[int] = None
    zb_memory_limit: Optional[float] = None
    zb_costs: Optional[str] = None
    zb_measure_steps: int = 3


@dataclass
class TrainConfig:
    """The training loop.

    Attributes:
        steps: optimizer steps to train
        seed: seed of the weights' initialisation and of the data order
        global_batch_size: samples per optimizer step, over all data-parallel ranks
        rampup_batch_size: [start, increment, samples], Megatron's --rampup-batch-size: the global batch
            starts at start samples and grows by increment at evenly spaced consumed-sample points until
            samples samples are consumed, then stays at global_batch_size; the micro-batch size is fixed,
            the micro-batches per step grow. train.steps and every optim.*_steps key then count
            global_batch_size samples per step: the run trains steps x global_batch_size samples (in more,
            smaller steps) and the schedules follow consumed samples. Costs a pipeline bubble per extra step
            and one lowered pipeline schedule per micro-batch count (null: no ramp)
        micro_batch_size: samples per forward/backward on one rank
        seq_length: tokens per sample
        log_interval: steps between console lines and metrics.jsonl records
        eval_interval: steps between validations (0: no validation)
        eval_iters: validation micro-batches per validation
        precision: fp32; bf16 (bf16 parameters; fp32 main parameters and gradients in the optimizer); or
            fp8 (as bf16, with every weight GEMM but the output head's in FP8 E4M3 with 1x128 / 128x128
            scales, DeepSeek-V3's recipe: model.fp8)
        compile: torch.compile: none, regions (attention, dense MLP, norms) or model (see
            runtime.compile_model)
        device: auto, cpu or cuda
        threads: torch CPU threads (default: torch's choice)
        peak_tflops: per accelerator, dense BF16, for MFU on CUDA
        max_skipped_steps: consecutive steps skipped for a non-finite gradient norm before stopping
            (exit 3)
    """

    steps: int = 100
    seed: int = 1234
    global_batch_size: int = 8
    rampup_batch_size: Optional[list[int]] = None
    micro_batch_size: int = 4
    seq_length: int = 64
    log_interval: int = 1
    eval_interval: int = 0
    eval_iters: int = 2
    precision: str = "fp32"
    compile: str = "none"
    device: str = "auto"
    threads: Optional[int] = None
    peak_tflops: float = 989.0
    max_skipped_steps: int = 3


@dataclass
class OptimConfig:
    """AdamW, gradient clipping and the schedules of the learning rate, router bias rate and MTP weight.

    With train.rampup_batch_size the schedules follow consumed samples: each *_steps key counts
    train.global_batch_size samples per step (moe_train.schedules).

    Attributes:
        lr: peak learning rate
        min_lr: learning rate at the end of the cosine
        weight_decay: AdamW's decoupled weight decay
        adam_beta1: AdamW's beta1
        adam_beta2: AdamW's beta2
        adam_eps: AdamW's epsilon
        moment_dtype: dtype AdamW stores its two moments in: fp32, or bf16 (DeepSeek-V3; the update
            still runs in fp32 against the fp32 master weights; betas above 1 - 2^-8 are refused, see
            parallel.adamw); a resume from a checkpoint with the other dtype converts them
        clip_grad: global gradient-norm clip (0: none)
        lr_schedule: constant, cosine or dsv3 (warm-up, constant, cosine, tail)
        lr_warmup_steps: linear warm-up steps
        lr_decay_steps: cosine length; default: the steps left after warm-up (and constant)
        lr_constant_steps: dsv3: steps held at the peak before the cosine
        lr_tail_steps: dsv3: final steps at lr_tail
        lr_tail: dsv3: learning rate of the final steps
        bias_update_rate_final: router bias rate after bias_update_switch_step
        bias_update_switch_step: step from which bias_update_rate_final applies (none: never)
        mtp_loss_scale_final: MTP weight after mtp_loss_switch_step
        mtp_loss_switch_step: step from which mtp_loss_scale_final applies (none: never)
        ema_decay: keep an EMA of the parameters in CPU memory, updated in the background after
            every step as ema = ema_decay * ema + (1 - ema_decay) * param, saved in checkpoints
            (`python -m moe_train.checkpoint.hf export --ema` writes it); none: no EMA
    """

    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    moment_dtype: str = "fp32"
    clip_grad: float = 1.0
    lr_schedule: str = "cosine"
    lr_warmup_steps: int = 10
    lr_decay_steps: Optional[int] = None
    lr_constant_steps: int = 0
    lr_tail_steps: int = 0
    lr_tail: float = 0.0
    bias_update_rate_final: float = 0.0
    bias_update_switch_step: Optional[int] = None
    mtp_loss_scale_final: float = 0.1
    mtp_loss_switch_step: Optional[int] = None
    ema_decay: Optional[float] = None


@dataclass
class DataConfig:
    """Training and validation data.

    Attributes:
        path: indexed-dataset prefix (or its .bin/.idx), or a Megatron blend "W1 P1 W2 P2 ..." (a string
            or a YAML list; weights are normalised); none: the built-in demo corpus
        tokenizer: "byte" or a tokenizer.json path
        valid_path: validation data (a prefix or blend, all of its documents), instead of valid_fraction
        valid_fraction: documents of each dataset of path held out for validation (default 0.01
            without valid_path)
        cache_dir: demo corpus cache (default ~/.cache/moe_train)
        demo_max_bytes: cap on the demo corpus size
    """

    path: Union[str, list[str], None] = None
    tokenizer: str = "byte"
    valid_path: Union[str, list[str], None] = None
    valid_fraction: Optional[float] = None
    cache_dir: Optional[str] = None
    demo_max_bytes: Optional[int] = None

    @property
    def split_fraction(self) -> float:
        """The fraction of `path` held out: `valid_fraction`, by default 0.01 unless `valid_path` is set."""
        if self.valid_fraction is not None:
            return self.valid_fraction
        return 0.0 if self.valid_path is not None else DEFAULT_VALID_FRACTION


@dataclass
class CheckpointConfig:
    """Checkpoints and resume.

    Attributes:
        dir: checkpoint root (default: <logging.dir>/checkpoints)
        interval: steps between checkpoints (0: only at the end of training)
        keep: checkpoints kept; older ones are removed
        resume: 'auto' (the latest checkpoint of dir, if any), 'none' or a checkpoint path
        weights_only: load only model weights from resume (fine-tuning)
        async_save: write checkpoints in the background while training goes on (one host-memory copy of
            this rank's model, optimizer and EMA state while a save is in flight)
    """

    dir: Optional[str] = None
    interval: int = 0
    keep: int = 2
    resume: str = "auto"
    weights_only: bool = False
    async_save: bool = False


@dataclass
class LoggingConfig:
    """Where logs go.

    Attributes:
        dir: the run's folder: metrics.jsonl, config.yaml, tensorboard/, checkpoints/
        tensorboard: TensorBoard scalars in <dir>/tensorboard, when the tensorboard package is installed
        overwrite: with checkpoint.resume=none: move an earlier run in dir aside (never deleted)
        wandb_project: Weights & Biases project to log to (none: no W&B; needs the wandb package)
        wandb_mode: offline (files under <dir>/wandb, `wandb sync` them later) or online
        profile_steps: [first, last]: steps (as the log counts them) traced with torch.profiler into
            <dir>/profile/rank<r>_steps<first>-<last>.json (a Chrome trace; TensorBoard's profiler
            reads it); none: no trace
        profile_ranks: the ranks that trace profile_steps and write memory_snapshot
        straggler_threshold: with several processes, at every log the ranks all-gather their step and compute
            times (2 floats each; hosts once at start-up), metrics.jsonl gets ranks/<r>/step_s and
            ranks/<r>/compute_s, and the log names a pipeline stage's slowest rank and its host when its
            compute time is more than this fraction above the stage's median (moe_train.straggler); null: none
        memory_snapshot: CUDA only (refused elsewhere): record the caching allocator's history from start-up
            and write it after the first step, so that step's peak is in it, to
            <dir>/memory_snapshot/rank<r>_step<n>.pickle on the profile_ranks (pytorch.org/memory_viz)
    """

    dir: str = "runs/default"
    tensorboard: bool = True
    overwrite: bool = False
    wandb_project: Optional[str] = None
    wandb_mode: str = "offline"
    profile_steps: Optional[list[int]] = None
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    straggler_threshold: Optional[float] = 0.2
    memory_snapshot: bool = False


@dataclass
class Config:
    """A run: one section per dataclass."""

    model: ModelArgs = field(default_factory=ModelArgs)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path(self.logging.dir) / "checkpoints")


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _section_types(section: str) -> dict[str, Any]:
    cls = type(getattr(Config(), section))
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _did_you_mean(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(value: Any, annotation: Any) -> Any:
    """Value converted to the field's type, or TypeError with what was expected."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        errors = []
        for option in options:
            try:
                return _coerce(value, option)
            except TypeError as err:
                errors.append(str(err).removeprefix("expected "))
        raise TypeError("expected " + " or ".join(errors))
    if origin is list:
        if isinstance(value, list):
            return [_coerce(item, typing.get_args(annotation)[0]) for item in value]
        raise TypeError("expected a list")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise TypeError("expected true or false")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeError("expected an integer")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError("expected a number")
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise TypeError("expected a string")
    raise TypeError(f"unsupported field type {annotation}")


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def apply_mapping(config: Config, data: Any, problems: list[tuple[str, str]]) -> None:
    """Set fields of `config` from a {section: {key: value}} mapping, collecting problems."""
    if data is None:
        return
    if not isinstance(data, dict):
        problems.append(("<top level>", "must be a mapping of sections"))
        return
    for section, values in data.items():
        if section not in SECTIONS:
            problems.append((str(section), "unknown section" + _did_you_mean(str(section), list(SECTIONS))))
            continue
        if values is None:
            continue
        if not isinstance(values, dict):
            problems.append((section, "must be a mapping of keys"))
            continue
        for key, value in values.items():
            set_value(config, f"{section}.{key}", value, problems)


def set_value(config: Config, dotted: str, value: Any, problems: list[tuple[str, str]]) -> None:
    if dotted == LEGACY_RECOMPUTE_KEY:  # the configs of runs and checkpoints made before recompute_modules
        dotted, value = "model.recompute_modules", [] if value is None else [value]
    section, _, key = dotted.partition(".")
    if section not in SECTIONS:
        problems.append((dotted, "unknown section" + _did_you_mean(section, list(SECTIONS))))
        return
    fields = _section_types(section)
    if key not in fields:
        problems.append((dotted, "unknown key" + _did_you_mean(key, list(fields))))
        return
    try:
        setattr(getattr(config, section), key, _coerce(value, fields[key]))
    except TypeError as err:
        problems.append((dotted, f"{err}, got {value!r} ({_type_name(type(value))})"))


LEGACY_RECOMPUTE_KEY = "model.recompute_granularity"  # `full` (or null) is read as recompute_modules [full] (or [])


def parse_override(text: str) -> tuple[str, Any]:
    """'section.key=value' -> (dotted key, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError([(text, "an override must look like section.key=value")])
    key, raw = text.split("=", 1)
    key = key.strip()
    if "." not in key:
        raise ConfigError([(key, "an override key must be section.key")])
    try:
        return key, yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        return key, raw


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- overrides, then validation; raises ConfigError listing every problem."""
    config = Config()
    problems: list[tuple[str, str]] = []
    source = None
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError([("<file>", f"cannot read: {err.strerror}")], source) from None
        try:
            data = yaml.load(text, Loader=UniqueKeyLoader)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<file>"
            raise ConfigError([(where, f"invalid YAML: {getattr(err, 'problem', err)}")], source) from None
        if data is None:  # an empty file would silently train the built-in defaults into runs/default
            raise ConfigError([("<file>", "is empty (no sections); name the sections to set, or pass no "
                                          "--config to run the defaults")], source)
        apply_mapping(config, data, problems)
    for text in overrides:
        key, value = parse_override(text)
        set_value(config, key, value, problems)
    if problems:
        raise ConfigError(problems, source)
    problems = validate(config)
    if problems:
        raise ConfigError(problems, source)
    return config


# Every numeric key's allowed values, by section (the model section's are in model.args.INTERVALS).
INTERVALS: dict[str, dict[str, Interval]] = {
    "parallel": {
        **dict.fromkeys(("pp", "ep", "virtual_stages", "grad_bucket_elements"), POSITIVE_COUNT),
        **dict.fromkeys(("gpus_per_node", "nproc_per_node"), Interval(low=1, optional=True)),
        **dict.fromkeys(("first_stage_layers", "last_stage_layers"), Interval(low=0, optional=True)),
        "timeout_s": Interval(low=0, low_open=True, unit="seconds"),
        "comm_sms": Interval(low=2),  # and even: 2 SMs per channel
        "zb_memory_limit": Interval(low=1, optional=True),
        "zb_measure_steps": Interval(low=2),  # the first step is not timed
    },
    "train": {
        **dict.fromkeys(("steps", "global_batch_size", "micro_batch_size", "seq_length", "log_interval", "eval_iters",
                         "max_skipped_steps"), POSITIVE_COUNT),
        "seed": Interval(low=0, high=2**63, high_open=True),
        "eval_interval": COUNT,  # 0: no validation
        "threads": Interval(low=1, optional=True),  # null: torch's choice
        "peak_tflops": POSITIVE,
    },
    "optim": {
        **dict.fromkeys(("lr", "min_lr", "weight_decay", "clip_grad", "lr_tail", "bias_update_rate_final",
                         "mtp_loss_scale_final"), NON_NEGATIVE),  # clip_grad 0: no clipping
        **dict.fromkeys(("adam_beta1", "adam_beta2"), PROBABILITY),
        "adam_eps": POSITIVE,
        **dict.fromkeys(("lr_warmup_steps", "lr_constant_steps", "lr_tail_steps"), COUNT),
        "lr_decay_steps": Interval(low=1, optional=True),  # null: the rest of training
        **dict.fromkeys(("bias_update_switch_step", "mtp_loss_switch_step"), Interval(low=0, optional=True)),
        "ema_decay": Interval(low=0, high=1, low_open=True, high_open=True, optional=True),  # null: no EMA
    },
    "data": {
        "valid_fraction": Interval(low=0, high=1, high_open=True, optional=True),
        "demo_max_bytes": Interval(low=1, optional=True),
    },
    "checkpoint": {"interval": COUNT, "keep": POSITIVE_COUNT},  # interval 0: only at the end
    "logging": {"straggler_threshold": Interval(low=0, low_open=True, optional=True)},  # null: no report
}


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping: PyYAML keeps the last one
    silently, so an edit lower in a long config would override a value the user is looking at."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first on line {first_line[key] + 1})", key_node.start_mark)
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _choice(problems: list, key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        problems.append((key, f"must be one of {', '.join(options)}; got {value!r}" + _did_you_mean(value, list(options))))


def validate(config: Config) -> list[tuple[str, str]]:
    """Cross-field checks that do not need the process layout (that is checked at start-up)."""
    problems = [(f"model.{key}", message) for key, message in config.model.validate()]
    t, o, p, c = config.train, config.optim, config.parallel, config.checkpoint
    for section, intervals in INTERVALS.items():
        problems += interval_problems(getattr(config, section), intervals, f"{section}.")
    if t.micro_batch_size > 0 and t.global_batch_size % t.micro_batch_size:
        problems.append(("train.global_batch_size",
                         f"{t.global_batch_size} is not a multiple of train.micro_batch_size={t.micro_batch_size}"))
    problems.extend(_ramp_problems(t))
    if t.seq_length > config.model.max_position_embeddings:
        problems.append(("train.seq_length",
                         f"{t.seq_length} exceeds model.max_position_embeddings={config.model.max_position_embeddings}"))
    _choice(problems, "train.precision", t.precision, PRECISIONS)
    _choice(problems, "train.compile", t.compile, COMPILE_MODES)
    if t.compile != "none" and t.precision == "fp8":
        problems.append(("train.compile", f"{t.compile!r} is not supported with train.precision=fp8 (its GEMMs "
                                          "are not traced): use train.compile=none"))
    if t.compile != "none" and p.pp > 1:
        problems.append(("train.compile", f"{t.compile!r} needs parallel.pp=1, got {p.pp}: a compiled region would "
                                          "bypass the split backward that defers the pipeline's weight gradients"))
    if t.compile != "none" and set(config.model.recompute_modules) & set(SELECTIVE_RECOMPUTE):
        problems.append(("train.compile", f"{t.compile!r} cannot trace the saved-tensor hooks of model.recompute_modules "
                                          f"{config.model.recompute_modules}: use train.compile=none"))
    _choice(problems, "train.device", t.device, DEVICES)
    _choice(problems, "optim.lr_schedule", o.lr_schedule, LR_SCHEDULES)
    _choice(problems, "optim.moment_dtype", o.moment_dtype, tuple(MOMENT_DTYPES))
    for key in ("adam_beta1", "adam_beta2"):
        if o.moment_dtype == "bf16" and BF16_BETA_LIMIT < getattr(o, key) < 1:
            problems.append((f"optim.{key}", f"{getattr(o, key)} with optim.moment_dtype=bf16: a bf16 moment cannot "
                                             f"decay by less than 2^-8 per step (beta at most {BF16_BETA_LIMIT}); "
                                             "use a smaller beta or optim.moment_dtype=fp32"))
    _choice(problems, "parallel.dispatcher", p.dispatcher, DISPATCHERS)
    _choice(problems, "parallel.schedule", p.schedule, tuple(SCHEDULES))
    if o.min_lr > o.lr:
        problems.append(("optim.min_lr", f"{o.min_lr} is above optim.lr={o.lr}"))
    if p.ep >= 1 and config.model.num_moe_experts % p.ep:
        problems.append(("parallel.ep", f"num_moe_experts={config.model.num_moe_experts} is not divisible by ep={p.ep}"))
    if p.fp8_dispatch:
        why = [f"{key}={value}" for key, value, fine in (
            ("train.precision", t.precision, t.precision == "fp8"), ("parallel.ep", p.ep, p.ep > 1),
            ("model.hidden_size", config.model.hidden_size, config.model.hidden_size % 128 == 0)) if not fine]
        if why:
            problems.append(("parallel.fp8_dispatch", "needs train.precision=fp8 (the expert GEMMs consume the "
                                                      "FP8 rows), parallel.ep > 1 and model.hidden_size divisible by 128; "
                                                      f"got {', '.join(why)}"))
    if p.comm_sms % 2:
        problems.append(("parallel.comm_sms", f"must be even (2 SMs per channel), got {p.comm_sms}"))
    if p.zb_costs is not None:
        try:
            parse_zb_costs(p.zb_costs)
        except ValueError as err:
            problems.append(("parallel.zb_costs", str(err).removeprefix("zb_costs: ")))
    for key in ("zb_memory_limit", "zb_costs"):
        if getattr(p, key) is not None and p.schedule != "zb-auto":
            problems.append((f"parallel.{key}", f"applies to parallel.schedule=zb-auto only, got {p.schedule!r}"))
    if config.logging.overwrite and c.resume != "none":
        problems.append(("logging.overwrite", f"true needs checkpoint.resume=none, got {c.resume!r}"))
    problems.extend(_data_problems(config.data))
    _choice(problems, "logging.wandb_mode", config.logging.wandb_mode, WANDB_MODES)
    steps = config.logging.profile_steps
    if steps is not None and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
        problems.append(("logging.profile_steps", f"must be [first, last] with 1 <= first <= last, got {steps}"))
    if any(rank < 0 for rank in config.logging.profile_ranks):
        problems.append(("logging.profile_ranks", f"ranks are >= 0, got {config.logging.profile_ranks}"))
    return problems


def _ramp_problems(t: TrainConfig) -> list[tuple[str, str]]:
    """train.rampup_batch_size against itself and train.global_batch_size (its split over micro-batches and
    data-parallel ranks is checked at start-up: moe_train.preflight.layout)."""
    ramp = t.rampup_batch_size
    if ramp is None:
        return []
    key = "train.rampup_batch_size"
    if len(ramp) != 3 or min(ramp) < 1:
        return [(key, f"must be [start, increment, samples], three integers >= 1, got {ramp}")]
    start, increment, _ = ramp
    if start >= t.global_batch_size:
        return [(key, f"start {start} must be below train.global_batch_size={t.global_batch_size}, "
                      "the batch the ramp grows to")]
    if (t.global_batch_size - start) % increment:
        return [(key, f"train.global_batch_size - start = {t.global_batch_size - start} is not a multiple of "
                      f"increment {increment}")]
    return []


def _data_problems(data: DataConfig) -> list[tuple[str, str]]:
    problems = []
    for key in ("path", "valid_path"):
        if getattr(data, key) is not None:
            try:
                parse_blend(getattr(data, key))
            except ValueError as err:
                problems.append((f"data.{key}", str(err)))
    if data.valid_fraction is not None and data.valid_path is not None:
        problems.append(("data.valid_path", "is set together with data.valid_fraction; validation data comes "
                                            "from one of them: unset the other"))
    return problems


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def to_yaml(config: Config) -> str:
    """The resolved configuration as YAML that `load_config` reads back to an equal Config."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def zb_search(parallel: ParallelConfig) -> tuple[Costs | None, float | None]:
    """(costs, memory limit) of zb-auto's search from `parallel.zb_costs` / `zb_memory_limit` (None: the
    builder's defaults); other schedules take neither."""
    costs = parse_zb_costs(parallel.zb_costs) if parallel.zb_costs is not None else None
    return costs, parallel.zb_memory_limit
