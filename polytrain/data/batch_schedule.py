"""The global batch as a function of the samples consumed: Megatron's batch-size ramp-up.

    schedule = BatchSchedule(global_batch_size=512, start=32, increment=32, ramp_samples=100_000)
    schedule.at(consumed_samples)     # 32 until 6,667 samples, then 64, ... 512 from 100,000 on

Megatron's `--rampup-batch-size START INCREMENT SAMPLES`: the (global - start) / increment
increments are spread evenly over the first SAMPLES samples, so the batch grows by
INCREMENT every SAMPLES / increments samples and is the configured global batch after
that. Keyed on samples, not steps, so a run resumed at another batch size (or on another
number of ranks) is at the same point of its schedule. With start = 0 the batch is
constant.

Every size the schedule takes must split into whole micro-batches on every data-parallel
rank: `check(micro_batch_size, dp)` says which size does not and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.errors import ConfigError


@dataclass(frozen=True)
class BatchSchedule:
    """See the module docstring; start = 0 means no ramp-up."""

    global_batch_size: int
    start: int = 0
    increment: int = 0
    ramp_samples: int = 0

    @classmethod
    def from_config(cls, train) -> BatchSchedule:
        """From a TrainConfig's global_batch_size and batch_rampup_* keys."""
        return cls(train.global_batch_size, train.batch_rampup_start, train.batch_rampup_increment,
                   train.batch_rampup_samples)

    @property
    def ramps(self) -> bool:
        return self.start > 0

    def validate(self, micro_batch_size: int) -> None:
        """Checks that need no world size; ConfigError naming the key and the fix."""
        if not self.ramps:
            if self.increment or self.ramp_samples:
                raise ConfigError("train.batch_rampup_increment and train.batch_rampup_samples need "
                                  "train.batch_rampup_start > 0 (the first global batch); set it or remove them")
            return
        if self.start >= self.global_batch_size:
            raise ConfigError(f"train.batch_rampup_start = {self.start} must be below train.global_batch_size "
                              f"= {self.global_batch_size}, which the ramp-up grows to")
        if self.increment <= 0 or self.ramp_samples <= 0:
            raise ConfigError("a batch-size ramp-up needs train.batch_rampup_increment > 0 and "
                              "train.batch_rampup_samples > 0 (samples over which the batch grows)")
        if (self.global_batch_size - self.start) % self.increment:
            raise ConfigError(
                f"train.global_batch_size - train.batch_rampup_start = {self.global_batch_size - self.start} "
                f"is not a multiple of train.batch_rampup_increment = {self.increment}; the ramp-up must "
                f"end on the global batch")
        self.check(micro_batch_size, 1)

    def check(self, micro_batch_size: int, dp: int) -> None:
        """Every size must be whole micro-batches on each of `dp` ranks."""
        unit = micro_batch_size * dp
        for key, value in (("train.batch_rampup_start", self.start),
                           ("train.batch_rampup_increment", self.increment)):
            if self.ramps and value % unit:
                raise ConfigError(
                    f"{key} = {value} is not a multiple of train.micro_batch_size x dp = {micro_batch_size} x "
                    f"{dp} = {unit}: every ramp-up batch must split into whole micro-batches on every rank; "
                    f"use {max(unit, value // unit * unit)}")

    def sizes(self) -> list[int]:
        """Every global batch size the schedule takes, smallest first."""
        if not self.ramps:
            return [self.global_batch_size]
        return list(range(self.start, self.global_batch_size + 1, self.increment))

    def at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` samples."""
        if not self.ramps or consumed_samples >= self.ramp_samples:
            return self.global_batch_size
        increments = (self.global_batch_size - self.start) // self.increment
        done = int(consumed_samples * increments // self.ramp_samples)
        return min(self.global_batch_size, self.start + done * self.increment)


def check_batch_schedule(cfg, dp: int, pipeline=None) -> None:
    """Start-up check of the ramp-up keys, at `dp` data-parallel ranks (and a pipeline plan's runs)."""
    t = cfg.train
    schedule = BatchSchedule.from_config(t)
    schedule.validate(t.micro_batch_size)
    if not schedule.ramps:
        return
    schedule.check(t.micro_batch_size, dp)
    if pipeline is not None:
        for size in schedule.sizes():
            local = size // (t.micro_batch_size * dp)
            if local % pipeline.microbatches or (pipeline.schedule == "1f1b" and local < pipeline.pp):
                raise ConfigError(
                    f"the ramp-up's global batch {size} gives each pipeline {local} micro-batch(es), which "
                    f"{pipeline.microbatches}-micro-batch pipeline runs do not split (1f1b also needs >= "
                    f"parallel.pp = {pipeline.pp}); set parallel.pp_microbatches to a divisor of every "
                    f"step's count, or raise train.batch_rampup_start")
