"""Tooling above the core: the bench, the `ps-bridge` CLI, verl-check and their helpers (comparison
with Hugging Face, the single-process runtime, the schedule, data parallelism over processes, tiny
checkpoints). The verl plugin (`ps_bridge.verl`) and the model code never import this package."""
