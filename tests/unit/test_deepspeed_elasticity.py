"""DeepSpeed's `elasticity` block (0.1): the batch its rule picks, the world sizes that keep it, the mapping."""

from __future__ import annotations

import pytest

from polytrain.config import load_config
from polytrain.errors import ConfigError
from polytrain.deepspeed import load_ds_config, to_overrides
from polytrain.deepspeed.elasticity import elastic_batch, highly_composite_numbers


def test_highly_composite_numbers_by_brute_force():
    counts = [sum(n % d == 0 for d in range(1, n + 1)) for n in range(1, 5041)]
    records = [n for n in range(1, 5041) if counts[n - 1] > max(counts[:n - 1], default=0)]
    assert highly_composite_numbers(5040) == records
    assert len(highly_composite_numbers(720720)) == 38  # DeepSpeed's table: enough up to 720K


def test_deepspeed_unit_test_example():
    """DeepSpeed's own test (tests/unit/elasticity, test_basic_10k): 9792 sequences, 23 world sizes."""
    micro = [8, 12, 16, 17]
    batch = elastic_batch(micro, 10000, min_gpus=32, max_gpus=1500)
    assert batch.global_batch_size == 9792 and len(batch.world_sizes) == 23
    for world in batch.world_sizes:
        assert batch.global_batch_size % world == 0 and batch.micro_batch_at(world) in micro
        assert 32 <= world <= 1500


def test_ds_config_block_maps_to_an_elastic_run():
    block = {"elasticity": {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [2, 3],
                            "min_gpus": 1, "max_gpus": 8, "version": 0.1}}
    ds = load_ds_config(block, world_size=4)
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (12, 3, 1)
    cfg = load_config(None, to_overrides(ds))
    assert cfg.parallel.elastic and cfg.train.global_batch_size == 12 and cfg.train.micro_batch_size == 3
    with pytest.raises(ConfigError, match="world size 5 cannot keep the elastic global batch 12 .* valid world "
                                          "sizes: 1, 2, 3, 4, 6"):
        load_ds_config(block, world_size=5)
    with pytest.raises(ConfigError, match="train_batch_size conflict with the enabled elasticity block"):
        load_ds_config({**block, "train_batch_size": 16}, world_size=4)
    ignored = {"elasticity": {**block["elasticity"], "ignore_non_elastic_batch_info": True}, "train_batch_size": 16}
    assert load_ds_config(ignored, world_size=2).train_batch_size == 12
    with pytest.raises(ConfigError, match="elasticity.version = 0.2: polytrain implements version 0.1"):
        load_ds_config({"elasticity": {**block["elasticity"], "version": 0.2}}, world_size=4)
