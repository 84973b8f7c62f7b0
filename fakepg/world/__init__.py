"""The world: one in-process cluster, its scheduler and the ProcessGroup its ranks call.

:mod:`.cluster` matches and completes collectives, :mod:`.scheduler` runs one rank at a time,
:mod:`.liveness` decides hangs and timeouts (:mod:`.hang_report` words them, :mod:`.watchdog`
covers waits hidden in C++), :mod:`.isolation` / :mod:`.rng_state` give each rank its own
process state, :mod:`.process_group` / :mod:`.python_group` / :mod:`.work` are what torch sees,
:mod:`.outcome` is what a world leaves, :mod:`.hooks` lets a layer above (simddp) observe it.
"""
