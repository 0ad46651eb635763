"""The options of a training run, declared once: :class:`TrainFields`, the base of
:class:`gpuflow.config.TrainConfig`.

Each field declares its flag (:func:`gpuflow.options.option`): the type and choices are its
annotation, the default its default, and the help, metavar and any special parsing sit beside
them. The `gpuflow train` flags, the type checks of TOML values and the flag reference in
docs/cli.md are generated from these declarations. They sit below ``config`` and
``config_checks``, so that the checks name the fields' type without importing the module
that runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gpuflow.options import option
from gpuflow.precision import Precision

Fp8Recipe = Literal["tensorwise", "rowwise"]
OptimizerName = Literal["adamw", "sgd"]
OptimizerImpl = Literal["fused", "foreach"]
Schedule = Literal["cosine", "constant"]
StrategyName = Literal["single", "ddp", "fsdp", "tp", "pp"]
Strategy = StrategyName | Literal["auto"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
PipelineSplit = Literal["auto", "trace", "manual"]
FsdpWrap = Literal["block", "model"]
CompileScope = Literal["block", "model"]
BaseQuantization = Literal["nf4"]
# DistributedDataParallel's gradient bucket size when --bucket-mb is not given.
DDP_DEFAULT_BUCKET_MIB = 25.0
DataSource = Literal["real", "synthetic"]
Decode = Literal["auto", "cpu", "gpu"]
DEFAULT_BATCH_SIZE = 64
DEFAULT_EVAL_BATCHES = 20  # see gpuflow.data.eval_set
DISTRIBUTED = "distributed (torch.distributed, elastic launcher)"  # the flags' help group
LORA = "LoRA adapters (needs gpuflow[hf]: PEFT)"


def default_strategy(world: int) -> StrategyName:
    """Data-parallel when there is more than one process."""
    return "ddp" if world > 1 else "single"


def _int_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def _positive_or_none(text: str) -> float | None:
    return None if text.lower() in ("none", "off", "0") else float(text)


def _int_or_none(text: str) -> int | None:
    return None if text == "auto" else int(text)


def _decay_or_off(text: str) -> float:
    return 0.0 if text.lower() in ("none", "off") else float(text)


@dataclass
class TrainFields:
    """Everything a training run needs besides the workload itself."""

    workload: str = option(
        "digits", metavar="NAME|pkg.module:factory",
        help="a built-in workload (digits, mnist-idx, textlm, speech, asr, images), hf:DIR "
             "(a Hugging Face model directory), or your own: a factory returning a Workload",
        details="see [workloads/README.md](workloads/README.md)")
    data_dir: str | None = option(
        None, metavar="DIR",
        help="the workload's data (a folder; each workload says what it reads)",
        details="see [workloads/README.md](workloads/README.md)")
    data: DataSource = option(
        "real", help="synthetic: random data of the workload's shapes, for throughput runs at "
                     "any size")
    model_size: str | None = option(
        None, metavar="SIZE", unset="per workload",
        help="the workload's model size: a preset (e.g. textlm tiny|small|124m|350m|1b) or "
             "explicit dims (`layers=4,dim=256,heads=4,seq=256`)")
    tokenizer: str | None = option(
        None, metavar="DIR",
        help="textlm: the tokenizer of model directory DIR gives the vocabulary; --data-dir is "
             "a set packed with it (`gpuflow data pack --tokenizer DIR`)",
        details="see [workloads/finetune.md](workloads/finetune.md)")
    from_config: bool = option(
        False, help="hf:DIR: random weights from the directory's config.json instead of its "
                    "trained ones")
    seq_len: int | None = option(
        None, metavar="N", unset="hf:DIR: its context, at most 1024",
        help="hf:DIR: tokens per training sequence")
    truncate_chats: bool = option(
        False, help="hf:DIR: cut conversations longer than --seq-len instead of refusing them",
        details="see [workloads/finetune.md](workloads/finetune.md)")
    val_speakers: str | None = option(
        None, metavar="NAMES", unset="the last speaker by name",
        help="speech: speakers held out for validation, comma-separated; none: takes 0-4 of "
             "every speaker",
        details="see [workloads/speech.md](workloads/speech.md)")
    batch_seconds: float | None = option(
        None, metavar="S", unset="asr: 60",
        help="asr: audio seconds per training batch (padded), batches formed by duration",
        details="see [workloads/asr.md](workloads/asr.md)")
    max_audio_seconds: float | None = option(
        None, metavar="S", unset="asr: 30",
        help="asr: longer utterances are dropped from training (counted), and refused by "
             "the server",
        details="see [workloads/asr.md](workloads/asr.md)")
    image_size: int | None = option(
        None, metavar="PX", unset="images: 224",
        help="images: the side of the square crops the model trains and serves on",
        details="see [workloads/images.md](workloads/images.md)")
    strict_data: bool = option(
        False, help="images: stop at the first file that does not decode, naming it (default: "
                    "skip and count it)")
    decode: Decode | None = option(
        None, unset="auto",
        help="images: where JPEGs are decoded; auto falls back to the CPU and says why",
        details="see [workloads/images.md](workloads/images.md)")
    device: str = option("auto", metavar="auto|cpu|cuda|cuda:N",
                         help="auto picks CUDA when present")
    precision: Precision = option(
        "fp32",
        help="fp32, tf32 (CUDA tensor cores), or bf16 or fp16 autocast over fp32 master "
             "weights; fp8: torchao float8 matmuls in the linear layers that gain, bf16 "
             "autocast elsewhere (H100-class GPUs, turns on --compile, needs gpuflow[fp8])",
        details="see [precision.md](precision.md)")
    batch_size: int | Literal["auto"] = option(
        DEFAULT_BATCH_SIZE, metavar="N|auto", parse=_int_or_auto,
        help="samples per micro-batch, or auto: the largest that fits, accumulating to keep "
             "the global batch",
        details="see [planner.md](planner.md#in-the-trainer-strategy-auto-and-batch-size-auto)")
    fp8_recipe: Fp8Recipe = option(
        "tensorwise",
        help="--precision fp8's scaling: one scale per tensor (and fp8 all-gathers under "
             "fsdp), or per row (more accurate, a little slower)")
    fp8_min_features: int | None = option(
        None, metavar="N|auto", parse=_int_or_none, unset="auto",
        help="--precision fp8 converts only the linear layers whose in and out features are "
             "both at least N (0: every layer fp8 can run); auto: torchao's size thresholds "
             "for the recipe",
        details="see [precision.md](precision.md#which-layers-compute-in-fp8)")
    global_batch: int | None = option(
        None, unset="batch x accum x dp",
        help="samples per optimizer step over all ranks, kept by --batch-size auto and "
             "--strategy auto")
    memory_cap_gib: float | None = option(
        None, metavar="G", unset="GPU: its free memory; CPU: 90% of RAM",
        help="memory --batch-size auto may use per device, GiB")
    grad_accum: int = option(
        1, help="micro-batches per optimizer step (global batch = batch size x accum x dp)")
    lr: float = option(3e-3, help="peak learning rate")
    optimizer: OptimizerName = option(
        "adamw", help="AdamW (betas 0.9/0.95) or SGD with Nesterov momentum 0.9",
        details="fused kernels on CUDA and CPU, one call per group of sharded (DTensor) or "
                "whole parameters (foreach for SGD on sharded ones: DTensor has no rule for "
                "fused SGD)")
    optimizer_impl: OptimizerImpl = option(
        "fused", help="the update's kernels: fused (one pass over the parameters) or foreach "
                      "(several multi-tensor passes, torch's default)",
        details="fused falls back to foreach where it cannot run (devices other than CUDA "
                "and CPU, SGD on sharded parameters); both give the same losses within "
                "fp32 rounding, see [training.md](training.md#the-optimizers-kernels)")
    loss_chunks: int = option(
        1, help="compute a language model's loss N chunks of rows at a time, never the whole "
                "fp32 logits (1: in one piece)",
        details="textlm and hf:DIR, --strategy single or ddp; see "
                "[training.md](training.md#chunked-cross-entropy)")
    weight_decay: float = option(
        0.01, help="applied to weight matrices only, never to biases and norms")
    schedule: Schedule = option(
        "cosine", help="after warmup: cosine decay to 10% of --lr, or constant")
    warmup_steps: int = option(20, help="linear warmup steps")
    max_steps: int | None = option(
        None, help="length of the run in optimizer steps; give it or --epochs (a stream "
                   "without a length needs --max-steps)")
    epochs: float | None = option(
        None, unset="the workload's (10; speech 40) without --max-steps",
        help="length of the run in passes over the training set; give it or --max-steps")
    eval_every: int = option(
        100, help="evaluate every N steps (0: only at the end); the run always ends with an "
                  "evaluation")
    eval_batches: int = option(
        DEFAULT_EVAL_BATCHES,
        help="validation batches each evaluation reads: a fixed subset spread over the set, "
             "the same every time; a set of at most N batches is evaluated whole (0: always "
             "whole)",
        details="the banner says which; see [data.md](data.md#bounded-evaluation)")
    log_every: int = option(
        10, help="write one metrics record per N steps (figures are means over those steps)")
    compile: bool = option(
        False, help="`torch.compile` each repeated block in place (--compile-scope model: "
                    "the whole model)",
        details="identical blocks share one graph, so compile time does not grow with depth; "
                "a model without blocks is compiled whole; if compilation fails the run says "
                "why and continues eagerly")
    compile_scope: CompileScope = option(
        "block", help="what --compile compiles: each repeated block, or the whole model as "
                      "one graph (--strategy single, ddp or tp)",
        details="see [training.md](training.md#whole-model-compile)")
    activation_checkpointing: bool = option(
        False, help="recompute the workload's repeated blocks in backward to save activation "
                    "memory")
    cuda_graphs: bool = option(
        False,
        help="replay each step's forward and backward as CUDA graphs "
             "(`torch.compile(mode=\"reduce-overhead\")` of the whole model; turns --compile "
             "on): for launch-bound, static-shape runs of a small model on one GPU",
        details="needs `--strategy single`, `--grad-accum 1` (a replay reuses the memory the "
                "last one wrote its gradients to) and batches of one shape only; anything "
                "else (a CPU, ddp/fsdp/tp/pp, accumulation or `--batch-size auto`, a workload "
                "that pads each batch to its longest sample, as speech does) is refused with "
                "exit 2")
    ema_decay: float | None = option(
        None, metavar="D", parse=_decay_or_off, unset="the workload's (off; speech 0.99)",
        help="keep an exponential moving average of the weights, D per step (0.99 averages "
             "about the last 100 steps); evaluations and the final weights use it (off or 0: "
             "none)",
        details="see [training.md](training.md#weight-averaging)")
    clip_grad: float | None = option(
        None, metavar="X", parse=_positive_or_none, unset="off",
        help="clip the global gradient norm to X (none, off or 0: no clipping)")
    seed: int = option(
        0, help="seeds Python, NumPy and torch; the data order depends only on the seed and "
                "epoch")
    run_dir: str | None = option(
        None, metavar="DIR", unset="`runs/<workload>-<timestamp>`",
        help="where metrics, summary and checkpoints go")
    checkpoint_every: int = option(
        0, help="also save every N steps (0: at the end only; a final checkpoint is always "
                "saved)")
    keep_checkpoints: int = option(3, metavar="K", help="newest checkpoints kept")
    save_checkpoints: bool = option(
        True, flag="no-checkpoints",
        help="write no checkpoint at all, not even the final one (benchmarks, throwaway runs)")
    save_on_signal: bool = option(
        True, flag="no-save-on-signal",
        help="on SIGTERM or SIGUSR1 (a scheduler's preemption notice) finish the step, save a "
             "checkpoint and exit with code 75 for a requeue; off: the signal ends the run at "
             "once",
        details="see [checkpoints.md](checkpoints.md#preemption)")
    resume: str | bool = option(
        False, metavar="DIR",
        help="continue the run in DIR (or in --run-dir) from its newest valid checkpoint, "
             "with its saved configuration unless flags override it",
        details="see [checkpoints.md](checkpoints.md)")
    num_workers: int = option(
        0, help="DataLoader worker processes (batches are the same with any number)")
    max_nonfinite_steps: int = option(
        20, help="stop after N consecutive NaN/inf losses (exit code 3)")
    tensorboard: bool = option(
        False, help="also write the scalars as TensorBoard events in RUN_DIR/tensorboard "
                    "(needs gpuflow[tensorboard])")
    progress: bool = option(
        True, flag="no-progress",
        help="no live progress output (the summary table still prints)")
    lora_rank: int | None = option(
        None, group=LORA, metavar="R", unset="off: every weight trains",
        help="train rank-R LoRA adapters beside a frozen base instead of every weight",
        details="see [workloads/finetune.md](workloads/finetune.md#lora-adapters)")
    lora_alpha: float | None = option(
        None, group=LORA, metavar="A", unset="2 x rank",
        help="the adapters' scale is A / rank")
    lora_dropout: float = option(0.0, group=LORA, help="dropout on the adapters' input")
    lora_targets: str = option(
        "all-linear", group=LORA, metavar="NAMES|all-linear",
        help="modules that get adapters, comma-separated (q_proj,v_proj), or every linear "
             "layer but the output layer")
    quantize_base: BaseQuantization | None = option(
        None, group=LORA, unset="off: the base in its dtype",
        help="hold the frozen base's linear layers as NF4 (QLoRA: torchao, gpuflow[fp8]), "
             "dequantized layer by layer in the forward",
        details="see [workloads/finetune.md](workloads/finetune.md#qlora-an-nf4-base)")
    strategy: Strategy | None = option(
        None, group=DISTRIBUTED, unset="single for 1 process, ddp for more",
        help="how the model and the data are spread over the processes; auto: the "
             "planner's best plan for the devices present",
        details="see [parallelism.md](parallelism.md)")
    reshard_after_forward: bool = option(
        True, group=DISTRIBUTED,
        help="fsdp: free gathered parameters after forward (ZeRO-3-like) or keep them for "
             "backward (ZeRO-2-like)")
    fsdp_wrap: FsdpWrap = option(
        "block", group=DISTRIBUTED,
        help="fsdp's unit of gathering: each repeated block, gathered just before it runs; "
             "or the whole model, gathered in one all-gather and reduced in one collective "
             "per step (two collectives per step instead of three per block)",
        details="fewer points where ranks wait for each other, for CPUs and slow links, "
                "where collectives cannot overlap compute; needs no `blocks`")
    bucket_mb: float | None = option(
        None, group=DISTRIBUTED,
        unset=f"PyTorch's: 1 for the first bucket, {DDP_DEFAULT_BUCKET_MIB:g} after",
        help="ddp: MiB of gradients per all-reduce bucket; a bucket is all-reduced once "
             "backward has filled it, so smaller buckets start earlier and leave less to "
             "finish after backward, larger ones make fewer calls")
    fsdp_prefetch: int | None = option(
        None, group=DISTRIBUTED, unset="FSDP's own",
        help="fsdp per block: each block's forward starts the all-gathers of the next N "
             "blocks, its backward those of the N before it, whether or not the host runs "
             "ahead (FSDP alone prefetches one, in forward only while the host is ahead of "
             "the GPU); holds N more blocks gathered")
    tp: int = option(
        1, group=DISTRIBUTED, metavar="M",
        help="tensor-parallel degree: all processes with --strategy tp, or an FSDP x TP mesh "
             "(dp = processes / M) with --strategy fsdp")
    pp: int = option(
        1, group=DISTRIBUTED, metavar="K",
        help="pipeline stages: all processes with --strategy pp, or an FSDP x PP mesh with "
             "--strategy fsdp")
    dp: int | None = option(
        None, group=DISTRIBUTED, unset="processes / (tp x pp)",
        help="data-parallel degree, checked: dp x tp x pp = processes")
    pp_schedule: PipelineSchedule = option(
        "1f1b", group=DISTRIBUTED, help="pipeline schedule (interleaved: 2 stages per rank)")
    pp_split: PipelineSplit = option(
        "auto", group=DISTRIBUTED,
        help="how the model is cut into stages: traced with torch.export, or manual: module "
             "copies cut at the repeated blocks; auto traces and falls back to manual "
             "stages, saying so, when tracing fails or the traced first stage takes the "
             "model's inputs in another order",
        details="in manual stages the other stages' blocks are stood in for; the layers "
                "outside the blocks are held on every stage and their gradients summed")
    microbatches: int | None = option(
        None, group=DISTRIBUTED, unset="2 x pp",
        help="pipeline micro-batches per --batch-size batch")
    nproc: int = option(1, group=DISTRIBUTED,
                        help="worker processes on this machine (one per GPU)")
    nnodes: int = option(1, group=DISTRIBUTED, metavar="M",
                         help="machines in the job (c10d rendezvous)")
    node_rank: int = option(0, group=DISTRIBUTED, metavar="R",
                            help="this machine's rank in the job; node 0 hosts the rendezvous")
    rdzv_endpoint: str | None = option(
        None, group=DISTRIBUTED, metavar="HOST:PORT",
        help="the c10d rendezvous of a multi-node job (on node 0)")
    max_restarts: int = option(
        0, group=DISTRIBUTED, metavar="K",
        help="restart the workers after a failure, resuming from the last checkpoint")
    extra: dict[str, Any] = option(
        default_factory=dict, cli=False,
        help="the workload's own settings, given in code (no flag, no TOML key)")
