"""Choices: every nondeterministic decision a world can make, as data.

:mod:`.schedule` (which runnable rank goes next, which sender an any-source recv matches, ...;
replayable from a token), :mod:`.faults` (crashes and exceptions injected at a rank's k-th
collective) and :mod:`.strategies` (hypothesis strategies that generate both). The world reads
them; nothing here imports the world.
"""
