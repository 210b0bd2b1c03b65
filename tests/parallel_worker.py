"""One rank of a multi-process test run, launched by `torchrun` from tests/test_parallel.py.

Loads the checkpoint with the given TP / PP / SP / CP, runs the test micro-batches prefix-shared
(with --unshared: every sample its own sequence) forward+backward (and forward only) through
megatron's schedule, and has global rank 0 save the log-probs and the full gradients under Hugging
Face names. Every rank logs its `[PS]` lines.
"""

import argparse
import contextlib
import logging
import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from parallel_cases import (  # noqa: E402
    MICRO_BATCHES, aux_by_micro_batch, leave_worker, micro_batch_weights, moe_recompute_on_build,
    provider_settings_on_build, recorded_aux_losses,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-path", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism: groups split across the DP ranks")
    parser.add_argument("--cases", default=None, choices=sorted(MICRO_BATCHES), help="default: ep with --ep > 1, else parallel")
    parser.add_argument("--skip-finish-gradients", action="store_true", help="negative control")
    parser.add_argument("--moe-recompute", action="store_true", help="megatron's MoE activation recompute on")
    parser.add_argument("--prompt-values", action="store_true", help="PrefixSharingConfig(prompt_values=True)")
    parser.add_argument("--moe-load-balancing", choices=["aux_loss", "global_aux_loss"], help="the routers' load-balancing loss")
    parser.add_argument("--unshared", action="store_true", help="every sample its own sequence (share=False)")
    parser.add_argument("--tree", action="store_true", help="prefix trees: PrefixSharingConfig(tree=True, tree_min_shared=0)")
    parser.add_argument("--cuda-op-formulas", action="store_true",
                        help="the element-wise ops' CUDA paths on the CPU (qwen35_helpers.cuda_op_formulas_on_cpu)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("ps_bridge").setLevel(logging.INFO)

    from ps_bridge.config import PrefixSharingConfig
    from ps_bridge.parallel.gradients import hf_named_gradients
    from ps_bridge.parallel.groups import is_output_rank
    from ps_bridge.tools.runtime import load_model
    from ps_bridge.tools.schedule import logprob_pass

    if args.skip_finish_gradients:
        import ps_bridge.tools.schedule

        ps_bridge.tools.schedule.finish_gradients = lambda model, config: None

    run = contextlib.ExitStack()  # what holds for the whole run (kept referenced until main returns)
    if args.cuda_op_formulas:
        from qwen35_helpers import cuda_op_formulas_on_cpu

        run.enter_context(cuda_op_formulas_on_cpu())
    with contextlib.ExitStack() as build:
        if args.moe_recompute:
            build.enter_context(moe_recompute_on_build())
        if args.moe_load_balancing:
            build.enter_context(provider_settings_on_build(moe_router_load_balancing_type=args.moe_load_balancing))
        loaded = load_model(
            args.hf_path,
            PrefixSharingConfig(enabled=True, prompt_values=args.prompt_values, tree=args.tree,
                                tree_min_shared=0 if args.tree else None),
            tp=args.tp, pp=args.pp, sequence_parallel=args.sp,
            cp=args.cp, ep=args.ep,
        )
    if args.ep > 1:  # data-parallel ranks: each runs its whole groups, rows and gradient sums gathered
        from ps_bridge.tools.data_parallel import dp_logprob_pass as logprob_pass  # noqa: F811
    rank = torch.distributed.get_rank()
    print(f"[parallel_worker] global_rank={rank} backend={torch.distributed.get_backend()} device={loaded.device}", file=sys.stderr)
    micro_batches = MICRO_BATCHES[args.cases or ("ep" if args.ep > 1 else "parallel")]()
    # the rows the output layer runs on, per micro-batch, on the last pipeline stage
    output_rows = []
    model = loaded.model
    while hasattr(model, "module"):
        model = model.module
    model = getattr(model, "language_model", model)  # a vision-language model's output layer is its language model's
    if model.post_process:
        model.output_layer.register_forward_hook(lambda module, inputs, output: output_rows.append(int(inputs[0].shape[0])))
    loaded.model.zero_grad(set_to_none=True)
    with recorded_aux_losses() as records:
        shared = logprob_pass(loaded, micro_batches, share=not args.unshared, loss_weights=micro_batch_weights(micro_batches))
    # MoE: each rank's load-balancing loss is its share (its tokens' router probabilities against the
    # token counts of the whole micro-batch); the shares of all ranks add up to the single-rank value
    aux = {}
    box = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(box, aux_by_micro_batch(records))
    for part in box:
        for key, value in part.items():
            aux[key] = aux.get(key, 0.0) + value
    grads = hf_named_gradients(loaded.bridge, loaded.model)
    with torch.no_grad():
        forward_only = logprob_pass(loaded, micro_batches, share=not args.unshared)
    from megatron.core import parallel_state

    every_rank = [None] * torch.distributed.get_world_size()
    mine = dict(tp=parallel_state.get_tensor_model_parallel_rank(), cp=parallel_state.get_context_parallel_rank(),
                last_stage=bool(model.post_process), rows=output_rows)
    torch.distributed.all_gather_object(every_rank, mine)
    if is_output_rank():  # (under --ep, data-parallel rank 0 of global rank 0 holds every row)
        torch.save(dict(logprobs=shared, forward_only=forward_only, grads=grads, aux=aux, output_rows=every_rank), args.out)
    leave_worker()


if __name__ == "__main__":
    main()
