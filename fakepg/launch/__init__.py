"""Launchers: ways to start a world.

:mod:`.spawn` (``fakepg.spawn``: one program, one world), :mod:`.explore` (``fakepg.explore``:
one program under many schedules and faults) and :mod:`.fakerun` (the ``fakerun`` command,
torchrun's drop-in). The pytest plugin, ``fakepg.pytest_plugin``, stays at the package's top
so its entry point name is stable.
"""
