"""One run of verl's own `python -m verl.trainer.main_ppo` (GRPO, Megatron actor and ref, vLLM rollout,
Ray on this machine, verl's GSM8K function reward): the command, its environment, and the run.

`RunSpec` is one run: one engine ("ps": ps-bridge with the README's three settings; "stock": verl's own
Megatron engine), one seed, a number of steps, one output folder, optionally resumed from a checkpoint.
`run_main_ppo` runs it and returns what it wrote: verl's per-step metrics (its "file" logger), the log
with the Ray workers' lines, the rollouts verl dumps and the checkpoints.

On a machine without CUDA or an NPU the command also carries the CPU path (`CPU_SETTINGS` says each
setting and why; `ps_bridge.compat.main_ppo_on_cpu` the patches verl's processes load through
`VERL_USE_EXTERNAL_MODULES`). On GPUs the same function runs the GPU command, with none of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ENGINES = ("ps", "stock")
ROLLOUT_SEEDS = "ps_bridge.compat.rollout_seeds"
# the rollout dump with each response's token log-probs (old, ref, vLLM's), for the per-response comparison
LOGPROB_DUMP = "ps_bridge.tools.grpo.logprob_dump"

#: What the CPU run sets beyond a GPU run, and why (docs/verl.md lists the same).
CPU_SETTINGS: Dict[str, str] = {
    "VERL_USE_EXTERNAL_MODULES=ps_bridge.compat.main_ppo_on_cpu":
        "verl imports it in every process it starts (verl/__init__.py): the CPU patches, named there",
    "VERL_ENGINE_DEVICE=cuda":
        "verl registers its Megatron engine for cuda and npu only; the CPU looks it up under cuda",
    "ray_kwargs.ray_init.num_gpus=1":
        "verl places its workers on Ray 'GPU' resources and counts only those (one per worker here)",
    "ray_kwargs.ray_init.num_cpus=8":
        "Ray's logical CPU slots for verl's actors (trainer, workers, vLLM server, reward, TransferQueue)",
    "ray_kwargs.ray_init.include_dashboard=False":
        "two fewer Python processes at Ray's start (Ray gives its node 30 s to come up, verl cannot change it)",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1":
        "each TransferQueue storage unit is a Ray actor taking a CPU slot",
    "actor_rollout_ref.rollout.enable_sleep_mode=False, free_cache_engine=False":
        "vLLM's CPU build refuses sleep mode ('Sleep mode is not supported on current platform'); verl frees the KV cache through it",
    "actor_rollout_ref.rollout.enforce_eager=True":
        "no CUDA graphs on a CPU; also skips torch.compile's start-up",
    "actor_rollout_ref.actor.megatron.dtype=float32 (and ref, rollout)":
        "a CPU gains nothing from bf16, and the two engines are compared within float32 noise",
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer=False":
        "megatron-core loads the distributed optimizer's state only on TE's or Apex's Adam, so a run could save but "
        "not resume; the plain optimizer is the same Adam on one rank",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64":
        "weights reach vLLM through a shared-memory bucket of this size (2 GB by default) in /dev/shm",
    "VLLM_CPU_KVCACHE_SPACE=1":
        "vLLM's CPU KV cache in GiB (its default takes a large share of memory)",
    "TORCHDYNAMO_DISABLE=1":
        "verl's entropy is torch.compiled: 10-14 s per process on 2 cores for a tiny model",
}


@dataclasses.dataclass
class RunSpec:
    engine: str
    model_dir: Path
    data_dir: Path
    out_dir: Path
    seed: int = 1
    steps: int = 3
    prompts_per_step: int = 2
    n: int = 4
    micro_batch: int = 4
    mini_batch: int = 2
    max_prompt_length: int = 64
    max_response_length: int = 16
    save_freq: int = -1
    resume_from: Optional[Path] = None
    tree: bool = False
    sharing: bool = True  # engine "ps" only: False runs ps-bridge's engine with PS_BRIDGE_SHARING=off
    lr: float = 1e-3
    extra_overrides: Sequence[str] = ()
    timeout_s: int = 1800

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"RunSpec.engine={self.engine!r}: use one of {ENGINES}")
        if self.tree and self.engine != "ps":
            raise ValueError("RunSpec.tree=True needs engine='ps' (PS_BRIDGE_TREE=1 is ps-bridge's setting)")
        if not self.sharing and self.engine != "ps":
            raise ValueError("RunSpec.sharing=False needs engine='ps' (PS_BRIDGE_SHARING=off is ps-bridge's setting)")
        self.model_dir, self.data_dir, self.out_dir = Path(self.model_dir), Path(self.data_dir), Path(self.out_dir)


@dataclasses.dataclass
class RunResult:
    returncode: int
    out_dir: Path
    metrics_path: Path
    log_path: Path
    rollouts_dir: Path
    checkpoint_dir: Path
    steps: List[dict]
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def has_accelerator() -> bool:
    # imported here: ps_bridge.compat.main_ppo_on_cpu imports torch, which is heavy
    from ps_bridge.compat.main_ppo_on_cpu import has_accelerator as probe

    return probe()


def cpu_hybrid_rollout_refusal() -> Optional[str]:
    """Why vLLM's CPU build cannot serve a hybrid model (Qwen3.5: Gated DeltaNet beside softmax attention)
    to verl on this machine, or None. On a processor with AMX tiles vLLM-CPU 0.24.0 stops it twice: its
    platform turns prefix caching off for linear attention after the model's config hook sized the recurrent
    state's blocks for prefix caching, and VllmConfig then refuses that size (vllm/platforms/cpu.py:160-172,
    vllm/model_executor/models/config.py:453, vllm/config/vllm.py:2180); and it packs the Gated DeltaNet conv
    weight into a 2-D layout for its AMX kernel (vllm/model_executor/layers/utils.py:240), which verl's weight
    update cannot load into (vllm/model_executor/layers/mamba/mamba_mixer2.py:216). Answering vLLM "no AMX"
    in Python (`torch.cpu._is_amx_tile_supported`) did not help: the run then stopped in the delta rule's
    decode kernel ("tensor must be contiguous at last dimension"), likely because vLLM's C++ kernels detect
    the processor themselves."""
    # imported here: torch is heavy, and the launcher's other paths do not need it
    from ps_bridge.compat.torch import cpu_has_amx_tiles

    if has_accelerator() or not cpu_has_amx_tiles():
        return None
    return ("vLLM's CPU build (vllm-cpu 0.24.0) cannot serve Qwen3.5 to verl on a processor with AMX tiles "
            "(it refuses its own recurrent-state block size, vllm/config/vllm.py:2180, and packs the Gated "
            "DeltaNet conv weight where verl's weight update cannot load it, vllm/model_executor/layers/utils.py:240): "
            "run --model qwen3.5 on a GPU or on a CPU without AMX; --model qwen2.5 runs here")


def has_gated_deltanet(model_dir: Path) -> bool:
    """The checkpoint has Gated DeltaNet layers (Qwen3.5: `linear_attention` among its layer types)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    layer_types = config.get("text_config", config).get("layer_types") or ()
    return "linear_attention" in layer_types


def _overrides(spec: RunSpec, on_cpu: bool) -> List[str]:
    out = spec.out_dir.resolve()
    mb, lp_mb = spec.micro_batch, spec.micro_batch
    o = [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={spec.data_dir.resolve() / 'train.parquet'}",
        f"data.val_files={spec.data_dir.resolve() / 'test.parquet'}",
        f"data.train_batch_size={spec.prompts_per_step}",
        f"data.max_prompt_length={spec.max_prompt_length}",
        f"data.max_response_length={spec.max_response_length}",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.shuffle=False",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={spec.model_dir.resolve()}",
        "actor_rollout_ref.model.use_fused_kernels=False",
        f"actor_rollout_ref.actor.optim.lr={spec.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={spec.mini_batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mb}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.shuffle=False",
        # a resumed run continues the learning-rate schedule instead of restarting it (docs/verl.md)
        "actor_rollout_ref.actor.optim.use_checkpoint_opt_param_scheduler=True",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
        f"actor_rollout_ref.actor.megatron.seed={spec.seed}",
        "actor_rollout_ref.actor.megatron.vanilla_mbridge=False",
        # both engines compute the same model: no dropout, megatron's fusions off (ps-bridge's providers
        # turn them off themselves)
        "+actor_rollout_ref.actor.megatron.override_transformer_config.attention_dropout=0.0",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.hidden_dropout=0.0",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=False",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.bias_activation_fusion=False",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.masked_softmax_fusion=False",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.bias_dropout_fusion=False",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion=False",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={lp_mb}",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={spec.n}",
        f"actor_rollout_ref.rollout.seed={spec.seed}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={lp_mb}",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"actor_rollout_ref.rollout.max_model_len={spec.max_prompt_length + spec.max_response_length}",
        # a step's prompts fit vLLM's token budget at once, so no prefill is cut into chunks: vLLM rewinds a
        # seeded request's generator after a chunk (vllm/v1/worker/gpu_model_runner.py:3640, `set_offset`),
        # which a CPU generator refuses ("CPU Generator does not use offset"), and where the chunks fall would
        # depend on vLLM's batching
        f"actor_rollout_ref.rollout.max_num_batched_tokens="
        f"{max(512, spec.prompts_per_step * spec.n * (spec.max_prompt_length + spec.max_response_length))}",
        "reward.num_workers=1",
        "trainer.critic_warmup=0",
        "trainer.logger=[console,file]",
        "trainer.project_name=ps_bridge_grpo",
        f"trainer.experiment_name={spec.engine}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.balance_batch=False",
        f"trainer.total_training_steps={spec.steps}",
        f"trainer.save_freq={spec.save_freq}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"trainer.rollout_data_dir={out / 'rollouts'}",
    ]
    if spec.resume_from is not None:
        o += ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={Path(spec.resume_from).resolve()}"]
    else:
        o += ["trainer.resume_mode=disable"]
    if spec.engine == "ps":
        o += ["actor_rollout_ref.model.external_lib=ps_bridge.verl"]
    if on_cpu:
        o += [
            "trainer.device=cpu",
            "+ray_kwargs.ray_init.num_gpus=1",
            "+ray_kwargs.ray_init.num_cpus=8",
            "+ray_kwargs.ray_init.include_dashboard=False",
            f"+ray_kwargs.ray_init._temp_dir=/tmp/ray-grpo-{spec.engine}-{os.getpid()}",
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
            "+actor_rollout_ref.rollout.enable_sleep_mode=False",
            "actor_rollout_ref.rollout.free_cache_engine=False",
            "actor_rollout_ref.rollout.enforce_eager=True",
            "actor_rollout_ref.actor.megatron.dtype=float32",
            "actor_rollout_ref.ref.megatron.dtype=float32",
            "actor_rollout_ref.actor.megatron.use_distributed_optimizer=False",
            "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
        ]
        if has_gated_deltanet(spec.model_dir):
            # vLLM's CPU Gated DeltaNet runs in bf16 only (vllm/model_executor/layers/mamba/ops/cpu/
            # gdn_attention.py:53, "CPU GDN attention requires BF16"), its recurrent state in float32 (with the
            # model's dtype as the state's, chunk_gated_delta_rule_cpu stops on "Input tensor dtype mismatch");
            # the actor and the reference stay float32
            o += ["actor_rollout_ref.rollout.dtype=bfloat16",
                  "+actor_rollout_ref.rollout.engine_kwargs.vllm.mamba_ssm_cache_dtype=float32"]
        else:
            o += ["actor_rollout_ref.rollout.dtype=float32"]
    return o + list(spec.extra_overrides)


def build_command(spec: RunSpec, on_cpu: Optional[bool] = None) -> Tuple[List[str], Dict[str, str]]:
    """verl's command line and the environment it runs in (the caller's environment plus ours)."""
    on_cpu = (not has_accelerator()) if on_cpu is None else on_cpu
    argv = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-name=ppo_megatron_trainer",
            *_overrides(spec, on_cpu)]
    env = dict(os.environ)
    out = spec.out_dir.resolve()
    env.update({
        "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"),
        "PYTHONUNBUFFERED": "1",
        "HYDRA_FULL_ERROR": "1",
        "WANDB_MODE": "disabled",
        # every worker's lines reach the log (Ray folds repeated lines of different workers into one)
        "RAY_DEDUP_LOGS": "0",
    })
    # on GPUs too: vLLM samples each request with its own seed, so that two runs (and a resumed one) from
    # the same weights sample the same responses (ps_bridge/compat/rollout_seeds.py says why verl's
    # rollout.full_determinism does not do it)
    env["VERL_USE_EXTERNAL_MODULES"] = f"{ROLLOUT_SEEDS},{LOGPROB_DUMP}"
    env.pop("ENABLE_PREFIX_SHARING", None)
    env.pop("PS_BRIDGE_TREE", None)
    env.pop("PS_BRIDGE_SHARING", None)
    if spec.engine == "ps":
        env["ENABLE_PREFIX_SHARING"] = "1"
        if spec.tree:
            env["PS_BRIDGE_TREE"] = "1"
        if not spec.sharing:
            env["PS_BRIDGE_SHARING"] = "off"
    if on_cpu:
        env.update({
            "VERL_USE_EXTERNAL_MODULES": f"ps_bridge.compat.main_ppo_on_cpu,{ROLLOUT_SEEDS},{LOGPROB_DUMP}",
            "VERL_ENGINE_DEVICE": "cuda",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "TORCHDYNAMO_DISABLE": "1",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        })
    return argv, env


_STEP = re.compile(r"step:(\d+)\s+-")


def read_metrics(path: Path) -> List[dict]:
    """verl's file logger: one `{"step": N, "data": {...}}` line per step; the `data` dicts in step order."""
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            row = json.loads(line)
            rows.append(dict(row["data"], step=row["step"]))
    return sorted(rows, key=lambda r: r["step"])


def run_main_ppo(spec: RunSpec, progress: Optional[Callable[[str], None]] = None,
                 on_cpu: Optional[bool] = None) -> RunResult:
    """Run verl's main_ppo for `spec`; its output (the Ray workers' lines included) goes to
    `out_dir/main_ppo.log`, short progress lines to `progress`."""
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    argv, env = build_command(spec, on_cpu=on_cpu)
    log_path = spec.out_dir / "main_ppo.log"
    metrics_path = spec.out_dir / "metrics.jsonl"
    (spec.out_dir / "command.json").write_text(json.dumps({"argv": argv, "env": {
        k: env[k] for k in sorted(env) if k.startswith(("VERL_", "PS_BRIDGE", "ENABLE_PREFIX", "VLLM_", "TORCH"))}},
        indent=1))
    say = progress or (lambda line: None)
    start = time.time()
    for attempt in range(1 + RAY_START_RETRIES):
        say(f"{spec.engine}: starting verl main_ppo ({spec.steps} steps)")
        returncode = _run_logged(argv, env, log_path, spec, say, start)
        if returncode == 0 or RAY_START_TIMEOUT not in log_path.read_text(errors="replace"):
            break
        say(f"{spec.engine}: Ray's node did not come up within its 30 s on this busy machine; trying again")
    return RunResult(returncode=returncode, out_dir=spec.out_dir, metrics_path=metrics_path, log_path=log_path,
                     rollouts_dir=spec.out_dir / "rollouts", checkpoint_dir=spec.out_dir / "ckpt",
                     steps=read_metrics(metrics_path), seconds=time.time() - start)


#: Ray's own message when its node is not up 30 s after start (ray/_private/node.py; not configurable)
RAY_START_TIMEOUT = "The current node timed out during startup"
RAY_START_RETRIES = 2


def _run_logged(argv, env, log_path: Path, spec: RunSpec, say, start: float) -> int:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, process_group=0)  # its own process group: _stop kills Ray and vLLM with it
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                m = _STEP.search(line)
                if m:
                    say(f"{spec.engine}: step {m.group(1)}/{spec.steps} done ({time.time() - start:.0f} s)")
                elif "sharing detected" in line and "[PS][prepare]" in line:
                    say(f"{spec.engine}: {line.strip()[-120:]}")
                if time.time() - start > spec.timeout_s:
                    say(f"{spec.engine}: stopped after {spec.timeout_s} s (RunSpec.timeout_s)")
                    _stop(proc)
                    break
            return proc.wait()
        except BaseException:
            _stop(proc)
            raise


def _stop(proc) -> None:
    """main_ppo and what it started in its process group (Ray's processes)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m ps_bridge.tools.grpo.launch ENGINE MODEL DATA OUT [key=value ...]` (RunSpec fields)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4:
        print(main.__doc__)
        return 2
    engine, model, data, out, *rest = args
    fields = {f.name: f.type for f in dataclasses.fields(RunSpec)}
    kwargs = {}
    for item in rest:
        key, _, value = item.partition("=")
        if key not in fields:
            print(f"unknown setting {key!r}: use one of {sorted(fields)}")
            return 2
        if key == "extra_overrides":
            kwargs[key] = kwargs.get(key, ()) + (value,)
        elif key in ("tree",):
            kwargs[key] = value.lower() in ("1", "true", "yes")
        elif key in ("lr",):
            kwargs[key] = float(value)
        elif key in ("resume_from",):
            kwargs[key] = Path(value)
        else:
            kwargs[key] = int(value)
    spec = RunSpec(engine=engine, model_dir=Path(model), data_dir=Path(data), out_dir=Path(out), **kwargs)
    result = run_main_ppo(spec, progress=lambda line: print(line, flush=True))
    print(f"returncode {result.returncode}, {len(result.steps)} steps in {result.seconds:.0f} s; log {result.log_path}")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
