"""The run configuration: one typed dataclass per section, documented field by field.

Keys here are the user-facing names (YAML and dotted CLI overrides such as
``policy.model_name=Qwen/Qwen3-8B``). Fields whose allowed values form a closed set declare
them in ``metadata={"choices": (...)}`` so the loader can name them in errors; plugin-selecting
fields (``policy.training_backend``, ``policy.rollout_engine``, ``algorithm.adv_estimator``,
...) are validated against the plugin registry at assembly time instead, since plugins are
open-ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ClusterConfig",
    "OptimConfig",
    "PolicyTrainConfig",
    "SamplingConfig",
    "LoraConfig",
    "PolicyConfig",
    "AlgorithmConfig",
    "RewardConfig",
    "DatasetConfig",
    "RolloutQuantConfig",
    "TrainingQuantConfig",
    "RolloutCorrectionConfig",
    "QuantizationConfig",
    "R3Config",
    "MoEConfig",
    "CriticConfig",
    "CheckpointingConfig",
    "LoggerConfig",
    "WeightSyncConfig",
    "AsyncTrainingConfig",
    "RayConfig",
    "ControllerConfig",
    "AssemblyConfig",
    "TrainerConfig",
    "EvalConfig",
    "RunConfig",
]


def choices(*values: Any) -> dict[str, Any]:
    """Field metadata naming the allowed values of a closed-set field."""
    return {"choices": tuple(values)}


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    num_nodes: int = 1  # machines in the run
    gpus_per_node: int = 0  # 0 = CPU run
    device: str = field(default="auto", metadata=choices("auto", "cpu", "cuda"))  # auto: cuda if available


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    lr_schedule: str = field(default="constant", metadata=choices("constant", "linear", "cosine"))
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # floor of linear/cosine decay, as a fraction of lr


@dataclass(kw_only=True, slots=True)
class PolicyTrainConfig:
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batch_size: int = 0  # sequences per optimizer step; 0 = whole batch (one step per epoch)
    micro_batch_size: int = 8  # sequences per forward/backward (gradient accumulation)
    gradient_checkpointing: bool = False
    mixed_precision: str = field(default="auto", metadata=choices("auto", "bf16", "fp32"))  # auto: bf16 on GPU
    # padding-free forwards: auto = pack real tokens into fewer rows or trim all-pad columns, whichever is
    # cheaper; trim = only drop all-pad columns; none = the padded grid
    packing: str = field(default="auto", metadata=choices("auto", "trim", "none"))
    compile_layers: bool = False  # torch.compile each decoder layer (GPU speed; parameter names unchanged)
    # one-rank fast path of the fsdp2 backend: no fully_shard; the module holds bf16 compute weights, the
    # optimizer fp32 master weights (flat buffers, foreach/fused ops). auto = on when world_size == 1 and
    # no FP8 training; on = required (error otherwise); off = always fully_shard
    single_device: str = field(default="auto", metadata=choices("auto", "on", "off"))
    # on the one-rank path, q/k/v and gate/up as one GEMM each over their adjacent weights (same math up to
    # accumulation order; not in the bitwise mode). auto = on where the one-rank path runs on CUDA and
    # exact_logprobs is off; on = required (error otherwise, CPU included); off = a GEMM per projection
    group_projections: str = field(default="auto", metadata=choices("auto", "on", "off"))
    # optimizer steps whose loss or grad norm is non-finite are skipped (no update, counted in
    # actor/nonfinite_skipped); this many in a row stop the run with an error
    max_consecutive_nonfinite_steps: int = 3


@dataclass(kw_only=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding in the native engine (lumenrl-sddd draft; docs/decisions/0013-sddd.md)."""

    draft_path: str = ""  # empty: off; an exported Eagle3 dir (config.json) or a DFlash draft dir (draft.pt)
    num_draft_tokens: int = field(default=5, metadata={"ge": 1})  # k drafted per verify step (DFlash: block_size - 1)
    online_sddd_steps: int = field(default=0, metadata={"ge": 0})  # RL: SDDD draft steps after each weight sync
    online_sddd_lr: float = field(default=1e-3, metadata={"gt": 0})  # RL online SDDD: draft learning rate
    compile_draft: bool = True  # CUDA: an Eagle3 draft's chained steps through torch.compile (fewer kernels per step)


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    n: int = 8  # responses per prompt (group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    ignore_eos: bool = False  # for benchmarks: always generate max_new_tokens
    max_batch_size: int = 256  # concurrent sequences in the engine
    gpu_memory_utilization: float = 0.5  # fraction of free GPU memory for the KV cache
    cuda_graphs: bool = True  # decode with CUDA graphs on GPU
    compile: str = field(default="none", metadata=choices("none", "full"))  # full: torch.compile the decode forward (GPU)
    fuse_projections: bool = True  # native engine: one q/k/v and one gate/up GEMM per layer (fused weight views)
    overlap_sync: bool = True  # native engine: read step t's tokens while step t+1 runs (results unchanged)
    # native engine: rows of one context admitted together (a group's n samples of a prompt) run one prefill; the
    # others copy its K/V and last logits (vLLM and SGLang share such prefixes through their prefix caches)
    share_prefill: bool = True
    # native engine: prefills too large for a CUDA graph run their contexts back to back, no padding (one forward for
    # the rows a partial rollout continues after an update); auto = where torch's varlen flash attention runs (CUDA,
    # 16-bit); on = everywhere (a block-diagonal mask elsewhere); off = left-padded rows
    pack_prefill: str = field(default="auto", metadata=choices("auto", "on", "off"))
    # native engine: decode attends to a multiple of this many cache columns, one CUDA graph per (batch bucket, that
    # length); 0 = the engine's default (64 on CUDA; exact lengths on the CPU). Larger: fewer graphs to capture in a
    # run, at no cost in the attention where a split spans the whole length (it stops at each row's own column)
    kv_block: int = field(default=0, metadata={"ge": 0})
    # native engine, MoE experts on lumenrl-quant's fused Triton kernel (FP8 experts with the fp8_block scheme):
    # auto = on for bf16 experts on CUDA with Triton; on = every recognised experts module on any device
    # (CPU: torch emulation); off = transformers' experts implementation
    fused_moe: str = field(default="auto", metadata=choices("auto", "on", "off"))
    # native engine, CUDA: 16-bit decode GEMMs of the fused projections on its Triton decode kernel (decision 0023):
    # auto = shapes with measured launch parameters, 33..64 rows; on = every shape it takes, 1..128 rows; off = cuBLAS
    decode_linear: str = field(default="auto", metadata=choices("auto", "on", "off"))
    pdl: bool = True  # native engine, CUDA sm90+: decode kernels launch with programmatic dependent launch
    # bitwise on-policy mode (native engine + fsdp2 actor): batch-invariant kernels on both sides, so rollout
    # log-probs equal the trainer's exactly; needs full-precision rollout (no FP8/MX weights or KV), compile none
    exact_logprobs: bool = False
    # what a nonzero actor/logprob_max_abs_diff does while exact_logprobs is on: raise, warn, or nothing
    exact_logprobs_check: str = field(default="error", metadata=choices("error", "warn", "off"))
    # rollout tensor parallel degree: passed to the vllm/sglang adapters; the native/hf/atom engines decode on
    # one device and refuse > 1 at assembly (decision 0016)
    tensor_parallel_size: int = 1
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # native engine: draft-then-verify


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Training model parallelism (decisions 0016, 0017); data-parallel size = world / (tp * cp * pp).
    Expert parallelism stays ``moe.expert_parallel_size`` (one key)."""

    tp: int = 1  # tensor (+ sequence) parallel degree over the mesh dim "tp"
    cp: int = 1  # context parallel degree over the mesh dim "cp"
    pp: int = 1  # pipeline stages (megatron backend only: Megatron's 1F1B schedule; fsdp2 refuses > 1)


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """LoRA adapters on the policy (peft): only the adapters train; the reference is the base."""

    rank: int = 0  # adapter rank r; 0 = full fine-tuning (no adapters)
    alpha: float = 16.0  # scaling = alpha / rank
    dropout: float = 0.0  # dropout on the adapter input (update forward only)
    # leaf names of the linear layers that get adapters (those present in the model are used)
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    model_name: str = "lumenrl:tiny-qwen3-arith"  # HF path/id, or a built-in "lumenrl:" demo model
    tokenizer_name: str = ""  # empty: same as model_name
    dtype: str = field(default="auto", metadata=choices("auto", "float32", "bfloat16", "float16"))
    training_backend: str = "fsdp2"  # lumenrl.training_backends plugin name
    rollout_engine: str = "native"  # lumenrl.rollout_engines plugin name
    max_prompt_length: int = 64
    trust_remote_code: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: PolicyTrainConfig = field(default_factory=PolicyTrainConfig)
    rollout: SamplingConfig = field(default_factory=SamplingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    name: str = field(default="grpo", metadata=choices("grpo", "dapo", "ppo", "sddd"))  # sddd: trainer.name sddd
    adv_estimator: str = "grpo"  # lumenrl.advantage_estimators plugin name
    norm_adv_by_std: bool = True  # false = Dr.GRPO
    policy_loss: str = "ppo_clip"  # lumenrl.policy_losses plugin name
    clip_ratio_low: float = 0.2  # eps_low
    clip_ratio_high: float = 0.2  # eps_high (DAPO clip-higher: 0.28)
    clip_ratio_c: float | None = 3.0  # dual-clip constant (> 1); null = dual-clip off
    loss_agg_mode: str = field(
        default="token-mean",
        metadata=choices("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    )
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 1e-3
    kl_loss_type: str = field(default="low_var_kl", metadata=choices("k1", "k2", "k3", "low_var_kl"))
    use_kl_in_reward: bool = False
    kl_reward_coef: float = 1e-3
    entropy_coef: float = 0.0
    # recompute: a forward pass before the update gives old_log_probs; reuse: one optimizer step per
    # rollout batch (on-policy; async_rl: the proximal policy), so old_log_probs are the update forward's own
    # log-probs, detached (ratio 1, TRL's default): one forward pass less per step; refused where something
    # reads them earlier
    old_log_probs: str = field(default="recompute", metadata=choices("recompute", "reuse"))
    # DAPO
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    max_num_gen_batches: int = 4  # bound on extra generation batches to fill the train batch
    overlong_buffer_len: int = 0  # L_buf; 0 disables overlong shaping
    overlong_penalty_factor: float = 1.0


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    name: str = "math"  # lumenrl.rewards plugin name
    function: str = ""  # "module:fn" user reward; overrides name when set
    format_score: float = 0.0  # score for a well-formed but wrong answer


@dataclass(kw_only=True, slots=True)
class DatasetConfig:
    name: str = "arithmetic"  # built-in generated task, or "jsonl" / "parquet"
    path: str = ""  # local jsonl/parquet file for name=jsonl|parquet
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    prompt_template: str = "{prompt}"  # used when the tokenizer has no chat template
    use_chat_template: bool = True
    train_batch_size: int = 8  # prompts per step
    num_examples: int = 2000  # size of a generated task
    difficulty: int = 2  # generated tasks: digits per operand
    shuffle: bool = True


@dataclass(kw_only=True, slots=True)
class RolloutQuantConfig:
    precision: str = field(default="bf16", metadata=choices("bf16", "fp16", "fp32", "fp8", "mxfp8", "mxfp4"))
    scheme: str = ""  # lumenrl.quant_schemes plugin name; empty = derived from precision
    skip_first_n_layers: int = 0
    skip_last_n_layers: int = 0
    quantize_lm_head: bool = False  # also the (untied) output head: faster decode, FP8 rounding in the logits
    # fp8_row SwiGLU MLPs: SiLU * up and the down input's FP8 quantization (1 x 128 group scales) in the gate/up
    # GEMM's epilogue (lumenrl_quant.fused_mlp). Off by default: no faster decode on the H200 (figures: benchmarks/RESULTS.md,
    # entry fused_mlp), slightly lower KL; off = per-token scales, separate kernels
    fuse_mlp: bool = False
    kv_cache_dtype: str = field(default="auto", metadata=choices("auto", "fp8"))
    kv_scale_recalibration: bool = True  # recompute KV scales after every weight sync


@dataclass(kw_only=True, slots=True)
class TrainingQuantConfig:
    precision: str = field(default="bf16", metadata=choices("bf16", "fp32", "fp8", "mxfp8", "mxfp4"))
    recipe: str = field(default="blockwise", metadata=choices("tensorwise", "rowwise", "blockwise"))
    fp8_format: str = field(default="hybrid", metadata=choices("e4m3", "hybrid"))
    weight_cache: bool = True


@dataclass(kw_only=True, slots=True)
class RolloutCorrectionConfig:
    enabled: bool = False
    mode: str = "tis_token"  # lumenrl.rollout_corrections plugin name
    clip: float = 2.0  # TIS cap C
    # MIS band; None = the mode's own default ([0.5, 2] for token/sequence MIS and seq_mis,
    # [0.999, 1.001] for the geometric-mean mask, whose ratio is a per-token average)
    mask_low: float | None = None
    mask_high: float | None = None
    extreme_tau: float = 2.0  # threshold for the extreme-token fraction metric


@dataclass(kw_only=True, slots=True)
class QuantizationConfig:
    rollout: RolloutQuantConfig = field(default_factory=RolloutQuantConfig)
    training: TrainingQuantConfig = field(default_factory=TrainingQuantConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass(kw_only=True, slots=True)
class R3Config:
    enabled: bool = False  # the engine records routes (route_recording), the backend replays them (route_replay)
    # hard_assignment: recorded experts, gate weights from the live router logits (router trained);
    # distribution: recorded experts and recorded probabilities (needs record_router_logits)
    replay_mode: str = field(default="hard_assignment", metadata=choices("hard_assignment", "distribution"))
    record_router_logits: bool = False  # also record router probabilities (B, P+T, L_moe, E) float32
    router: str = ""  # lumenrl.moe_routers plugin name; empty = by model type


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    r3: R3Config = field(default_factory=R3Config)
    expert_parallel_size: int = 1


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    enabled: bool = False  # PPO turns it on
    model_name: str = ""  # empty: same as policy.model_name
    cliprange_value: float = 0.5
    value_loss_coef: float = 0.5
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))


@dataclass(kw_only=True, slots=True)
class CheckpointingConfig:
    enabled: bool = True
    save_every: int = 0  # steps; 0 = only at the end
    keep_last: int = 2
    resume: bool = False  # continue from the latest checkpoint in trainer.output_dir
    export_hf: bool = True  # save_pretrained the final policy


@dataclass(kw_only=True, slots=True)
class LoggerConfig:
    backends: list[str] = field(default_factory=lambda: ["jsonl", "console"])  # lumenrl.loggers names
    progress_bar: bool = True
    wandb_project: str = ""  # empty: trainer.project_name
    log_every: int = 1  # console lines every N steps (jsonl, tensorboard and wandb keep every step)


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    method: str = "inprocess"  # lumenrl.weight_syncs plugin name
    bucket_size_mb: int = 512
    snapshot_dir: str = ""  # filesystem sync: where snapshots are written


@dataclass(kw_only=True, slots=True)
class AsyncTrainingConfig:
    # Read by trainer.name=async_rl (docs/decisions/0012-async-rl.md); with trainer.name=rl,
    # enabled=true is refused by assembly.
    enabled: bool = False
    staleness_threshold: float = field(default=0.0, metadata={"ge": 0})  # extra window fraction produced ahead
    trigger_parameter_sync_step: int = field(default=1, metadata={"ge": 1})  # local updates per weight sync
    require_batches: int = field(default=1, metadata={"ge": 1})  # mini-batches per local update
    partial_rollout: bool = False  # interrupt in-flight sequences at a sync, resume under the new weights
    # with partial_rollout, the version a group's lag counts from: "finish", the weights that finished it (its
    # older tokens stay off-policy, weighed by the rollout correction), or "start", its oldest token (strict:
    # a group resumed across more than ceil(staleness_threshold) syncs is dropped as stale)
    staleness_from: str = field(default="finish", metadata=choices("finish", "start"))
    # with partial_rollout, what a sequence interrupted by a weight update continues on: "recompute", its context
    # prefilled again under the new weights (AReaL's interruptible rollout), or "keep", the keys/values its old
    # weights cached (PipelineRL's in-flight update: only its new tokens see the new weights; no prefill)
    resume_kv: str = field(default="recompute", metadata=choices("recompute", "keep"))
    queue_size: int = field(default=0, metadata={"ge": 0})  # samples; 0: window capacity + one window
    recompute_proximal_log_probs: bool = True  # decoupled PPO: old_log_probs = current policy before update


@dataclass(kw_only=True, slots=True)
class RayConfig:
    address: str = ""  # empty: start a local Ray; "auto": join a running cluster
    colocate: bool = True  # true: roles share one actor per rank; false: separate rollout pool (disaggregated)
    num_workers: int = field(default=1, metadata={"ge": 1})  # training ranks (one Ray actor each)
    rollout_workers: int = field(default=0, metadata={"ge": 0})  # disaggregated rollout replicas; 0: num_workers
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = field(default=0.0, metadata={"ge": 0})  # 0: CPU actors (gloo)
    placement_strategy: str = field(default="PACK", metadata=choices("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    release_rollout_memory: bool = True  # colocated: free the engine KV cache while training runs
    # per-role groups (original LumenRL: controller.ray.<role>.{dispatch_mode, num_workers}); roles
    # actor/ref/critic/rollout; checked and normalized at load (config/rules.py _check_ray_roles)
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class ControllerConfig:
    name: str = "local"  # lumenrl.controllers plugin name
    ray: RayConfig = field(default_factory=RayConfig)


@dataclass(kw_only=True, slots=True)
class AssemblyConfig:
    strict_policy: bool = True
    allowed_training_backends: list[str] = field(default_factory=list)  # empty: all allowed
    allowed_inference_backends: list[str] = field(default_factory=list)  # empty: all allowed
    check_plugin_versions: bool = True


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    name: str = "rl"  # lumenrl.trainers plugin name
    output_dir: str = "runs/default"
    project_name: str = "lumenrl"  # the wandb project (unless logger.wandb_project); SDDD transfer namespaces
    experiment_name: str = "default"
    test_freq: int = 0  # evaluate every N steps; 0 = never during training
    total_epochs: int = 0  # 0 = bounded by num_training_steps only
    warm_start_sft_steps: int = 0  # built-in demo: short SFT before RL (0 = none)
    warm_start_sft_lr: float = field(default=3e-3, metadata={"gt": 0})  # constant lr of the warm-start SFT
    warm_start_sft_batch_size: int = field(default=64, metadata={"ge": 1})  # examples per SFT step
    # torch intra-op threads of the run's processes; 0 = torch's default on CPU, one once the models are loaded on
    # an accelerator (the host only keeps books there: a thread pool stalls small operators on a busy host)
    cpu_threads: int = field(default=0, metadata={"ge": 0})
    # output_dir holding another config's run (its config.yaml differs): refused unless true, which first
    # removes that run's outputs (the same config: resumed with checkpointing.resume=true, else replaced)
    overwrite: bool = False


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    enabled: bool = True
    num_examples: int = 64
    temperature: float = 0.0  # greedy
    every: int = 0  # steps; 0 = before and after training only


@dataclass(kw_only=True, slots=True)
class SDDDConfig:
    """Speculative-decoding draft distillation (algorithm.name sddd, trainer.name sddd; lumenrl-sddd)."""

    draft: str = "eagle3"  # lumenrl.draft_models plugin name: eagle3 | dflash
    mode: str = field(default="online", metadata=choices("online", "disaggregated"))  # teacher in-process / own process
    transfer_engine: str = "inprocess"  # lumenrl.transfer_engines name (disaggregated: shm, tcp, mooncake)
    tcp_host: str = "127.0.0.1"  # tcp transfer engine: the teacher's bind address
    tcp_port: int = field(default=0, metadata={"ge": 0})  # 0: any free port
    teacher_train_steps: int = field(default=0, metadata={"ge": 0})  # demo: teach the teacher the synthetic corpus first
    num_prompts: int = field(default=256, metadata={"ge": 1})  # synthetic-corpus prompts regenerated by the teacher
    prompt_tokens: int = field(default=10, metadata={"ge": 1})  # characters of each corpus line kept as the prompt
    response_tokens: int = field(default=40, metadata={"ge": 1})  # tokens the teacher regenerates per prompt
    teacher_temperature: float = field(default=0.0, metadata={"ge": 0})  # teacher regeneration; 0 = greedy
    batch_size: int = field(default=32, metadata={"ge": 1})  # sequences per draft step
    lr: float = field(default=3e-3, metadata={"gt": 0})
    draft_vocab_size: int = field(default=0, metadata={"ge": 0})  # eagle3: 0 = the target vocabulary
    ttt_steps: int = field(default=7, metadata={"ge": 1})  # eagle3 training-time-test unroll
    num_aux_layers: int = field(default=3, metadata={"ge": 1})  # dflash: evenly spaced teacher layers
    dflash_layers: int = field(default=2, metadata={"ge": 1})
    block_size: int = field(default=8, metadata={"ge": 2})  # dflash block (anchor + block_size - 1 drafted)
    gamma: float = field(default=7.0, metadata={"gt": 0})  # dflash position weights exp(-(k-1)/gamma)
    num_draft_tokens: int = field(default=5, metadata={"ge": 1})  # eagle3 k for the tau evaluation
    eval_prompts: int = field(default=16, metadata={"ge": 1})  # prompts for the tau evaluation (native engine)


@dataclass(kw_only=True, slots=True)
class RunConfig:
    seed: int = 1
    num_training_steps: int = 20
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    assembly: AssemblyConfig = field(default_factory=AssemblyConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sddd: SDDDConfig = field(default_factory=SDDDConfig)
