"""Checkpoints and plots get the modes the user's umask gives, as ``open()`` and ``mkdir()`` would."""

import torch
from skip_plugin_trainer.train import shards
from skip_plugin_trainer.train.checkpoint import CheckpointManager
from skip_plugin_trainer.train.summary import plot
from skiptests import assert_umask_modes


def test_a_checkpoint_gets_the_umask_modes(tmp_path, umask):
    """The shards' directory and files too, which torch.distributed.checkpoint writes."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # so the optimizer's state is written too
    manager = CheckpointManager(tmp_path / "ckpt")
    path = manager.save(
        1, {"global_step": 1}, {}, lambda directory: {"actor": shards.save(model, optimizer, directory / "actor")}
    )
    assert (path / "actor").is_dir() and any((path / "actor").iterdir())
    assert_umask_modes(tmp_path / "ckpt", umask)


def test_a_plot_gets_the_umask_modes(tmp_path, umask):
    plot([{"step": 1, "critic/score/mean": 0.5, "timing_s/step": 1.0}], tmp_path / "out" / "plot.png")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["plot.png"]
    assert_umask_modes(tmp_path / "out", umask)
