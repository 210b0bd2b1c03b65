"""User-facing switch and knobs of prefix sharing, and the only reader of the project's environment.

`PrefixSharingConfig` is the one object the rest of the code reads. It is built explicitly, or
from the environment (`ENABLE_PREFIX_SHARING=1`, `PS_BRIDGE_BACKEND`, `PS_BRIDGE_PROVIDER`,
`PS_BRIDGE_GDN_BACKEND`, `PS_BRIDGE_PROMPT_VALUES`, `PS_BRIDGE_SHARING`, `PS_BRIDGE_TREE`,
`PS_BRIDGE_TREE_MIN_SHARED`, `PS_BRIDGE_TREE_MAX_DEPTH`, `PS_BRIDGE_CUDA_GRAPHS`,
`PS_BRIDGE_CUDA_GRAPH_BUCKETS`, `PS_BRIDGE_CUDA_GRAPH_MEMORY`), and validates names at construction so that a typo fails here, with the
valid choices, rather than deep inside a forward pass. `PS_BRIDGE_LOG_LEVEL` (the `[PS]` lines under
verl) is read here too. torchrun's own variables are read where the process group is set up
(`ps_bridge.parallel.groups`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ps_bridge.launch_rule import MODES
from ps_bridge.providers.registry import provider_names

ENV_ENABLE = "ENABLE_PREFIX_SHARING"
ENV_BACKEND = "PS_BRIDGE_BACKEND"
ENV_PROVIDER = "PS_BRIDGE_PROVIDER"
ENV_GDN_BACKEND = "PS_BRIDGE_GDN_BACKEND"
ENV_LOG_LEVEL = "PS_BRIDGE_LOG_LEVEL"
ENV_PROMPT_VALUES = "PS_BRIDGE_PROMPT_VALUES"
ENV_SHARING = "PS_BRIDGE_SHARING"
ENV_TREE = "PS_BRIDGE_TREE"
ENV_TREE_MIN_SHARED = "PS_BRIDGE_TREE_MIN_SHARED"
ENV_TREE_MAX_DEPTH = "PS_BRIDGE_TREE_MAX_DEPTH"
ENV_CUDA_GRAPHS = "PS_BRIDGE_CUDA_GRAPHS"
ENV_CUDA_GRAPH_BUCKETS = "PS_BRIDGE_CUDA_GRAPH_BUCKETS"
ENV_CUDA_GRAPH_MEMORY = "PS_BRIDGE_CUDA_GRAPH_MEMORY"
# how a micro-batch's pack is bucketed for CUDA graphs (`ps_bridge.cuda_graphs`)
GRAPH_BUCKETS = ("segment", "level")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _env_flag(name: str, default: bool = False) -> bool:
    """A boolean from the environment; `default` when unset or empty."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a boolean; use 1 or 0")


def _env_share(name: str) -> Optional[float]:
    """A share (0 < x <= 1) from the environment, or None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; give a share of the device's memory, 0 < x <= 1 "
                         f"(unset it for the default)") from None


def _env_count(name: str) -> Optional[int]:
    """A non-negative integer from the environment, or None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"{name}={raw!r} is not a non-negative integer; unset it for the default")
    return int(raw)


@dataclass
class PrefixSharingConfig:
    """What prefix sharing does in this process.

    enabled:      pack each group of samples with an identical prompt once (else every sample is
                  its own sequence, the unshared computation).
    backend:      softmax-attention backend name, see `ps_bridge.kernels.attention.BACKENDS`.
    provider:     provider name from `ps_bridge.providers.registry`, or None to detect it from the
                  Hugging Face config.
    pad_multiple: every packed sequence is padded to a multiple of this (the TP size when sequence
                  parallelism is on); None means "the tensor-parallel size".
    gdn_backend:  Gated DeltaNet backend name (Qwen3.5), see `ps_bridge.kernels.gdn`.
    prompt_values: False (default): with sharing on, the output layer runs only on the positions
                  whose values verl's losses read, every response position and each prompt's last
                  position (its `G + sum R_i` rows instead of the pack's `T`); the log-prob, entropy
                  and other per-token rows hold 0 at the other prompt positions (row positions
                  before `P_i - 1`, which verl's `response_mask` masks). True: every position is
                  computed, as without this option; for callers that read prompt positions (e.g.
                  an SFT loss whose `loss_mask` covers prompt tokens). Under verl set it with
                  `PS_BRIDGE_PROMPT_VALUES=1`. With `enabled=False` (the unshared computation, the
                  stock engine's) every position is computed whatever this says.
    sharing:      with `enabled`, which micro-batches run shared: `auto` (default) where the rule of
                  `ps_bridge.launch_rule` finds that the tokens saved outweigh the shared path's extra
                  kernel launches (small models with short prompts run unshared: sharing would be
                  slower), `measured` the same rule with the shared path's host time scaled by this
                  process's measured host (under verl, where a micro-batch runs on one rank alone:
                  no TP, PP or CP; decisions then depend on timing), `on` every micro-batch that has
                  a prompt with two or more responses, `off` none (the unshared computation, with
                  sharing's micro-batching). Under verl `PS_BRIDGE_SHARING=auto|measured|on|off`.
    tree:         with sharing on, share every common prefix (default: the token radix tree, whose
                  depth-one case is a GRPO group: each prompt once for its responses; deeper where a
                  system prompt is shared across prompts, a sample is a prefix of another's, ...).
                  False: identical prompts only (one level). A depth-one tree packs exactly as one
                  level. Trees run under TP, SP, PP, CP and EP with every attention backend;
                  `flash_atten_gpu_expand` / `flash_atten_npu` take depth one only and refuse a deeper
                  micro-batch (docs/how-it-works.md). Under verl `PS_BRIDGE_TREE=0` turns it off
                  (docs/verl.md).
    tree_min_shared: the shortest common run a tree shares (None: `layout.DEFAULT_MIN_SHARED`), but
                  a whole prompt shared by all its responses is shared whatever its length (as one
                  level shares it); `PS_BRIDGE_TREE_MIN_SHARED`.
    tree_max_depth:  the tree's depth limit (None: none; 1 is one level of sharing);
                  `PS_BRIDGE_TREE_MAX_DEPTH`.
    cuda_graphs:  replay the model's passes (forward-only, and forward with backward) as CUDA graphs
                  where a micro-batch's layout repeats one seen before, shared and unshared micro-batches
                  alike; where `ps_bridge.cuda_graphs.graph_refusal` refuses (TP/PP/CP, MoE,
                  vision-language models, recomputation, dropout with gradients) the pass runs eagerly.
                  `PS_BRIDGE_CUDA_GRAPHS=1`.
    cuda_graph_buckets: how a shared pack is bucketed so that packs of other lengths replay one graph:
                  `segment` (default) pads every segment of a tree level to the bucket of the level's
                  longest; `level` keeps each segment's length and pads each level's block to a bucket
                  of its total (`ps_bridge.tree.level_buckets`: far less padding where a level's
                  responses differ in length). `PS_BRIDGE_CUDA_GRAPH_BUCKETS=segment|level`.
    cuda_graph_memory: the share of the device's memory the process's CUDA graphs may hold (each graph's
                  memory pool keeps its pass's activations and output for as long as it lives, memory the
                  eager passes and the loss then do without); a graph that would take them past it is not
                  kept, unless graphs not run for a while make room, and its structure runs eagerly from
                  then on. `PS_BRIDGE_CUDA_GRAPH_MEMORY`, 0 < x <= 1.
    """

    enabled: bool = True
    backend: str = "torch_ref"
    provider: Optional[str] = None
    pad_multiple: Optional[int] = None
    gdn_backend: str = "auto"
    prompt_values: bool = False
    sharing: str = "auto"
    tree: bool = True
    tree_min_shared: Optional[int] = None
    tree_max_depth: Optional[int] = None
    cuda_graphs: bool = False
    cuda_graph_buckets: str = "segment"
    cuda_graph_memory: float = 0.25

    def __post_init__(self):
        # imported here: torch is heavy
        from ps_bridge.kernels.attention import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown prefix-sharing attention backend {self.backend!r}; "
                f"valid backends: {', '.join(sorted(BACKENDS))}"
            )
        if self.provider is not None:
            if self.provider not in provider_names():
                raise ValueError(
                    f"unknown ps-bridge provider {self.provider!r}; "
                    f"valid providers: {', '.join(provider_names())}"
                )
        # imported here: torch is heavy
        from ps_bridge.kernels.gdn import GDN_BACKENDS

        if self.gdn_backend not in GDN_BACKENDS:
            raise ValueError(
                f"unknown Gated DeltaNet backend {self.gdn_backend!r}; "
                f"valid backends: {', '.join(sorted(GDN_BACKENDS))}"
            )

        if self.sharing not in MODES:
            raise ValueError(
                f"unknown prefix-sharing mode {self.sharing!r} ({ENV_SHARING}); valid modes: {', '.join(MODES)}"
            )
        if self.cuda_graph_buckets not in GRAPH_BUCKETS:
            raise ValueError(
                f"unknown CUDA-graph buckets {self.cuda_graph_buckets!r} ({ENV_CUDA_GRAPH_BUCKETS}); "
                f"valid: {', '.join(GRAPH_BUCKETS)}"
            )
        if not 0 < self.cuda_graph_memory <= 1:
            raise ValueError(
                f"cuda_graph_memory={self.cuda_graph_memory} ({ENV_CUDA_GRAPH_MEMORY}) is not a share of the device's "
                f"memory: give 0 < x <= 1"
            )
        if self.pad_multiple is not None and self.pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {self.pad_multiple}")

    def layout_share(self, share=None):
        """What `build_layout(share=...)` gets for a run with this config: `share` (default: `enabled`),
        and a prefix tree ("tree") where sharing is on and `tree` is set."""
        share = self.enabled if share is None else share
        return "tree" if share is True and self.tree else share

    @property
    def layout_prompt_values(self) -> bool:
        """What `build_layout(prompt_values=...)` gets for a run with this config: the option when
        sharing is on; True (every position, the stock computation) when it is off."""
        return self.prompt_values or not self.enabled

    @classmethod
    def from_env(cls, **overrides) -> "PrefixSharingConfig":
        """Read `ENABLE_PREFIX_SHARING`, `PS_BRIDGE_BACKEND`, `PS_BRIDGE_PROVIDER`,
        `PS_BRIDGE_GDN_BACKEND`, `PS_BRIDGE_PROMPT_VALUES`, `PS_BRIDGE_SHARING`, `PS_BRIDGE_TREE`,
        `PS_BRIDGE_TREE_MIN_SHARED`, `PS_BRIDGE_TREE_MAX_DEPTH`, `PS_BRIDGE_CUDA_GRAPHS`,
        `PS_BRIDGE_CUDA_GRAPH_BUCKETS`, `PS_BRIDGE_CUDA_GRAPH_MEMORY`; overrides win."""
        values = dict(
            enabled=_env_flag(ENV_ENABLE),
            prompt_values=_env_flag(ENV_PROMPT_VALUES),
            backend=os.environ.get(ENV_BACKEND) or "torch_ref",
            provider=os.environ.get(ENV_PROVIDER) or None,
            gdn_backend=os.environ.get(ENV_GDN_BACKEND) or "auto",
            sharing=(os.environ.get(ENV_SHARING) or "auto").strip().lower(),
            tree=_env_flag(ENV_TREE, default=True),
            tree_min_shared=_env_count(ENV_TREE_MIN_SHARED),
            tree_max_depth=_env_count(ENV_TREE_MAX_DEPTH),
            cuda_graphs=_env_flag(ENV_CUDA_GRAPHS),
            cuda_graph_buckets=(os.environ.get(ENV_CUDA_GRAPH_BUCKETS) or "segment").strip().lower(),
        )
        graph_memory = _env_share(ENV_CUDA_GRAPH_MEMORY)
        if graph_memory is not None:
            values["cuda_graph_memory"] = graph_memory
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def log_level_from_env(default: str = "INFO") -> str:
    """`PS_BRIDGE_LOG_LEVEL` (the level of the `ps_bridge` logger under verl), upper case."""
    return (os.environ.get(ENV_LOG_LEVEL) or default).upper()
