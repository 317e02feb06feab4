"""Every extension point of skip, in one place.

A plugin is a module (or object) with functions named like these specs and marked
``@skip_core.hookimpl``; it is found through the ``skip`` entry-point group. Pluggy lets an
implementation accept only the arguments it needs, so ``def skip_warp(store, hit)`` is valid.

The per-call hooks (``skip_resolve_step``, ``skip_precondition``, ``skip_warp``,
``skip_dump``) are only called for a role that is enabled and only on the slow path: a
disabled role, or a trainer-step role on an ineligible step, costs one attribute check.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("skip")
hookimpl = pluggy.HookimplMarker("skip")


@hookspec(historic=True)
def skip_add_hookspecs(add):
    """Add hook specs of a plugin's own: call ``add(module)`` with the module that declares them.

    Historic, as pytest's ``pytest_addhooks``: a plugin registered after others still adds
    its specs, and implementations registered before them are checked then. The trainer adds
    its tools, tool parsers, tasks and rewards this way; every ``skip_register_<kind>(register)``
    hook added joins ``skip_core.plugins.registry()`` and ``skip plugins``.
    """


@hookspec
def skip_register_roles(register):
    """Register skip roles: call ``register(Role(...))`` once per role this plugin provides.

    A role names a family of decorated functions (``@SkipManager.annotate(role=...)``) and the
    ``skip.<role>`` config section that drives them. Two plugins registering the same role
    name is an error reported at ``SkipManager.init``.
    """


@hookspec
def skip_register_sections(register):
    """Declare config sections: call ``register(key, model)`` with a dotted key and a pydantic model.

    ``register("async_training", AsyncTraining)`` makes ``async_training`` a section of every run
    config, validated by ``AsyncTraining`` once at the start of a run with every other declared
    section (``skip_core.sections.parse_sections``); factories and hooks then receive the
    validated ``Sections`` and read ``sections[AsyncTraining]``. The model's fields and
    defaults are also the Hydra defaults of that section, so each of its keys can be overridden
    on the command line and no other can.
    """


@hookspec
def skip_register_backends(register):
    """Register rollout backends: call ``register(backend)`` with a ``skip_core.backend.Backend``.

    The one object declares the backend: its ``name`` (``rollout.backend=<name>`` selects it), its
    options model ``Options``, registered as the config section ``section`` with it, ``check``
    (run in the driver before any worker starts or the model exists) and ``build``, which starts
    the engine on the model in a worker.
    """


@hookspec
def skip_register_schedules(register):
    """Register trainer schedules: call ``register(name, factory)``.

    ``factory(sections) -> skip_core.schedule.Schedule``; ``trainer.schedule=<name>`` selects it.
    """


@hookspec(firstresult=True)
def skip_resolve_step(role, config, call):
    """Return the step (``int``) of one call of a role whose ``Role.online_step`` is true.

    Roles without online steps use the trainer step from ``SkipManager.set_step`` and never
    reach this hook. Return ``None`` to let another plugin answer; if none does, the call
    runs unchanged. Raise ``ValueError`` for an argument that cannot carry a step.
    """


@hookspec(firstresult=True)
def skip_precondition(role, config, store, step, call):
    """Decide whether this call is replaced: return a ``Hit`` to replace it, ``None`` to run it.

    Called only when ``step`` is listed in ``skip.<role>.steps``. The returned ``Hit`` is
    handed to ``skip_warp``. Core's default implementation serves ``action=cache|repeat``
    from the verified cache store; implement this hook for a role with other actions.
    """


@hookspec(firstresult=True)
def skip_warp(role, config, store, hit, call):
    """Produce the result of a replaced call without running it (e.g. load it from disk).

    If it raises, a warning names the role and step and the original function runs instead:
    a failed replacement never loses a training step.
    """


@hookspec
def skip_dump(role, config, store, step, call, result):
    """Persist the result of a call that ran on an eligible step.

    Runs in a background thread after the decorated function returned;
    ``SkipManager.flush()`` waits for it. Until it has run, a lookup of this step's entry in
    ``store`` (``store.entry``, ``store.nearest``) waits for it, so the next call sees the
    dump as if it had been written synchronously. Exceptions become warnings and make that
    lookup a miss: a failed dump never kills training.
    """


@hookspec
def skip_register_commands(cli):
    """Add subcommands to the ``skip`` command: ``cli`` is its ``click.Group``.

    Called once when the command starts; keep imports of heavy libraries inside the commands.
    """


@hookspec
def skip_span_sinks(sections, worker):
    """Return a ``skip_core.spans.SpanSink`` to receive this process's spans, or ``None``.

    Called by ``skip_core.spans.configure`` once per process (the trainer driver with
    ``worker=-1``, each rollout worker with its rank) with the run's validated ``Sections``. Sinks are
    resolved once and then called directly: a hook call per span would cost more than the
    span itself.
    """
