"""loss.png of a model folder: the training loss curves of its train_log.json, the periodic
held-out evals and the unigram baseline, in bits per token against training tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..outputs import save_figure


def plot_loss(log: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = log["steps"]
    tok = np.array([r["tokens"] for r in steps]) / 1e6
    loss = np.array([r["loss"] for r in steps]) / np.log(2)
    mce = np.array([r["masked_ce"] for r in steps]) / np.log(2)
    k = max(1, len(steps) // 100)

    def smooth(x):
        return np.convolve(x, np.ones(k) / k, mode="valid") if len(x) >= k else x

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    ax.plot(tok, loss, color="C0", alpha=0.2, lw=0.6)
    ax.plot(tok[k - 1 :], smooth(loss), color="C0", label="train NELBO (1/t-weighted), bits/token")
    ax.plot(tok[k - 1 :], smooth(mce), color="C1", label="train masked CE (unweighted), bits/token")
    if log.get("evals"):
        ax.plot(
            [e["tokens"] / 1e6 for e in log["evals"]],
            [e["bits_per_token"] for e in log["evals"]],
            "o-",
            color="C2",
            label="held-out masked CE, ratio 0.5, B=16 (first tokens)",
        )
    if log.get("unigram"):
        ax.axhline(log["unigram"]["cross_entropy"], color="gray", ls="--", lw=1, label="held-out unigram cross-entropy")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("bits / token")
    ax.set_ylim(0, max(14, float(np.nanmax(smooth(loss)[:5])) if len(loss) else 14))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("clover-tiny block-diffusion training")
    fig.tight_layout()
    try:
        return save_figure(fig, path, dpi=100)
    finally:
        plt.close(fig)
