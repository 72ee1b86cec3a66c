"""Starting distributed programs, and recognising who started them.

* ``distcomm run`` (:mod:`.cli`, :mod:`.agent`): torchrun's command line; one
  launcher per node hosts or joins the job's store, runs the node's workers,
  restarts them on failure and leaves no process behind.
* :func:`distcomm.spawn` (:mod:`.spawn`): N processes running a function.
* :mod:`.environment` and the ``env_*`` modules: what torchrun, Open MPI,
  MPICH/Hydra and Slurm tell a process about its rank, world size and master,
  for ``init_process_group()`` with no arguments.

This package sits beside the stack: the launcher and ``spawn`` use the store
through its public API, and the store's ``env://`` rendezvous imports only
the environment modules, which import nothing but :mod:`distcomm.errors`.
Nothing is imported here, so importing an environment module stays cheap.
"""
