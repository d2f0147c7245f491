"""Live training progress for rank 0: a tqdm bar on a terminal, throttled plain lines in logs.

A redrawn bar writes carriage returns that turn CI logs and `> file` redirects into one
enormous line, so when the output is not a terminal we print an ordinary line at most
every `plain_interval_s` seconds instead.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

from tqdm import tqdm


def _stats(loss: float, tokens_per_s: float, mfu: float | None, mem_gb: float | None) -> str:
    """'loss 3.2141 | 12.3k tok/s | MFU 41.2% | 3.10 GB'; unknown MFU/memory are left out."""
    loss_text = f"{loss:.4f}" if loss is not None and math.isfinite(loss) else "nan"
    parts = [f"loss {loss_text}", f"{tqdm.format_sizeof(tokens_per_s)} tok/s"]
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    if mem_gb is not None:
        parts.append(f"{mem_gb:.2f} GB")
    return " | ".join(parts)


class ProgressBar:
    """Shows step/total, loss, tokens/s, MFU, memory and ETA; does nothing when disabled."""

    def __init__(
        self,
        total_steps: int,
        initial: int = 0,
        enabled: bool = True,
        plain_interval_s: float = 5.0,
        file: TextIO | None = None,
    ) -> None:
        self.enabled = enabled
        self.total = total_steps
        self._file = file if file is not None else sys.stdout
        self._interval = plain_interval_s
        self._bar: tqdm | None = None
        self._initial = initial
        self._start = time.monotonic()
        self._last_print = -math.inf
        self._unprinted: str | None = None  # newest plain line not yet shown
        isatty = getattr(self._file, "isatty", None)
        if enabled and isatty is not None and isatty():
            self._bar = tqdm(
                total=total_steps,
                initial=initial,
                file=self._file,
                unit="step",
                dynamic_ncols=True,
                mininterval=0.5,
                bar_format="{n_fmt}/{total_fmt} {bar} [{elapsed}<{remaining}] {postfix}",
            )

    def update(
        self,
        step: int,
        loss: float,
        tokens_per_s: float,
        mfu: float | None = None,
        mem_gb: float | None = None,
    ) -> None:
        """Report that `step` steps are done, with the latest metrics."""
        if not self.enabled:
            return
        stats = _stats(loss, tokens_per_s, mfu, mem_gb)
        if self._bar is not None:
            self._bar.set_postfix_str(stats, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        percent = 100 * step / max(self.total, 1)
        self._unprinted = (
            f"step {step}/{self.total} ({percent:.0f}%) | {stats} | ETA {self._eta(step)}"
        )
        now = time.monotonic()
        if now - self._last_print >= self._interval or step >= self.total:
            self._print(self._unprinted)
            self._last_print = now

    def _eta(self, step: int) -> str:
        """Remaining time at the average rate since this bar was created."""
        done = step - self._initial
        if done <= 0:
            return "?"
        rate = done / max(time.monotonic() - self._start, 1e-9)
        return tqdm.format_interval(max(self.total - step, 0) / rate)

    def _print(self, line: str) -> None:
        print(line, file=self._file, flush=True)
        self._unprinted = None

    def write(self, msg: str) -> None:
        """Print a message line without breaking the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(msg, file=self._file)
        else:
            print(msg, file=self._file, flush=True)

    def close(self) -> None:
        """Finish the bar; in plain mode, show the last update if the throttle held it back."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self._unprinted is not None:
            self._print(self._unprinted)
        self.enabled = False
