"""Ranks as processes (``isolation="process"``): the same world, each rank in its own OS process.

The parent's side: :mod:`.process_mode` starts the children, :mod:`.rank_proxy` performs each
child's requests on the world, :mod:`.wire` is the pipe's message format, :mod:`.mp_spawn` is
``torch.multiprocessing.spawn`` inside a world. The child's side is :mod:`.remote`.
"""
