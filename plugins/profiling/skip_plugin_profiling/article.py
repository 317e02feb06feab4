"""What the events of the verl multi-turn profiling article's logger mean in our vocabulary.

Its logger (``SGLangLogManager`` in the article's ``sglang_rollout.py``) writes, per rollout
worker, one line when an event ends: ``timestamp`` (the end), ``duration_sec``, ``workid``,
``step`` and, for per-request events, ``extra.request_id``. It has no span ids, so which event
holds which can only come from knowing the logger: that knowledge lives here, next to the
renaming, so the reader and the analyses agree on it. The table in the plugin's README says
the same for people.
"""

from __future__ import annotations

#: The article's event names mapped onto ours; names not listed are kept as written.
CANONICAL = {
    # per worker, before and after its requests
    "preprocessing_duration": "preprocess",
    "preprocessing": "preprocess",
    "async_generate_duration": "async_generate",
    "sorting_duration": "sorting",
    "barrier_wait_duration": "barrier_wait",
    "barrier": "barrier_wait",
    "broadcast_duration": "broadcast",
    "data_extraction_duration": "data_extraction",
    "padding_duration": "padding",
    "concatenation_duration": "concatenation",
    "batch_construction_duration": "batch_construction",
    "cache_flush_duration": "cache_flush",
    "final_construction_duration": "final_construction",
    "total_step_duration": "rollout",
    # per request
    "async_rollout_request_complete": "request",
    "turn_end": "turn",
    "engine_async_generate": "generate",
    "engine_async_generate_actual": "generate",
    "tool_execution": "tool_call",
    "tool_creation_pending_state": "tool_create",
    "reward_calculation": "tool_reward",
    "calc_reward": "tool_reward",
}

#: The article's events that only hold others (as named after ``CANONICAL``): counting them
#: beside their children would count that time twice. ``async_rollout_request_complete``
#: (read as ``request``) is the article's marker of a request's completion: its duration is
#: the request's whole time since it began, not an event of its own.
CONTAINERS = frozenset(
    {
        "async_generate",  # all of a worker's requests
        "main_loop",  # a request's turns
        "pending_state_handling",  # tool_create, interaction_start_pending_state
        "turn_engine_call",  # engine_generate_setup, generate
        "turn_post_process",  # turn_tool_parsing
        "tool_calling_state",  # tool_call, tool_response_processing
        "interacting_state",  # interaction_response
    }
)

#: Attribute names of the article's logger mapped onto ours.
ATTRIBUTES = {"actual_response_tokens": "response_tokens"}
