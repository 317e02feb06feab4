"""Which way a run's weight syncs go (``weight_sync.py``), and the reason it gives."""

import pytest
from skip_core.config import ConfigError
from skip_plugin_trainer.config.settings import RunSettings

GPUS = {"trainer": {"device": "cuda"}}


def chosen(**sections):
    return RunSettings.from_config({"task": {"name": None}, **sections}).weight_sync()


def test_auto_takes_the_object_store_on_cpus_and_a_group_takes_gloo_there():
    sync = chosen()
    assert (sync.via, sync.backend) == ("object_store", None)
    assert sync.line() == (
        "weight sync: through Ray's object store (rollout.weight_sync=auto: the actor or the engines on CPUs, "
        "where it measured faster)"
    )
    group = chosen(rollout={"weight_sync": "group"})
    assert (group.via, group.backend) == ("group", "gloo")
    assert group.reason == "rollout.weight_sync=group: the hf engines join it, the actor or the engines on CPUs"


def test_on_gpus_of_their_own_auto_takes_nccls_group_and_colocated_the_object_store():
    pools = {"actor": {"gpus_per_worker": 1}, "rollout": {"gpus_per_worker": 1}}
    separate = chosen(**GPUS, resources=pools)
    assert (separate.via, separate.backend) == ("group", "nccl")
    colocated = {"colocate": True, "actor": {"gpus_per_worker": 1}}
    assert chosen(**GPUS, resources=colocated).via == "object_store"
    forced = chosen(**GPUS, resources=colocated, rollout={"weight_sync": "group"})
    assert (forced.via, forced.backend) == ("group", "gloo")
    assert "NCCL refuses two ranks of one group on one GPU: through host memory" in forced.reason
    engines_on_cpus = chosen(**GPUS, resources={"actor": {"gpus_per_worker": 1}})
    assert engines_on_cpus.via == "object_store"


def test_the_object_store_when_asked_or_when_the_engine_joins_no_group(held_backend):
    asked = chosen(rollout={"weight_sync": "object_store"})
    assert (asked.via, asked.backend) == ("object_store", None)
    assert asked.line() == "weight sync: through Ray's object store (rollout.weight_sync=object_store)"
    unable = chosen(rollout={"backend": "held_hf"})
    assert unable.via == "object_store"
    assert unable.reason == "rollout.weight_sync=auto: the held_hf backend takes weights only through update_weights"


def test_a_group_the_engine_cannot_join_is_refused_in_one_line_naming_the_key(held_backend):
    with pytest.raises(ConfigError) as error:
        chosen(rollout={"backend": "held_hf", "weight_sync": "group"})
    assert str(error.value) == (
        "rollout.weight_sync: group is not possible: the held_hf backend takes weights only through "
        "update_weights; allowed: auto, object_store"
    )
