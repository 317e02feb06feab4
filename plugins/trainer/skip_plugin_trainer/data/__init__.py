"""Prompts for RL training: verl-shaped rows read (``rows``), rendered and length-checked
(``dataset``), and batched as a resumable stream (``loader``); conversations as token ids, turn
by turn, the way the agent loop and warm-up data build them (``chat``)."""

from skip_plugin_trainer.data.dataset import RLDataset, truncate
from skip_plugin_trainer.data.loader import PromptLoader, collate, generation_inputs

__all__ = ["PromptLoader", "RLDataset", "collate", "generation_inputs", "truncate"]
