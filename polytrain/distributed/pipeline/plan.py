"""Which modules each pipeline stage holds, which rank runs it, and how a step is cut into runs.

The model is the sequence of units

    <embedding units>, layers.0, ..., layers.<n-1>, <head units>

(for Llama: tok_embeddings, the blocks, norm, output; GPT-2 adds pos_embeddings to the
embedding units, as its Architecture entry says) and a pipeline of S stages cuts it
into S contiguous pieces: the first stage starts with the embedding units, the last
ends with the final norm, the output head (and, in the schedule, the loss).
`parallel.pp_split` names the units that start stages 2..S ("layers.2,layers.4");
empty balances the blocks by count. Only decoders (the causal LM objective, which the
schedule's loss computes from the data's targets directly) run as pipelines.

Stages per rank: one for gpipe / 1f1b; `pp_virtual_stages` for interleaved and
zero_bubble. Interleaved places them looped (rank r holds stages r, r + pp, ...);
zero_bubble is the ZB-V schedule, whose two stages per rank form a V (rank r holds
stages r and 2 pp - 1 - r), so the first and last stage share rank 0.

Pure Python: the command line checks a config here before it starts any worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from polytrain.errors import ConfigError

if TYPE_CHECKING:
    from polytrain.config import Config

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved", "zero_bubble")


EMBEDDING_UNITS = ("tok_embeddings",)
HEAD_UNITS = ("norm", "output")


def model_units(n_layers: int, embedding: tuple[str, ...] = EMBEDDING_UNITS,
                head: tuple[str, ...] = HEAD_UNITS) -> list[str]:
    """The top-level modules of a decoder in forward order (the names stages are cut at)."""
    return [*embedding, *(f"layers.{i}" for i in range(n_layers)), *head]


@dataclass(frozen=True)
class PipelinePlan:
    """A validated pipeline layout for one config (see the module docstring)."""

    pp: int
    schedule: str
    stages: tuple[tuple[str, ...], ...]
    """Per global stage, the units it holds, in forward order."""
    microbatches: int
    """Micro-batches per pipeline run (per schedule.step)."""
    runs: int
    """Pipeline runs per optimizer step (this rank's micro-batches = microbatches x runs)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank (coordinate on the mesh's pp axis) that runs global `stage`."""
        if self.schedule == "zero_bubble":  # V: down the ranks, then back up
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of_rank(self, rank: int) -> list[int]:
        """Global stage indices pipeline rank `rank` runs, in increasing order."""
        return [s for s in range(self.num_stages) if self.rank_of_stage(s) == rank]


def plan_from_config(cfg: Config, dp: int, embedding: tuple[str, ...] = EMBEDDING_UNITS,
                     head: tuple[str, ...] = HEAD_UNITS) -> PipelinePlan | None:
    """The pipeline plan for `cfg` at `dp` data-parallel ranks; None when parallel.pp = 1.

    `embedding` and `head`: the model's units before and after its blocks (its registry
    entry's); the start-up check has already refused models that cannot run as pipelines.
    """
    p, t = cfg.parallel, cfg.train
    if p.pp == 1:
        if p.pp_split:
            raise ConfigError("parallel.pp_split only applies with parallel.pp > 1; remove it or raise pp")
        return None
    if p.zero in (1, 2):
        raise ConfigError(f"parallel.zero = {p.zero} does not compose with parallel.pp > 1 yet; "
                          f"use parallel.zero = 0 (replicas) or 3 (sharded parameters)")
    local = t.global_batch_size // (t.micro_batch_size * dp)
    return plan_pipeline(p.pp, p.pp_schedule, p.pp_virtual_stages, p.pp_split, cfg.model.n_layers,
                         p.pp_microbatches, local, embedding, head)


def plan_pipeline(pp: int, schedule: str, virtual_stages: int, split: str, n_layers: int,
                  microbatches: int, local_batches: int, embedding: tuple[str, ...] = EMBEDDING_UNITS,
                  head: tuple[str, ...] = HEAD_UNITS) -> PipelinePlan:
    """Check the pipeline keys against the model and batch; ConfigError names the key and the fix.

    `local_batches` is the number of micro-batches each data-parallel rank runs per
    optimizer step; `microbatches` is parallel.pp_microbatches (0 = all of them at once).
    `embedding` and `head`: the model's units before and after its blocks.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule = '{schedule}' is not one of {', '.join(SCHEDULES)}")
    per_rank = virtual_stages if schedule in MULTI_STAGE_SCHEDULES else 1
    if schedule == "zero_bubble" and per_rank != 2:
        raise ConfigError(f"parallel.pp_schedule = 'zero_bubble' (ZB-V) runs exactly 2 stages per rank; "
                          f"set parallel.pp_virtual_stages = 2, not {virtual_stages}")
    if schedule in MULTI_STAGE_SCHEDULES and per_rank < 2:
        raise ConfigError(f"parallel.pp_schedule = '{schedule}' needs parallel.pp_virtual_stages >= 2 "
                          f"(got {virtual_stages}); with one stage per rank use '1f1b'")
    num_stages = pp * per_rank
    stages = _split_stages(split, num_stages, model_units(n_layers, embedding, head), pp, per_rank)
    m = microbatches or local_batches
    if local_batches % m:
        raise ConfigError(
            f"parallel.pp_microbatches = {microbatches} must divide the {local_batches} micro-batches each "
            f"data-parallel rank runs per step (train.global_batch_size / (train.micro_batch_size x dp)); "
            f"choose one of {', '.join(str(d) for d in _divisors(local_batches))} or 0")
    _check_microbatches(schedule, pp, m, microbatches)
    return PipelinePlan(pp=pp, schedule=schedule, stages=stages, microbatches=m, runs=local_batches // m)


def _split_stages(split: str, num_stages: int, units: list[str], pp: int,
                  per_rank: int) -> tuple[tuple[str, ...], ...]:
    first = units.index("layers.0")  # the embedding units all stay on the first stage
    n_layers = sum(u.startswith("layers.") for u in units)
    if not split:
        if num_stages > n_layers:
            what = f"parallel.pp = {pp}" + (f" x parallel.pp_virtual_stages = {per_rank}" if per_rank > 1 else "")
            raise ConfigError(
                f"{what} = {num_stages} stages but model.n_layers = {n_layers}: every stage needs a block; "
                f"lower the pipeline degree or name the cuts in parallel.pp_split")
        # Blocks split as evenly as possible; the remainder goes to the earliest stages
        # because the last one also carries the output head and the loss.
        base, extra = divmod(n_layers, num_stages)
        starts, layer = [], 0
        for s in range(1, num_stages):
            layer += base + (1 if s - 1 < extra else 0)
            starts.append(first + layer)  # unit index of layers.<layer>
    else:
        names = [n.strip() for n in split.split(",")]
        if len(names) != num_stages - 1:
            raise ConfigError(
                f"parallel.pp_split names {len(names)} cut(s) but {num_stages} stages need {num_stages - 1} "
                f"(the units that start stages 2..{num_stages}), e.g. "
                f"'{','.join(units[first + (i + 1) * n_layers // num_stages] for i in range(num_stages - 1))}'")
        position = {name: i for i, name in enumerate(units)}
        for name in names:
            if position.get(name, -1) < first:
                raise ConfigError(
                    f"parallel.pp_split: '{name}' is not a module a stage can start at; "
                    f"use one of layers.0..layers.{n_layers - 1}, {', '.join(units[first + n_layers:])}")
        starts = [position[n] for n in names]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ConfigError(f"parallel.pp_split = '{split}' must name modules in forward order, each once")
    bounds = [0, *starts, len(units)]
    return tuple(tuple(units[a:b]) for a, b in zip(bounds, bounds[1:]))


def _check_microbatches(schedule: str, pp: int, m: int, configured: int) -> None:
    """The counts torch's schedules accept; each error says how to get a count that works."""
    key = f"parallel.pp_microbatches = {configured}" if configured else (
        f"{m} micro-batches per pipeline run (train.global_batch_size / (train.micro_batch_size x dp))")
    if schedule == "1f1b" and m < pp:
        raise ConfigError(f"{key}: 1f1b needs at least parallel.pp = {pp} micro-batches per run; raise "
                          f"train.global_batch_size or parallel.pp_microbatches, or use pp_schedule = 'gpipe'")
    if schedule == "interleaved":
        # torch's interleaved 1F1B runs max(1, m // pp) rounds of equal size.
        rounds = max(1, m // pp)
        if m % rounds:
            raise ConfigError(f"{key}: the {schedule} schedule runs {rounds} rounds of micro-batches and needs "
                              f"a count they split evenly: fewer than {2 * pp} or a multiple of parallel.pp = "
                              f"{pp}; change parallel.pp_microbatches or train.global_batch_size")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
