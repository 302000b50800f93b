"""PNG charts of a replay (matplotlib, Agg backend: no display needed).

- ``throughput.png``: prompt and output tokens/s against concurrency;
- ``ttft.png``: TTFT p50/p90/p99 against concurrency;
- ``shares_c<N>.png``: for each level, every request in issue order as a
  stacked bar of the prompt tokens served by device, pool and computation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.tools.replay.records import ReplayResult


def write_plots(directory: Path, results: Sequence[ReplayResult]) -> list[Path]:
    """Write the charts into ``directory`` (created); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    levels = [r.concurrency for r in results]

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(levels, [r.summary["prompt_tok_s"] for r in results], marker="o", label="prompt tok/s")
    ax.plot(levels, [r.summary["output_tok_s"] for r in results], marker="s", label="output tok/s")
    ax.set(xlabel="concurrent sessions", ylabel="tokens / s", title="Throughput")
    ax.legend()
    written.append(_save(fig, directory / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for q in (50, 90, 99):
        ax.plot(levels, [r.summary[f"ttft_p{q}_s"] for r in results], marker="o", label=f"p{q}")
    ax.set(xlabel="concurrent sessions", ylabel="seconds", title="Time to first token")
    ax.legend()
    written.append(_save(fig, directory / "ttft.png"))

    for result in results:
        ok = [r for r in result.records if r.error is None]
        x = range(len(ok))
        device = [r.device_tokens for r in ok]
        pool = [r.pool_tokens for r in ok]
        computed = [r.computed_tokens for r in ok]
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.bar(x, device, width=1.0, label="device")
        ax.bar(x, pool, width=1.0, bottom=device, label="pool")
        ax.bar(x, computed, width=1.0, bottom=[d + p for d, p in zip(device, pool)], label="computed")
        ax.set(xlabel="request (issue order)", ylabel="prompt tokens",
               title=f"Where each prompt's KV came from, concurrency {result.concurrency}")
        ax.legend()
        written.append(_save(fig, directory / f"shares_c{result.concurrency}.png"))
    return written


def _save(fig: object, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100, bbox_inches="tight")  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    return path
