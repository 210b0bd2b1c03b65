"""verl-check's curves: loss and grad norm per optimizer step, phase times, log-prob differences."""

from __future__ import annotations

from ps_bridge.tools.verl_check.config import PHASES


def write_plot(doc: dict, path: str) -> None:
    """Per optimizer step loss and grad norm of both engines; per step phase times; log-prob diffs."""
    try:
        # imported here: matplotlib is optional (the plot extra)
        import matplotlib

        matplotlib.use("Agg")
        # imported here: matplotlib is optional (the plot extra)
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from None
    steps = doc["steps"]
    a, b = "stock", "shared"
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    updates = [u for s in steps for u in s["updates"]]
    x = range(1, len(updates) + 1)
    for name, style in ((a, "-o"), (b, "--x")):
        ax[0][0].plot(x, [u["loss"][name] for u in updates], style, label=name)
        ax[0][1].plot(x, [u["grad_norm"][name] for u in updates], style, label=name)
    ax[0][0].set(title="loss per optimizer step", xlabel="optimizer step")
    ax[0][1].set(title="grad norm per optimizer step", xlabel="optimizer step")
    t = [s["step"] for s in steps]
    for ph, color in zip(PHASES, ("C0", "C1", "C2")):
        ax[1][0].plot(t, [s["phase_seconds"][a][ph] for s in steps], "-o", color=color, label=f"{ph} {a}")
        ax[1][0].plot(t, [s["phase_seconds"][b][ph] for s in steps], "--x", color=color, label=f"{ph} {b}")
    ax[1][0].set(title="phase seconds", xlabel="trainer step")
    for key in ("logprob_max_abs_diff", "ref_logprob_max_abs_diff", "entropy_max_abs_diff"):
        ax[1][1].semilogy(t, [max(s[key], 1e-12) for s in steps], "-o", label=key)
    ax[1][1].set(title="max |stock - shared|", xlabel="trainer step")
    for row in ax:
        for one in row:
            one.legend(fontsize=7)
    cfg = doc["config"]
    fig.suptitle(f"verl-check {cfg['model']} ({cfg['dtype']}): S = {cfg['ideal_speedup_S']:.2f}; "
                 + ", ".join(f"{ph} {v:.2f}x" for ph, v in cfg["speedup"].items()))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
