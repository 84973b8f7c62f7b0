"""The world: one in-process cluster, its scheduler and what torch sees of it.

:mod:`.cluster` matches and completes collectives, :mod:`.scheduler` runs one rank at a time,
:mod:`.liveness` decides hangs and timeouts (:mod:`.hang_report` words them, :mod:`.watchdog`
covers waits hidden in C++), :mod:`.binding` says which world and rank the calling thread is,
:mod:`.checks` is the interface of the checks the world runs (it names none of them),
:mod:`.isolation` / :mod:`.rng_state` give each rank its own process state,
:mod:`.process_group` / :mod:`.python_group` / :mod:`.work` are what torch sees,
:mod:`.events` is a collective's range in the rank's profiler, :mod:`.outcome` is what a world
leaves, :mod:`.hooks` lets a layer above (simddp) observe it. Nothing here imports the rooms
above (fidelity, process, launch): what the world needs from them it is handed.
"""
