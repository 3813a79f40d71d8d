"""Launching across processes and machines: hostfiles, launcher arguments, rendezvous checks, Slurm.

Everything here reads what launchers and schedulers hand to a process (arguments, environment, files) and
checks it before any process group is formed or any file is written; ``hftrain doctor`` reports the same
checks by hand.
"""
