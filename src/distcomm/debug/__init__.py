"""Tools for debugging distributed jobs.

* :mod:`.levels`: ``DISTCOMM_DEBUG=OFF|INFO|DETAIL`` and the functions that read and set it;
* :mod:`.fingerprint` and :mod:`.gates`: the DETAIL check of each collective's arguments;
* :mod:`.monitored_barrier`: a barrier that names the ranks that did not arrive;
* :mod:`.recorder` and :mod:`.flight_recorder`: the last operations of each rank, dumped as JSON;
* :mod:`.analyze` and :mod:`.trace_cli`: ``distcomm trace analyze DIR``;
* :mod:`.log`: the ``distcomm`` loggers;
* :mod:`.hooks`: what ``init_process_group``, ``new_group`` and ``destroy_process_group`` tell these tools.

This module imports nothing: :mod:`distcomm.group` imports :mod:`.recorder`
(plain data, standard library only) and must not pull the rest in.
"""
