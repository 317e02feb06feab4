"""Hand-made batches in verl's layout, for the tests of the policy and critic workers."""

import torch
from skip_core.batch import Batch

PROMPT, RESPONSE = 12, 10


def padded_batch(rows: list[tuple[list[int], list[int]]]) -> Batch:
    """verl's layout: prompts left-padded to PROMPT, responses right-padded to RESPONSE."""
    n = len(rows)
    prompts, responses = torch.zeros(n, PROMPT, dtype=torch.long), torch.zeros(n, RESPONSE, dtype=torch.long)
    prompt_mask, response_mask = torch.zeros(n, PROMPT, dtype=torch.long), torch.zeros(n, RESPONSE, dtype=torch.long)
    for i, (prompt, response) in enumerate(rows):
        prompts[i, PROMPT - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[i, PROMPT - len(prompt) :] = 1
        responses[i, : len(response)] = torch.tensor(response)
        response_mask[i, : len(response)] = 1
    positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
    return Batch(
        {
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "position_ids": torch.cat([positions, positions[:, -1:] + torch.arange(1, RESPONSE + 1)], 1),
            "responses": responses,
            "response_mask": response_mask,
        }
    )


ROWS = [([5, 6, 7], [8, 9, 10, 11]), ([20, 21, 22, 23, 24], [30, 31]), ([40, 41], [50, 51, 52, 53, 54, 55])]
