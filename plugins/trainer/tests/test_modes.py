"""Checkpoints and plots get the modes the user's umask gives, as ``open()`` and ``mkdir()`` would."""

import torch
from skip_plugin_trainer.train.checkpoint import CheckpointManager
from skip_plugin_trainer.train.metrics import plot
from skiptests import assert_umask_modes


def test_a_checkpoint_gets_the_umask_modes(tmp_path, umask):
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, torch.nn.Linear(2, 2).state_dict(), {}, {"global_step": 1}, {})
    assert_umask_modes(tmp_path / "ckpt", umask)


def test_a_plot_gets_the_umask_modes(tmp_path, umask):
    plot([{"step": 1, "critic/score/mean": 0.5, "timing_s/step": 1.0}], tmp_path / "out" / "plot.png")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["plot.png"]
    assert_umask_modes(tmp_path / "out", umask)
