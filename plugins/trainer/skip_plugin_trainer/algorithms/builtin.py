"""The policy losses this distribution registers, by verl 0.9.1's names (``skip plugins`` lists them)."""

from __future__ import annotations

from skip_plugin_trainer.algorithms import cov_losses, losses
from skip_plugin_trainer.algorithms.contract import LossFunction
from skip_plugin_trainer.algorithms.correction import bypass_mode

LOSSES: dict[str, LossFunction] = {
    "vanilla": losses.vanilla,
    "dppo_tv": losses.dppo_tv,
    "dppo_kl": losses.dppo_kl,
    "gspo": losses.gspo,
    "sapo": losses.sapo,
    "gpg": losses.gpg,
    "clip_cov": cov_losses.clip_cov,
    "kl_cov": cov_losses.kl_cov,
    "geo_mean": losses.geo_mean,
    "dro": losses.dro,
    "cispo": losses.cispo,
    "bypass_mode": bypass_mode,
}
