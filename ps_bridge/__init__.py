"""ps-bridge: prefix-shared RL training of LLMs with verl + Megatron-core through Megatron-Bridge."""

__version__ = "0.1.0"
