"""An elastic job's layout at each world size: the global batch kept, the micro-batch re-derived,
the user's degrees where they divide the world, the planner where they do not; ranges refused
when some size cannot keep the batch."""

from __future__ import annotations

import pytest

from polytrain.config import ConfigError, load_config
from polytrain.plan import Cluster, device_spec
from polytrain.plan.elastic import check_worlds, layout_for_world, micro_batch_for


def _cfg(*args: str):
    return load_config(None, ["--train.global_batch_size", "24", "--train.micro_batch_size", "4", *args])


def test_global_batch_kept_micro_batch_re_derived():
    cfg = _cfg()
    for world, mbs in ((1, 4), (2, 4), (3, 4), (4, 3), (6, 4), (8, 3), (12, 2), (24, 1)):
        at = layout_for_world(cfg, world)
        assert at.train.micro_batch_size == mbs and at.parallel.nproc == world
        assert at.train.global_batch_size == 24
    assert micro_batch_for(cfg, 5) is None


def test_fixed_degrees_kept_where_they_divide_the_world_else_the_planner():
    cfg = _cfg("--parallel.tp", "2", "--model.size", "small")
    assert layout_for_world(cfg, 4).parallel.tp == 2
    with pytest.raises(ConfigError, match="no layout of 3 ranks keeps train.global_batch_size = 24: 3 is not "
                                          "a multiple of parallel.tp x pp = 2"):
        layout_for_world(cfg, 3)
    planned = layout_for_world(cfg, 3, Cluster(device_spec("H100"), 3))
    assert planned.parallel.tp in (1, 3) and planned.parallel.nproc == 3
    assert 24 % (planned.train.micro_batch_size * planned.parallel.dp) == 0


def test_ranges_that_cannot_keep_the_batch_are_refused_with_the_fix():
    check_worlds(_cfg(), 2, 4)
    with pytest.raises(ConfigError) as e:
        check_worlds(_cfg("--train.global_batch_size", "30", "--train.micro_batch_size", "2"), 2, 4)
    assert str(e.value) == ("train.global_batch_size = 30 cannot stay the same at 4 worker(s) of parallel.nproc "
                            "= 2:4; world sizes that keep it: 1, 2, 3, 5, 6; global batches every size 2..4 "
                            "keeps: 24 or 36 (multiples of 12)")
