"""The rank programs the notebooks show and then launch on N ranks (helpers.launch.run_program).

Each is a script you can run yourself from the repository root, e.g.

    torchrun --nproc_per_node 2 -m helpers.programs.zero_stages --out runs/zero --stages 0 1 2 3

Every rank writes what it measured to OUT/rank<N>.json; the notebook turns those into tables.
"""
