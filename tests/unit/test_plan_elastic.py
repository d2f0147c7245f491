"""An elastic job's layout at each world size: the global batch kept, the micro-batch re-derived,
the user's degrees where they divide the world, the planner's layout where they do not, the
layouts written for the workers; ranges refused when a size cannot keep the batch."""

from __future__ import annotations

import pytest

from polytrain.config import load_config
from polytrain.errors import ConfigError
from polytrain.plan import Cluster, device_spec
from polytrain.plan.elastic import elastic_layouts, layout_for_world, write_layouts
from polytrain.train.elastic import elastic_config, micro_batch_for, with_degrees

H100 = device_spec("H100")


def _cfg(*args: str):
    return load_config(None, ["--train.global_batch_size", "24", "--train.micro_batch_size", "4", *args])


def test_global_batch_kept_micro_batch_re_derived():
    cfg = _cfg()
    for world, mbs in ((1, 4), (2, 4), (3, 4), (4, 3), (6, 4), (8, 3), (12, 2), (24, 1)):
        at = with_degrees(cfg, world)
        assert at.train.micro_batch_size == mbs and at.parallel.nproc == world
        assert at.train.global_batch_size == 24
    assert micro_batch_for(cfg, 5) is None


def test_degrees_kept_where_they_divide_else_planned_and_read_back(tmp_path):
    cfg = _cfg("--parallel.tp", "2", "--model.size", "small", "--run.out_dir", str(tmp_path))
    assert layout_for_world(cfg, 4, Cluster(H100, 4)).parallel.tp == 2
    with pytest.raises(ConfigError, match="no layout of 3 ranks keeps train.global_batch_size = 24 .3 is not a "
                                          "multiple of parallel.tp x pp = 2."):
        elastic_config(cfg, 3)  # no planned layouts yet
    layouts = elastic_layouts(cfg, 2, 4, Cluster(H100, 4))
    assert layouts[2]["parallel.tp"] == layouts[4]["parallel.tp"] == 2 and layouts[3]["parallel.tp"] in (1, 3)
    write_layouts(cfg, layouts)
    at3 = elastic_config(cfg, 3)  # what a worker of a 3-rank attempt runs
    assert at3.parallel.tp == layouts[3]["parallel.tp"] and at3.train.global_batch_size == 24
    assert 24 % (at3.train.micro_batch_size * (3 // at3.parallel.tp)) == 0


def test_a_size_no_layout_keeps_is_refused_with_the_fix():
    one_way = ["--model.n_heads", "1", "--model.n_kv_heads", "1", "--model.n_layers", "1"]  # dp only
    with pytest.raises(ConfigError) as e:
        elastic_layouts(_cfg("--train.global_batch_size", "30", "--train.micro_batch_size", "2", *one_way),
                        2, 4, Cluster(H100, 4))
    assert str(e.value) == ("train.global_batch_size = 30 cannot stay the same at 4 worker(s) of parallel.nproc "
                            "= 2:4; world sizes that keep it: 1, 2, 3, 5, 6; global batches every size 2..4 "
                            "keeps: 24 or 36 (multiples of 12)")
