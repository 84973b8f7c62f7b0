"""Set-up shared by the tests.

pytester's in-process runs (the pytest plugin's tests) remove, when a run ends, every module it
imported first. torch registers operator libraries from some Python modules as they are imported
(``torch._dynamo`` imports ``torch._inductor.test_operators``; DDP's first forward imports
``torch._dynamo``), and importing such a module a second time fails ("Only a single
TORCH_LIBRARY can be used to register the namespace _inductor_test"), as does importing fakepg
twice (its backend registers with torch once). So a test process imports both before any inline
run; otherwise the first DDP of a worker, if it ran inside an inline run, broke every DDP test
after it in that worker (seen under xdist, depending on test order). The plugin itself imports
neither at load (``_fakepg_pytestplugin``).
"""

import torch._dynamo  # noqa: F401

import fakepg  # noqa: F401

import os  # noqa: E402

# simddp's capture cache stays off in the suite (its own tests switch it on in a temporary
# directory): a test that expects a capture, or output printed while capturing, gets one
os.environ.setdefault("SIMDDP_NO_CACHE", "1")
